"""Admission, queueing, timeouts, cancellation and drain between the HTTP handlers and an :class:`Engine`.

The policy (docs/serving.md):

* **slots**: the engine runs at most ``engine.capacity`` sequences; a request holds a slot from admission until the
  engine is done with its generation (the terminal event), not until its client has read everything, so a slow
  reader holds no slot. The second part of a forced tool call in thinking mode takes a slot again at the head
  of the queue (never refused).
* **queue**: a request that finds no free slot waits, first come first served, in a queue of at most
  ``max_queue`` requests; a request that finds the queue full is refused at once (429, ``queue_full``), one that
  waits longer than ``queue_timeout_s`` is refused then (429, ``queue_timeout``); both with ``Retry-After``.
  Nothing has been sent to the client yet, so a streaming request gets the 429 as its HTTP status.
* **timeouts**: a request ends ``request_timeout_s`` after it arrived (queue time included): the engine is told to
  stop and the client gets a timeout error.
* **cancellation**: a handler that leaves (the client went away, a timeout, an error) cancels its generation; the
  engine stops it within a step and the slot is given back then.
* **slow clients**: each generation's events wait in a buffer of ``stream_buffer`` pieces
  (:class:`~ds4c.server.engine.RequestStream`); the engine never waits for a client, and a client that falls that
  far behind has its generation cancelled, so it holds no slot and slows no one.
* **drain**: after :meth:`Scheduler.drain` (SIGTERM) new requests are refused (503, ``draining``) and the
  admitted ones run to their end; :meth:`Scheduler.abort` (the drain timeout) stops those still running, each
  ending with OpenAI's error (503 ``draining``: the status of a whole reply, an error event of a stream).

The engine's interface is all the scheduler uses, so the lanes engine of issue 30 drops in for the
one-sequence engine with no change here or in the handlers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ds4c.errors import Ds4cError
from ds4c.server.engine import Engine, Failed, Finished, GenRequest, Piece, RequestStream
from ds4c.server.metrics import Metrics
from ds4c.server.protocol import APIError


@dataclass(frozen=True)
class SchedulerConfig:
    """The limits of the policy (module docstring); times in seconds, None = no limit. A timeout that is not a
    finite number > 0 is a Ds4cError."""

    max_queue: int = 256
    queue_timeout_s: float = 60.0
    request_timeout_s: float | None = 600.0
    stream_buffer: int = 4096

    def __post_init__(self) -> None:
        for name in ("queue_timeout_s", "request_timeout_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise Ds4cError(f"{name}: expected a finite number of seconds > 0, found {v}")


class Slot:
    """An admitted request's right to generate: :meth:`start` generations one after another (one engine sequence
    at a time), :meth:`events` their events, timed into the metrics."""

    def __init__(self, sched: Scheduler, arrival: float):
        self._sched = sched
        self.arrival = arrival
        self.deadline = None if sched.config.request_timeout_s is None else arrival + sched.config.request_timeout_s
        self.streams: list[RequestStream] = []
        self.holding = True        # admitted: the first generation has its slot
        self._first_at: float | None = None
        self._last_at = 0.0

    def _done(self, ev: Finished | Failed) -> None:
        """The engine is done with a generation: its slot is free, its tokens counted (also those of a request
        whose client went away or fell behind)."""
        self.holding = False
        self._sched._release()
        if isinstance(ev, Finished):
            self._sched.metrics.prompt_tokens.inc(ev.prompt_tokens)
            self._sched.metrics.generation_tokens.inc(ev.completion_tokens)

    async def start(self, req: GenRequest) -> RequestStream:
        """Start ``req`` on the engine once the previous generation of this request has ended (a later one waits
        for a slot at the head of the queue)."""
        assert all(s.terminal is not None for s in self.streams), "one generation at a time per request"
        if self._sched.aborted:      # the second part of a forced tool call, after the drain timeout
            raise APIError(503, "the server is shutting down", code="draining")
        if not self.holding:
            await self._sched._acquire(priority=True)
            self.holding = True
        st = RequestStream(asyncio.get_running_loop(), self._sched.config.stream_buffer, self.deadline, self._done)
        self.streams.append(st)
        self._sched.engine.start(req, st)
        return st

    async def events(self, st: RequestStream) -> AsyncIterator[Piece | Finished | Failed]:
        """The events of ``st`` until its terminal one; times the first text (from arrival) and the gaps between
        pieces (per token) as the handler takes them. ``TimeoutError`` past the request's deadline (the generation
        is cancelled)."""
        m, done = self._sched.metrics, 0
        while True:
            ev = await st.next()
            now = time.monotonic()
            if isinstance(ev, Piece):
                if self._first_at is None:
                    self._first_at = now
                    m.ttft.observe(now - self.arrival)
                elif ev.tokens > done:
                    gap = (now - self._last_at) / (ev.tokens - done)
                    for _ in range(ev.tokens - done):
                        m.itl.observe(gap)
                self._last_at = now
                done = ev.tokens
            yield ev
            if not isinstance(ev, Piece):
                return


class Scheduler:
    """Admits requests to an :class:`Engine` (module docstring).

    Args:
        engine: the engine; its ``capacity`` is the number of slots.
        metrics: where queue depth, running sequences, pages and timings go.
        config: the limits.
    """

    def __init__(self, engine: Engine, metrics: Metrics, config: SchedulerConfig = SchedulerConfig()):
        self.engine, self.metrics, self.config = engine, metrics, config
        self._free = engine.capacity
        self._waiters: deque[asyncio.Future] = deque()
        self._slots: set[Slot] = set()
        self.draining = False
        self.aborted = False
        metrics.queue_depth.set_function(lambda: self.queue_depth)
        metrics.running.set_function(lambda: self.engine.stats().running)
        metrics.pages.set_function(lambda: self.engine.stats().pages_in_use)
        metrics.prefix_pages.set_function(lambda: self.engine.stats().prefix_pages)
        metrics.prefix_reused.set_function(lambda: self.engine.stats().prefix_reused_tokens)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return sum(not f.done() for f in self._waiters)

    @property
    def idle(self) -> bool:
        """No request admitted (its response included) and none waiting."""
        return not self._slots and not self.queue_depth

    def drain(self) -> None:
        """Refuse new requests (503); admitted ones go on."""
        self.draining = True

    def abort(self) -> int:
        """Drain, and stop every admitted request's generation (each ends with 503 ``draining``); returns how many
        were stopped. Requests still queued are refused when their slot comes."""
        self.draining = self.aborted = True
        n = 0
        for slot in self._slots:
            for st in slot.streams:
                if st.terminal is None:
                    st.cancel()
                    n += 1
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(APIError(503, "the server is shutting down", code="draining"))
        return n

    async def _acquire(self, priority: bool = False) -> None:
        """Take a slot: at once if one is free and nobody waits; else wait in the queue (``priority``: at its head,
        without limit or timeout)."""
        if not priority:
            if self.draining:
                raise APIError(503, "the server is shutting down", code="draining")
            if self._free > 0 and not self.queue_depth:
                self._free -= 1
                return
            if self.queue_depth >= self.config.max_queue:
                raise APIError(429, f"the server is busy: {self.engine.capacity} sequence(s) running and "
                                    f"{self.queue_depth} request(s) queued (the limit); retry later",
                               code="queue_full", headers={"Retry-After": "1"})
        elif self._free > 0:
            self._free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        if priority:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await asyncio.wait_for(fut, None if priority else self.config.queue_timeout_s)
        except TimeoutError:
            raise APIError(429, f"the server is busy: no sequence slot within {self.config.queue_timeout_s:g} s; "
                                f"retry later", code="queue_timeout",
                           headers={"Retry-After": str(max(1, math.ceil(self.config.queue_timeout_s / 10)))}) \
                from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release()      # handed a slot just as the waiter went away
            raise
        finally:
            if fut in self._waiters and fut.done():
                self._waiters.remove(fut)

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    @asynccontextmanager
    async def slot(self, arrival: float) -> AsyncIterator[Slot]:
        """Admission (may raise APIError 429 / 503), then the :class:`Slot` until the block ends; leaving the
        block cancels an unfinished generation (its slot is freed when the engine has stopped it)."""
        await self._acquire()
        s = Slot(self, arrival)
        self._slots.add(s)
        try:
            yield s
        finally:
            self._slots.discard(s)
            for st in s.streams:
                if st.terminal is None:
                    st.cancel()
            if s.holding and all(st.terminal is not None for st in s.streams):
                s.holding = False      # admitted, but no generation holds the slot: give it back now
                self._release()
