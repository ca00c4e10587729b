#!/usr/bin/env python3
"""GPU check of the reference (run on a CUDA machine): the reference on cuda against the reference on cpu.

Writes the tiny model, then for a prompt: greedy tokens on cpu and cuda (must be identical), logits of
every step compared by relative error (bf16-level tolerance 1e-2: GPU and CPU BLAS sum in different
orders), and timings. Prints a short table last. Usage: python tools/gpu_reference_check.py [N_TOKENS]
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from ds4c.config import preset
from ds4c.generate import generate
from ds4c.gguf_file import open_model
from ds4c.reference import Reference, ReferenceWeights
from ds4c.synth import make_model


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    path = make_model(preset("tiny"), Path(tempfile.mkdtemp()) / "tiny.gguf", seed=0)
    mf = open_model(path)
    prompt = [5, 17, 301, 42, 7, 99, 250, 3, 11]
    rows = []
    toks = {}
    for dev in ("cpu", "cuda"):
        ref = Reference(ReferenceWeights.load(mf, dev), max_ctx=len(prompt) + n)
        t0 = time.perf_counter()
        res = generate(ref, prompt, n)
        toks[dev] = res.tokens
        rows.append((dev, time.perf_counter() - t0, res.decode_tokens_per_s))
    # step logits on the same token stream
    seq = prompt + toks["cpu"][:40]
    out = {}
    for dev in ("cpu", "cuda"):
        ref = Reference(ReferenceWeights.load(mf, dev), max_ctx=len(seq))
        out[dev] = torch.cat([ref.verify(seq[p:p + 5], p).cpu() for p in range(0, len(seq), 5)])
    rel = ((out["cpu"] - out["cuda"]).norm() / out["cpu"].norm()).item()
    same = toks["cpu"] == toks["cuda"]
    first_diff = next((i for i, (a, b) in enumerate(zip(toks["cpu"], toks["cuda"])) if a != b), None)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("device  seconds  decode tok/s")
    for dev, s, tps in rows:
        print(f"{dev:6s} {s:8.2f} {tps:12.2f}")
    print(f"greedy tokens identical over {n}: {same} (first difference at {first_diff})")
    print(f"verify logits rel err cuda vs cpu over {len(seq)} positions: {rel:.2e} (tolerance 1e-2)")
    ok = rel < 1e-2 and (same or (first_diff is not None and first_diff > 50))
    print("RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
