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

Graphs hold a fixed set of lane counts (:attr:`LanesStep.sizes`: powers of two up to the slots, and the slots): a
step of ``n`` running lanes replays the smallest size ``>= n``; the padding lanes run on free slots (position 0, token
0; a slot is overwritten whole when a sequence is installed) and their rows are never read. :meth:`LanesStep.warm`
builds and captures every (size, bucket) graph ahead, so serving compiles nothing after start.

Sampling per lane on the device (:meth:`LanesStep.configure`, :meth:`LanesStep.next_tokens`): one
:class:`~ds4c.runtime.sampler.DeviceSampler` per slot with its request's temperature, top-k, top-p and seed, the
greedy lanes by one argmax over the rows; a lane's draws are those the one-sequence device loop
(``CompiledStep.decode_tokens``) makes for the same request (same rule, same counter-based noise, same rows).

A prompt beside the decode lanes (``prompt_rows`` P > 0; :meth:`LanesStep.decode_beside`): graphs with one more lane
of P rows after the decode lanes, bound to a slot of its own (the *prompt slot*, index ``slots``), which the prompt
being prefilled holds; P of its tokens per step, on the weights the decode rows read anyway, so the decoding
sequences' next token waits one slightly wider step instead of a prefill chunk. :meth:`LanesStep.move` hands the
finished prompt's state to a decode slot.

Not yet: verify rows inside a lanes step (the IR and lowering take them, the runtime has no lanes rollback), page
tables (a slot holds the sequence's whole capacity; the reference's paged pool, ds4c.reference.paged, is where the
pages live; ds4c.batch_slots keeps prefixes as slot snapshots).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch

from ds4c import settings
from ds4c.errors import StepError
from ds4c.ir import build_step
from ds4c.ir.builder import MAX_LANE_ROWS, MAX_WIDTH, lane_state_name, state_inputs
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.sampler import DeviceSampler, argmax_chunk, argmax_rows
from ds4c.runtime.step.binding import DTYPES, StepGraph
from ds4c.runtime.step.graphs import StepGraphs
from ds4c.runtime.step.lane_batch import batch_lanes


class LaneScalars:
    """The lanes step buffer: ``positions`` [rows], ``tokens`` [rows] (a row per decode lane, then a prompt lane's
    rows) and ``lane{j}.live_r{r}`` per lane and ratio; written through a pinned host copy and uploaded in one copy
    per step."""

    def __init__(self, cfg: Any, lanes: int, rows: int, dev: torch.device):
        self.ratios = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r})
        off = {"positions": 0, "tokens": rows}
        k = 2 * rows
        for j in range(lanes):
            for r in self.ratios:
                off[lane_state_name(j, f"live_r{r}")] = k
                k += 1
        self.offsets = off
        self.host = torch.zeros(k, dtype=torch.int64).pin_memory()
        self._np = self.host.numpy()
        self.buffer = torch.zeros(k, dtype=torch.int64, device=dev)
        self._done = torch.cuda.Event()

    def upload(self, positions: list[int], tokens: list[int], prompt: tuple[int, list[int]] | None = None) -> None:
        """Lane j decodes ``tokens[j]`` at ``positions[j]`` (the decode lanes of the graph, padding included);
        ``prompt`` = (first position, tokens): the prompt lane after them, its rows at consecutive positions."""
        self._done.synchronize()  # the previous upload has left the pinned buffer
        a, off, n = self._np, self.offsets, len(positions)
        a[off["positions"]:off["positions"] + n] = positions
        a[off["tokens"]:off["tokens"] + n] = tokens
        for j, p in enumerate(positions):
            for r in self.ratios:
                a[off[lane_state_name(j, f"live_r{r}")]] = (p + 1) // r
        if prompt is not None:
            p0, toks = prompt
            q = len(toks)
            a[off["positions"] + n:off["positions"] + n + q] = range(p0, p0 + q)
            a[off["tokens"] + n:off["tokens"] + n + q] = toks
            for r in self.ratios:
                a[off[lane_state_name(n, f"live_r{r}")]] = (p0 + q) // r
        self.buffer.copy_(self.host, non_blocking=True)
        self._done.record()


class LanesStep:
    """Decode lanes over ``slots`` sequence slots, on a one-sequence :class:`CompiledStep`'s weights, kernel cache
    and device (an unsplit step with no taps or final-HC recording).

    Args:
        step: the one-sequence compiled step (its prefill fills a sequence before :meth:`install`).
        slots: the most sequences decoding together (1..16: the lanes step's row budget).
        use_graphs: capture each (lanes, bucket) graph on its first step and replay it.
        prompt_rows: P > 0: graphs with a prompt lane of P rows beside the decode lanes (module docstring), for
            the decode lane counts whose padded size leaves P rows of the budget (:attr:`prompt_sizes`); 0: none.

    Raises:
        StepError: a split step, a step with taps or final-HC recording, slots outside 1..16 or prompt_rows
            outside 0..5.
    """

    def __init__(self, step: Any, slots: int = 8, use_graphs: bool = True, prompt_rows: int = 0):
        if step.is_split or step.taps or step.record_hc:
            raise StepError("lanes run on an unsplit compiled step without taps or final-HC recording")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_LANE_ROWS:
            raise StepError(f"slots must be in 1..{MAX_LANE_ROWS}, found {slots!r}")
        if isinstance(prompt_rows, bool) or not isinstance(prompt_rows, int) or not 0 <= prompt_rows <= MAX_WIDTH:
            raise StepError(f"prompt_rows must be in 0..{MAX_WIDTH}, found {prompt_rows!r}")
        self.step, self.cfg, self.slots, self.use_graphs = step, step.cfg, slots, use_graphs
        self.dev = step.dev
        self.sizes = tuple(sorted({1 << k for k in range(5) if 1 << k < slots} | {slots}))
        self.prompt_rows = prompt_rows
        #: the prompt slot (index ``slots``), None without a prompt lane
        self.prompt_slot = slots if prompt_rows else None
        #: decode lane count -> the padded size of a graph with the prompt lane (None: no such graph); while a
        #: prompt is prefilled at most slots - 1 sequences decode
        self._prompt_size = {n: self._fit_prompt(n) for n in range(1, slots)} if prompt_rows else {}
        #: the decode sizes of the graphs with a prompt lane
        self.prompt_sizes = tuple(sorted({s for s in self._prompt_size.values() if s is not None}))
        rows = max([slots] + [s + prompt_rows for s in self.prompt_sizes])
        specs = state_inputs(self.cfg, step.capacity)
        n_slots = slots + bool(prompt_rows)
        with torch.cuda.device(self.dev):
            # each state buffer of every slot in one tensor [slots, ...]: slot j's is a view, so a lane's buffers
            # sit a constant stride from the next lane's (lane batching binds them so)
            stacked = {k: torch.empty((n_slots,) + tuple(t.shape), dtype=DTYPES[t.dtype], device=self.dev)
                       for k, t in specs.items()}
            self.slot_state: list[dict[str, torch.Tensor]] = [{k: v[j] for k, v in stacked.items()}
                                                              for j in range(n_slots)]
            for j in range(len(self.slot_state)):
                self.reset(j)
            self.pos = [0] * len(self.slot_state)
            self.scalars = LaneScalars(self.cfg, len(self.slot_state), rows, self.dev)
            self.samplers = [DeviceSampler(self.cfg.vocab_size, self.dev) for _ in range(slots)]
            self.tokens_host = torch.zeros(slots, dtype=torch.int64).pin_memory()
            bound = {lane_state_name(j, k): t for j, st in enumerate(self.slot_state) for k, t in st.items()}
            g = step.graphs
            self.graphs = StepGraphs(
                cfg=self.cfg, buckets=SimpleNamespace(widths=(rows,), contexts=step.buckets.contexts),
                capacity=step.capacity, layers=step.layers, split=False, shard=0, taps=(), record_hc=False,
                prefill_chunks=(), types=g.types, target=g.target, cache=g.cache, manifest=None, artifact=None,
                programmatic=g.programmatic, weights=step.weights, state=bound, scalars=self.scalars,
                is_first=True, is_last=True, dev=self.dev)
            # each lane's attention, compressor, indexer and ring write side by side (settings.lane_streams), or
            # as one launch per kernel over the lanes (settings.lane_batch)
            self.graphs.lane_streams = slots if settings.lane_streams() else 0
        self.lane_batch = settings.lane_batch()
        self._chunk = argmax_chunk(self.cfg.vocab_size)
        self.temperature = [0.0] * slots  # per slot, host side: which lanes draw (> 0) and which take the argmax

    def _fit_prompt(self, n: int) -> int | None:
        """The padded decode size of a step of ``n`` decode lanes and the prompt lane: the smallest lane size >= n
        that leaves the prompt its rows, else ``n`` rounded up to the largest count that does (None: none)."""
        room = MAX_LANE_ROWS - self.prompt_rows
        size = next((s for s in self.sizes if s >= n and s <= room), None)
        return size if size is not None else (min(room, self.slots) if n <= room else None)

    def prompt_size_for(self, lanes: int) -> int | None:
        """The decode size of the graph a step of ``lanes`` decode lanes and the prompt lane replays (None: no such
        graph: the prompt lane is off or the lanes leave it no rows)."""
        return self._prompt_size.get(lanes)

    # ------------------------------------------------------------------------------------------ slots
    def reset(self, slot: int) -> None:
        """Slot ``slot`` back to an empty sequence (KV 0, compressor scores -inf)."""
        for name, t in self.slot_state[slot].items():
            t.fill_(float("-inf") if name.endswith("_score") else 0)

    def poison(self, slot: int) -> None:
        """Fill slot ``slot``'s state with NaN (tests: a read of a slot no sequence holds shows)."""
        self._check_slot(slot)
        with torch.cuda.device(self.dev):
            for t in self.slot_state[slot].values():
                t.fill_(float("nan"))

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
        """Copy slot ``src``'s sequence into slot ``dst`` (compaction when a sequence leaves; the prompt slot's into a
        decode slot when its prompt is in)."""
        self._check_slot(src)
        self._check_slot(dst, prompt=False)
        with torch.cuda.device(self.dev):
            for name, t in self.slot_state[dst].items():
                t.copy_(self.slot_state[src][name])
            if src != self.prompt_slot:  # the prompt slot has no sampler: :meth:`configure` sets the slot's
                a, b = self.samplers[src], self.samplers[dst]
                for k in ("temperature", "top_k", "top_p", "seed", "counter"):
                    getattr(b, k).copy_(getattr(a, k))
                self.temperature[dst] = self.temperature[src]
        self.pos[dst] = self.pos[src]

    def save(self, slot: int) -> dict[str, Any]:
        """A device copy of slot ``slot``'s sequence, in the one-sequence step's snapshot form (``pos``,
        ``tap_end``, ``state``): ``CompiledStep.restore`` takes it (a prefix a later prompt starts from)."""
        self._check_slot(slot)
        with torch.cuda.device(self.dev):
            state = {k: v.clone() for k, v in self.slot_state[slot].items()}
        return {"pos": self.pos[slot], "tap_end": self.pos[slot], "state": state}

    def configure(self, slot: int, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """The sampling of slot ``slot``'s sequence from its next step on (its draw counter restarts at 0, as the
        one-sequence device loop's does after the first token)."""
        self._check_slot(slot, prompt=False)
        with torch.cuda.device(self.dev):
            self.samplers[slot].configure(temperature, top_k, top_p, seed)
        self.temperature[slot] = float(temperature)

    def _check_slot(self, slot: int, prompt: bool = True) -> None:
        """A decode slot (0 .. slots-1), or with ``prompt`` also the prompt slot."""
        n = self.slots + bool(prompt and self.prompt_slot is not None)
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < n:
            raise StepError(f"slot must be in 0..{n - 1}, found {slot!r}")

    # ------------------------------------------------------------------------------------------ graphs
    def context_for(self, lanes: int, prompt: int = 0) -> int:
        """The context bucket a step of lanes ``0 .. lanes-1`` (and ``prompt`` rows of the prompt slot) needs (their
        furthest position's)."""
        end = max(self.pos[:lanes]) + 1
        if prompt:
            end = max(end, self.pos[self.prompt_slot] + prompt)
        for c in self.step.buckets.contexts:
            if end <= c:
                return c
        raise StepError(f"a lane at position {end - 1} is past the largest context bucket "
                        f"{self.step.buckets.contexts[-1]}")

    def size_for(self, lanes: int) -> int:
        """The lane count of the graph a step of ``lanes`` running lanes replays (the smallest size holding them)."""
        return next(n for n in self.sizes if n >= lanes)

    def warm(self, contexts: tuple[int, ...] | None = None) -> float:
        """Build, compile and capture the graph of every lane size at every context bucket (default: all of the
        step's) now, so no step compiles or captures later; every slot is reset afterwards (the captures' eager
        runs write them). Returns the seconds it took."""
        t0 = time.perf_counter()
        with torch.cuda.device(self.dev):
            for c in contexts or self.step.buckets.contexts:
                for n, p in [(n, 0) for n in self.sizes] + [(n, self.prompt_rows) for n in self.prompt_sizes]:
                    sg = self.prepare(n, c, p)
                    if self.use_graphs and sg.cuda_graph is None:
                        self.scalars.upload([0] * n, [0] * n, (0, [0] * p) if p else None)
                        self.graphs.capture(sg)
            torch.cuda.synchronize()
            for j in range(len(self.slot_state)):
                self.reset(j)
        self.pos = [0] * len(self.slot_state)
        return time.perf_counter() - t0

    def prepare(self, lanes: int, context: int, prompt: int = 0) -> StepGraph:
        """The graph of ``lanes`` decode lanes (and with ``prompt`` = :attr:`prompt_rows`, the prompt lane after
        them, bound to the prompt slot) at ``context``, built, lowered, compiled (kernel cache) and bound once."""
        key = (lanes, context, prompt) if prompt else (lanes, context)
        sg = self.graphs.by_key.get(key)
        if sg is not None:
            return sg
        if not 1 <= lanes <= self.slots or context not in self.step.buckets.contexts \
                or (prompt and (prompt != self.prompt_rows or lanes not in self.prompt_sizes)):
            raise StepError(f"no lanes graph for (lanes {lanes}, context {context}, prompt rows {prompt}): lanes "
                            f"1..{self.slots}, contexts {list(self.step.buckets.contexts)}, a prompt lane of "
                            f"{self.prompt_rows} rows beside {list(self.prompt_sizes)} lanes")
        shape = (1,) * lanes + ((prompt,) if prompt else ())
        g = run_pipeline(build_step(self.cfg, sum(shape), self.step.capacity, lanes=shape), "default",
                         context=context).graph
        kernels = lower_graph(g, self.cfg, self.graphs.target, self.graphs.types)
        if self.lane_batch:
            kernels = batch_lanes(kernels)
        binaries = self.graphs.binaries([(key, kernels)], progress=False)[0]
        state = self.graphs.state
        if prompt:  # lane ``lanes`` is the prompt slot's
            state = dict(state)
            state.update({lane_state_name(lanes, k): t for k, t in self.slot_state[self.prompt_slot].items()})
        return self.graphs.bind(sum(shape), context, g, kernels, binaries, key=key, state=state)

    # ------------------------------------------------------------------------------------------ step
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode row for each of lanes ``0 .. len(tokens)-1`` (lane j takes ``tokens[j]`` at its slot's
        position); returns fp32 logits ``[lanes, vocab]`` (a device tensor, valid until the next step) and
        advances each lane.

        Raises:
            StepError: no lanes or more than the slots, a token outside the vocabulary, a lane past the largest
                bucket.
        """
        return self.decode_beside(tokens)[0]

    def decode_beside(self, tokens: list[int], prompt: list[int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`decode`, and with ``prompt`` (:attr:`prompt_rows` token ids) the next rows of the sequence in the
        prompt slot in the same step. Returns the decode lanes' logits ``[lanes, vocab]`` and the prompt's last
        row's ``[1, vocab]`` (None without a prompt); both device tensors valid until the next step.

        Raises:
            StepError: as :meth:`decode`; a prompt of another row count than :attr:`prompt_rows`, or beside more
                decode lanes than a prompt graph holds (:meth:`prompt_size_for`).
        """
        n = len(tokens)
        if not 1 <= n <= self.slots:
            raise StepError(f"a lanes step takes 1..{self.slots} tokens (one per lane), found {n}")
        p = 0 if prompt is None else len(prompt)
        bad = [t for t in list(tokens) + list(prompt or ())
               if isinstance(t, bool) or not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise StepError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, found {bad}")
        tokens, prompt = [int(t) for t in tokens], None if prompt is None else [int(t) for t in prompt]
        if prompt is not None:
            size = self.prompt_size_for(n)
            if not self.prompt_rows or p != self.prompt_rows or size is None:
                raise StepError(f"a prompt lane takes {self.prompt_rows} rows beside at most "
                                f"{max(self._prompt_size, default=0)} decode lanes; found {p} rows beside {n}")
        else:
            size = self.size_for(n)
        with torch.cuda.device(self.dev):
            sg = self.prepare(size, self.context_for(n, p), p)
            pad = size - n  # padding lanes on free slots: position 0, token 0, rows never read
            self.scalars.upload(self.pos[:n] + [0] * pad, list(tokens) + [0] * pad,
                                (self.pos[self.prompt_slot], list(prompt)) if p else None)
            if not self.use_graphs:
                self.graphs.run(sg)
            elif sg.cuda_graph is None:
                self.graphs.capture(sg)  # its eager run is this step
            else:
                sg.cuda_graph.replay()
        for j in range(n):
            self.pos[j] += 1
        logits = sg.values["logits"]
        if not p:
            return logits[:n], None
        self.pos[self.prompt_slot] += p
        return logits[:n], logits[size + p - 1:size + p]

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each lane's argmax token (ties to the lower id), on the device, read back in one copy."""
        return argmax_rows(logits, self._chunk).tolist()

    def next_tokens(self, logits: torch.Tensor) -> list[int]:
        """Each lane's next token from its logits row (:meth:`decode`'s ``[lanes, vocab]``) by its slot's sampling
        (:meth:`configure`): the argmax for greedy lanes, a draw of the slot's device sampler for the others;
        read back in one copy."""
        n = logits.shape[0]
        with torch.cuda.device(self.dev):
            ids = argmax_rows(logits, self._chunk)
            for j in range(n):
                if self.temperature[j] > 0:
                    ids[j:j + 1] = self.samplers[j].sample(logits[j])
            host = self.tokens_host[:n]
            host.copy_(ids)  # synchronous: the ids are needed now
        return host.tolist()
