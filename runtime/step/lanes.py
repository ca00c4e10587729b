"""Decode lanes on the compiled step (issue 30): the decode rows of several sequences in one step graph, built from
``build_step(..., lanes=(1,) * L)`` through the same passes and lowering as the one-sequence step (weights read once
per step for all rows; each lane's compressor, indexer, attention and ring write on its own state).

Each sequence lives in a *slot*: a full set of state buffers (``state_inputs`` at the step's capacity) on the device.
Lane j of a graph of L lanes is bound to slot j, so the running sequences occupy slots ``0 .. L-1``
(:meth:`LanesStep.move` compacts them when one leaves). A sequence's prompt is prefilled by the one-sequence
:class:`~ds4c.runtime.step.compiled.CompiledStep` (its prefill chunk graphs) and its state copied into a slot
(:meth:`LanesStep.install`): a device copy of a few MiB.

One graph per (lanes, context bucket), the bucket the furthest lane needs; captured as a CUDA graph on its first step
and replayed. The step buffer holds every lane's row position, token and live compressed lengths, uploaded in one
copy per step.

Not yet: verify rows inside a lanes step (the IR and lowering take them, the runtime has no lanes rollback), page
tables (a slot holds the sequence's whole capacity; the reference's paged pool, ds4c.reference.paged, is where the
pages and prefix reuse live), device sampling with per-lane parameters (:meth:`LanesStep.greedy` is the device
argmax; other sampling reads the logits rows).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.ir import build_step
from ds4c.ir.builder import MAX_LANE_ROWS, lane_state_name, state_inputs
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.sampler import argmax_chunk, argmax_rows
from ds4c.runtime.step.binding import DTYPES, StepGraph
from ds4c.runtime.step.graphs import StepGraphs


class LaneScalars:
    """The lanes step buffer: ``positions`` [slots], ``tokens`` [slots], ``lane{j}.live_r{r}`` per slot and
    ratio; written through a pinned host copy and uploaded in one copy per step."""

    def __init__(self, cfg: Any, slots: int, dev: torch.device):
        self.ratios = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r})
        off = {"positions": 0, "tokens": slots}
        k = 2 * slots
        for j in range(slots):
            for r in self.ratios:
                off[lane_state_name(j, f"live_r{r}")] = k
                k += 1
        self.offsets = off
        self.host = torch.zeros(k, dtype=torch.int64).pin_memory()
        self._np = self.host.numpy()
        self.buffer = torch.zeros(k, dtype=torch.int64, device=dev)
        self._done = torch.cuda.Event()

    def upload(self, positions: list[int], tokens: list[int]) -> None:
        """Lane j decodes ``tokens[j]`` at ``positions[j]``."""
        self._done.synchronize()  # the previous upload has left the pinned buffer
        a, off, n = self._np, self.offsets, len(positions)
        a[off["positions"]:off["positions"] + n] = positions
        a[off["tokens"]:off["tokens"] + n] = tokens
        for j, p in enumerate(positions):
            for r in self.ratios:
                a[off[lane_state_name(j, f"live_r{r}")]] = (p + 1) // r
        self.buffer.copy_(self.host, non_blocking=True)
        self._done.record()


class LanesStep:
    """Decode lanes over ``slots`` sequence slots, on a one-sequence :class:`CompiledStep`'s weights, kernel cache
    and device (an unsplit step with no taps or final-HC recording).

    Args:
        step: the one-sequence compiled step (its prefill fills a sequence before :meth:`install`).
        slots: the most sequences decoding together (1..16: the lanes step's row budget).
        use_graphs: capture each (lanes, bucket) graph on its first step and replay it.

    Raises:
        StepError: a split step, a step with taps or final-HC recording, or slots outside 1..16.
    """

    def __init__(self, step: Any, slots: int = 8, use_graphs: bool = True):
        if step.is_split or step.taps or step.record_hc:
            raise StepError("lanes run on an unsplit compiled step without taps or final-HC recording")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_LANE_ROWS:
            raise StepError(f"slots must be in 1..{MAX_LANE_ROWS}, found {slots!r}")
        self.step, self.cfg, self.slots, self.use_graphs = step, step.cfg, slots, use_graphs
        self.dev = step.dev
        specs = state_inputs(self.cfg, step.capacity)
        with torch.cuda.device(self.dev):
            self.slot_state: list[dict[str, torch.Tensor]] = [
                {k: torch.empty(tuple(t.shape), dtype=DTYPES[t.dtype], device=self.dev) for k, t in specs.items()}
                for _ in range(slots)]
            for j in range(slots):
                self.reset(j)
            self.pos = [0] * slots
            self.scalars = LaneScalars(self.cfg, slots, self.dev)
            bound = {lane_state_name(j, k): t for j, st in enumerate(self.slot_state) for k, t in st.items()}
            g = step.graphs
            self.graphs = StepGraphs(
                cfg=self.cfg, buckets=SimpleNamespace(widths=(slots,), contexts=step.buckets.contexts),
                capacity=step.capacity, layers=step.layers, split=False, shard=0, taps=(), record_hc=False,
                prefill_chunks=(), types=g.types, target=g.target, cache=g.cache, manifest=None, artifact=None,
                programmatic=g.programmatic, weights=step.weights, state=bound, scalars=self.scalars,
                is_first=True, is_last=True, dev=self.dev)
        self._chunk = argmax_chunk(self.cfg.vocab_size)

    # ------------------------------------------------------------------------------------------ slots
    def reset(self, slot: int) -> None:
        """Slot ``slot`` back to an empty sequence (KV 0, compressor scores -inf)."""
        for name, t in self.slot_state[slot].items():
            t.fill_(float("-inf") if name.endswith("_score") else 0)

    def install(self, slot: int) -> None:
        """Copy the one-sequence step's current sequence (its state and position, e.g. after a prefill) into
        ``slot``."""
        self._check_slot(slot)
        src = self.step.sequence.buffers
        with torch.cuda.device(self.dev):
            for name, t in self.slot_state[slot].items():
                t.copy_(src[name])
        self.pos[slot] = self.step.pos

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s sequence into slot ``dst`` (compaction when a sequence leaves)."""
        self._check_slot(src)
        self._check_slot(dst)
        with torch.cuda.device(self.dev):
            for name, t in self.slot_state[dst].items():
                t.copy_(self.slot_state[src][name])
        self.pos[dst] = self.pos[src]

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise StepError(f"slot must be in 0..{self.slots - 1}, found {slot!r}")

    # ------------------------------------------------------------------------------------------ graphs
    def context_for(self, lanes: int) -> int:
        """The context bucket a step of lanes ``0 .. lanes-1`` needs (their furthest position's)."""
        end = max(self.pos[:lanes]) + 1
        for c in self.step.buckets.contexts:
            if end <= c:
                return c
        raise StepError(f"a lane at position {end - 1} is past the largest context bucket "
                        f"{self.step.buckets.contexts[-1]}")

    def prepare(self, lanes: int, context: int) -> StepGraph:
        """The graph of ``lanes`` decode lanes at ``context``, built, lowered, compiled (kernel cache) and bound
        once."""
        key = (lanes, context)
        sg = self.graphs.by_key.get(key)
        if sg is not None:
            return sg
        if not 1 <= lanes <= self.slots or context not in self.step.buckets.contexts:
            raise StepError(f"no lanes graph for (lanes {lanes}, context {context}): lanes 1..{self.slots}, contexts "
                            f"{list(self.step.buckets.contexts)}")
        g = run_pipeline(build_step(self.cfg, lanes, self.step.capacity, lanes=(1,) * lanes), "default",
                         context=context).graph
        kernels = lower_graph(g, self.cfg, self.graphs.target, self.graphs.types)
        binaries = self.graphs.binaries([(key, kernels)], progress=False)[0]
        return self.graphs.bind(lanes, context, g, kernels, binaries)

    # ------------------------------------------------------------------------------------------ step
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode row for each of lanes ``0 .. len(tokens)-1`` (lane j takes ``tokens[j]`` at its slot's
        position); returns fp32 logits ``[lanes, vocab]`` (a device tensor, valid until the next step) and
        advances each lane.

        Raises:
            StepError: no lanes or more than the slots, a token outside the vocabulary, a lane past the largest
                bucket.
        """
        n = len(tokens)
        if not 1 <= n <= self.slots:
            raise StepError(f"a lanes step takes 1..{self.slots} tokens (one per lane), found {n}")
        bad = [t for t in tokens if isinstance(t, bool) or not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise StepError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, found {bad}")
        with torch.cuda.device(self.dev):
            sg = self.prepare(n, self.context_for(n))
            self.scalars.upload(self.pos[:n], [int(t) for t in tokens])
            if not self.use_graphs:
                self.graphs.run(sg)
            elif sg.cuda_graph is None:
                self.graphs.capture(sg)  # its eager run is this step
            else:
                sg.cuda_graph.replay()
        for j in range(n):
            self.pos[j] += 1
        return sg.values["logits"]

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each lane's argmax token (ties to the lower id), on the device, read back in one copy."""
        return argmax_rows(logits, self._chunk).tolist()
