#!/usr/bin/env python3
"""Where a speculative step's time goes on the compiled step (issue: speculative decoding): greedy verify steps
of q rows with the device-side acceptance (``verify_greedy``) after a prompt, timed three ways in one run:

* wall time per ``verify_greedy`` call (what the loop sees);
* GPU time of the same calls, CUDA events recorded on the stream before and after each call (idle gaps
  inside a call count; gaps between calls do not);
* the kernels' own time per call from torch.profiler (sum of device kernel durations), and the verify
  graph's replay time alone (``time_replays``).

    python tools/spec_profile.py [MODEL] [--prompt 512] [--q 5] [--steps 40]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="synthetic:flash-l4")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--q", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    import torch

    from ds4c.engine import open_engine
    from ds4c.sources import open_model

    mf = open_model(a.model)
    V = mf.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(a.prompt)]
    step = open_engine(mf, device="cuda", max_ctx=a.prompt + 4 * a.steps * a.q + 16, progress=False)

    def prefill():
        step.reset()
        for s in range(0, len(prompt), 5):
            step.step(prompt[s:s + 5], s)

    def run(n, fill=True):
        if fill:
            prefill()
        pos, tok = len(prompt), prompt[-1]
        walls, gpus = [], []
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for i in range(n):
            drafts = [rng.randrange(V) for _ in range(a.q - 1)]  # wrong: one token per step
            t0 = time.perf_counter()
            evs[i][0].record()
            new = step.verify_greedy([tok] + drafts, pos)
            evs[i][1].record()
            walls.append(time.perf_counter() - t0)
            pos, tok = pos + len(new), new[-1]
        torch.cuda.synchronize()
        gpus = [x.elapsed_time(y) for x, y in evs]
        return walls, gpus, pos

    def run_pipelined(n):
        """The pipelined loop's pattern (runtime/spec_pipeline.py): queue N+1, await N, release N+1; per step
        the wall time between consecutive results."""
        prefill()
        pipe = step.greedy_pipeline()
        pos, tok = len(prompt), prompt[-1]
        pipe.enqueue(a.q, pos)
        pipe.release([tok] + [rng.randrange(V) for _ in range(a.q - 1)], pos)
        stamps = []
        for _ in range(n):
            pipe.enqueue(a.q, pos + a.q)
            new = pipe.result()
            stamps.append(time.perf_counter())
            pos, tok = pos + len(new), new[-1]
            pipe.release([tok] + [rng.randrange(V) for _ in range(a.q - 1)], pos)
        pipe.close(tok, pos)
        torch.cuda.synchronize()
        return [y - x for x, y in zip(stamps, stamps[1:])]

    run(5)
    if step.greedy_pipeline() is not None:
        run_pipelined(5)
        per = run_pipelined(a.steps)
        print(f"pipelined q={a.q}: {1e3 * statistics.median(per):.3f} ms per step (median wall between results)")
    walls, gpus, end = run(a.steps)
    med = lambda xs: statistics.median(xs)
    print(f"verify_greedy q={a.q} after {a.prompt} tokens, {a.steps} steps: wall {1e3 * med(walls):.3f} ms, "
          f"GPU span {med(gpus):.3f} ms (median per call)")
    prefill()
    rep = step.time_replays([prompt[-1]] + [1] * (a.q - 1), len(prompt), 30)
    print(f"verify graph replay alone (time_replays): {rep:.3f} ms")
    # kernel time per call from the profiler
    from torch.profiler import ProfilerActivity, profile

    prefill()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(10, fill=False)
    ka = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
    print(f"profiler: device self time {dev_us / 1e3 / 10:.3f} ms per call over 10 calls")
    print(ka.table(sort_by="self_device_time_total" if hasattr(ka[0], "self_device_time_total")
                   else "self_cuda_time_total", row_limit=25))
    # the device timeline of the profiled calls: kernels and copies in start order, the idle gaps between them
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start),
                 key=lambda t: t[0])
    if evs:
        busy = sum(b - a for a, b, _ in evs)
        span = evs[-1][1] - evs[0][0]
        gaps = sorted(((evs[i + 1][0] - evs[i][1], evs[i][2], evs[i + 1][2]) for i in range(len(evs) - 1)),
                      reverse=True)
        print(f"device timeline: {len(evs)} events, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
              f"idle {(span - busy) / 1e3:.3f} ms over 10 calls; largest gaps (us, after -> before):")
        for g, x, y in gaps[:24]:
            print(f"  {g:8.1f}  {x[:40]} -> {y[:40]}")
        small = [g for g, _, _ in gaps if 0 < g < 20]
        print(f"gaps < 20 us: {len(small)}, {sum(small) / 1e3:.3f} ms in all")
    # per-call host phases without the GPU: enqueue cost of one call while the GPU is busy
    prefill()
    pos, tok = len(prompt), prompt[-1]
    t = []
    for i in range(10):
        drafts = [rng.randrange(V) for _ in range(a.q - 1)]
        t0 = time.perf_counter()
        step.arm_undo([tok] + drafts, pos)
        t1 = time.perf_counter()
        step.scalars.upload([tok] + drafts, pos)
        t2 = time.perf_counter()
        t.append((t1 - t0, t2 - t1))
        step.sequence.undo = None
    print(f"host: arm_undo {1e6 * med([x for x, _ in t]):.1f} us, _upload {1e6 * med([y for _, y in t]):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
