"""Where a continuous-batching step on the compiled step spends its time (issue 30): L greedy requests decoding
together through ``BatchEngine`` (ds4c.batch_slots), each step's wall time split into the lanes graph's launch
(``LanesStep.decode``), the sampling and read-back (``next_tokens``) and the rest of the engine (scheduler, token
hand-out), against the same lanes step driven in a bare loop (``tools/lanes_gpu.py``'s measurement).

    python3 tools/batch_profile.py [--model synthetic:flash-l4] [--lanes 16] [--steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:flash-l4")
    ap.add_argument("--lanes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    from ds4c.batching import BatchConfig, BatchEngine
    from ds4c.engine import open_engine
    from ds4c.sources import open_model

    mf = open_model(a.model)
    step = open_engine(mf, device="cuda", engine="compiled", max_ctx=1024, progress=False)
    eng = BatchEngine(step, step.max_ctx, BatchConfig(max_lanes=a.lanes, prefix_states=0))
    lanes = eng.backend.lanes
    parts = {"decode": [], "next_tokens": [], "step": []}
    dec, nxt = lanes.decode, lanes.next_tokens

    def timed(name, fn):
        def run(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            parts[name].append(time.perf_counter() - t0)
            return out
        return run

    lanes.decode, lanes.next_tokens = timed("decode", dec), timed("next_tokens", nxt)
    run = eng.backend.run
    eng.backend.run = timed("step", run)
    g = torch.Generator().manual_seed(3)
    reqs = [eng.submit(torch.randint(0, mf.config.vocab_size, (32,), generator=g).tolist(), a.steps + a.lanes + 8)
            for _ in range(a.lanes)]
    while min(len(r.tokens) for r in reqs) < 2:
        time.sleep(0.001)
    for v in parts.values():
        v.clear()
    t0, s0 = time.perf_counter(), eng.steps
    while eng.steps - s0 < a.steps:
        time.sleep(0.0005)
    wall = (time.perf_counter() - t0) / (eng.steps - s0)
    for r in reqs:
        r.stop()
    eng.close()
    med = {k: statistics.median(v) * 1e3 for k, v in parts.items() if v}
    print(f"engine, {a.lanes} lanes: {wall * 1e3:.3f} ms per step (wall); median decode {med['decode']:.3f} ms, "
          f"next_tokens {med['next_tokens']:.3f} ms, backend.run {med['step']:.3f} ms")
    # the bare loop on the same slots
    toks = [1] * a.lanes
    for j in range(a.lanes):
        step.reset()
        step.prefill(list(range(32)), 0)
        lanes.install(j)
    lanes.decode, lanes.next_tokens = dec, nxt
    for _ in range(4):
        toks = lanes.next_tokens(lanes.decode(toks))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        toks = lanes.next_tokens(lanes.decode(toks))
    print(f"bare loop, {a.lanes} lanes: {(time.perf_counter() - t0) / a.steps * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
