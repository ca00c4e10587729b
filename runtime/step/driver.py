"""The compiled step's step and prefill drivers: a step of q rows at the sequence's next position (its graph picked by
(q, context bucket), its scalars uploaded, its CUDA graph replayed), and the prefill of a prompt in chunk graphs
(``prefill_chunks``, docs/prefill.md) or verify steps."""

from __future__ import annotations

from typing import Any

import torch

from ds4c.buckets import BucketSpec, prefill_chunk_for
from ds4c.errors import StepError
from ds4c.runtime.step.binding import StepGraph
from ds4c.runtime.step.graphs import StepGraphs
from ds4c.runtime.step.scalars import StepScalars
from ds4c.runtime.step.sequence import StepSequence


class StepDriver:
    """Runs steps and prefills on one compiled step's graphs, scalars and sequence.

    Args:
        graphs, scalars, sequence: the step's parts.
        buckets: the widths and context buckets served; prefill_chunks: the chunk graphs' row counts (ascending).
        is_last: the step runs the head (returns logits; else a shard's outgoing HC state).
        use_graphs: replay captured CUDA graphs (else launch the kernels one by one).

    Attributes: ``last_prefill``: how the last :meth:`prefill` ran (``{"chunks": [[rows, valid], ...],
    "verify_tokens": n}``), None before one.
    """

    def __init__(self, graphs: StepGraphs, scalars: StepScalars, sequence: StepSequence, buckets: BucketSpec,
                 prefill_chunks: tuple[int, ...], is_last: bool, use_graphs: bool):
        self.graphs, self.scalars, self.sequence = graphs, scalars, sequence
        self.buckets, self.prefill_chunks, self.is_last, self.use_graphs = buckets, prefill_chunks, is_last, use_graphs
        self.last_prefill: dict[str, Any] | None = None

    def begin(self, tokens: list[int], pos: int) -> StepGraph:
        """Check that ``pos`` is the sequence's next position, get the step graph of (``len(tokens)``, bucket)
        and upload the step's scalars. Raises StepError as :meth:`step`."""
        if pos != self.sequence.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.sequence.pos}")
        sg = self.graphs.prepare(len(tokens), self.buckets.bucket(pos, len(tokens)))
        self.scalars.upload(tokens, pos)
        return sg

    def step(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Run ``len(tokens)`` rows at ``pos..``; returns fp32 logits [q, vocab] (a shard before the last: its
        outgoing HC state rows). Raises StepError: ``pos`` is not the next position, positions past max_ctx, or no
        compiled graph for the key."""
        sg = self.begin(tokens, pos)
        self.go(sg, pos + len(tokens))
        return sg.values["logits"] if self.is_last else sg.values["hc_out"]

    def go(self, sg: StepGraph, end: int) -> None:
        """Run ``sg`` (its scalars uploaded): replay its CUDA graph, or launch its kernels without graphs; the
        sequence then ends at position ``end``."""
        if self.use_graphs:
            if sg.cuda_graph is None:
                # first use without prepare_all: the warm-up run inside capture is this step's result
                self.graphs.capture(sg)
            else:
                sg.cuda_graph.replay()
        else:
            self.graphs.run(sg)
        self.sequence.advance(end)

    def prefill(self, tokens: list[int], pos: int, chunks: tuple[int, ...] | None = None) -> torch.Tensor:
        """Ingest ``tokens`` at ``pos..`` and return the fp32 logits of the last one, ``[1, vocab]``
        (``CompiledStep.prefill``). Raises StepError as it does."""
        use = self.prefill_chunks if chunks is None else tuple(sorted(chunks))
        if not set(use) <= set(self.prefill_chunks):
            raise StepError(f"prefill chunks {list(use)}: this step holds chunk graphs of {list(self.prefill_chunks)}")
        if pos != self.sequence.pos:
            raise StepError(f"prefill at position {pos}, but the sequence's next position is {self.sequence.pos}")
        n = len(tokens)
        if n == 0:
            raise StepError("prefill of no tokens (expected at least one)")
        if pos + n > self.buckets.max_ctx:
            raise StepError(f"positions {pos}..{pos + n - 1} exceed max_ctx={self.buckets.max_ctx}")
        self.sequence.undo = None  # a rollback after this would restore what the chunk overwrote: nothing to restore
        widest, i, logits = max(self.buckets.widths), 0, None
        plan: dict[str, Any] = {"chunks": [], "verify_tokens": 0}
        while i < n:
            c = prefill_chunk_for(use, n - i, pos + i, self.buckets.max_ctx)
            if c is None:
                q = min(widest, n - i)
                logits = self.step(tokens[i:i + q], pos + i)[-1:]
                i += q
                plan["verify_tokens"] += q
                continue
            k = min(c, n - i)
            logits = self.chunk(tokens[i:i + k], pos + i, c)
            i += k
            plan["chunks"].append([c, k])
        self.last_prefill = plan
        return logits

    def chunk(self, tokens: list[int], pos: int, rows: int) -> torch.Tensor:
        """One prefill chunk graph of ``rows`` rows over ``tokens`` (``len(tokens) <= rows``; the rest padding) at
        ``pos``; returns its logits ``[1, vocab]``."""
        sg = self.begin_chunk(tokens, pos, rows)
        self.go(sg, pos + len(tokens))
        return sg.values["logits"]

    def begin_chunk(self, tokens: list[int], pos: int, rows: int) -> StepGraph:
        """The chunk graph of ``rows`` rows in the smallest context bucket holding ``pos + rows``, its scalars
        uploaded (as :meth:`begin` for a step)."""
        sg = self.graphs.prepare(rows, next(c for c in self.buckets.contexts if pos + rows <= c))
        self.scalars.upload(tokens, pos, rows=rows)
        return sg
