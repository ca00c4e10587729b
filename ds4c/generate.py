"""Token generation on any engine: prefill as verify steps of the widest width (or the compiled step's prefill
chunk graphs: an engine with the :class:`~ds4c.engine_protocol.ChunkedPrefill` capability), then q = 1 decodes.

docs/model.md sections 5-6 and P12 (sampling). Device-agnostic: the stepper is any
:class:`~ds4c.engine_protocol.Engine`, the reference (:class:`~ds4c.reference.Reference`, CPU or CUDA) or the
compiled step (:class:`~ds4c.runtime.step.CompiledStep`). The first token is sampled on the CPU from the prefill's
logits; after it, an engine with the :class:`~ds4c.engine_protocol.DeviceLoop` capability (the compiled step)
samples on its device inside the replayed graphs (runtime/sampler.py: the same rule, equal in distribution, its own
seeded noise), any other brings each step's logits to the CPU sampler. Greedy tokens are the same either way; seeded samples are reproducible per engine.

Two forms: :func:`generate` runs to the end (an ``on_token`` callback sees each token as it is sampled and may
stop the run); :func:`stream` returns a :class:`TokenStream`, an iterator of the new token ids whose
``result`` is the :class:`GenerationResult` once it has ended (or been stopped).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.engine_protocol import ChunkedPrefill, DeviceLoop, Drafter, Engine, drafter_name
from ds4c.errors import StepError
from ds4c.reference import MAX_WIDTH
from ds4c.reference.primitives import sample
from ds4c.sampling import check_sampling, check_seed, filter_logits  # noqa: F401 (re-exported)
from ds4c.speculative import SpecStats, WidthPolicy, measure_width_costs, speculative_tokens

#: Why generation ended: a stop id was sampled (``"eos"``), the caller stopped it (``"stop"``: an ``on_token``
#: callback returned true or :meth:`TokenStream.stop`, e.g. at a stop string), ``max_new_tokens`` were made, or
#: Ctrl-C (``"interrupted"``: a KeyboardInterrupt during the run, :class:`ds4c.errors.GenerationInterrupted`).
STOP_REASONS = ("eos", "stop", "length", "interrupted")


@dataclass
class GenerationResult:
    """Output of :func:`generate`: the prompt, the new tokens, wall-clock timings in seconds, and why it ended.

    ``tokens`` includes the stop id that ended the run (``stop_reason == "eos"``) as its last entry.
    ``decode_s`` is the time spent producing tokens (sampling the first one and every decode step), not the
    time a streaming consumer spent between tokens; ``step_s`` holds each decode step's time."""

    prompt: list[int]
    tokens: list[int]
    prefill_s: float
    decode_s: float
    step_s: list[float] = field(default_factory=list)
    stop_reason: str = "length"
    speculative: dict | None = None
    """With a drafter: :class:`ds4c.speculative.SpecStats` as a dict (steps, tokens per step, acceptance by
    draft depth, widths)."""
    prefill_plan: dict | None = None
    """How the prompt was ingested: ``{"chunks": [[rows, valid], ...], "verify_tokens": n}``: the prefill chunk
    graphs run in order (rows of the graph, prompt tokens in it; fewer = padded) and the tokens that went as
    verify steps (all of them without chunk graphs)."""

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens per second of prefill (None when the prefill took no measurable time)."""
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens after the first, per second of decode (the first comes from the prefill); None when
        fewer than two tokens were generated."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "tokens": self.tokens, "stop_reason": self.stop_reason,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "step_ms": [round(s * 1e3, 3) for s in self.step_s],
                **({"speculative": self.speculative} if self.speculative is not None else {}),
                **({"prefill_plan": self.prefill_plan} if self.prefill_plan is not None else {})}


_ACTIVE: "weakref.WeakKeyDictionary[Any, TokenStream]" = weakref.WeakKeyDictionary()
"""Per stepper, the generation running on it: a generation that starts ends the one before it (module docstring
of :class:`TokenStream`), so an unfinished stream never shares the sequence state with another."""


def _claim(ref: Any, ts: "TokenStream") -> None:
    """Make ``ts`` the generation running on ``ref``, ending (closing) an unfinished one before it."""
    try:
        old = _ACTIVE.get(ref)
    except TypeError:  # a stepper that cannot be weakly referenced: not tracked
        return
    if old is not None and old is not ts and old.result is None:
        if old._gen.gi_running:  # started inside old's run (the oracle drafter's AR pass): old goes on after it
            ts._outer = old
        else:
            old._superseded = True
            old._gen.close()  # its run's finally (e.g. the device loop recording its position) runs now, not later
    _ACTIVE[ref] = ts


class TokenStream:
    """Iterator over the new token ids of one generation (see :func:`stream`).

    Iterate it to run the model step by step; :meth:`stop` ends the run early (``stop_reason == "stop"``);
    :attr:`result` is the :class:`GenerationResult` once the run has ended, None before. Time the consumer
    spends between tokens is not counted in ``decode_s``.

    One generation runs on a stepper at a time (they share its sequence state): a generation that starts on the
    same stepper while this one is unfinished ends it, and reading this one on raises a one-line StepError.
    ``on_end`` (if given) is called once when the run is over and closed (read to its end, :meth:`stop`, failed,
    ended by another generation, or garbage-collected). ``on_prefill(done, total)`` (if given) is called as the
    prompt is ingested: after each verify step with the prompt tokens done so far, or once after the compiled
    step's chunked prefill, the last call with ``done == total``.
    """

    def __init__(self, ref: Engine, prompt: list[int], max_new_tokens: int, temperature: float, seed: int, width: int,
                 top_k: int, top_p: float, stop_ids: frozenset[int], draft: Drafter | None = None, spec_width: int | str = MAX_WIDTH,
                 on_end: Callable[[], Any] | None = None, on_prefill: Callable[[int, int], Any] | None = None):
        self._ref, self._prompt, self._n = ref, list(prompt), max_new_tokens
        self._on_end, self._on_prefill = on_end, on_prefill
        check_seed(seed)
        self._temp, self._seed, self._width = temperature, seed, width
        self._top_k, self._top_p, self._stop_ids = top_k, top_p, stop_ids
        self._draft, self._spec_width = draft, spec_width
        self._spec = None
        self._out: list[int] = []
        self._steps: list[float] = []
        self._prefill_s = self._decode_s = 0.0
        self._prefill_plan: dict | None = None
        self._gen = self._run()
        self._superseded = False
        self._outer: TokenStream | None = None  # the generation this one runs inside of (see _claim)
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self._superseded:
            raise StepError("this generation was ended by another generation on the same model (one runs at a "
                            "time: they share the sequence state); finish or stop() a stream before starting another")
        if self.result is not None:
            # close the run now: its device loop (decode_tokens) records how far it went on closing, which
            # must not wait for garbage collection (it would move a later request's position)
            self._gen.close()
            raise StopIteration
        return next(self._gen)

    def stop(self) -> GenerationResult:
        """End the run now (``stop_reason`` ``"stop"`` unless it had already ended) and close it (its device loop
        records its position now, not at garbage collection); returns the result."""
        self._gen.close()
        if self.result is None:
            self.result = self._finish("stop")
        self._ended()  # a run closed before its first step ran no finally
        return self.result

    def run(self) -> GenerationResult:
        """Run to the end; returns the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def _sample(self, logits: torch.Tensor) -> int:
        logits = filter_logits(logits, self._temp, self._top_k, self._top_p)
        return int(sample(logits, self._temp, self._rng)[0])

    def _ended(self) -> None:
        """Call ``on_end`` (once)."""
        cb, self._on_end = self._on_end, None
        if cb is not None:
            cb()

    def _finish(self, reason: str) -> GenerationResult:
        if self._outer is not None:  # the generation this one ran inside of is the running one again
            try:
                _ACTIVE[self._ref] = self._outer
            except TypeError:
                pass
        if self._spec is not None:  # the tokens kept after the prefill's (a step may accept past the end)
            self._spec.delivered = max(0, len(self._out) - 1)
        return GenerationResult(self._prompt, self._out, self._prefill_s, self._decode_s, self._steps, reason,
                                None if self._spec is None else self._spec.as_dict(), self._prefill_plan)

    def _run(self) -> Iterator[int]:
        try:
            yield from self._loop()
        finally:  # closed, ended, failed or superseded: the run is over
            self._ended()

    def _loop(self) -> Iterator[int]:
        ref, prompt = self._ref, self._prompt
        _claim(ref, self)
        self._rng = torch.Generator().manual_seed(self._seed)
        self._policy = None
        if self._draft is not None:
            sw = self._spec_width
            t_prep = time.perf_counter()
            if self._n > 1:  # something to speculate: e.g. the oracle's autoregressive pass, before the prefill
                self._draft.prepare(ref, prompt, self._n)
                # auto: each verify width's cost on this stepper; or a caller's own policy
                self._policy = WidthPolicy(costs=measure_width_costs(ref)) if sw == "auto" else \
                    sw if isinstance(sw, WidthPolicy) else WidthPolicy(sw)
            pol = self._policy
            if pol is not None:
                sw = "auto" if pol.adaptive else pol.width
            elif isinstance(sw, WidthPolicy):
                sw = "auto" if sw.adaptive else sw.width
            # the request's report, also when no step speculates (max_new_tokens <= 1, EOS first)
            self._spec = SpecStats(drafter_name(self._draft), sw, costs_ms={w: t * 1e3 for w, t in pol.costs.items()}
                                   if pol is not None and pol.adaptive else None,
                                   prepare_s=time.perf_counter() - t_prep)
        ref.reset()
        t0 = time.perf_counter()
        logits = None
        told = self._on_prefill or (lambda done, total: None)
        if isinstance(ref, ChunkedPrefill) and ref.prefill_chunks and prompt:  # the compiled step's chunk graphs
            logits = ref.prefill(prompt, 0)
            self._prefill_plan = ref.last_prefill
            told(len(prompt), len(prompt))
        else:
            for s in range(0, len(prompt), self._width):
                logits = ref.verify(prompt[s:s + self._width], s)
                told(min(s + self._width, len(prompt)), len(prompt))
            self._prefill_plan = {"chunks": [], "verify_tokens": len(prompt)}
        t1 = time.perf_counter()
        self._prefill_s = t1 - t0
        if self._n == 0:
            self.result = self._finish("length")
            return
        tok = self._sample(logits[-1:].float().cpu())
        self._out.append(tok)
        self._decode_s += time.perf_counter() - t1
        # a stepper that samples on its device (the compiled step) decodes host-free; else logits come to
        # the CPU sampler step by step
        on_device = ref.decode_tokens if isinstance(ref, DeviceLoop) else None
        more = None
        if self._draft is not None and self._n > 1 and tok not in self._stop_ids:
            more = speculative_tokens(ref, self._draft, prompt, tok, self._n - 1, self._policy, self._temp,
                                      self._top_k, self._top_p, self._rng, self._spec, self._sample)
        elif on_device is not None and self._n > 1 and tok not in self._stop_ids:
            more = on_device(tok, len(prompt), self._n - 1, self._temp, self._top_k, self._top_p, self._seed)
        try:
            while True:
                if tok in self._stop_ids:
                    self.result = self._finish("eos")
                elif len(self._out) >= self._n:
                    self.result = self._finish("length")
                yield tok
                if self.result is not None:
                    return
                ts = time.perf_counter()
                if more is not None:
                    tok = next(more)
                else:
                    logits = ref.decode(tok, len(prompt) + len(self._out) - 1).float().cpu()
                    tok = self._sample(logits)
                self._out.append(tok)
                dt = time.perf_counter() - ts
                self._steps.append(dt)
                self._decode_s += dt
        finally:
            if more is not None:
                more.close()


def check_spec_width(spec_width: Any) -> None:
    """Speculative decoding's verify rows per step: an int in ``1..MAX_WIDTH``, ``"auto"`` or a
    :class:`~ds4c.width_policy.WidthPolicy`.

    Raises:
        StepError: anything else (one line).
    """
    if spec_width != "auto" and not isinstance(spec_width, WidthPolicy) and (
            isinstance(spec_width, bool) or not isinstance(spec_width, int) or not 1 <= spec_width <= MAX_WIDTH):
        raise StepError(f"the speculative width must be an int in 1..{MAX_WIDTH} (verify rows per step) or 'auto', "
                        f"found {spec_width!r}")


def stream(ref: Engine, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
           width: int = MAX_WIDTH, top_k: int = 0, top_p: float = 1.0,
           stop_ids: Collection[int] = (), draft: Drafter | None = None, spec_width: int | str = MAX_WIDTH,
           on_end: Callable[[], Any] | None = None,
           on_prefill: Callable[[int, int], Any] | None = None) -> TokenStream:
    """The generation of :func:`generate` as a :class:`TokenStream` (token ids as they are sampled); ``on_end`` is
    called once when it ends, ``on_prefill(done, total)`` as the prompt is ingested (:class:`TokenStream`).

    The arguments are checked here, before any step runs. Raises as :func:`generate`."""
    if not prompt:
        raise StepError("the prompt must hold at least one token id")
    check_sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise StepError(f"max_new_tokens must be an int >= 0, found {max_new_tokens!r}")
    if len(prompt) + max_new_tokens > ref.max_ctx:
        raise StepError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_ctx={ref.max_ctx}")
    check_spec_width(spec_width)
    if draft is not None and not isinstance(draft, Drafter):
        raise StepError(f"draft: expected a drafter spelling (a str such as 'oracle:0.8', 'dspark:PATH', 'mtp', "
                        f"'mtp:PATH'; ds4c.Model.generate and the CLI take those) or a drafter object with prepare() "
                        f"and propose() (ds4c.engine_protocol.Drafter), found {type(draft).__name__} {draft!r:.60}")
    return TokenStream(ref, prompt, max_new_tokens, temperature, seed, width, top_k, top_p,
                       frozenset(int(t) for t in stop_ids), draft, spec_width, on_end, on_prefill)


def generate(ref: Engine, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, width: int = MAX_WIDTH, top_k: int = 0, top_p: float = 1.0,
             stop_ids: Collection[int] = (), on_token: Callable[[int], Any] | None = None,
             draft: Drafter | None = None,
             spec_width: int | str = MAX_WIDTH) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` on a fresh sequence.

    ``ref`` is any :class:`~ds4c.engine_protocol.Engine` (a :class:`~ds4c.reference.Reference` or the compiled
    step's :class:`~ds4c.runtime.step.CompiledStep`; :func:`ds4c.engine.open_engine` opens either). The prompt runs
    as verify steps of ``width`` rows (the last may be narrower), or, on a :class:`~ds4c.engine_protocol.ChunkedPrefill`
    engine with ``prefill_chunks`` (the compiled step opened with prefill chunk graphs), through its
    ``prefill(tokens, pos)``; the last row's logits give the first new token; each further
    token is one decode step.

    Sampling: greedy when ``temperature == 0`` (``top_k`` / ``top_p`` change nothing then); else the logits are
    filtered by ``top_k`` and ``top_p`` (:func:`filter_logits`) and sampled by P12 with a CPU generator seeded by
    ``seed``. Generation ends when a token of ``stop_ids`` is sampled (kept as the last token; ``stop_reason``
    ``"eos"``), when ``on_token(token)`` returns a true value (``"stop"``), or after ``max_new_tokens``
    (``"length"``). Without ``stop_ids`` (the default) it always runs ``max_new_tokens``.

    Speculative decoding: with a ``draft`` (:func:`ds4c.drafters.factory.make_drafter`) each step after the first
    token verifies up to ``spec_width`` rows (the last token and ``spec_width - 1`` drafts; ``"auto"``: a width
    per step from the observed acceptance and each width's measured cost, :class:`ds4c.speculative.WidthPolicy`;
    or a ``WidthPolicy`` of the caller's)
    and keeps what the target accepts (:mod:`ds4c.speculative`: exact for greedy and for sampling);
    ``result.speculative`` reports the steps, acceptance and widths.

    Raises:
        StepError: empty prompt, a bad temperature / top_k / top_p, negative ``max_new_tokens``, or prompt + new
            tokens past ``ref.max_ctx``; what the stepper raises (token ids outside the vocabulary).
    """
    ts = stream(ref, prompt, max_new_tokens, temperature, seed, width, top_k, top_p, stop_ids, draft, spec_width)
    for tok in ts:
        if on_token is not None and on_token(tok):
            if ts.result is None:
                return ts.stop()
            if ts.result.stop_reason == "length":  # stopped by the caller on the last token
                ts.result.stop_reason = "stop"
    assert ts.result is not None
    return ts.result
