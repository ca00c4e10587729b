"""Run the grouped experts GEMM family's rendered kernels (runtime/families/moe_gemm.py) on the CPU, no GPU:
every launch of one call (route, actq_x, up, actq_h, down, combine) compiled as host C++20 with the experts
emulator's host prelude (emulators/experts_emu.py: GPU threads as fibers, barriers, shuffles, ``mma.sync`` and the
e4m3 / int8 -> f16 cvts computed from the PTX fragment layouts; a grid's blocks run one after another) and run in
launch order on shared buffers.

Every workspace and the output start poisoned (NaN; ``perm`` / ``tiles`` 0x7f7f7f7f), so a test sees what a
launch did not write. Checks the kernels' own logic on small shapes (routing tables, tile gathers, fragment
ownership, per-block scaling, epilogues, the ordered combine); not the compiler, the hardware MMA's internal
precision, or timing. Used by tests/test_moe_gemm_family.py; by hand: ``python tests/emulators/moe_gemm_emu.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: tests/, for emulators.*
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from ds4c.runtime.families import moe_gemm as MG  # noqa: E402
from ds4c.runtime.targets import target as make_target  # noqa: E402
from emulators.experts_emu import compile_host, host_body, host_unavailable, run_host, vendor_defines  # noqa: E402,F401

#: C expressions of the kernel arguments (buffers of main() below)
_ARG = {"ids": "(const i64*)ids.data()", "weights": "(const float*)wts.data()", "x": "(const u16*)x.data()",
        "w1": "w1.data()", "w3": "w3.data()", "w2": "w2.data()", "perm": "perm.data()", "tiles": "tiles.data()",
        "xq": "xq.data()", "xs": "xs.data()", "hbuf": "hbuf.data()", "hq": "hq.data()", "hs": "hs.data()",
        "ybuf": "ybuf.data()", "out": "out.data()", "shared": "(const u16*)shared.data()"}
#: (C type, element bytes, poison literal) of every written buffer
_OUT = {"perm": ("int", 4, "0x7f7f7f7f"), "tiles": ("int", 4, "0x7f7f7f7f"), "xq": ("u16", 2, "(u16)0x7e01"),
        "xs": ("float", 4, "NAN"), "hbuf": ("u16", 2, "(u16)0x7fc1"), "hq": ("u16", 2, "(u16)0x7e01"),
        "hs": ("float", 4, "NAN"), "ybuf": ("u16", 2, "(u16)0x7fc1"), "out": ("float", 4, "NAN")}
_DT = {"perm": np.int32, "tiles": np.int32, "xq": np.float16, "xs": np.float32, "hbuf": np.int16, "hq": np.float16,
       "hs": np.float32, "ybuf": np.int16, "out": np.float32}


def _outputs(spec: MG.MoeGemmSpec) -> dict[str, tuple[str, int, str]]:
    """The written buffers of ``spec``'s call (:func:`moe_gemm.workspaces` and ``out``, bf16 when dense / shared)."""
    out = {n: _OUT[n] for n in MG.workspaces(spec)}
    if spec.xfmt == "e4m3":  # actq form e4m3s: one byte a value, poisoned with the e4m3fn NaN
        out.update({n: ("u8", 1, "(u8)0x7f") for n in ("xq", "hq")})
    out["out"] = ("u16", 2, "(u16)0x7fc1") if spec.dense or spec.shared else _OUT["out"]
    return out


def _inputs(spec: MG.MoeGemmSpec) -> tuple[str, ...]:
    """The input names of ``spec``'s call (dense: no ids / weights; shared: + ``shared``)."""
    base = ("x", "w1", "w3", "w2") if spec.dense else ("x", "ids", "weights", "w1", "w3", "w2")
    return base + (("shared",) if spec.shared else ())


def build(spec: MG.MoeGemmSpec, workdir: Path, arch: str = "sm_90") -> Path:
    """Compile the emulator of every kernel of ``spec`` rendered for ``arch`` (CUDA, or an AMD arch with matrix cores:
    its HIP body, wave 32 or 64) into ``workdir/emu``.

    Raises:
        RenderError: an unsupported target; RuntimeError: no host C++20 compiler, or the host compile failed."""
    tgt = make_target(arch)
    srcs = MG.render_moe_gemm(spec, tgt, "emu")
    launches = MG.launch_shapes(spec, tgt)
    names = MG.arg_names(spec)
    shapes = MG.arg_shapes(spec)
    spaces, calls = [], []
    for i, (src, la) in enumerate(zip(srcs, launches)):
        body = host_body(src)
        if la.kernel.startswith("actq_"):  # its reduction array is function-local shared memory: one per block
            body = "#undef DS4C_SHARED\n#define DS4C_SHARED static\n" + body + "\n#undef DS4C_SHARED\n#define DS4C_SHARED\n"
        extra = f"alignas(16) u8 mg_smem[{la.smem} + 64];\n" if la.kernel in ("up", "down") else ""
        spaces.append(f"namespace k{i}_ns {{\n{body}\n{extra}}}\n")
        args = ", ".join(_ARG[n] for n in names[la.kernel])
        calls.append(f"  run_grid({la.grid[0]}, {la.grid[1]}, {la.block[0]}, [&] {{ k{i}_ns::{src.entry}({args}); }});\n")
    outs = _outputs(spec)
    bufs = "".join(f"  std::vector<{ct}> {n}({int(np.prod(shapes[n][0]))}, {pz});\n" for n, (ct, _, pz) in outs.items())
    saves = "".join(f"  save(d, \"{n}\", {n}.data(), {n}.size() * {b});\n" for n, (_, b, _) in outs.items())
    loads = "".join(f'  auto {"wts" if n == "weights" else n} = load(d, "{n}");\n' for n in _inputs(spec))
    main = "".join(spaces) + f"""
int main(int argc, char** argv) {{
  const char* d = argv[1];
{loads}{bufs}{"".join(calls)}{saves}  return 0;
}}
"""
    return compile_host(main, workdir, "moe_gemm_emu", vendor_defines(tgt))


def run(spec: MG.MoeGemmSpec, inputs: dict[str, torch.Tensor], workdir: Path, arch: str = "sm_90",
        exe: Path | None = None) -> dict[str, torch.Tensor]:
    """Emulate one call on CPU ``inputs`` (``x``, ``ids``, ``weights``, ``w1``, ``w3``, ``w2``; names of
    :func:`ds4c.runtime.families.moe_gemm.random_inputs`; dense: no ids / weights; shared: + ``shared`` bf16
    [C, D]). Returns every written buffer (:func:`moe_gemm.workspaces` and ``out``, shapes
    :func:`~ds4c.runtime.families.moe_gemm.arg_shapes`; ``hbuf`` / ``ybuf`` and a bf16 ``out`` as bf16)."""
    run_host(exe or build(spec, workdir, arch), workdir, {k: inputs[k] for k in _inputs(spec)}, "moe_gemm_emu",
             timeout=1800)
    shapes = MG.arg_shapes(spec)
    out = {}
    for n, (ct, _, _) in _outputs(spec).items():
        dt = shapes[n][1]  # bf16: hbuf, ybuf, a bf16 out, and xq / hq of a wgmma call (form bf16p); e4m3: form e4m3s
        raw = np.int16 if dt == torch.bfloat16 else np.uint8 if dt == torch.float8_e4m3fn else _DT[n]
        a = torch.from_numpy(np.frombuffer((workdir / n).read_bytes(), dtype=raw).copy())
        if dt in (torch.bfloat16, torch.float8_e4m3fn):
            a = a.view(dt)
        out[n] = a.view(shapes[n][0])
    return out


def main() -> int:
    import time

    ok = True
    for fmt in MG.FORMATS:
        spec = MG.MoeGemmSpec(rows=37, hidden=256, inter=128, k=3, n_experts=16, fmt=fmt)
        inp = MG.random_inputs(spec, torch.Generator().manual_seed(1), skew=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            got = run(spec, inp, Path(d))
        e = MG.rel_l2(got["out"], MG.reference(spec, **inp))
        good = e < 1e-3
        ok &= good
        print(f"{spec.short():50s} rel_l2 {e:.2e} {'ok' if good else 'FAIL'}  {time.perf_counter() - t0:.1f} s")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
