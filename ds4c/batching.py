"""Continuous batching: many sequences stepped together on one engine (issue 30, docs/batching.md).

A :class:`BatchEngine` owns a scheduler thread and a *lanes backend*, the way its steps run:

* on the reference, :class:`~ds4c.batch_paged.PagedLanes`: the paged state pool, every step one
  ``step_lanes`` call mixing decode rows and prompt rows (its policy, admission and prefix reuse are described
  there);
* on the compiled step, :class:`~ds4c.batch_slots.SlotLanes`: decode lanes over sequence slots in one CUDA graph,
  prompts prefilled beside them one piece per step on the one-sequence step (its policy there).

:func:`lanes_backend` picks the backend by the engine. Requests (:meth:`BatchEngine.submit`, from any thread) wait in
arrival order, are admitted between steps when the backend has room (a lane and its pages or slot), and leave the
batch the step they end (their pages or slot free for the next admission then).

* **sampling** per request, each with its own generator seeded by the request's seed, by the rule the one-sequence
  loop uses (:func:`ds4c.generate.stream`): on the host from the logits on the reference; on the compiled step the
  first token on the host and the rest on the device per lane, as the compiled one-sequence loop draws them. A
  request's tokens equal the same request run alone.
* **cancellation**: :meth:`BatchRequest.stop` (or its ``cancel`` event set from any thread) ends it before the next
  step; its pages or slot are freed then.

A :class:`BatchRequest` reads like the one-sequence :class:`~ds4c.generate.TokenStream` (an iterator of token ids,
``result``, ``stop()``, ``run()``), so :class:`ds4c.Model` turns either into text the same way.
"""

from __future__ import annotations

import itertools
import operator
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.batch_lane import LaneOut
from ds4c.batch_paged import PagedLanes
from ds4c.engine_protocol import SamplingDrafter, drafter_needs
from ds4c.errors import Ds4cError, StepError
from ds4c.generate import GenerationResult
from ds4c.reference import MAX_WIDTH
from ds4c.reference.model import Reference
from ds4c.reference.primitives import sample
from ds4c.sampling import check_sampling, check_seed, filter_logits
from ds4c.speculative import WidthPolicy

log = logging.getLogger("ds4c.batching")


@dataclass(frozen=True)
class BatchConfig:
    """How many sequences and rows a step holds and how large the pool is.

    Attributes:
        max_lanes: sequences in a step at most (decoding and prefilling).
        max_rows: rows in a step at most (>= ``max_lanes``: every lane can have a row); None: ``max(16,
            max_lanes)``.
        pages: pages in the pool; None: enough for ``max_lanes`` sequences of the engine's ``max_ctx``.
        page_tokens: positions per page; None: :func:`~ds4c.pages.default_page_tokens`.
        prefix_states: boundary states the prefix cache keeps (0: no prefix reuse); on the compiled step, slot
            snapshots (at most as many as the slots).
        poison: fill freed pages with NaN (tests: a stale read shows).
        prefill_chunk: compiled step: the largest prefill chunk run beside decoding sequences (a bound on how long
            their next token waits; None: the prefill policy's own chunks, as a prompt alone is ingested).
        prefill_every: compiled step: a prefill piece every this many steps while sequences decode (1: every
            step; N: their mean inter-token latency grows by a chunk's time / N, the prompt's prefill takes longer).
        prefill_rows: compiled step: P in 1..5 runs a prompt's rows as a lane of P rows in the decode step itself
            while sequences decode (their next token never waits for a chunk; the prompt takes P tokens a step,
            ingested within the one-sequence step's noise floor of alone, not bit for bit); 0: the chunks beside
            (``prefill_chunk``, ``prefill_every``). ds4c/batch_slots.py states the policy.
        warm: compiled step: build and capture every lanes graph when the engine opens (nothing compiled later).
    """

    max_lanes: int = 8
    max_rows: int | None = None
    pages: int | None = None
    page_tokens: int | None = None
    prefix_states: int = 64
    poison: bool = False
    prefill_chunk: int | None = None
    prefill_every: int = 1
    prefill_rows: int = 0
    warm: bool = True

    def __post_init__(self) -> None:
        if self.max_rows is None and isinstance(self.max_lanes, int) and not isinstance(self.max_lanes, bool):
            object.__setattr__(self, "max_rows", max(16, self.max_lanes))

    def check(self) -> None:
        """Raises StepError (one line) for a value out of range."""
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.max_lanes) or self.max_lanes < 1:
            raise StepError(f"max_lanes must be an int >= 1, found {self.max_lanes!r}")
        if not is_int(self.max_rows) or self.max_rows < self.max_lanes:
            raise StepError(f"max_rows must be an int >= max_lanes ({self.max_lanes}), found {self.max_rows!r}")
        if self.pages is not None and (not is_int(self.pages) or self.pages < 1):
            raise StepError(f"pages must be an int >= 1 or None, found {self.pages!r}")
        if not is_int(self.prefix_states) or self.prefix_states < 0:
            raise StepError(f"prefix_states must be an int >= 0, found {self.prefix_states!r}")
        if self.prefill_chunk is not None and (not is_int(self.prefill_chunk) or self.prefill_chunk < 1):
            raise StepError(f"prefill_chunk must be an int >= 1 or None, found {self.prefill_chunk!r}")
        if not is_int(self.prefill_every) or self.prefill_every < 1:
            raise StepError(f"prefill_every must be an int >= 1, found {self.prefill_every!r}")
        if not is_int(self.prefill_rows) or not 0 <= self.prefill_rows <= MAX_WIDTH:
            raise StepError(f"prefill_rows must be an int in 0..{MAX_WIDTH}, found {self.prefill_rows!r}")
        for name in ("poison", "warm"):
            if not isinstance(getattr(self, name), bool):
                raise StepError(f"{name} must be True or False, found {getattr(self, name)!r}")


_END = object()


def _int_ids(ids: Any, what: str) -> list[int]:
    """``ids`` as a list of ints; StepError (one line) for a str, bytes, a non-iterable, a bool or a non-int."""
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise StepError(f"{what}: expected a list of int token ids, found {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool):
            raise StepError(f"{what}: expected int token ids, found a bool")
        try:
            out.append(operator.index(t))
        except TypeError:
            raise StepError(f"{what}: expected int token ids, found {type(t).__name__} {t!r:.30}") from None
    return out


class BatchRequest:
    """One request in a :class:`BatchEngine` (module docstring): iterate it for its new token ids (blocks until
    the engine samples them); ``result`` is its :class:`~ds4c.generate.GenerationResult` once it has ended.

    ``stop_reason``: ``"eos"`` (a stop id, kept as the last token), ``"length"``, ``"stop"`` (:meth:`stop`, or its
    ``cancel`` event). An engine failure of this request raises its one-line error from the iteration."""

    def __init__(self, rid: int, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, seed: int, stop_ids: frozenset[int], cancel: threading.Event,
                 on_prefill: Callable[[int, int], Any] | None, engine: "BatchEngine"):
        self.id, self.prompt, self.max_new_tokens = rid, prompt, max_new_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.stop_ids, self.cancel_event, self.on_prefill = stop_ids, cancel, on_prefill
        self._engine = engine
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.tokens: list[int] = []
        self._final: GenerationResult | None = None
        self._read = 0
        self.error: Ds4cError | None = None
        self._done = threading.Event()
        self._rng = torch.Generator().manual_seed(seed)
        # speculative decoding (submit's draft): the drafter and its width policy
        self.draft: Any = None
        self.policy: Any = None
        # engine-side bookkeeping
        self.seq: Any = None
        self.fed: list[int] = []
        self.reused = 0
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_first = self.t_last = 0.0
        self.step_s: list[float] = []

    # ---------------------------------------------------------------------------------------------- reader side
    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        item = self._q.get()
        if item is _END:
            self._q.put(_END)  # a later next() ends too
            if self.error is not None:
                raise self.error
            raise StopIteration
        self._read += 1
        return item

    @property
    def result(self) -> GenerationResult | None:
        """The result once the request has ended and its tokens have been read (as the one-sequence stream's,
        which is set when its last token is handed out); None before."""
        f = self._final
        return f if f is not None and self._read >= len(f.tokens) else None

    def cancel(self) -> None:
        """Ask the engine to end this request before its next step (from any thread)."""
        self.cancel_event.set()
        self._engine._wake()

    def stop(self) -> GenerationResult:
        """End the request now (``stop_reason`` ``"stop"`` unless it had ended) and wait for the engine to let it
        go; returns its result."""
        if self._final is None:
            self.cancel()
            self._done.wait()
        if self._final is None:  # failed in the engine: what it made until then
            return self._result("stop")
        return self._final

    def run(self) -> GenerationResult:
        """Wait for the end; returns the result (raises the engine's error of this request)."""
        for _ in self:
            pass
        assert self._final is not None
        return self._final

    @property
    def prefix_reused(self) -> int:
        """Prompt positions taken from the prefix cache instead of prefilled."""
        return self.reused

    # ---------------------------------------------------------------------------------------------- engine side
    def _result(self, reason: str) -> GenerationResult:
        prefill = (self.t_first or time.perf_counter()) - self.t_submit
        return GenerationResult(list(self.prompt), list(self.tokens), prefill, sum(self.step_s), list(self.step_s),
                                reason, None, {"chunks": [], "verify_tokens": len(self.prompt) - self.reused,
                                               "prefix_reused": self.reused})

    def _emit(self, tok: int, last: str | None = None) -> None:
        """Hand out ``tok``; ``last``: it ends the request for this reason, and the result is set before the token
        is handed out (a reader that takes it sees ``result`` at once: the eos token is then not text)."""
        now = time.perf_counter()
        if self.t_first:
            self.step_s.append(now - self.t_last)
        else:
            self.t_first = now
        self.t_last = now
        self.tokens.append(tok)
        if last is not None:
            self._final = self._result(last)
        self._q.put(tok)

    def _end(self, reason: str | None, error: Ds4cError | None = None) -> None:
        if error is not None:
            self.error = error
        elif self._final is None:
            self._final = self._result(reason or "stop")
        self._q.put(_END)
        self._done.set()

    def _sample(self, logits: torch.Tensor) -> int:
        logits = filter_logits(logits, self.temperature, self.top_k, self.top_p)
        return int(sample(logits, self.temperature, self._rng)[0])


class BatchEngine:
    """Continuous batching (module docstring) over a lanes backend.

    Args:
        ref: the engine whose weights every lane shares: the whole model's reference (its own one-sequence
            :attr:`~Reference.state` is not touched; it must record neither taps nor the final HC state), or the
            compiled step (its one-sequence state is where prompts are prefilled; unsplit, no taps, no final HC).
        max_ctx: positions a request may hold (prompt + new tokens).
        config: lanes, rows and pool (:class:`BatchConfig`).
        backend: the lanes backend to use instead of the one :func:`lanes_backend` makes for ``ref``.

    Raises:
        StepError: a bad config; a layer split; a step that records taps / final HC.
    """

    def __init__(self, ref: Any, max_ctx: int, config: BatchConfig = BatchConfig(), backend: Any = None):
        if not isinstance(config, BatchConfig):
            raise StepError(f"config: expected a BatchConfig, found {type(config).__name__}")
        config.check()
        top = ref.cfg.max_position if isinstance(ref, Reference) else ref.max_ctx
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or not 1 <= max_ctx <= top:
            raise StepError(f"max_ctx must be an int in 1..{top}, found {max_ctx!r}")
        self.ref, self.max_ctx, self.config = ref, max_ctx, config
        self.backend = backend if backend is not None else lanes_backend(ref, max_ctx, config)
        self._lock = threading.Condition()
        self._incoming: deque[BatchRequest] = deque()
        self._waiting: deque[BatchRequest] = deque()
        self._active: list[BatchRequest] = []
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.rows = 0
        self.spec = [0, 0, 0]  # speculative lanes stepped, drafts verified, drafts accepted

    @property
    def pool(self) -> Any:
        """The reference backend's paged pool (:class:`~ds4c.reference.paged.StatePool`)."""
        return self.backend.pool

    # ---------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_ids: Collection[int] = (),
               cancel: threading.Event | None = None,
               on_prefill: Callable[[int, int], Any] | None = None, draft: Any = None,
               spec_width: int = 5) -> BatchRequest:
        """Queue a request (from any thread); returns its :class:`BatchRequest` at once. Arguments as
        :func:`ds4c.generate.stream`; ``cancel``: an event that ends it when set; ``on_prefill(done, total)`` is
        called from the engine's thread after each prefill chunk; ``draft``: a drafter of this request alone
        (speculative rows in the batch, the reference's backend: :mod:`ds4c.batch_paged`) with ``spec_width``
        verify rows per step (1..5).

        Raises:
            StepError: an empty prompt or an id outside the vocabulary, bad sampling values, a negative
                ``max_new_tokens``, prompt + new tokens past ``max_ctx`` or past the whole pool, the engine closed;
                a draft on the compiled step's batch, one that needs the target's taps or final HC state, a
                spec_width outside 1..5.
        """
        prompt = _int_ids(prompt, "prompt")
        if not prompt:
            raise StepError("the prompt must hold at least one token id")
        stops = _int_ids(stop_ids, "stop_ids")
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise StepError(f"cancel: expected a threading.Event, found {type(cancel).__name__}")
        if on_prefill is not None and not callable(on_prefill):
            raise StepError(f"on_prefill: expected a callable (done, total), found {type(on_prefill).__name__}")
        vocab = self.ref.cfg.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise StepError(f"token ids must be in 0..{vocab - 1}, found {bad[0]}")
        check_sampling(temperature, top_k, top_p)
        check_seed(seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise StepError(f"max_new_tokens must be an int >= 0, found {max_new_tokens!r}")
        n = len(prompt) + max_new_tokens
        if n > self.max_ctx:
            raise StepError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_ctx={self.max_ctx}")
        self.backend.check_request(n)
        policy = self._spec_policy(draft, spec_width) if draft is not None else None
        req = BatchRequest(next(self._ids), prompt, max_new_tokens, temperature, top_k, top_p, seed,
                           frozenset(stops), cancel or threading.Event(), on_prefill, self)
        req.draft, req.policy = draft, policy
        with self._lock:
            if self._closed:
                raise StepError("the batch engine is closed")
            self._incoming.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ds4c-batch", daemon=True)
                self._thread.start()
            self._lock.notify()
        return req

    def _spec_policy(self, draft: Any, spec_width: Any) -> Any:
        """The fixed-width policy of a request's speculative rows; StepError (one line) for what the batch cannot
        run."""
        if not getattr(self.backend, "speculates", False):
            raise StepError(f"draft: speculative rows inside the batch run on the reference's batch; the "
                            f"{self.backend.name} step's batch decodes one row per sequence")
        if not callable(getattr(draft, "propose", None)) or not callable(getattr(draft, "prepare", None)):
            raise StepError(f"draft: expected a drafter (prepare, propose), found {type(draft).__name__}")
        if isinstance(spec_width, bool) or not isinstance(spec_width, int) or not 1 <= spec_width <= MAX_WIDTH:
            raise StepError(f"spec_width: expected an int in 1..{MAX_WIDTH} (verify rows per step) in a batch, found "
                            f"{spec_width!r}")
        return WidthPolicy(spec_width)

    def stats(self) -> dict[str, int]:
        """Running sequences (admitted: prefilling or decoding), waiting requests, steps and rows run, and the
        backend's: pages in use (by running sequences or the prefix cache), pages the running sequences hold,
        pages in the pool, cached prefix pages, prefix hits and the prompt positions they saved (on the compiled
        step a page is a slot: :meth:`~ds4c.batch_slots.SlotLanes.stats`)."""
        with self._lock:
            waiting = len(self._waiting) + len(self._incoming)
        active = list(self._active)
        return {"running": len(active), "waiting": waiting, **self.backend.stats(active), "steps": self.steps,
                "rows": self.rows, "spec_steps": self.spec[0], "drafts": self.spec[1], "accepted": self.spec[2]}

    def clear_prefixes(self) -> None:
        """Forget every cached prefix nobody runs (a benchmark's cold start; memory back)."""
        with self._lock:
            self.backend.clear_prefixes()

    def close(self) -> None:
        """Stop: running and waiting requests end with ``stop_reason`` ``"stop"``; later submissions fail."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            pending = list(self._incoming) + list(self._waiting)
            self._incoming.clear()
            self._waiting.clear()
        for req in pending + self._active:
            self._finish(req, "stop")
        self._active = []
        self.backend.close()

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    # ---------------------------------------------------------------------------------------------- the loop
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not (self._incoming or self._waiting or self._active):
                    self._lock.wait()
                if self._closed:
                    return
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            try:
                self.step()
            except Exception as e:  # an engine bug fails the running requests, never the thread
                log.exception("batch step failed")
                err = e if isinstance(e, Ds4cError) else StepError(f"internal engine error ({type(e).__name__}: {e})")
                with self._lock:  # everything in flight fails: an error that repeats must not spin the thread
                    pending = list(self._waiting) + list(self._incoming)
                    self._waiting.clear()
                    self._incoming.clear()
                for req in list(self._active) + pending:
                    self._finish(req, None, err)

    def step(self) -> bool:
        """One scheduler step (the engine's thread calls it; a caller driving the engine itself may too, when it
        never started the thread): reap ended requests, admit waiting ones, run one step of every lane. Returns
        whether any lane ran."""
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        self._reap()
        self._admit()
        if not self._active:
            return False
        outs = self.backend.run(self._active)
        self.steps += 1
        self.rows += sum(o.rows for o in outs)
        for o in outs:
            self._advance(o)
        self._reap()
        return True

    def _reap(self) -> None:
        for req in [r for r in self._active if r.cancel_event.is_set()]:
            self._finish(req, "stop")

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.config.max_lanes:
            req = self._waiting[0]
            if req.cancel_event.is_set():
                self._waiting.popleft()
                self._finish(req, "stop")
                continue
            if req.max_new_tokens == 0:  # nothing to generate: no step needed
                self._waiting.popleft()
                self._finish(req, "length")
                continue
            if not self.backend.admit(req):
                break  # first come, first served: wait for room
            self._waiting.popleft()
            req.t_admit = time.perf_counter()
            self._active.append(req)
            if req.draft is not None and req.max_new_tokens > 1:  # as alone: before the target's prefill
                try:  # a drafter reading the final HC state or taps: on the request's own sequence (its rows)
                    needs = drafter_needs(req.draft)
                    target = self.backend.draft_target(req) if needs.final_hc or needs.taps else self.ref
                    req.draft.prepare(target, req.prompt, req.max_new_tokens)
                except Exception as e:  # the request's drafter fails its own request only
                    err = e if isinstance(e, Ds4cError) else StepError(f"draft: {type(e).__name__}: {e}")
                    self._finish(req, None, err)

    def _advance(self, o: LaneOut) -> None:
        req = o.req
        if o.error is not None:
            self._finish(req, None, o.error)
            return
        if o.prompt_done is not None:
            if req.on_prefill is not None:
                try:
                    req.on_prefill(o.prompt_done, len(req.prompt))
                except Exception as e:  # the caller's callback fails its own request only
                    self._finish(req, None, StepError(f"on_prefill raised {type(e).__name__}: {e}"))
                    return
            if o.prompt_done < len(req.prompt):  # more of the prompt to come
                return
        if o.tokens is not None:  # a speculative lane: its settled tokens, up to an eos or the length
            self.spec[0] += 1
            self.spec[1] += o.rows - 1
            self.spec[2] += len(o.tokens) - 1
            toks = o.tokens
        else:
            toks = [o.token if o.token is not None else req._sample(o.logits)]
        if not req.tokens and req.draft is not None:
            if isinstance(req.draft, SamplingDrafter):  # as alone: drafts sampled with the request's generator
                req.draft.configure_sampling(req.temperature, req.top_k, req.top_p, req._rng)
        for tok in toks:
            last = "eos" if tok in req.stop_ids else "length" if len(req.tokens) + 1 >= req.max_new_tokens else None
            req._emit(tok, last)
            if last is not None:
                self._finish(req, last)
                return

    def _finish(self, req: BatchRequest, reason: str | None, error: Ds4cError | None = None) -> None:
        if req.seq is not None:
            self.backend.free(req, failed=error is not None)
        if req in self._active:
            self._active.remove(req)
        if not req._done.is_set():
            req._end(reason, error)


def lanes_backend(ref: Any, max_ctx: int, config: BatchConfig) -> Any:
    """The lanes backend for ``ref``: :class:`~ds4c.batch_paged.PagedLanes` on the reference,
    :class:`~ds4c.batch_slots.SlotLanes` on the compiled step. StepError (one line) for anything else (a layer
    split, a step recording taps or the final HC state)."""
    if isinstance(ref, Reference):
        if config.prefill_chunk is not None or config.prefill_every != 1 or config.prefill_rows:
            raise StepError("prefill_chunk / prefill_every / prefill_rows (--lanes-prefill-chunk / -every / -rows): "
                            "the compiled step's prompt policy; the reference mixes prompt rows into its steps (drop "
                            "them, or run the compiled engine on cuda)")
        return PagedLanes(ref, max_ctx, config)
    if getattr(ref, "is_split", True) or getattr(ref, "taps", ()) or getattr(ref, "record_hc", False):
        raise StepError("continuous batching runs on the whole model's reference engine or on an unsplit compiled "
                        "step without DSpark taps or final-HC recording")
    from ds4c.batch_slots import SlotLanes  # its runtime imports only where the compiled step runs

    return SlotLanes(ref, max_ctx, config)
