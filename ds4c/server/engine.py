"""What the server asks of an engine; the one-sequence-at-a-time engine over :class:`ds4c.Model` and the
continuous-batching one over a Model opened with ``lanes`` (:mod:`ds4c.batching`).

The interface (:class:`Engine`) is small so that the multi-sequence engine of issue 30 (lanes over a paged
state pool) can replace :class:`SerialEngine` without changing the scheduler or any handler:

* :meth:`Engine.start` takes a :class:`GenRequest` (prompt ids and :class:`SamplingParams`) and the request's
  :class:`RequestStream`, and returns at once; the engine pushes :class:`Piece` events and then exactly one
  terminal event (:class:`Finished` or :class:`Failed`) into the stream, from any thread;
* it stops a request within one step once :attr:`RequestStream.cancelled` is set (a client that went away, a
  timeout, a buffer that overflowed) and then pushes ``Finished("cancelled", ...)``;
* it never waits for a consumer: :meth:`RequestStream.push` does not block; the stream's buffer is bounded and a
  request whose consumer falls that far behind is cancelled (so a client that stops reading never stalls the
  engine, nor anyone else's tokens);
* :attr:`Engine.capacity` sequences at most are started at once (the scheduler admits no more);
* :meth:`Engine.stats` reports the running sequences and the KV pages they hold.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ds4c.api import Model
from ds4c.errors import Ds4cError

log = logging.getLogger("ds4c.server")

#: Tokens per KV page the page gauge counts in (the seed's paged cache, and issue 30's pool, use 128).
PAGE_TOKENS = 128


@dataclass(frozen=True)
class SamplingParams:
    """How to generate: at most ``max_tokens`` new tokens; ``temperature`` 0 = greedy, else seeded sampling after
    ``top_k`` (0 = off) / ``top_p`` (1 = off) filtering; ``stop`` strings end the text before them;
    ``ignore_eos`` generates past the end-of-sequence token."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenRequest:
    """One generation: ``prompt_ids`` (with bos), ``params``, and an ``id`` for logs."""

    id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Piece:
    """New text (complete UTF-8; never text that may begin a stop string) and the tokens generated so far."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Finished:
    """The end of a request. ``reason``: ``"eos"`` (the end-of-sequence token), ``"stop"`` (a stop string:
    ``matched_stop`` says which), ``"length"`` (``max_tokens``) or ``"cancelled"``; token counts of the prompt and
    of the new tokens (an ending eos included)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    matched_stop: str | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed in the engine: a one-line message (bad input the checks before did not catch, or an
    engine error)."""

    message: str


Event = Piece | Finished | Failed


class RequestStream:
    """One request's events, from the engine (any thread) to the request's handler (the event loop).

    Args:
        loop: the event loop the handler runs on.
        capacity: pieces buffered for a consumer that has not taken them; one more cancels the request
            (:attr:`overflowed`), the terminal event is always delivered.
        deadline: ``time.monotonic()`` past which :meth:`next` raises ``TimeoutError`` (None: no limit).
        on_done: called on the loop with the terminal event when it arrives (the engine is done with the request:
            the scheduler frees its sequence slot and counts its tokens then, whether or not the consumer has read
            the events yet).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int, deadline: float | None = None,
                 on_done: Callable[[Finished | Failed], None] | None = None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, found {capacity}")
        self._loop = loop
        self._capacity = capacity
        self._q: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self.deadline = deadline
        self.overflowed = False
        self.done = asyncio.Event()   # set when the terminal event has been pushed (the engine is done with it)
        self.terminal: Finished | Failed | None = None
        self._on_done = on_done

    # ---------------------------------------------------------------------------- engine side (any thread)
    @property
    def cancelled(self) -> bool:
        """Whether the request should stop (thread-safe)."""
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        """The event :meth:`cancel` sets (an engine that steps many requests watches it between steps)."""
        return self._cancel

    def push(self, ev: Event) -> None:
        """Deliver an event (never blocks; thread-safe). After the handler's event loop has closed (the server
        stopped while the engine still ran the request) the event is dropped: nobody is there to read it, and the
        engine thread must not die of it."""
        try:
            self._loop.call_soon_threadsafe(self._put, ev)
        except RuntimeError:
            if not self._loop.is_closed():
                raise

    def _put(self, ev: Event) -> None:
        if isinstance(ev, Piece):
            if self.terminal is not None or self.overflowed:
                return
            if self._q.qsize() >= self._capacity:
                self.overflowed = True
                self._cancel.set()
                return
        else:
            if self.terminal is not None:
                return
            self.terminal = ev
            self.done.set()
            if self._on_done is not None:
                self._on_done(ev)
        self._q.put_nowait(ev)

    # ---------------------------------------------------------------------------- consumer side (the loop)
    def cancel(self) -> None:
        """Ask the engine to stop this request (idempotent)."""
        self._cancel.set()

    async def next(self) -> Event:
        """The next event; ``TimeoutError`` past the deadline (the request is then cancelled)."""
        if self.deadline is None:
            return await self._q.get()
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return await asyncio.wait_for(self._q.get(), left)
        except TimeoutError:
            self.cancel()
            raise


@dataclass
class EngineStats:
    """What an engine holds now: running sequences and the KV pages they take (:data:`PAGE_TOKENS` tokens; the
    batch engine's own pages), the pages its prefix cache holds and the prompt positions it saved so far."""

    running: int
    pages_in_use: int
    prefix_pages: int = 0
    prefix_reused_tokens: int = 0


class Engine(Protocol):
    """The server's view of an engine (module docstring)."""

    capacity: int
    max_ctx: int

    def start(self, req: GenRequest, stream: RequestStream) -> None:
        """Begin ``req``; its events go to ``stream``. Returns at once."""

    def stats(self) -> EngineStats:
        """Running sequences and pages in use."""

    def close(self) -> None:
        """Stop after the running request (which is cancelled); later :meth:`start` calls fail their request."""


@dataclass
class _Job:
    req: GenRequest
    stream: RequestStream
    tokens: int = 0


@dataclass
class SerialEngine:
    """One sequence at a time on a :class:`ds4c.Model`: one worker thread owns the model and runs the started
    requests in order (the scheduler starts at most :attr:`capacity` = 1, so none waits here).

    Args:
        model: the opened model (only the worker thread generates with it); its ``draft``, if any, decodes every
            request speculatively (a drafter made per request with the request's seed).
        spec_width: verify rows per speculative step, 1..5 or ``"auto"``.
    """

    model: Model
    spec_width: int | str = 5
    capacity: int = 1
    _jobs: queue.Queue = field(default_factory=queue.Queue, repr=False)
    _running: dict[int, _Job] = field(default_factory=dict, repr=False)
    _closed: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        self.max_ctx = self.model.max_ctx
        self._threads = [threading.Thread(target=self._work, name=f"ds4c-engine-{k}", daemon=True)
                         for k in range(self.capacity)]
        for t in self._threads:
            t.start()

    def start(self, req: GenRequest, stream: RequestStream) -> None:
        if self._closed:
            stream.push(Failed("the server is shutting down"))
            return
        self._jobs.put(_Job(req, stream))

    def stats(self) -> EngineStats:
        jobs = list(self._running.values())
        return EngineStats(len(jobs), sum(math.ceil((len(j.req.prompt_ids) + j.tokens) / PAGE_TOKENS) for j in jobs))

    def close(self) -> None:
        self._closed = True
        for job in list(self._running.values()):
            job.stream.cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=60)

    # ---------------------------------------------------------------------------- the worker thread
    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            me = threading.get_ident()
            self._running[me] = job
            try:
                job.stream.push(self._run(job))
            except Ds4cError as e:
                job.stream.push(Failed(" ".join(str(e).split())))
            except Exception as e:  # an engine bug must not kill the worker: the request fails, the log has it
                log.exception("request %s failed", job.req.id)
                job.stream.push(Failed(f"internal engine error ({type(e).__name__}: {e})"))
            finally:
                self._running.pop(me, None)

    def _run(self, job: _Job) -> Finished:
        req, st, p = job.req, job.stream, job.req.params
        if st.cancelled:
            return Finished("cancelled", len(req.prompt_ids), 0)
        s = self.model.generate(list(req.prompt_ids), max_new_tokens=p.max_tokens, temperature=p.temperature,
                                top_k=p.top_k, top_p=p.top_p, seed=p.seed, stop=list(p.stop) or None,
                                ignore_eos=p.ignore_eos, stream=True, **self._run_options(st))
        for piece in s:
            job.tokens = s.n_tokens
            st.push(Piece(piece, s.n_tokens))
            if st.cancelled:
                c = s.close()
                return Finished("cancelled", len(c.prompt_ids), len(c.ids))
        c = s.completion
        if st.cancelled:  # ended by its cancellation before a piece came (the batch engine stops it mid-prompt)
            return Finished("cancelled", len(c.prompt_ids), len(c.ids))
        return Finished(c.stop_reason, len(c.prompt_ids), len(c.ids), _matched_stop(self.model, c.ids, c.text,
                                                                                    p.stop, c.stop_reason))


    def _run_options(self, stream: RequestStream) -> dict:
        return {"spec_width": self.spec_width}


@dataclass
class BatchedEngine(SerialEngine):
    """Many sequences at once on a :class:`ds4c.Model` opened with ``lanes`` (continuous batching,
    :class:`ds4c.batching.BatchEngine`): one worker thread per sequence slot hands its request to the Model's batch
    engine, which steps every running request together; a request's cancellation reaches the batch engine through
    its stream's event, so it ends before the next step, also in the middle of its prompt. :attr:`capacity`: the
    Model's lanes (or fewer)."""

    def __post_init__(self) -> None:
        batch = self.model.batch
        if batch is None:
            raise Ds4cError("BatchedEngine needs a Model opened with lanes")
        if not 1 <= self.capacity <= batch.config.max_lanes:
            raise Ds4cError(f"max_concurrency {self.capacity}: the model runs {batch.config.max_lanes} sequences at "
                            f"once (its lanes)")
        super().__post_init__()

    def stats(self) -> EngineStats:
        st = self.model.batch.stats()
        return EngineStats(st["running"], st["pages_running"], st["prefix_pages"], st["prefix_hit_tokens"])

    def _run_options(self, stream: RequestStream) -> dict:
        return {"cancel": stream.cancel_event, "spec_width": self.spec_width}


def _matched_stop(model: Model, ids: Sequence[int], text: str | None, stops: Sequence[str],
                  reason: str) -> str | None:
    """Which stop string ended the text: the decoded new tokens go on with it right after ``text`` (the text is cut
    before the first stop string found)."""
    if reason != "stop" or not stops or text is None:
        return None
    rest = model.detokenize(ids)[len(text):]
    return next((s for s in sorted(stops, key=len, reverse=True) if rest.startswith(s)), None)
