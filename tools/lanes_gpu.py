"""Decode lanes on the compiled step, on the device: exactness against each sequence alone (teacher-forced) and the
aggregate decode rate at 1, 2, 4, 8 and 16 lanes against the one-sequence step, from one run.

    python3 tools/lanes_gpu.py [--model synthetic:flash-l4] [--lanes 1,2,4,8,16] [--steps 64] [--json out.json]

Prints one line per lane count: step time (each lane's inter-token latency), aggregate tokens/s, and the ratio to
one lane and to the one-sequence decode step (the same weights, same run)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ds4c.runtime.sampler import argmax_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:flash-l4")
    ap.add_argument("--lanes", default="1,2,4,8,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--check", type=int, default=8, help="lanes of the exactness check (0: none)")
    ap.add_argument("--beside", type=int, default=4096, help="prompt prefilled beside 7 decoding lanes (0: none)")
    ap.add_argument("--chunk", type=int, default=64, help="its prefill chunk rows (one chunk per decode step)")
    ap.add_argument("--profile", action="store_true",
                    help="per lane count, every launch of the lanes graph timed on its own, summed by family")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from lanes_compare import lanes_vs_alone

    from ds4c.buckets import BucketSpec
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.sampler import argmax_chunk
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.step.lanes import LanesStep
    from ds4c.sources import open_model

    counts = [int(x) for x in a.lanes.split(",")]
    mf = open_model(a.model)
    cfg = mf.config
    t0 = time.perf_counter()
    ex = CompiledStep(mf, BucketSpec.build(cfg, (1,), a.max_ctx), device_arch(), KernelCache(),
                      prefill_chunks=(a.chunk, 2048) if a.beside else ())
    lanes = LanesStep(ex, slots=max(counts + [a.check]))
    print(f"# {torch.cuda.get_device_name()} {a.model}: opened in {time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(1)
    vocab = cfg.vocab_size
    out: dict = {"device": torch.cuda.get_device_name(), "model": a.model, "rows": []}
    if a.check:
        prompts = [torch.randint(0, vocab, (a.prompt + 7 * j,), generator=g).tolist() for j in range(a.check)]
        feeds = [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in prompts]
        t0 = time.perf_counter()
        r = lanes_vs_alone(ex, lanes, prompts, feeds)
        e = r["errors"]
        line = (f"exactness: {a.check} lanes x 24 steps from positions {a.prompt}..{a.prompt + 7 * (a.check - 1)}: "
                f"rel err median {e.median():.2e} max {e.max():.2e}, bit-equal rows {r['exact']:.1%}, "
                f"argmax agreement {r['argmax']:.1%} ({time.perf_counter() - t0:.1f} s)")
        print(line, flush=True)
        out["exactness"] = {"lanes": a.check, "median": float(e.median()), "max": float(e.max()),
                            "exact": r["exact"], "argmax": r["argmax"]}
    # the one-sequence decode step: greedy loop as ds4c generate runs it (step, device argmax, read back)
    chunk = argmax_chunk(vocab)
    ex.reset()
    prompt = torch.randint(0, vocab, (16,), generator=g).tolist()
    for t in prompt:
        ex.step([t], ex.pos)
    tok = prompt[-1]
    for _ in range(4):
        tok = int(argmax_rows(ex.step([tok], ex.pos), chunk)[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        tok = int(argmax_rows(ex.step([tok], ex.pos), chunk)[0])
    single = (time.perf_counter() - t0) / a.steps
    print(f"one-sequence step: {single * 1e3:.3f} ms/token ({1 / single:.1f} tok/s)", flush=True)
    out["single_ms"] = single * 1e3
    if a.profile:
        out["profile_single"] = by_family(ex.time_launches([tok], ex.pos), "one-sequence step")
    base = None
    # every lane its own prompt: lanes decoding the same tokens route to the same experts and share their reads
    # (an earlier version timed that: 3.96x / 4.14x at 8 / 16 lanes on the H100, not what distinct requests get)
    prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(max(counts + [8]))]
    for n in counts:
        dt, toks = timed_lanes(ex, lanes, prompts, n, a.steps)
        agg = n / dt
        base = base or agg
        print(f"lanes {n:2d}: step {dt * 1e3:.3f} ms (ITL {dt / single:.2f}x the one-sequence step), aggregate "
              f"{agg:.1f} tok/s = {agg / base:.2f}x one lane, {agg * single:.2f}x the one-sequence step", flush=True)
        out["rows"].append({"lanes": n, "step_ms": dt * 1e3, "agg_tok_s": agg, "vs_one_lane": agg / base,
                            "vs_single": agg * single, "itl_vs_single": dt / single})
        if a.profile:
            out["rows"][-1]["profile"] = profile_lanes(lanes, toks)
    if a.beside:
        out["beside"] = beside(ex, lanes, prompts, a, g)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


def by_family(launches: list[dict], title: str) -> dict:
    """Sum launch times by family (experts split by entry: up / down) and print one line."""
    fam: dict[str, float] = {}
    for la in launches:
        key = la["family"] + ("." + la["entry"].rsplit("_", 1)[-1] if la["family"] == "experts" else "")
        fam[key] = fam.get(key, 0.0) + la["us"]
    total = sum(fam.values())
    parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(fam.items(), key=lambda kv: -kv[1]))
    print(f"  profile {title}: {len(launches)} launches, {total:.0f} us eager: {parts}", flush=True)
    return {"launches": len(launches), "total_us": total, "families": fam}


def profile_lanes(lanes, toks: list[int]) -> dict:
    """Every launch of the graph of ``len(toks)`` lanes, timed eagerly at the lanes' current positions with their next
    tokens ``toks`` (each lane its own: the hash-routed layers route by token id, so one token for all lanes would
    share their experts); the slots are left written: time them last."""
    from ds4c.runtime.step.timing import time_bound_launches

    n = len(toks)
    size = lanes.size_for(n)
    sg = lanes.prepare(size, lanes.context_for(n))
    lanes.scalars.upload(lanes.pos[:n] + [0] * (size - n), list(toks) + [0] * (size - n))
    with torch.cuda.device(lanes.dev):
        return by_family(time_bound_launches(sg, 10), f"{n} lanes")


def timed_lanes(ex, lanes, prompts, n: int, steps: int) -> tuple[float, list[int]]:
    """Lanes ``0 .. n-1``, lane j from ``prompts[j]`` (fed on the one-sequence step, then installed), 4 warm-up steps
    (build, compile, capture), then ``steps`` greedy decode steps timed: (seconds per step, the last tokens)."""
    for j in range(n):
        ex.reset()
        for t in prompts[j]:
            ex.step([t], ex.pos)
        lanes.install(j)
    toks = [p[-1] for p in prompts[:n]]
    for _ in range(4):
        toks = lanes.greedy(lanes.decode(toks))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = lanes.greedy(lanes.decode(toks))
    return (time.perf_counter() - t0) / steps, toks


def beside(ex, lanes, prompts, a, g) -> dict:
    """A new prompt of ``a.beside`` tokens arrives while 7 lanes decode: its chunks of ``a.chunk`` rows alternate with
    their decode steps (the policy: one chunk, then one decode step); their inter-token latency during the prefill
    against without it; then the time to first token of a second turn (64 new tokens) starting from the first
    turn's state held on the device, against a cold prefill of both turns."""
    vocab = ex.cfg.vocab_size
    alone, toks = timed_lanes(ex, lanes, prompts, 7, a.steps)
    long = torch.randint(0, vocab, (a.beside,), generator=g).tolist()
    ex.reset()
    ex.prefill(long[: a.chunk], 0, chunks=(a.chunk,))  # warm the chunk graph
    ex.reset()
    gaps, last, pos = [], time.perf_counter(), 0
    t_start = last
    while pos < len(long):
        c = long[pos:pos + a.chunk]
        ex.prefill(c, pos, chunks=(a.chunk,))
        pos += len(c)
        toks = lanes.greedy(lanes.decode(toks))
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    prefill_s = last - t_start
    gaps_t = torch.tensor(gaps)
    print(f"beside: 7 lanes ITL {alone * 1e3:.3f} ms alone; during a {a.beside}-token prefill in {a.chunk}-row chunks "
          f"(one chunk per decode step, {prefill_s:.2f} s): median {gaps_t.median() * 1e3:.3f} ms "
          f"({gaps_t.median() / alone:.2f}x), max {gaps_t.max() * 1e3:.3f} ms ({gaps_t.max() / alone:.2f}x)", flush=True)
    # prefix reuse: the first turn's state kept (a device snapshot), the second turn prefills its own tokens only
    turn2 = torch.randint(0, vocab, (64,), generator=g).tolist()
    held = ex.snapshot()  # the first turn (a.beside tokens) just prefilled
    ex.prefill(turn2, ex.pos)  # warm: the second turn's graphs built and captured once
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ex.restore(held)
    first = int(argmax_rows(ex.prefill(turn2, ex.pos), None)[0])
    warm = time.perf_counter() - t0
    ex.reset()
    torch.cuda.synchronize()
    ex.prefill(long + turn2, 0)  # warm the 2048-row graphs of every bucket the cold prefill crosses
    ex.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    cold_first = int(argmax_rows(ex.prefill(long + turn2, 0), None)[0])  # every chunk size: 2048s
    cold = time.perf_counter() - t0
    print(f"second turn: TTFT {warm * 1e3:.2f} ms from the held first turn vs {cold * 1e3:.2f} ms cold "
          f"({warm / cold:.3f}x); same first token: {first == cold_first}", flush=True)
    return {"itl_alone_ms": alone * 1e3, "itl_median_ms": float(gaps_t.median()) * 1e3,
            "itl_max_ms": float(gaps_t.max()) * 1e3, "chunk": a.chunk, "prompt": a.beside, "prefill_s": prefill_s,
            "ttft_warm_ms": warm * 1e3, "ttft_cold_ms": cold * 1e3, "same_first_token": first == cold_first}


if __name__ == "__main__":
    main()
