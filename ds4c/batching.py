"""Continuous batching: many sequences stepped together on one engine, over the paged state pool (issue 30,
docs/batching.md).

A :class:`BatchEngine` owns a :class:`~ds4c.reference.paged.StatePool` and a scheduler thread. Requests
(:meth:`BatchEngine.submit`, from any thread) wait in arrival order, are admitted between steps when a lane and
their pages are free, and leave the batch the step they end (their pages are free for the next admission then).
Every step is one :meth:`~ds4c.reference.Reference.step_lanes` call:

* **policy** (stated, and what the tests check): every decoding sequence gets one row; the rest of the row budget
  (``max_rows``) goes to the prompts being prefilled, in arrival order, each chunk cut at the next page boundary (so
  the prefix cache can record every full page). Decode never waits for a prefill; a prefill always gets at least one
  row (``max_lanes <= max_rows``), so no prompt starves.
* **admission** reserves every page a request can use (``prompt + max_new_tokens`` positions, less a reused prefix):
  a sequence never runs out of pages mid-run, so the pool running short is a wait in the queue (first come, first
  served: a large request is not overtaken), never a failure or a neighbour's corrupted state. Cached prefixes
  nobody runs are evicted (least recently used first) to make room.
* **prefix reuse**: a prompt that begins with full pages the cache holds (an earlier turn of the chat, a shared
  system prompt) starts at the end of the longest such prefix: its pages shared, the window ring and compressor
  state loaded from the boundary state kept there; only the rest is prefilled. Its tokens equal a fresh run's.
* **sampling** per request on the CPU, each with its own generator seeded by the request's seed, by the rule the
  one-sequence loop uses (:func:`ds4c.generate.stream`): a request's tokens equal the same request run alone.
* **cancellation**: :meth:`BatchRequest.stop` (or its ``cancel`` event set from any thread) ends it before the next
  step; its pages are freed then.

A :class:`BatchRequest` reads like the one-sequence :class:`~ds4c.generate.TokenStream` (an iterator of token ids,
``result``, ``stop()``, ``run()``), so :class:`ds4c.Model` turns either into text the same way.
"""

from __future__ import annotations

import itertools
import operator
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.errors import Ds4cError, StepError
from ds4c.generate import GenerationResult
from ds4c.reference.model import Reference
from ds4c.pages import check_page_tokens, default_page_tokens, lane_state_bytes, page_bytes
from ds4c.reference.paged import StatePool
from ds4c.reference.primitives import sample
from ds4c.sampling import check_sampling, check_seed, filter_logits

log = logging.getLogger("ds4c.batching")


@dataclass(frozen=True)
class BatchConfig:
    """How many sequences and rows a step holds and how large the pool is.

    Attributes:
        max_lanes: sequences in a step at most (decoding and prefilling).
        max_rows: rows in a step at most (>= ``max_lanes``: every lane can have a row).
        pages: pages in the pool; None: enough for ``max_lanes`` sequences of the engine's ``max_ctx``.
        page_tokens: positions per page; None: :func:`~ds4c.pages.default_page_tokens`.
        prefix_states: boundary states the prefix cache keeps (0: no prefix reuse).
        poison: fill freed pages with NaN (tests: a stale read shows).
    """

    max_lanes: int = 8
    max_rows: int = 16
    pages: int | None = None
    page_tokens: int | None = None
    prefix_states: int = 64
    poison: bool = False

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


_END = object()


def _int_ids(ids: Any, what: str) -> list[int]:
    """``ids`` as a list of ints; StepError (one line) for a str, bytes, a non-iterable, a bool or a non-int."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
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

    def _emit(self, tok: int) -> None:
        now = time.perf_counter()
        if self.t_first:
            self.step_s.append(now - self.t_last)
        else:
            self.t_first = now
        self.t_last = now
        self.tokens.append(tok)
        self._q.put(tok)

    def _end(self, reason: str | None, error: Ds4cError | None = None) -> None:
        if error is not None:
            self.error = error
        else:
            self._final = self._result(reason or "stop")
        self._q.put(_END)
        self._done.set()

    def _sample(self, logits: torch.Tensor) -> int:
        logits = filter_logits(logits, self.temperature, self.top_k, self.top_p)
        return int(sample(logits, self.temperature, self._rng)[0])


def _check_fits(cfg: Any, pages: int, page_tokens: int, lanes: int, device: torch.device) -> None:
    """StepError (one line) when the pool and the lanes' own state would not fit in the device's memory (the host's
    RAM for the CPU, the free memory of a CUDA device), before anything is allocated."""
    need = pages * page_bytes(cfg, page_tokens) + lanes * lane_state_bytes(cfg)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    if need > have:
        raise StepError(f"the page pool ({pages} pages of {page_tokens} tokens) and {lanes} lanes need "
                        f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {device}: fewer lanes, a "
                        f"smaller max_ctx or pages=")


class BatchEngine:
    """Continuous batching over the reference (module docstring).

    Args:
        ref: the reference whose weights every lane shares (its own one-sequence :attr:`~Reference.state` is not
            touched; it must record neither taps nor the final HC state).
        max_ctx: positions a request may hold (prompt + new tokens).
        config: lanes, rows and pool (:class:`BatchConfig`).

    Raises:
        StepError: a bad config; a reference that is a shard of a layer split or records taps / final HC.
    """

    def __init__(self, ref: Reference, max_ctx: int, config: BatchConfig = BatchConfig()):
        if not isinstance(config, BatchConfig):
            raise StepError(f"config: expected a BatchConfig, found {type(config).__name__}")
        config.check()
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or not 1 <= max_ctx <= ref.cfg.max_position:
            raise StepError(f"max_ctx must be an int in 1..{ref.cfg.max_position}, found {max_ctx!r}")
        if not isinstance(ref, Reference) or not ref.is_whole:
            raise StepError("continuous batching runs on the whole model's reference engine (not a layer split, not "
                            "the compiled step: its graphs hold one sequence)")
        cfg = ref.cfg
        self.ref, self.max_ctx, self.config = ref, max_ctx, config
        page_tokens = default_page_tokens(cfg) if config.page_tokens is None else check_page_tokens(cfg, config.page_tokens)
        per_seq = -(-max_ctx // page_tokens)
        pages = config.pages if config.pages is not None else config.max_lanes * per_seq
        _check_fits(cfg, pages, page_tokens, config.max_lanes, ref.device)
        self.pool = StatePool(cfg, pages, page_tokens, ref.device, config.prefix_states, config.poison)
        self._lock = threading.Condition()
        self._incoming: deque[BatchRequest] = deque()
        self._waiting: deque[BatchRequest] = deque()
        self._active: list[BatchRequest] = []
        self._ids = itertools.count()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.rows = 0

    # ---------------------------------------------------------------------------------------------- requests
    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_ids: Collection[int] = (),
               cancel: threading.Event | None = None,
               on_prefill: Callable[[int, int], Any] | None = None) -> BatchRequest:
        """Queue a request (from any thread); returns its :class:`BatchRequest` at once. Arguments as
        :func:`ds4c.generate.stream`; ``cancel``: an event that ends it when set; ``on_prefill(done, total)`` is
        called from the engine's thread after each prefill chunk.

        Raises:
            StepError: an empty prompt or an id outside the vocabulary, bad sampling values, a negative
                ``max_new_tokens``, prompt + new tokens past ``max_ctx`` or past the whole pool, the engine closed.
        """
        prompt = _int_ids(prompt, "prompt")
        if not prompt:
            raise StepError("the prompt must hold at least one token id")
        stops = _int_ids(stop_ids, "stop_ids")
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise StepError(f"cancel: expected a threading.Event, found {type(cancel).__name__}")
        if on_prefill is not None and not callable(on_prefill):
            raise StepError(f"on_prefill: expected a callable (done, total), found {type(on_prefill).__name__}")
        bad = [t for t in prompt if not 0 <= t < self.ref.cfg.vocab_size]
        if bad:
            raise StepError(f"token ids must be in 0..{self.ref.cfg.vocab_size - 1}, found {bad[0]}")
        check_sampling(temperature, top_k, top_p)
        check_seed(seed)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise StepError(f"max_new_tokens must be an int >= 0, found {max_new_tokens!r}")
        n = len(prompt) + max_new_tokens
        if n > self.max_ctx:
            raise StepError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_ctx={self.max_ctx}")
        if self.pool.pages_for(n) > self.pool.alloc.n_pages:
            raise StepError(f"prompt + max_new_tokens ({n} positions) need {self.pool.pages_for(n)} pages; the pool "
                            f"has {self.pool.alloc.n_pages}")
        req = BatchRequest(next(self._ids), prompt, max_new_tokens, temperature, top_k, top_p, seed,
                           frozenset(stops), cancel or threading.Event(), on_prefill, self)
        with self._lock:
            if self._closed:
                raise StepError("the batch engine is closed")
            self._incoming.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ds4c-batch", daemon=True)
                self._thread.start()
            self._lock.notify()
        return req

    def stats(self) -> dict[str, int]:
        """Running sequences (admitted: prefilling or decoding), waiting requests, pages in use (by running
        sequences or the prefix cache), pages the running sequences hold, pages in the pool, cached prefix pages,
        prefix hits and the prompt positions they saved, steps and rows run."""
        with self._lock:
            waiting = len(self._waiting) + len(self._incoming)
        active = list(self._active)
        running_pages = {p for r in active if r.seq is not None and not r.seq.freed for p in r.seq.table}
        return {"running": len(active), "waiting": waiting, "pages_in_use": self.pool.alloc.in_use,
                "pages_running": len(running_pages),
                "pages": self.pool.alloc.n_pages, "page_tokens": self.pool.page_tokens,
                "prefix_pages": len(self.pool.prefix.nodes), "prefix_hits": self.pool.prefix.hits,
                "prefix_hit_tokens": self.pool.prefix.hit_tokens, "steps": self.steps, "rows": self.rows}

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
        lanes, plan = self._plan()
        logits = self.ref.step_lanes(lanes, check_finite=False)
        self.steps += 1
        self.rows += sum(len(t) for _, t, _ in lanes)
        for (req, n), lg in zip(plan, logits):
            self._advance(req, n, lg)
        self._reap()
        return True

    def _reap(self) -> None:
        for req in [r for r in self._active if r.cancel_event.is_set()]:
            self._finish(req, "stop")

    def _admit(self) -> None:
        pool = self.pool
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
            n = len(req.prompt) + req.max_new_tokens
            reuse = pool.prefix.match(req.prompt) if pool.prefix_reuse else []
            for node in reuse:  # held while pages are made room for: eviction must not take them
                pool.alloc.incref(node.page)
            try:
                if not pool.can_admit(pool.pages_for(n) - len(reuse)):
                    break  # first come, first served: wait for pages
                self._waiting.popleft()
                req.seq = pool.new_sequence(n, reuse)
            finally:
                pool.alloc.release([node.page for node in reuse])
            pool.prefix.record_hit(len(reuse))
            req.reused = req.seq.pos
            req.fed = list(req.prompt[:req.seq.pos])
            req.t_admit = time.perf_counter()
            self._active.append(req)

    def _plan(self) -> tuple[list[tuple[Any, list[int], int]], list[tuple[BatchRequest, int]]]:
        """The step's lanes: every decoding request one row, then prefill chunks from what is left of
        ``max_rows`` in admission order, each cut at the next page boundary."""
        lanes, plan = [], []
        decoding = [r for r in self._active if r.tokens]
        prefilling = [r for r in self._active if not r.tokens]
        for req in decoding:
            lanes.append((req.seq, [req.tokens[-1]], req.seq.pos))
            plan.append((req, 1))
        budget = self.config.max_rows - len(decoding)
        P = self.pool.page_tokens
        for req in prefilling:
            if budget <= 0:
                break
            pos = req.seq.pos
            n = min(budget, len(req.prompt) - pos, P - pos % P)
            lanes.append((req.seq, req.prompt[pos:pos + n], pos))
            plan.append((req, n))
            budget -= n
        return lanes, plan

    def _advance(self, req: BatchRequest, n: int, logits: torch.Tensor) -> None:
        seq = req.seq
        req.fed += req.prompt[seq.pos - n:seq.pos] if not req.tokens else [req.tokens[-1]]
        if not bool(torch.isfinite(logits).all()):
            self._finish(req, None, StepError(f"non-finite logits at positions {seq.pos - n}..{seq.pos - 1}: the "
                                              f"weights or the config hold NaN/inf values"))
            return
        self.pool.cache_page(seq, req.fed)
        if not req.tokens and req.on_prefill is not None:
            try:
                req.on_prefill(seq.pos, len(req.prompt))
            except Exception as e:  # the caller's callback fails its own request only
                self._finish(req, None, StepError(f"on_prefill raised {type(e).__name__}: {e}"))
                return
        if not req.tokens and seq.pos < len(req.prompt):  # more of the prompt to come
            return
        tok = req._sample(logits[-1:].float().cpu())
        req._emit(tok)
        if tok in req.stop_ids:
            self._finish(req, "eos")
        elif len(req.tokens) >= req.max_new_tokens:
            self._finish(req, "length")

    def _finish(self, req: BatchRequest, reason: str | None, error: Ds4cError | None = None) -> None:
        if req.seq is not None:
            self.pool.free(req.seq)
        if req in self._active:
            self._active.remove(req)
        if req._final is None and req.error is None:
            req._end(reason, error)
