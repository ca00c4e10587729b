"""``ds4c bench --lanes L,L,...``: many sequences at once through the continuous-batching engine
(:mod:`ds4c.batching`, docs/batching.md), the three numbers issue 30 sets targets for, in one run:

* **decode**: for each L, L requests submitted together (distinct random prompts of ``prompt_len`` ids, greedy,
  ``new_tokens`` each): the aggregate decode rate (new tokens after each request's first, over the time from the
  last first token to the last token) and each sequence's median inter-token latency; ratios to L = 1;
* **prefill beside decode**: ``L_max - 1`` sequences decoding when a prompt of ``long_prompt`` ids arrives: their
  median inter-token latency while it is prefilled, over their latency before it arrived;
* **prefix reuse**: a second turn (the first turn's prompt and reply, then 16 more ids) after the first: its time
  to first token with the first turn's pages held, over a cold start of the same prompt.

It runs ``engine`` on ``device`` (``auto``: the compiled step on cuda, its decode lanes in one CUDA graph and prompts
prefilled beside them, :mod:`ds4c.batch_slots`; the reference on cpu, :mod:`ds4c.batch_paged`), one batch engine
for every measurement, opened (and on the compiled step warmed: every lanes graph captured) before any is timed;
the report names the engine and the warm-up time. Nothing imports this module but the CLI.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ds4c.batching import BatchConfig, BatchEngine
from ds4c.errors import Ds4cError
from ds4c.gguf_file import ModelFile


@dataclass
class LanesReport:
    """What :func:`run_lanes_bench` measured (seconds; rates in tokens/s)."""

    model: str
    device: str
    engine: str
    prompt_len: int
    new_tokens: int
    levels: list[dict[str, Any]] = field(default_factory=list)
    prefill_beside_decode: dict[str, Any] | None = None
    prefix_reuse: dict[str, Any] | None = None
    open_s: float = 0.0
    prefill_chunk: int | None = None
    prefill_every: int = 1
    prefill_rows: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _itl(reqs: list) -> float:
    return statistics.median(s for r in reqs for s in r.step_s) if any(r.step_s for r in reqs) else 0.0


def run_lanes_bench(mf: ModelFile, device: str, lanes: tuple[int, ...], new_tokens: int = 64, prompt_len: int = 32,
                    long_prompt: int = 4096, threads: int | None = None, engine: str = "auto",
                    prefill_chunk: int | None = None, prefill_every: int = 1, prefill_rows: int = 0,
                    say: Callable[[str], Any] = lambda m: None) -> LanesReport:
    """Measure (module docstring); ``prefill_chunk``, ``prefill_every``, ``prefill_rows``:
    :class:`~ds4c.batching.BatchConfig`'s (the compiled step's largest prefill chunk beside decoding sequences, how
    often one runs, or a prompt's rows as a lane of the decode step). Raises Ds4cError for lanes below 1 (above 16
    on the compiled step) or lengths past the model's context, and what :func:`~ds4c.engine.open_engine` raises."""
    from ds4c.engine import open_engine, resolve_engine  # start-up speed

    if not lanes or any(n < 1 for n in lanes):
        raise Ds4cError(f"--lanes: expected sequence counts >= 1, found {lanes}")
    if new_tokens < 2 or prompt_len < 1:
        raise Ds4cError("--lanes: expected --new-tokens >= 2 and --prompt-len >= 1")
    if long_prompt < 32:
        raise Ds4cError(f"--long-prompt must be >= 32 (the first chat turn is it less 24 tokens), found {long_prompt}")
    top = max(lanes)
    max_ctx = max(prompt_len + 2 * new_tokens + 16, long_prompt + 8)
    if engine == "compiled" and device != "cuda":  # said with this command's option (resolve_engine says --engine)
        raise Ds4cError(f"--lanes-engine compiled runs on device 'cuda' only, found device {device!r}")
    name = resolve_engine(device, engine)
    if name == "reference" and (prefill_chunk is not None or prefill_every != 1 or prefill_rows):
        raise Ds4cError("--lanes-prefill-chunk / --lanes-prefill-every / --lanes-prefill-rows: the compiled engine's "
                        "policy; the reference "
                        "mixes prompt rows into its steps (drop them, or --device cuda)")
    limit = mf.config.max_position
    if max(prompt_len + 2 * new_tokens + 16, long_prompt + 8) > limit:
        raise Ds4cError(f"--long-prompt / --prompt-len / --new-tokens: the runs need "
                        f"{max(prompt_len + 2 * new_tokens + 16, long_prompt + 8)} positions, the model holds {limit}")
    if name == "compiled" and top > 16:
        raise Ds4cError(f"--lanes: the compiled step runs 1..16 sequences at once, found {top}")
    t0 = time.perf_counter()
    ref = open_engine(mf, device=device, engine=name, max_ctx=max_ctx, threads=threads)
    eng = BatchEngine(ref, ref.max_ctx, BatchConfig(max_lanes=top, max_rows=max(16, top),
                                                    prefill_chunk=prefill_chunk, prefill_every=prefill_every,
                                                    prefill_rows=prefill_rows))
    vocab = mf.config.vocab_size
    rep = LanesReport(str(mf.path), device, name, prompt_len, new_tokens, open_s=time.perf_counter() - t0,
                      prefill_chunk=prefill_chunk, prefill_every=prefill_every, prefill_rows=prefill_rows)
    say(f"{name} engine opened in {rep.open_s:.1f} s (batch engine of {top} lanes)")
    try:
        _measure(eng, rep, lanes, new_tokens, prompt_len, long_prompt, vocab, say)
    finally:
        eng.close()
    return rep


def _measure(eng: BatchEngine, rep: LanesReport, lanes: tuple[int, ...], new_tokens: int, prompt_len: int,
             long_prompt: int, vocab: int, say: Callable[[str], Any]) -> None:
    top = max(lanes)
    for n in sorted(set(lanes)):
        steps0, rows0 = eng.steps, eng.rows
        say(f"lanes {n}: {n} request{'s' if n > 1 else ''} of {prompt_len} + {new_tokens} tokens")
        reqs = [eng.submit(_ids(prompt_len, 100 + k, vocab), new_tokens) for k in range(n)]
        for r in reqs:
            r.run()
        first = max(r.t_first for r in reqs)
        last = max(r.t_last for r in reqs)
        made = sum(len(r.tokens) - 1 for r in reqs)
        rep.levels.append({"lanes": n, "aggregate_tokens_per_s": made / (last - first) if last > first else None,
                           "itl_s": _itl(reqs), "ttft_s": statistics.median(r.t_first - r.t_submit for r in reqs),
                           "steps": eng.steps - steps0, "rows": eng.rows - rows0})
    base = rep.levels[0]
    for lv in rep.levels:
        a, b = lv["aggregate_tokens_per_s"], base["aggregate_tokens_per_s"]
        lv["aggregate_x"] = a / b if a and b else None
        lv["itl_x"] = lv["itl_s"] / base["itl_s"] if base["itl_s"] else None
    # prefill beside decode: top - 1 decoding, then a long prompt arrives
    if top >= 2:
        say(f"prefill beside decode: {top - 1} decoding, a {long_prompt}-token prompt arrives")
        n_dec = 2 * new_tokens
        dec = [eng.submit(_ids(prompt_len, 200 + k, vocab), n_dec) for k in range(top - 1)]
        while min(len(r.tokens) for r in dec) < new_tokens // 2:
            time.sleep(0.001)
        before = {id(r): len(r.step_s) for r in dec}
        long = eng.submit(_ids(long_prompt, 300, vocab), 2)
        long.run()
        t0, t1 = long.t_admit, long.t_first
        during = [s for r in dec for s, end in zip(r.step_s[before[id(r)]:], _ends(r)[before[id(r)]:]) if t0 <= end <= t1]
        calm = [s for r in dec for s in r.step_s[:before[id(r)]]]
        for r in dec:
            r.stop()
        rep.prefill_beside_decode = {
            "decoding": top - 1, "prompt": long_prompt, "prefill_s": t1 - t0,
            "itl_before_s": statistics.median(calm) if calm else None,
            "itl_during_s": statistics.median(during) if during else None,
            "itl_during_mean_s": statistics.fmean(during) if during else None,
            "itl_during_max_s": max(during) if during else None}
        if calm and during:
            base = statistics.median(calm)
            p = rep.prefill_beside_decode
            p["itl_x"], p["itl_mean_x"], p["itl_max_x"] = (statistics.median(during) / base,
                                                          statistics.fmean(during) / base, max(during) / base)
    # prefix reuse: a second turn with the first's pages held vs cold
    say(f"prefix reuse: a second turn after a {long_prompt}-token first turn")
    eng.clear_prefixes()
    first = _ids(long_prompt - 24, 400, vocab)
    r1 = eng.submit(first, 8)
    r1.run()
    turn2 = first + r1.tokens + _ids(16, 401, vocab)
    warm = eng.submit(turn2, 2)
    warm.run()
    eng.clear_prefixes()
    cold = eng.submit(turn2, 2)
    cold.run()
    rep.prefix_reuse = {"prompt": len(turn2), "reused": warm.prefix_reused, "cold_reused": cold.prefix_reused,
                        "ttft_warm_s": warm.t_first - warm.t_submit, "ttft_cold_s": cold.t_first - cold.t_submit,
                        "same_first_token": warm.tokens[:1] == cold.tokens[:1]}
    rep.prefix_reuse["ttft_x"] = rep.prefix_reuse["ttft_warm_s"] / rep.prefix_reuse["ttft_cold_s"]


def _ends(r: Any) -> list[float]:
    """The wall time at which each of ``r.step_s`` ended (the first token at ``t_first``)."""
    out, t = [], r.t_first
    for s in r.step_s:
        t += s
        out.append(t)
    return out


def format_lanes_report(rep: LanesReport) -> str:
    """The report as text: one line per lane count, then the two scenarios and the ratios."""
    def ms(s: float | None) -> str:
        return "-" if s is None else f"{s * 1e3:.1f} ms"

    def x(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    cap = "" if rep.prefill_chunk is None else f", prefill chunks <= {rep.prefill_chunk} beside decoding"
    cap += "" if rep.prefill_every == 1 else f", a prefill piece every {rep.prefill_every} steps"
    cap += "" if not rep.prefill_rows else f", prompts as {rep.prefill_rows}-row lanes beside decoding"
    lines = [f"{rep.model} on {rep.device} ({rep.engine} engine, opened in {rep.open_s:.1f} s{cap}): "
             f"{rep.prompt_len}-token prompts, {rep.new_tokens} new tokens each",
             f"{'lanes':>5} {'agg tok/s':>10} {'vs 1':>6} {'ITL':>10} {'vs 1':>6} {'TTFT':>10} {'rows/step':>9}"]
    for lv in rep.levels:
        agg = lv["aggregate_tokens_per_s"]
        lines.append(f"{lv['lanes']:>5} {('-' if agg is None else f'{agg:.1f}'):>10} {x(lv['aggregate_x']):>6} "
                     f"{ms(lv['itl_s']):>10} {x(lv['itl_x']):>6} {ms(lv['ttft_s']):>10} "
                     f"{lv['rows'] / max(lv['steps'], 1):>9.1f}")
    p = rep.prefill_beside_decode
    if p is not None:
        lines.append(f"prefill beside decode: {p['decoding']} decoding, a {p['prompt']}-token prompt prefilled in "
                     f"{p['prefill_s']:.2f} s: their ITL {ms(p['itl_before_s'])} before; during it median "
                     f"{ms(p['itl_during_s'])} ({x(p.get('itl_x'))}), mean {ms(p['itl_during_mean_s'])} "
                     f"({x(p.get('itl_mean_x'))}), max {ms(p['itl_during_max_s'])} ({x(p.get('itl_max_x'))})")
    q = rep.prefix_reuse
    if q is not None:
        lines.append(f"prefix reuse: second turn of {q['prompt']} tokens, {q['reused']} from the cache: TTFT "
                     f"{ms(q['ttft_warm_s'])} vs {ms(q['ttft_cold_s'])} cold ({x(q['ttft_x'])}); same first token: "
                     f"{q['same_first_token']}")
    return "\n".join(lines)
