"""Run the GEMM family's rendered kernel body on the CPU (no GPU), through the experts emulator's host prelude
(emulators/experts_emu.py: every GPU thread of a block is a fiber on one OS thread, barriers park a fiber until the
last of their threads arrives, shuffles go through an exchange buffer, ``mma.sync`` / ``cvt`` computed from the
PTX fragment layouts; the grid's blocks run one after another).

It checks the kernel's own logic (staging, fragment ownership, the in-kernel activation quant, the per-block
scaling, the epilogue and its row / column guards) on small shapes; not the compiler, the hardware MMA's
internal precision, or timing. The output buffer is poisoned (NaN) and has a guard region of a whole tile of
rows past ``C``: :func:`run` returns both, so a test sees unwritten elements and writes past row ``C``.
A prequant call (``GemmSpec.prequant`` where :func:`ds4c.runtime.families.gemm.uses_prequant`) runs both of
its kernels, the actq launch (templates/actq, form f16s) into NaN-poisoned ``xq`` / ``xs`` and then the GEMM,
whose cp.async copies are the experts emulator's (deferred to their ``wait_group``; a block that ends with
copies never waited for aborts); :func:`read_prequant` returns the two workspaces.
Used by ``tests/test_gemm_family.py``; runnable by hand: ``python tests/emulators/gemm_emu.py``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: tests/, for emulators.*
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from ds4c.runtime.families import gemm as GM  # noqa: E402
from ds4c.runtime.targets import target as make_target  # noqa: E402
from emulators.experts_emu import compile_host, host_body, host_unavailable, run_host, vendor_defines  # noqa: E402,F401

#: the template's PTX helpers (stripped from the body with the "mma.sync helpers" section) on the emulator's
SHIMS = r"""
DS4C_DEVICE u32 gm_f16x2(float lo, float hi) { return emu_f16_bits(lo) | (emu_f16_bits(hi) << 16); }
// cvt.rn.satfinite.e4m3x2.f32 as PTX defines it, written independently of the prelude's ds4c_round_e4m3: the
// nearest of the 127 finite positive e4m3 values (ties to the even code), saturated at 448
static inline u32 emu_e4m3_rne(float x) {
  const float a = std::fabs(x);
  u32 c = 0;
  if (a >= 448.0f) {
    c = 0x7e;
  } else {
    while (c < 0x7e && emu_e4m3(c + 1) <= a) ++c;
    if (emu_e4m3(c) != a) {
      const float lo = a - emu_e4m3(c), hi = emu_e4m3(c + 1) - a;
      if (hi < lo || (hi == lo && (c & 1u))) ++c;
    }
  }
  return c | (std::signbit(x) ? 0x80u : 0u);
}
DS4C_DEVICE u32 gm_e4m3_f16x2(float lo, float hi) {
  return emu_f16_bits(emu_e4m3(emu_e4m3_rne(lo))) | (emu_f16_bits(emu_e4m3(emu_e4m3_rne(hi))) << 16);
}
DS4C_DEVICE void gm_e4m3x4_f16(u32 v, u32& lo, u32& hi) { xp_e4m3x4_f16(v, lo, hi); }
DS4C_DEVICE void gm_cp16(void* dst, const void* src) { xp_cp16(dst, src); }
DS4C_DEVICE void gm_cp4(void* dst, const void* src) { xp_cp4(dst, src); }
DS4C_DEVICE void gm_cp_commit() { xp_cp_commit(); }
DS4C_DEVICE void gm_cp_wait_all() { xp_cp_wait<0>(); }
DS4C_DEVICE void gm_cp8(void* dst, const void* src) { xp_cp8(dst, src); }
template <int N> DS4C_DEVICE void gm_cp_wait_n() { xp_cp_wait<N>(); }
DS4C_DEVICE void gm_i8x4_f16(u32 w, u32& lo, u32& hi) { xp_i8x4_f16(w, lo, hi); }
DS4C_DEVICE void gm_mma_f16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                            float c2, float c3) { xp_mma_f16(d, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3); }
DS4C_DEVICE void gm_mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, float c0, float c1,
                             float c2, float c3) { xp_mma_bf16(d, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3); }
"""

#: rows of poisoned guard region after the C rows of the output
GUARD_ROWS = GM.BM


def build(spec: GM.GemmSpec, workdir: Path, arch: str = "sm_90") -> Path:
    """Compile the emulator of ``spec`` rendered for ``arch`` into ``workdir/emu``: a CUDA arch (engine ``simt``
    gives the SIMT body), or a HIP one (its wave; on the matrix-core archs the ``xm`` body, MFMA / WMMA from the
    ISA's fragment layouts); returns the executable.

    Raises:
        RuntimeError: no host C++20 compiler, or the host compile failed.
    """
    tgt = make_target(arch)
    srcs = GM.render_call(spec, tgt, "emu")
    launches = GM.launch_shapes(spec, tgt)
    names = GM.arg_names(spec, tgt)
    outb = 4 if spec.out_dtype == "f32" else 2
    ytype = "float" if spec.out_dtype == "f32" else "u16"
    ny = (spec.rows + GUARD_ROWS) * spec.n * spec.groups
    poison = "std::numeric_limits<float>::quiet_NaN()" if outb == 4 else "(u16)0x7fc1"
    expr = {"x": "(const u16*)x.data()", "w": "w.data()", "y": "y.data()", "xq": "xq.data()", "xs": "xs.data()"}
    spaces, calls = [], []
    for src, ln in zip(srcs, launches):
        body = host_body(src)
        if ln.kernel == "actq":  # its block reduction is a function-local shared array: one for all fibers
            spaces.append(f"namespace aq_ns {{\n#undef DS4C_SHARED\n#define DS4C_SHARED static\n{body}\n"
                          f"#undef DS4C_SHARED\n#define DS4C_SHARED\n}}\n")
            ns = "aq_ns"
        else:
            spaces.append(f"namespace gm_ns {{\n{SHIMS}\n{body}\nalignas(16) u8 gm_smem[{ln.smem} + 64];\n}}\n")
            ns = "gm_ns"
        args = ", ".join(expr[n] for n in names[ln.kernel])
        calls.append(f"  run_grid({ln.grid[0]}, {ln.grid[1]}, {ln.block[0]}, [&] {{ {ns}::{src.entry}({args}); }});\n")
    nq, ns_ = spec.rows * spec.k, spec.rows * (spec.k // GM.KSTEP)
    # prequant's xq: f16 NaN poison, or (xfmt e4m3: actq form e4m3s) the e4m3fn NaN byte
    qt, qb, qp = ("u8", 1, "(u8)0x7f") if spec.xfmt == "e4m3" else ("u16", 2, "(u16)0x7e01")
    main = "#include <limits>\n" + "".join(spaces) + f"""
int main(int argc, char** argv) {{
  const char* d = argv[1];
  auto x = load(d, "x"), w = load(d, "w");
  std::vector<{ytype}> y({ny}, {poison});
  std::vector<{qt}> xq({nq}, {qp});  // NaN poison (prequant's workspaces)
  std::vector<float> xs({ns_}, NAN);
  (void)x;
{"".join(calls)}  save(d, "y", y.data(), y.size() * {outb});
  save(d, "xq", xq.data(), xq.size() * {qb});
  save(d, "xs", xs.data(), xs.size() * 4);
  return 0;
}}
"""
    return compile_host(main, workdir, "gemm_emu", vendor_defines(tgt))


def run(spec: GM.GemmSpec, x: torch.Tensor, w: torch.Tensor, workdir: Path, arch: str = "sm_90",
        exe: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulate one launch on CPU tensors ``x`` (bf16 ``[C, K]``) and ``w`` (the stored weight). Returns
    ``(y, guard)``: ``y`` ``[C, N]`` in ``out_dtype`` and ``guard`` ``[GUARD_ROWS, N]``, the poisoned rows
    after it (all NaN unless the kernel wrote past row C)."""
    run_host(exe or build(spec, workdir, arch), workdir, {"x": x, "w": w}, "gemm_emu", timeout=600)
    raw = (workdir / "y").read_bytes()
    if spec.out_dtype == "f32":
        a = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())
    else:
        a = torch.from_numpy(np.frombuffer(raw, dtype=np.int16).copy()).view(torch.bfloat16)
    a = a.view(spec.rows + GUARD_ROWS, spec.n * spec.groups)
    return a[:spec.rows], a[spec.rows:]


def read_prequant(spec: GM.GemmSpec, workdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """After :func:`run` in ``workdir``: the prequant workspaces ``(xq f16 [C, K] (float8_e4m3fn with xfmt e4m3),
    xs fp32 [C, K/128])`` as the actq launch left them (NaN poison where nothing wrote, e.g. a call without
    prequant)."""
    e4 = spec.xfmt == "e4m3"
    xq = torch.from_numpy(np.frombuffer((workdir / "xq").read_bytes(), dtype=np.uint8 if e4 else np.float16).copy())
    xs = np.frombuffer((workdir / "xs").read_bytes(), dtype=np.float32).copy()
    return ((xq.view(torch.float8_e4m3fn) if e4 else xq).view(spec.rows, spec.k),
            torch.from_numpy(xs).view(spec.rows, spec.k // GM.KSTEP))


def main() -> int:
    import time

    ok = True
    for fmt in GM.FORMATS:
        for eng, pq in (("mma", False), ("simt", False), ("mma", True)):
            spec = GM.GemmSpec(rows=70, n=96, k=256, fmt=fmt, engine=eng, prequant=pq)
            g = torch.Generator().manual_seed(1)
            x, w = GM.random_x(spec, g), GM.random_weight(spec, g)
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                y, guard = run(spec, x, w, Path(d))
            e = GM.rel_l2(y, GM.reference(spec, x, w))
            good = e < 1e-3 and bool(torch.isnan(guard.float()).all())
            ok &= good
            print(f"{spec.short():45s} {eng:5s} rel_l2 {e:.2e} {'ok' if good else 'FAIL'}  "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
