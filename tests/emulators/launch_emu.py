"""Run a sequence of lowered launches (runtime/lowered.py ``Launch`` records, any family without inline PTX) on the
CPU, through the experts emulator's host prelude (:mod:`emulators.experts_emu`: every GPU thread of a block a fiber,
the grid's blocks one after another; function-local shared arrays become statics, shared by the threads of the
one running block). Buffers are bound by name: each launch's argument list names the buffers (or gives an int),
every buffer is loaded before the first launch and saved after the last, so a test can feed a plan kernel's
launches with tensors for the graph values and weights their ``Arg`` bindings name and compare the results with
the IR interpreter's ops.

It checks the kernels' own logic and the lowering's argument order on small shapes; not the compiler, the
hardware or timing. Used by ``tests/test_prefill_lower.py``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: tests/, for emulators.*
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from emulators.experts_emu import compile_host, host_body, host_unavailable, run_host, vendor_defines  # noqa: E402,F401

SHARED_STATIC = "#undef DS4C_SHARED\n#define DS4C_SHARED static\n"
#: CUDA's correctly rounded fp32 intrinsics (no FMA contraction) on the host: the plain operations (the host build
#: targets x86-64 without FMA, so nothing is contracted)
SHIMS = """
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
"""

#: the block index a lane-batched kernel's entry reads (``blockIdx.z``); the family kernels read x / y through the
#: prelude's accessors
DIM3 = "struct EmuDim3 { int x, y, z; };\nstatic EmuDim3 blockIdx = {0, 0, 0};\n"


def _param_types(src: Any) -> list[str]:
    """C types of the entry's parameters in order (``const u16*``, ``int``, ...)."""
    text = re.sub(r"//[^\n]*", "", src.source)
    m = re.search(r"\b" + re.escape(src.entry) + r"\s*\(([^)]*)\)", text)
    if not m:
        raise RuntimeError(f"launch_emu: no signature of {src.entry}")
    out = []
    for p in (p.strip() for p in m.group(1).split(",") if p.strip()):
        p = p.replace("DS4C_RESTRICT", " ")
        out.append(re.sub(r"\s+", " ", p[: len(p) - len(re.search(r"(\w+)\s*$", p).group(1))]).strip())
    return out


_EXTERN_SHARED = re.compile(r"extern DS4C_SHARED (__attribute__\(\(aligned\(\d+\)\)\) )?(\w+) (\w+)\[\];")


def _carg(a: Any, ctype: str, ident: dict[str, str]) -> str:
    """One argument as a C expression: an int, ``("i64", v)``, a buffer name, or ``(name, byte offset)``."""
    if isinstance(a, int):
        return str(int(a))
    if isinstance(a, tuple) and a[0] == "i64":
        return f"(i64){int(a[1])}LL"
    name, off = (a, 0) if isinstance(a, str) else a
    return f"({ctype})({ident[name]}.data() + {int(off)})"


def build(launches: Sequence[tuple], buffers: dict[str, int], workdir: Path) -> Path:
    """Compile a host program running ``launches`` (``(KernelSource, grid, block, args)`` or ``(..., args,
    smem)``, args: buffer names, ``(name, byte offset)``, ints or ``("i64", v)``, in kernel order) over the
    buffers ``{name: nbytes}``. A 3-d grid runs its z planes one after another with ``blockIdx.z`` set (the lane
    of a lane-batched kernel, runtime/step/lane_batch.py). A kernel's dynamic shared memory (``extern DS4C_SHARED T
    name[];``, e.g. the grouped experts GEMM's) becomes a static array of ``smem + 64`` bytes, one for the running
    block's fibers.

    Raises:
        RuntimeError: an argument count that is not the signature's, or the host compile failed.
    """
    names = sorted(buffers)
    ident = {n: f"b{i}" for i, n in enumerate(names)}
    spaces, calls = [], []
    spaced: dict[tuple[str, int], int] = {}  # (source digest, smem) -> its namespace: a kernel launched again reuses it
    for i, (src, grid, block, args, *rest) in enumerate(launches):
        types = _param_types(src)
        if len(types) != len(args):
            raise RuntimeError(f"launch_emu: {src.entry} takes {len(types)} arguments, {len(args)} given")
        smem = int(rest[0]) if rest else 0
        if (src.digest(), smem) in spaced:
            i = spaced[src.digest(), smem]
        else:
            spaced[src.digest(), smem] = i
            body = host_body(src)
            if _EXTERN_SHARED.search(body):
                body = _EXTERN_SHARED.sub(lambda m: f"alignas(16) static {m.group(2)} {m.group(3)}[{smem} + 64];",
                                          body)
            spaces.append(f"namespace k{i}_ns {{\n{SHARED_STATIC}{body}\n}}\n")
        cargs = ", ".join(_carg(a, t, ident) for a, t in zip(args, types))
        gz = grid[2] if len(grid) > 2 else 1
        calls.append(f"  for (int z = 0; z < {gz}; ++z) {{ blockIdx.z = z; "
                     f"run_grid({grid[0]}, {grid[1]}, {block[0]}, [&] {{ k{i}_ns::{src.entry}({cargs}); }}); }}\n")
    loads = "".join(f'  auto {ident[n]} = load(d, "{n}");\n' for n in names)
    saves = "".join(f'  save(d, "{n}", {ident[n]}.data(), {buffers[n]});\n' for n in names)
    main = "#include <limits>\n" + SHIMS + DIM3 + "".join(spaces) + f"""
int main(int argc, char** argv) {{
  const char* d = argv[1];
{loads}{"".join(calls)}{saves}  return 0;
}}
"""
    targets = {src.target.slug: src.target for src, *_ in launches}
    if len({(t.vendor, t.wave) for t in targets.values()}) > 1:
        raise RuntimeError(f"launch_emu: one program runs one vendor and wave, not {', '.join(sorted(targets))}")
    defines = vendor_defines(next(iter(targets.values()))) if targets else ""
    return compile_host(main, workdir, "launch_emu", defines)


def run(launches: Sequence[tuple], buffers: dict[str, torch.Tensor],
        workdir: Path) -> dict[str, torch.Tensor]:
    """Emulate ``launches`` on CPU copies of ``buffers`` (contiguous tensors by name); returns every buffer after the
    last launch (same dtypes and shapes)."""
    flat = {n: t.detach().contiguous().cpu() for n, t in buffers.items()}
    files = {n: t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8) for n, t in flat.items()}
    exe = build(launches, {n: t.numel() * t.element_size() for n, t in flat.items()}, workdir)
    run_host(exe, workdir, files, "launch_emu", timeout=900)
    out = {}
    for n, t in flat.items():
        raw = np.frombuffer((workdir / n).read_bytes(), dtype=np.uint8).copy()
        out[n] = torch.from_numpy(raw).view(t.dtype).view(t.shape)
    return out
