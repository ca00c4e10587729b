#!/usr/bin/env python3
"""Launch-shape sweep of the GEMV family on a CUDA GPU: rows per thread R x blocks per SM, for the GEMVs of a
flash-l4 step that take the most time (the head, wq_b, the attention-input multi-GEMV, wq_a), at q=1 and q=5.
Each variant is checked against the family's reference once (relative error) and timed with rotated weight
copies (L2 cold). Prints one line per variant, best first per case. Usage:

    python tests/gpu_checks/gemv_sweep.py [--arch sm_90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import gemv as G
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_all, median_us
from gpu_checks.gemv import TOL, _attn_input, _rel, case_buffers

O = G.GemvOutput
CASES = [
    ("head", 4096, [O(129280, "bf16", "f32")]),
    ("wq_b", 1024, [O(32768, "q8_0", "fp8act")]),
    ("attn_in", 4096, _attn_input()),
    ("wq_a", 4096, [O(1024, "q8_0", "fp8act")]),
]


def _rotating(fn, grid, block, x, wsets, ys, sm):
    """A launch closure that reads the next weight copy on every call (L2 cold)."""
    it = iter(range(10**9))
    return lambda: fn(grid, block, [x, *wsets[next(it) % len(wsets)], *ys], sm)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--qs", default="1,5")
    a = ap.parse_args()
    tgt = make_target(a.arch)
    specs = {}
    for name, k, outs in CASES:
        for q in (int(x) for x in a.qs.split(",")):
            for r in (1, 2, 4, 8):
                try:
                    specs[f"sw_{name}_q{q}_r{r}"] = G.GemvSpec(k, q, outs, True, rows=r)
                    G.plan(specs[f"sw_{name}_q{q}_r{r}"], tgt)
                except Exception as e:  # noqa: BLE001 - a shape the plan refuses is skipped
                    specs.pop(f"sw_{name}_q{q}_r{r}", None)
                    print(f"skip {name} q={q} R={r}: {e}")
    srcs = [G.render_gemv(s, tgt, e) for e, s in specs.items()]
    smem = {e: G.launch_shape(s, tgt)[2] for e, s in specs.items()}
    kern, wall = compile_all(srcs, "ds4c-sweep-", smem)
    print(f"compiled {len(srcs)} variants in {wall:.1f} s")
    g = torch.Generator(device="cuda").manual_seed(5)
    results: dict[str, list] = {}
    for e, spec in specs.items():
        fn, use, _ = kern[e]
        pl = G.plan(spec, tgt)
        x, ws, wsets, ys = case_buffers(spec, g)
        wbytes = G.weight_bytes(spec)
        _, block, sm = G.launch_shape(spec, tgt)
        case = e.rsplit("_r", 1)[0]
        for bps in (1, 2, 3, 4, 6, 8):
            grid = (min(pl.total_tiles, bps * G.DEFAULT_SMS), 1, 1)
            if bps > 1 and grid[0] == min(pl.total_tiles, (bps - 1) * G.DEFAULT_SMS):
                continue
            for y in ys:
                y.fill_(float("nan"))
            fn(grid, block, [x, *ws, *ys], sm)
            torch.cuda.synchronize()
            want = G.reference(spec, x, ws)
            err = max(_rel(y, w) for y, w in zip(ys, want))
            ok = err < min(TOL[o.out_dtype] for o in spec.outputs)
            us = median_us(_rotating(fn, grid, block, x, wsets, ys, sm), 50, 5)
            results.setdefault(case, []).append((us, spec.rows, bps, grid[0], use.get("registers"), err, ok,
                                                 wbytes / us / 1e3))
        del wsets, ws
        torch.cuda.empty_cache()
    for case, rows in results.items():
        rows.sort()
        s0 = specs[next(k for k in specs if k.startswith(case + "_r"))]
        default_r = G.plan(G.GemvSpec(s0.k, s0.q, s0.outputs), tgt).outs[0].r
        print(f"== {case} (default today: R={default_r}, {G.BLOCKS_PER_SM} blocks/SM)")
        for us, r, bps, grid, regs, err, ok, gbps in rows[:8]:
            print(f"  {us:8.1f} us {gbps:7.0f} GB/s  R={r} blocks/SM={bps} grid={grid} regs={regs} "
                  f"err={err:.1e} {'ok' if ok else 'BAD'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
