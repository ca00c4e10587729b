#!/usr/bin/env python3
"""GPU soak of the compiled step (CUDA graphs) on one CUDA GPU: the long form of the GPU tests
(tests/test_compiled_step.py, tests/test_gpu_lockstep.py), on any model, for a device session
(tools/device_session.sh soak). Phases, in the order they run:

1. Repeated requests: R calls of ``ds4c.generate.generate`` on one CompiledStep in this process, all the same
   request, greedy and then seeded sampling (temperature 0.8): every request must give the first's tokens.
   Then ``ds4c generate FILE --device cuda --json`` as a subprocess (--cli-runs times): identical tokens.
   (Before the reference is loaded, so the subprocess has GPU memory: flash-l4's reference with
   --cache-experts 1024 holds ~102 GiB.)
2. Teacher-forced (--teacher-forced P): before every step the GPU reference's state is copied into the compiled
   step; steps of the widest width, then each other, up to position P; every row's logits compared (median
   < 1e-2, p90 < 3e-2). With --noise-floor K the reference on the CPU also runs the first K steps from the same
   state, and the tolerance is the spread of the two references instead (median and p90 at most 1.5x + 1e-3).
3. Lockstep soak: N decode steps of the compiled step (graph replays) and of the GPU reference, each from an
   empty sequence with its own state, fed the same tokens (``step_compare.lockstep_errors``); relative
   error of every step's logits, reported per window of W steps (median, p90, max, argmax agreement). Drift
   criterion (``step_compare.lockstep_ok``): the last tenth's median <= the first tenth's x sqrt of the step
   ratio + 0.01 (rounding's random walk) and every step < 0.25; the per-window line keeps 1.5 x + 0.01. max_ctx >= N, so the run crosses every context bucket up to N.
   --time-budget S stops this phase cleanly after S seconds; with --checkpoint FILE both states, the errors
   and the step are saved there when stopped, and a later run with the same options resumes from it (the
   file is removed once all N steps are done): a soak longer than one device call runs in several.
A window table and a phase table come last, then ``RESULT PASS`` or ``RESULT FAIL``. Usage:

    python tests/gpu_soak.py [--model tiny|flash-l4 | --gguf FILE] [--lockstep N] [--window W]
        [--time-budget S] [--checkpoint FILE] [--requests R] [--new-tokens T] [--prompt-len P]
        [--cli-runs K] [--max-ctx C] [--widths 1,2,3,4,5] [--artifact] [--cache-experts E]
        [--teacher-forced P [--noise-floor K]]

    # ~92 ms per lockstep step (the reference's host loop), so 10,000 steps take ~15 min: run it in
    # several device calls; a resuming call can skip phase 1 with --requests 0 --cli-runs 0
    python tests/gpu_soak.py --model tiny --artifact --time-budget 470 --checkpoint out/soak-tiny.pt
    python tests/gpu_soak.py --gguf out/fl4.gguf --cache-experts 1024 --artifact --time-budget 330 \\
        --checkpoint out/soak-fl4.pt
    # flash-l4 teacher-forced within the noise floor of the CPU and GPU references, no soak
    python tests/gpu_soak.py --gguf out/fl4.gguf --max-ctx 1024 --teacher-forced 60 --noise-floor 14 \\
        --lockstep 0 --requests 0 --cli-runs 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ds4c.buckets import BucketSpec
from ds4c.config import preset
from ds4c.generate import generate
from ds4c.sources import open_model
from ds4c.reference import Reference, ReferenceWeights
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.step import CompiledStep
from ds4c.synth import make_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/, for step_compare (run as a script)

from step_compare import lockstep_ok, summary, teacher_forced_errors  # noqa: E402


def requests(ex: CompiledStep, prompt: list[int], n_new: int, r: int, temperature: float, seed: int,
             width: int) -> tuple[list[int], int, list[float]]:
    """``r`` identical requests on one engine: (the first's tokens, how many equal it, seconds per request)."""
    outs, secs = [], []
    for _ in range(r):
        t0 = time.perf_counter()
        outs.append(generate(ex, prompt, n_new, temperature=temperature, seed=seed, width=width).tokens)
        secs.append(time.perf_counter() - t0)
    return outs[0], sum(o == outs[0] for o in outs), secs


def cli_runs(path: Path, prompt: list[int], n_new: int, k: int, art: Path | None, cache: Path
             ) -> list[tuple[list[int] | None, float]]:
    """``ds4c generate FILE --device cuda --json`` ``k`` times as a subprocess: (tokens or None, seconds)."""
    exe = Path(sys.executable).parent / "ds4c"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from ds4c.cli import main; main()"]
    cmd += ["generate", str(path), "--device", "cuda", "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", str(n_new), "--json"] + (["--artifact", str(art)] if art else [])
    env = {**os.environ, "DS4C_CACHE": str(cache)}  # the second run finds the first's kernels
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        dt = time.perf_counter() - t0
        try:
            assert p.returncode == 0, f"exit {p.returncode}"
            out.append((json.loads(p.stdout.strip().splitlines()[-1])["tokens"], dt))
        except (AssertionError, ValueError, KeyError, IndexError) as exc:
            print(f"CLI run failed ({exc}): {p.stderr[-2000:]}", flush=True)
            out.append((None, dt))
        print(f"CLI run {len(out)}/{k} in {dt:.1f} s: tokens {(out[-1][0] or [])[:12]}...", flush=True)
    return out


def window_stats(e: torch.Tensor, a: torch.Tensor) -> str:
    return f"{summary(e)}, argmax {a.float().mean():.3f}"


def soak(ex: CompiledStep, ref: Reference, toks: list[int], n: int, w: int, budget: float | None,
         ckpt: Path | None, tag: dict) -> tuple[list[float], list[bool], str]:
    """The lockstep loop (``step_compare.lockstep_errors`` with windows, a time budget and a checkpoint).
    Returns the per-step errors, argmax agreements and how the phase ended."""
    errs, agree, start = [], [], 0
    if ckpt is not None and ckpt.exists():
        d = torch.load(ckpt, map_location="cuda", weights_only=False)
        if d["tag"] != tag:
            raise SystemExit(f"checkpoint {ckpt} is of another run ({d['tag']} != {tag}); remove it")
        ex.restore(d["ex"])
        ref.restore(d["ref"])
        errs, agree, start = d["errs"], d["agree"], d["step"]
        print(f"resumed from {ckpt} at step {start}", flush=True)
    else:
        ex.reset()
        ref.reset()
    t0 = tw = time.perf_counter()
    end, i_w = "done", start
    try:
        for i in range(start, n):
            if budget is not None and time.perf_counter() - t0 > budget:
                end = f"stopped by --time-budget {budget:g} s at step {i}"
                break
            got = ex.step([toks[i]], i).float().cpu()
            want = ref.decode(toks[i], i).cpu()
            errs.append(float((got - want).norm() / want.norm()))
            agree.append(int(got.argmax()) == int(want.argmax()))
            if (i + 1) % w == 0 or i + 1 == n:
                k, now = (i + 1) % w or w, time.perf_counter()
                print(f"  lockstep {i + 1}/{n}: {now - t0:.0f} s ({(now - tw) / (i + 1 - i_w) * 1e3:.0f} ms/step); "
                      f"window {window_stats(torch.tensor(errs[-k:]), torch.tensor(agree[-k:]))}", flush=True)
                tw, i_w = now, i + 1
    except Exception as exc:  # report what ran (a crash is a FAIL, not a lost log)
        end = f"error at step {len(errs)}: {type(exc).__name__}: {exc}"
    if ckpt is not None and end.startswith("stopped"):
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tag": tag, "step": len(errs), "errs": errs, "agree": agree, "ex": ex.snapshot(),
                    "ref": ref.snapshot()}, ckpt)
        end += f"; checkpoint saved to {ckpt}"
    elif ckpt is not None and end == "done" and ckpt.exists():
        ckpt.unlink()
    return errs, agree, end


def teacher_forced_phase(ex: CompiledStep, ref: Reference, toks: list[int], until: int, widths: tuple[int, ...],
                         floor_model: Any, floor_steps: int) -> tuple[str, int, bool, str]:
    """Teacher-forced steps up to position ``until`` (``step_compare``), the widest of ``widths`` first, then
    each other (5, 1, 2, 3, 4 by default): a phase row.
    Tolerance: median < 1e-2 and p90 < 3e-2 of the per-row errors; with ``floor_model`` (a model file: its
    reference on the CPU, from the same state for the first ``floor_steps`` steps) instead within the noise
    floor of the two references (median and p90 at most 1.5x the CPU reference's + 1e-3)."""
    floor_ref = None
    if floor_model is not None:
        floor_ref = Reference(ReferenceWeights.load(floor_model, "cpu", cache_experts=256), max_ctx=ex.capacity)
    t0 = time.perf_counter()
    order = (max(widths),) + tuple(w for w in widths if w != max(widths))
    e, fl = teacher_forced_errors(ex, ref, toks, order, until, floor_ref, floor_steps)
    detail = f"{len(e)} rows in {time.perf_counter() - t0:.1f} s: {summary(e)}"
    if len(fl):
        ok = bool(fl[:, 0].median() <= 1.5 * fl[:, 1].median() + 1e-3
                  and torch.quantile(fl[:, 0], 0.9) <= 1.5 * torch.quantile(fl[:, 1], 0.9) + 1e-3)
        detail += (f"; noise floor over {len(fl)} rows: compiled {summary(fl[:, 0])}, CPU reference "
                   f"{summary(fl[:, 1])}")
    else:
        ok = bool(e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2)
    ex.reset()
    return "teacher-forced", len(e), ok, detail


def main() -> int:
    ap = argparse.ArgumentParser(description="GPU soak of the compiled step: repeated requests (in process and "
                                 "through the CLI), then a long lockstep against the GPU reference; see the "
                                 "module docstring.")
    ap.add_argument("--model", default="tiny", help="preset made here with seed 0 (tiny, flash-l4)")
    ap.add_argument("--gguf", default=None, help="use this model file instead of making one")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lockstep", type=int, default=10000, help="decode steps in lockstep (0: skip)")
    ap.add_argument("--window", type=int, default=1000, help="steps per statistics window")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="stop the lockstep phase after this many seconds of it (setup and requests come on top)")
    ap.add_argument("--checkpoint", type=Path, default=None, help="save the lockstep here when stopped; resume")
    ap.add_argument("--requests", type=int, default=100, help="identical requests per sampling mode (0: skip)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled set's temperature")
    ap.add_argument("--seed", type=int, default=5, help="the sampled set's seed")
    ap.add_argument("--cli-runs", type=int, default=2, help="ds4c generate subprocess runs (0: skip)")
    ap.add_argument("--max-ctx", type=int, default=None,
                    help="default: lockstep (or teacher-forced + 5) + prompt + new tokens")
    ap.add_argument("--widths", default="1,2,3,4,5", help="compiled widths (generate prefills at the widest)")
    ap.add_argument("--artifact", action="store_true", help="build an AOT artifact here and run from it")
    ap.add_argument("--ref", choices=("eager", "compiled"), default="eager",
                    help="the GPU reference: eager (~90 ms/step, the host loop) or its torch.compile form "
                         "(ds4c.reference.compiled, ~10 ms/step at flash-l4 after ~2 min of compile)")
    ap.add_argument("--ref-mode", default="reduce-overhead", help="torch.compile mode of --ref compiled")
    ap.add_argument("--cache-experts", type=int, default=None,
                    help="reference expert cache (flash-l4: 1024, else experts are re-read every step)")
    ap.add_argument("--teacher-forced", type=int, default=0,
                    help="before the lockstep: teacher-forced steps of widths 5,1,2,3,4 up to this position (0: skip)")
    ap.add_argument("--noise-floor", type=int, default=0,
                    help="for this many teacher-forced steps also run the reference on the CPU from the same state")
    a = ap.parse_args()
    t_all = time.perf_counter()
    mf = open_model(a.gguf if a.gguf else
                    make_model(preset(a.model), Path(tempfile.mkdtemp()) / f"{a.model}.gguf", seed=0))
    cfg = mf.config
    n, w = a.lockstep, max(1, a.window)
    gen = torch.Generator().manual_seed(7)
    toks = torch.randint(0, cfg.vocab_size, (max(n, a.prompt_len, a.teacher_forced + 5),), generator=gen).tolist()
    prompt = toks[:a.prompt_len]
    max_ctx = a.max_ctx or max(n, a.teacher_forced + 5) + a.prompt_len + a.new_tokens
    widths = tuple(int(x) for x in a.widths.split(","))
    buckets = BucketSpec.build(cfg, widths, max_ctx)
    print(f"model {cfg.name} ({mf.path}): {cfg.n_layers} layers, widths {widths}, buckets {buckets.contexts}",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="ds4c-soak-"))
    cache, art = KernelCache(tmp / "cache"), None
    if a.artifact:
        from ds4c.runtime.artifact import build_artifact
        from ds4c.runtime.targets import target

        t1 = time.perf_counter()
        art = build_artifact(cfg, [target(a.arch)], buckets, tmp / "art", cache=cache, progress=False,
                             weight_types={name: mf.ggml_type(name) for name in mf.specs})
        print(f"artifact built ({len(buckets.keys())} graphs, cold cache) in {time.perf_counter() - t1:.1f} s",
              flush=True)
    t1 = time.perf_counter()
    ex = CompiledStep(mf, buckets, a.arch, cache, artifact=str(art) if art else None)
    for wd in buckets.widths:
        ex.prepare(wd, buckets.contexts[0])
    torch.cuda.synchronize()
    print(f"compiled step ready in {time.perf_counter() - t1:.1f} s", flush=True)
    rows = []  # (phase, n, ok, detail)
    # 1. repeated requests, in process and through the CLI
    greedy = None
    for temp in ((0.0, a.temperature) if a.requests else ()):
        first, same, secs = requests(ex, prompt, a.new_tokens, a.requests, temp, a.seed, max(widths))
        greedy = first if temp == 0 else greedy
        s = torch.tensor(secs)
        name = "requests greedy" if temp == 0 else f"requests T={temp:g} seed {a.seed}"
        rows.append((name, a.requests, same == a.requests,
                     f"{same}/{a.requests} identical; {s.median() * 1e3:.1f} ms/request median, first "
                     f"{s[0] * 1e3:.1f}, max {s.max() * 1e3:.1f}; tokens {first[:8]}..."))
        print(f"{name}: {rows[-1][3]}", flush=True)
    if a.cli_runs:
        cli = cli_runs(Path(mf.path), prompt, a.new_tokens, a.cli_runs, art, tmp / "cache")
        got = [t for t, _ in cli]
        ok = all(t is not None for t in got) and all(t == got[0] for t in got)
        rows.append(("cli generate greedy", a.cli_runs, ok,
                     f"{sum(t is not None and t == got[0] for t in got)}/{len(got)} ran and identical, "
                     f"{sum(d for _, d in cli) / len(cli):.1f} "
                     f"s/run (load included); same as in-process greedy: "
                     f"{got[0] == greedy if greedy is not None else 'n/a'}"))
    # 2. teacher-forced steps, then the lockstep soak, against the GPU reference
    errs, agree, end = [], [], "skipped"
    if a.teacher_forced or n:
        t1 = time.perf_counter()
        ref = Reference(ReferenceWeights.load(mf, "cuda", cache_experts=a.cache_experts), max_ctx=ex.capacity)
        if a.ref == "compiled":
            from ds4c.reference.compiled import compile_reference

            ref = compile_reference(ref, mode=a.ref_mode)
        print(f"reference ({a.ref}) on cuda in {time.perf_counter() - t1:.1f} s", flush=True)
    if a.teacher_forced:
        rows.append(teacher_forced_phase(ex, ref, toks, a.teacher_forced, widths, mf if a.noise_floor else None,
                                         a.noise_floor))
        print(f"{rows[-1][0]}: {rows[-1][3]}", flush=True)
    if n:
        print(f"lockstep {n} steps, window {w}", flush=True)
        tag = {"config": cfg.hash(), "buckets": buckets.hash(), "n": n, "artifact": bool(art), "ref": a.ref}
        errs, agree, end = soak(ex, ref, toks, n, w, a.time_budget, a.checkpoint, tag)
    # summary
    print(f"\nlockstep: {len(errs)}/{n} steps, {end}; graphs captured: "
          f"{sorted(f'q{k[0]}c{k[1]}' for k in ex.capture_ms)}")
    if errs:
        e, g = torch.tensor(errs), torch.tensor(agree)
        print(f"{'window':>13} {'median':>9} {'p90':>9} {'max':>9} {'argmax':>7}")
        for s in range(0, len(e), w):
            seg, ag = e[s:s + w], g[s:s + w]
            print(f"{s:>6}-{s + len(seg) - 1:<6} {seg.median():9.2e} {torch.quantile(seg, 0.9):9.2e} "
                  f"{seg.max():9.2e} {ag.float().mean():7.3f}{'  (partial)' if len(seg) < w else ''}")
        full = len(e) // w
        first, last = e[:w].median(), e[(full - 1) * w:full * w].median() if full else e.median()
        win_ok = bool(last <= 1.5 * first + 1e-2) if full >= 2 else None
        ok = bool(e.max() < 0.25) and lockstep_ok(e) and win_ok is not False and not end.startswith("error")
        rows.append(("lockstep", len(e), ok,
                     f"{full} full windows; last median {last:.2e} vs first {first:.2e} -> "
                     f"{'n/a (< 2 windows)' if win_ok is None else ('met' if win_ok else 'NOT met')}; "
                     f"tenths (lockstep_ok) {'met' if lockstep_ok(e) else 'NOT met'}; max {e.max():.2e}; "
                     f"argmax {g.float().mean():.3f}{'' if len(e) == n else '; INCOMPLETE: ' + end}"))
    elif n:
        rows.append(("lockstep", 0, False, end))
    print(f"\n{'phase':<24} {'n':>6}  {'ok':<4} detail")
    for name, k, ok, detail in rows:
        print(f"{name:<24} {k:>6}  {'PASS' if ok else 'FAIL':<4} {detail}")
    print(f"total {time.perf_counter() - t_all:.0f} s")
    ok = bool(rows) and all(r[2] for r in rows)
    print("RESULT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
