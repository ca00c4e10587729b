"""Pipelined submission of greedy verify steps (the speculative loop is ds4c/speculative.py).

A synchronous speculative step leaves the GPU idle while the host turns one step's result into the next step's
launch: waking up, accepting, drafting, writing the step scalars, uploading them, and launching the verify's CUDA
graph. On the H200 (flash-l4, q = 5) that was ~0.24 ms of a ~2.85 ms step (docs/perf.md, session 8), and the
graph launch was its largest part.

:class:`GreedyPipeline` moves all of that except the drafting ahead of the data. While step N runs, the host
enqueues step N+1 *before* knowing its tokens. The stream waits on a host flag (:class:`~ds4c.runtime.launch.HostFlag`,
``cuStreamWaitValue32``), then copies the step scalars from a pinned buffer, replays the verify graph and
enqueues the greedy acceptance and rollback behind it
(:meth:`~ds4c.runtime.step.CompiledStep.accept_on_device`). Once step N's ids are back, the host drafts, writes
the scalars of N+1 into that pinned buffer, and stores the flag. The GPU starts N+1 within microseconds of that
store, with the graph already launched.

Rules:

* Only drafters that do not touch the GPU may run while a step is queued behind the flag. GPU work on the stream
  would wait behind the flag, which only the host's next store releases, so it would deadlock. The loop uses the
  pipeline only for such drafters (``Drafter.host_only``, e.g. the oracle).
* Width and context bucket of step N+1 are fixed when it is enqueued, before step N's result. The bucket is
  chosen for the furthest position step N can reach. A larger bucket is always valid; it only pads more.
* Every enqueued step must be released. A step not needed any more (the generation ended) is released by
  :meth:`close` with valid scalars (the last accepted token at the next position, no drafts). So, as with the
  decode loop's lag, the state can hold up to two steps more than were consumed; :attr:`CompiledStep.pos` says how far
  it went.
* Every (width, bucket) graph used, and the acceptance behind it, must have been captured by ``prepare_all``.
  Capturing runs the step eagerly, which must not happen behind a queued step. Nothing enqueued behind the flag
  may allocate either: a cudaMalloc may wait for the blocked stream, and that deadlocks. The first flash-l4 run
  hung, probably there, when the eager acceptance's temporaries met a cold allocator. The captured acceptance
  allocates nothing. :func:`pipeline` returns None when a graph is missing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.runtime.launch import HostFlag, LaunchError
from ds4c.sampling import accept_greedy


@dataclass
class _Queued:
    seq: int  # the flag value that releases it
    slot: int  # which pinned scalar / id buffers it uses
    sg: Any  # the step graph (width, bucket)
    tokens: list[int] | None = None  # set on release
    pos: int = -1


class GreedyPipeline:
    """Queued greedy verify steps on one unsplit :class:`~ds4c.runtime.step.CompiledStep` (module docstring).

    Use: :meth:`enqueue` a step of ``width`` rows for positions up to ``pos_bound``, :meth:`release` it with its
    tokens and position once they are known, :meth:`result` for its accepted ids (in order), and :meth:`close`
    at the end. At most two steps are queued at once (the pinned buffers are double-buffered).

    Raises:
        StepError: a width / bucket without a captured graph, more than two steps queued, a release or result
            out of order.
    """

    DEPTH = 2

    def __init__(self, step: Any):
        self.step = step
        with torch.cuda.device(step.dev):
            self.flag = HostFlag()
            n = step.scalars.buffer.numel()
            self._scalars = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(self.DEPTH)]
            self._np = [t.numpy() for t in self._scalars]
            maxq = max(step.buckets.widths)
            self._ids = [torch.zeros(maxq, dtype=torch.int64).pin_memory() for _ in range(self.DEPTH)]
            self._done = [torch.cuda.Event() for _ in range(self.DEPTH)]
        self._queue: deque[_Queued] = deque()
        self._seq = self.flag.value
        self._slot = 0
        self._next: tuple[int, int] | None = None  # (the sequence's next token, its position), once known
        self.owner: object | None = None
        """The request using the pipeline (set by its loop); None once ended by :meth:`abandon`."""

    @property
    def busy(self) -> bool:
        """Steps are queued (a request is running, or was left without :meth:`close`)."""
        return bool(self._queue)

    def abandon(self) -> None:
        """End a request left with queued steps (another call on the step needs its stream): :meth:`close` at the
        newest known position, and no owner, so the request's loop gets a one-line StepError if it goes on
        (:meth:`check_owner`)."""
        if self._queue:
            token, pos = self._next if self._next is not None else (0, self.step.pos)
            self.close(token, pos)
        self.owner = None

    def check_owner(self, me: object) -> None:
        """Raises StepError when the request ``me`` no longer owns the pipeline (another call ended it)."""
        if self.owner is not me:
            raise StepError("pipelined verify: this request was ended by another call on the compiled step")

    def _graph(self, width: int, pos_bound: int) -> Any:
        st = self.step
        ctx = st.buckets.bucket(min(pos_bound, st.buckets.max_ctx - width), width)
        sg = st.graphs.by_key.get((width, ctx))
        if sg is None or sg.cuda_graph is None:
            raise StepError(f"pipelined verify: no captured graph for (width {width}, context {ctx}); "
                            f"prepare_all captures them")
        return sg

    def enqueue(self, width: int, pos_bound: int) -> None:
        """Queue a step of ``width`` rows whose first position will be at most ``pos_bound``: the wait on the
        flag, the scalar upload, the graph replay and the acceptance (nothing runs until :meth:`release`)."""
        if len(self._queue) >= self.DEPTH:
            raise StepError(f"pipelined verify: at most {self.DEPTH} steps can be queued")
        sg = self._graph(width, pos_bound)
        st = self.step
        self._seq += 1
        q = _Queued(self._seq, self._slot, sg)
        self._slot ^= 1
        with torch.cuda.device(st.dev):
            self._done[q.slot].synchronize()  # the slot's last step (two back) has read its scalars and ids
            self.flag.wait(q.seq)
            self._queue.append(q)  # from here on the stream waits for it: close() must find it, even on an error
            st.scalars.buffer.copy_(self._scalars[q.slot], non_blocking=True)
            sg.cuda_graph.replay()
            st.accept_on_device(sg, self._ids[q.slot])
            self._done[q.slot].record()

    def release(self, tokens: list[int], pos: int, keep: int | None = None) -> None:
        """Give the oldest unreleased step its ``tokens`` (the last accepted token then the drafts, exactly its
        width) at ``pos`` (the sequence's next position) and let it run; ``keep``: the most rows it may keep
        (default all)."""
        q = next((x for x in self._queue if x.tokens is None), None)
        if q is None:
            raise StepError("pipelined verify: no queued step to release")
        if self._next is None:
            self._next = (int(tokens[0]), int(pos))
        a = self._np[q.slot]
        bad = None
        if len(tokens) != q.sg.width:
            bad = f"the queued step has {q.sg.width} rows, found {len(tokens)} tokens"
        elif pos < 0 or pos + len(tokens) > min(q.sg.context, self.step.buckets.max_ctx):
            bad = f"positions {pos}..{pos + len(tokens) - 1} outside the queued step's context bucket {q.sg.context}"
        if bad is not None:  # a queued step must run, or the stream waits forever: run it harmlessly at 0
            tokens, pos = [0] * q.sg.width, 0
        self.step.fill_scalars(a, tokens, pos, keep)
        q.tokens, q.pos = list(tokens), pos
        self.flag.release(q.seq)
        if bad is not None:
            raise StepError(f"pipelined verify: {bad} (the sequence state is no longer valid: reset it)")

    def result(self) -> list[int]:
        """Wait for the oldest step (released) and return the ids it adds (the accepted drafts then the target's
        token); the step's ``pos`` moves past them."""
        if not self._queue or self._queue[0].tokens is None:
            raise StepError("pipelined verify: no released step to wait for")
        q = self._queue.popleft()
        self._done[q.slot].synchronize()
        new = accept_greedy(self._ids[q.slot][:q.sg.width].tolist(), q.tokens[1:])
        self._advance(q.pos + q.sg.width, q.pos + len(new))
        self._next = (new[-1], self.step.pos)
        return new

    def _advance(self, written: int, pos: int) -> None:
        """The step's bookkeeping after a queued step of rows up to ``written`` (exclusive) kept rows up to
        ``pos``: its position, and how far its tap ring was written (as ``CompiledStep.step`` keeps them)."""
        self.step.sequence.advance(pos, written)

    def close(self, token: int, pos: int) -> None:
        """End the pipeline's request: wait for the released steps (their ids are not needed, but the position
        they reach is), then run a step still held as a plain decode of ``token`` at the position reached
        (``pos`` when none was released; its rows are repeats of ``token`` and only the first is kept), without
        waiting for it. ``step.pos`` is left after it: one position more than the loop consumed, a valid
        state (``token`` is the sequence's token at that position)."""
        while self._queue and self._queue[0].tokens is not None:
            new = self.result()
            token, pos = new[-1], self.step.pos
        for q in list(self._queue):  # held steps: each a decode of the token at the next position
            self.release([token] * q.sg.width, pos, keep=1)
            self._advance(pos + q.sg.width, pos + 1)
            pos += 1
        self._queue.clear()
        self._next = None


def pipeline(step: Any) -> GreedyPipeline | None:
    """The :class:`GreedyPipeline` of ``step`` (made once, kept on the step: pinning host memory costs
    milliseconds) when it can run one: an unsplit compiled step whose graphs ``prepare_all`` captured, on a
    device with stream memory operations and mapped pinned memory; else None (the loop then runs its steps one
    by one)."""
    if not step.use_graphs or step.is_split or not step.graphs.by_key:
        return None
    if any(sg.cuda_graph is None or (sg.width, sg.context) not in step.verifier.accept_graphs
           for sg in step.graphs.by_key.values()):
        return None
    pipe = step.verifier.pipeline
    if pipe is None:
        try:
            pipe = step.verifier.pipeline = GreedyPipeline(step)
        except LaunchError:  # no mapped host memory or no stream memory ops: the synchronous loop
            return None
    pipe.abandon()  # a request left unclosed: end it (nothing queued: no-op)
    return pipe
