"""Speculative decoding on the compiled step: verify steps that can be rolled back (a verify graph's rollback kernel,
runtime/families/undo.py, or a snapshot for q = 1), and the greedy acceptance on the device (each row's argmax, the
accepted count and the rollback enqueued behind the verify graph; :mod:`ds4c.runtime.spec_pipeline` queues them
ahead of their drafts)."""

from __future__ import annotations

from typing import Any

import torch

from ds4c.buckets import BucketSpec
from ds4c.errors import StepError
from ds4c.runtime.sampler import argmax_chunk, argmax_rows
from ds4c.runtime.step.binding import StepGraph
from ds4c.runtime.step.driver import StepDriver
from ds4c.runtime.step.graphs import StepGraphs
from ds4c.runtime.step.scalars import StepScalars
from ds4c.runtime.step.sequence import StepSequence
from ds4c.sampling import accept_greedy


class Verifier:
    """Verify, rollback and the device-side greedy acceptance of one compiled step.

    Args:
        driver: the step's driver (its graphs, scalars and sequence are this verifier's).
        buckets: the widths and context buckets served; is_last: the step holds the logits.
        dev: the step's CUDA device.

    Attributes: ``accept_graphs`` (the captured acceptance per (width, context)), ``pipeline`` (the
    :class:`~ds4c.runtime.spec_pipeline.GreedyPipeline` made on first use, or None).
    """

    def __init__(self, driver: StepDriver, buckets: BucketSpec, cfg: Any, is_last: bool, dev: torch.device):
        self.driver = driver
        self.graphs: StepGraphs = driver.graphs
        self.scalars: StepScalars = driver.scalars
        self.sequence: StepSequence = driver.sequence
        self.buckets, self.is_last = buckets, is_last
        self._accept_host: tuple[torch.Tensor, Any] | None = None  # verify_greedy's pinned result and its event
        self._argmax_chunk = argmax_chunk(cfg.vocab_size)
        self.pipeline: Any = None  # ds4c.runtime.spec_pipeline.pipeline's, made on first use
        # the greedy acceptance's argmax ids (device, int64 [max width])
        self._accept_ids = torch.zeros(max(buckets.widths), dtype=torch.int64, device=dev)
        self.accept_graphs: dict[tuple[int, int], Any] = {}  # its captured graphs per (width, context)

    def arm_undo(self, tokens: list[int], pos: int) -> None:
        """Make the next step (``tokens`` at ``pos``) one :meth:`rollback` can undo (``CompiledStep.arm_undo``)."""
        seq = self.sequence
        sg = self.graphs.prepare(len(tokens), self.buckets.bucket(pos, len(tokens))) if pos == seq.pos else None
        if sg is not None and sg.rollback is not None:
            seq.undo = ("kernel", sg, list(tokens), pos)
        else:
            seq.undo = ("snapshot", seq.snapshot(), list(tokens), pos)

    def verify(self, tokens: list[int], pos: int) -> torch.Tensor:
        """A verify step that can be rolled back (``CompiledStep.verify``)."""
        self.arm_undo(tokens, pos)
        return self.driver.step(tokens, pos)

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last verify and undo the rest (``CompiledStep.rollback``).

        Raises:
            StepError: no verify to roll back, or ``accepted`` outside 0..q.
        """
        seq = self.sequence
        undo = seq.undo
        if undo is None:
            raise StepError("rollback: no verify step to roll back")
        kind, held, tokens, pos = undo
        if not 0 <= accepted <= len(tokens):
            raise StepError(f"rollback: accepted must be in 0..{len(tokens)}, found {accepted}")
        seq.undo = None
        if accepted == len(tokens):
            return
        if kind == "kernel":
            self._launch_rollback(held, accepted)
            seq.pos = pos + accepted
            return
        seq.restore(held)
        if accepted:
            self.driver.step(tokens[:accepted], pos)

    def verify_greedy(self, tokens: list[int], pos: int) -> list[int]:
        """A verify step with greedy acceptance and its rollback on the device (``CompiledStep.verify_greedy``):
        the ids the step adds."""
        q = len(tokens)
        if q == 1:  # a plain decode: its one row is always kept, so there is nothing to undo (no snapshot)
            return [int(argmax_rows(self.driver.step(tokens, pos), self._argmax_chunk)[0])]
        seq = self.sequence
        self.arm_undo(tokens, pos)
        kind, held = seq.undo[0], seq.undo[1]
        logits = self.driver.step(tokens, pos)
        if kind != "kernel" or not self.is_last:
            new = accept_greedy(argmax_rows(logits, self._argmax_chunk).tolist(), list(tokens[1:]))
            self.rollback(len(new))
            return new
        if self._accept_host is None:  # pinned once: pinning costs milliseconds
            self._accept_host = (torch.zeros(max(self.buckets.widths), dtype=torch.int64).pin_memory(),
                                 torch.cuda.Event())
        h, done = self._accept_host
        self.accept_on_device(held, h)
        done.record()
        done.synchronize()
        seq.undo = None
        new = accept_greedy(h[:q].tolist(), list(tokens[1:]))  # the count the device computed, from the same ids
        seq.pos = pos + len(new)
        return new

    def accept_on_device(self, sg: StepGraph, host_ids: torch.Tensor) -> None:
        """Enqueue, behind ``sg``'s step on the current stream, its greedy acceptance (:meth:`_accept_body`) and
        a copy of the rows' argmax ids into ``host_ids`` (``CompiledStep.accept_on_device``)."""
        g = self.accept_graphs.get((sg.width, sg.context))
        if g is not None:
            g.replay()
        else:
            self._accept_body(sg)
        host_ids[:sg.width].copy_(self._accept_ids[:sg.width], non_blocking=True)

    def _accept_body(self, sg: StepGraph) -> None:
        """The greedy acceptance of ``sg``'s step: the rows' argmax into :attr:`_accept_ids`, the accepted count
        (1 + the leading drafts, the step buffer's tokens 1.., equal to their row's argmax; at most the step
        buffer's ``keep``) into its ``accepted`` slot, then ``sg``'s rollback kernel (when it has one: a q = 1
        step keeps its row)."""
        q, d, off = sg.width, self.scalars.buffer, self.scalars.offsets
        t0, acc, keep = off["tokens"], off["accepted"], off["keep"]
        top = argmax_rows(self.graphs.logits[:q], self._argmax_chunk)  # [q] int64
        self._accept_ids[:q].copy_(top)
        if sg.rollback is not None:
            n = torch.cumprod((top[:q - 1] == d[t0 + 1:t0 + q]).to(torch.int64), 0).sum(0, keepdim=True) + 1
            d[acc:acc + 1].copy_(torch.minimum(n, d[keep:keep + 1]))
            self._rollback_kernel(sg)

    def capture_accept(self, sg: StepGraph) -> None:
        """Capture :meth:`_accept_body` of ``sg`` as a CUDA graph (recorded, not run: the state is untouched)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.graphs.pool):
            self._accept_body(sg)
        torch.cuda.synchronize()
        self.accept_graphs[(sg.width, sg.context)] = g
        self.graphs.captures += 1

    def _launch_rollback(self, sg: StepGraph, accepted: int) -> None:
        """The rollback kernel of ``sg`` for ``accepted`` rows: the count uploaded into the step buffer's
        ``accepted`` slot (the verify's ``pos`` is still there), then one launch on the current stream."""
        self.scalars.upload_accepted(accepted)
        self._rollback_kernel(sg)

    def _rollback_kernel(self, sg: StepGraph) -> None:
        """Launch ``sg``'s rollback kernel on the current stream (it reads ``accepted`` from the step buffer)."""
        b = sg.rollback
        if sg.rollback_args is None:
            sg.rollback_args = b.kernel.pack(b.args)
        b.kernel.launch_packed(b.grid, b.block, sg.rollback_args, smem=b.smem)
