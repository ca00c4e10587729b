#!/usr/bin/env python3
"""GPU check of the sparse-attention family (runtime/families/attention.py): official (H 64, hd 512, W 128)
and tiny (H 4, hd 192, W 16) shapes, kinds swa / csa / hca, q = 1 and 5, positions before, at and after the
window wraps, split-K off and on, 1 / 2 / 4 heads per block; and a prefill chunk's rows (256 and 2048 at position
2048, official shapes) through the SIMT kernel and the tensor-core chunk kernel (runtime/families/chunk_attention.py,
variant ``mma``), with TFLOP/s = 4 x rows x heads x list entries x head_dim / time.

Per case: fresh random inputs (csa: random distinct valid ids with ~20% -1), outputs (and the split
workspace) poisoned with NaN before the launch, then: every output written (no NaN left), relative error
(Frobenius) against ``attention.reference`` (the reference's own list building and P9) below 1e-2, and the
median of 50 CUDA-event timings of the launch (main + combine). GB/s = distinct KV bytes the launch must read
(window rows, this step's rows, compressed rows) / time; each of the H head blocks re-reads them (from L2),
so the kernel's own traffic is H times that.

Usage: ``python tests/gpu_checks/attention.py [--arch sm_90]`` (prints a table), or through
``python tests/gpu_checks`` (every family). Needs a CUDA GPU, torch, cuda-python (cuda.bindings) and nvcc; compiles and
loads through tests/gpu_checks/common.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import attention as A
from ds4c.runtime.families import chunk_attention as CA
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_all, median_us, rel_err, standalone

SHAPES = {
    "official": (dict(heads=64, head_dim=512, window=128),
                 {"swa": {}, "csa": dict(cap=1024, topk=512), "hca": dict(cap=32, ratio=128)}, (5, 127, 3000)),
    "tiny": (dict(heads=4, head_dim=192, window=16),
             {"swa": {}, "csa": dict(cap=64, topk=8), "hca": dict(cap=32, ratio=16)}, (5, 15, 300)),
    # a prefill chunk's attention (q = C rows; issue 12): the official shapes at 256 rows past the window
    "prefill": (dict(heads=64, head_dim=512, window=128),
                {"swa": {}, "csa": dict(cap=1024, topk=512), "hca": dict(cap=32, ratio=128)}, (2048,)),
}
ROWS = {"official": (1, 5), "tiny": (1, 5), "prefill": (256, 2048)}
# (heads_per_block, splits[, threads]) per shape; "mma": the tensor-core chunk kernel (1 head per block and 8 heads
# per block were measured in Optimisation 7 and lost)
VARIANTS = {"official": ((1, 1), (1, 4), (2, 4), (4, 4), (4, 8)), "tiny": ((1, 1), (1, 4), (2, 4)),
            "prefill": ((4, 1), (4, 1, 128), "mma")}
TOL = 1e-2


# ------------------------------------------------------------------------------------------------ the check
def _inputs(spec: A.AttentionSpec, g: torch.Generator) -> dict[str, Any]:
    H, hd, W = spec.heads, spec.head_dim, spec.window
    bf = torch.bfloat16
    d: dict[str, Any] = {
        "q": torch.randn(spec.q, H, hd, generator=g).to(bf),
        "ring": torch.randn(W, hd, generator=g).to(bf),
        "kv_new": torch.randn(spec.q, hd, generator=g).to(bf),
        "sink": torch.randn(H, generator=g),
        "comp": None, "sel": None,
    }
    if spec.kind != "swa":
        d["comp"] = torch.randn(spec.cap, hd, generator=g).to(bf)
    if spec.kind == "csa":
        sel = torch.stack([torch.randperm(spec.cap, generator=g)[: spec.topk] for _ in range(spec.q)])
        sel[torch.rand(sel.shape, generator=g) < 0.2] = -1
        d["sel"] = sel
    return d


def _kv_bytes(spec: A.AttentionSpec, d: dict[str, Any], pos: int, live: int) -> int:
    """Distinct KV rows the launch must read, times the row size."""
    W = spec.window
    window = {t for i in range(spec.q) for t in range(max(0, pos + i - W + 1), pos + i + 1)}
    rows = len(window)
    if spec.kind == "csa":
        rows += int(torch.unique(d["sel"][d["sel"] >= 0]).numel())
    elif spec.kind == "hca":
        rows += min((pos + spec.q) // spec.ratio, live, spec.cap)
    return rows * spec.head_dim * 2


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, ok, rel_err, max_abs, all_written, us, GBps, regs."""
    tgt = make_target(arch)
    cases = []
    for shape, (base, kinds, positions) in SHAPES.items():
        for kind, extra in kinds.items():
            for q in ROWS[shape]:
                for v in VARIANTS[shape]:
                    mma = v == "mma"
                    hpb, splits, *threads = (1, 1) if mma else v
                    cases.append((shape, A.AttentionSpec(kind=kind, q=q, splits=splits, heads_per_block=hpb, **base,
                                                         threads=threads[0] if threads else 0, **extra), positions, mma))

    def name_of(shape: str, spec: A.AttentionSpec, mma: bool) -> str:
        if mma:
            return f"ca_{shape}_{spec.kind}_q{spec.q}"
        return f"sa_{shape}_{spec.kind}_q{spec.q}_s{spec.splits}_h{spec.heads_per_block}_t{spec.block_threads()}"

    # render + compile everything first (in parallel)
    srcs, smem = [], {}
    for shape, spec, _, mma in cases:
        if mma:
            srcs.append(CA.render_chunk_attention(spec, tgt, name_of(shape, spec, mma)))
            smem[srcs[-1].entry] = CA.launch_shape(spec, tgt).smem
        else:
            srcs += A.render_attention(spec, tgt, name_of(shape, spec, mma))
    kernels, compile_s = compile_all(srcs, "ds4c-attn-", smem)

    dev = torch.device("cuda")
    seeds: dict[tuple, tuple] = {}  # (shape, kind, q, pos) -> inputs and reference, shared by the variants
    rows: list[dict] = []
    for shape, spec, positions, mma in cases:
        name = name_of(shape, spec, mma)
        main, use, secs = kernels[name]
        comb = kernels.get(name + "_combine", (None, {}, 0.0))[0]
        shapes = [CA.launch_shape(spec, tgt)] if mma else A.launch_shapes(spec)
        for pos in positions:
            key = (shape, spec.kind, spec.q, pos)
            if key not in seeds:
                d = _inputs(spec, torch.Generator().manual_seed(1234 + len(seeds)))
                live = spec.cap
                seeds[key] = (d, A.reference(spec, d["q"], d["ring"], d["kv_new"], d["comp"], d["sel"], d["sink"],
                                             pos, live))
            d, want = seeds[key]
            live = spec.cap
            gd = {k: (v.to(dev).contiguous() if isinstance(v, torch.Tensor) else v) for k, v in d.items()}
            out = torch.full((spec.q, spec.heads, spec.head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
            ws = torch.full((max(A.workspace_floats(spec), 1),), float("nan"), dtype=torch.float32, device=dev)
            vals = {**gd, "out": out, "ws": ws, "pos": torch.tensor([pos], dtype=torch.int64, device=dev),
                    "live": torch.tensor([live], dtype=torch.int64, device=dev)}
            margs = [vals[n] for n in A.arg_names(spec)["main"]]

            def launch() -> None:
                main(shapes[0].grid, shapes[0].block, margs, shapes[0].smem)
                if comb is not None:
                    comb(shapes[1].grid, shapes[1].block, [ws, gd["sink"], out])

            launch()
            torch.cuda.synchronize()
            got = out.cpu()
            written = not bool(torch.isnan(got).any())
            diff = (got.float() - want.float())
            rel = rel_err(got, want)
            us = median_us(launch)
            nbytes = _kv_bytes(spec, d, pos, live)
            entries = spec.window + spec.comp_len if spec.kind != "hca" else spec.window + min(pos // spec.ratio, live)
            rows.append({
                "spec": f"{shape:8s} {spec.kind} q={spec.q} pos={pos:<5d} " + (
                    "tensor cores (chunk kernel)" if mma else
                    f"splits={spec.splits} heads/block={spec.heads_per_block} threads={spec.block_threads()}"),
                "ok": written and rel < TOL, "rel_err": rel, "max_abs": float(diff.abs().max()),
                "all_written": written, "us": us, "GBps": nbytes / (us * 1e-6) / 1e9, "kv_bytes": nbytes,
                "tflops": 4.0 * spec.q * spec.heads * entries * spec.head_dim / (us * 1e-6) / 1e12,
                "regs": use.get("registers"), "compile_s": secs,
            })
    for r in rows:
        r["compile_total_s"] = compile_s
    return rows


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'max_abs':>9s} {'us':>8s} {'GB/s':>7s} {'TFLOP/s':>7s} {'KV KB':>7s} {'regs':>4s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r['rel_err']:9.2e} {r['max_abs']:9.2e} {r['us']:8.2f} "
              f"{r['GBps']:7.1f} {r['tflops']:7.1f} {r['kv_bytes'] / 1024:7.0f} {str(r['regs']):>4s}  {r['spec']}")


def main() -> int:
    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
