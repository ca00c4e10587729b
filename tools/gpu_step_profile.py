#!/usr/bin/env python3
"""Where the compiled step's time goes: every launch timed on its own (CUDA events), summed per kernel family,
next to the graph-replay time of the whole step (``CompiledStep.time_replays``: back-to-back replays, the
method ``ds4c bench`` uses). Usage:

    python tools/gpu_step_profile.py [--model tiny|flash-l4 | --gguf FILE] [--widths 1,5] [--pos P]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4c.buckets import BucketSpec  # noqa: E402
from ds4c.config import preset  # noqa: E402
from ds4c.sources import open_model  # noqa: E402
from ds4c.runtime.cache import KernelCache  # noqa: E402
from ds4c.runtime.step import CompiledStep  # noqa: E402
from ds4c.synth import make_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--pos", type=int, default=200)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--prefill", default="", help="chunk sizes C,C: profile those prefill chunk graphs at --pos")
    a = ap.parse_args()
    cfg = preset(a.model)
    path = a.gguf if a.gguf else make_model(cfg, Path(tempfile.mkdtemp()) / f"{a.model}.gguf", seed=0)
    mf = open_model(path)
    widths = tuple(int(w) for w in a.widths.split(","))
    chunks = tuple(int(c) for c in a.prefill.split(",") if c)
    buckets = BucketSpec.build(mf.config, widths, max(a.max_ctx, a.pos + max(chunks, default=0) + 1))
    ex = CompiledStep(mf, buckets, a.arch, KernelCache(Path(tempfile.mkdtemp())), prefill_chunks=chunks)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, mf.config.vocab_size, (a.pos + max(chunks, default=8) + 8,), generator=g).tolist()
    p = 0
    if chunks and a.pos:  # fill through the chunk graphs: a long position in seconds, not thousands of steps
        ex.prefill(toks[:a.pos], 0, chunks)
        p = a.pos
    while p < a.pos:  # fill the sequence up to pos with the widest step
        q = min(max(widths), a.pos - p)
        if q not in widths:
            q = 1 if 1 in widths else min(widths)
        ex.step(toks[p:p + q], p)
        p += q
    runs = [(w, None) for w in widths] + [(c, c) for c in chunks]
    for w, chunk in runs:
        rows = ex.time_launches(toks[p:p + w], p, rows=chunk)
        total = sum(r["us"] for r in rows)
        rep = ex.time_replays(toks[p:p + w], p) if chunk is None else float("nan")
        if chunk is not None:
            print(f"== prefill chunk C={chunk}: {total / 1e3:.2f} ms for {chunk} rows = {chunk / total * 1e6:.0f} "
                  f"tokens/s (sum of launches)")
        fam = defaultdict(lambda: [0.0, 0])
        for r in rows:
            fam[r["family"]][0] += r["us"]
            fam[r["family"]][1] += 1
        where = f"C={chunk}" if chunk else f"q={w} bucket={buckets.bucket(p, w)}"
        print(f"== {mf.config.name} {where} pos={p}: {len(rows)} launches, "
              f"sum of launches {total:.1f} us, graph replay {rep * 1e3:.1f} us")
        for f, (us, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
            print(f"  {f:12s} {n:4d} launches {us:9.1f} us ({100 * us / total:5.1f}%)")
        print("  slowest launches:")
        for r in sorted(rows, key=lambda r: -r["us"])[:a.top]:
            print(f"    {r['us']:8.1f} us  {r['kernel']:40s} {r['entry']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
