"""The compiled step of a layer split: one :class:`~ds4c.runtime.step.CompiledStep` per shard, chained by
the HC state (docs/layer-split.md, "What a shard owns, and the boundary").

Each shard (``ds4c.shard_plan.ShardPlan``: a contiguous layer range on one device) owns, on its device, its
weights, sequence state, kernel modules, captured CUDA graphs, step-scalar buffer, activation arena and
workspaces; nothing is shared between shards (:meth:`ShardedStep.bound_tensors` lists what each shard's
launches read and write, for the isolation check). Shard 0 embeds the tokens; each shard after it starts
from its ``hc_in`` (bf16 ``[max width, hc, hidden]``), the HC state of the step's rows that the shard before
wrote to its ``hc_out``; the last shard runs the head and returns the logits.

The boundary copy ``hc_out[:q] -> next hc_in[:q]`` is device to device: captured inside the shard's CUDA
graphs when both shards are on one device (a virtual split), otherwise issued after the shard's graph on
its stream (``cudaMemcpyPeerAsync``: over NVLink/PCIe peer access when the devices have it, staged by the
driver otherwise), with an event so that the next device's stream waits for it. Every shard gets the step's
token ids and positions in its own scalar buffer (hash routing reads the ids on any shard).

Verify and rollback work shard by shard: a verify snapshots every shard's state; a rollback of a rejected
suffix restores each shard and replays the accepted rows through the chain (each shard reads the rows the
replayed shard before it hands over).

The host-free decode loop (:meth:`ShardedStep.decode_tokens`) replays per token every shard's q = 1 decode
graph: a shard before the last advances its own step scalars at its end, the last one samples on its device
and writes the id into the token slots of the shards on its device (inside its graph) and, for shards on
other devices, by a device-to-device copy after it; the host only reads the ids back, a few steps behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from ds4c.buckets import BucketSpec
from ds4c.errors import StepError
from ds4c.gguf_file import ModelFile
from ds4c.runtime.artifact_manifest import Artifact, open_artifact
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.step import CompiledStep
from ds4c.shard_plan import ShardPlan, validate


class ShardedStep:
    """The compiled decode/verify step of one model over the shards of ``plan``.

    Args:
        mf, buckets, arch, cache, use_graphs, artifact: as :class:`~ds4c.runtime.step.CompiledStep`
            (every shard serves the same widths and context buckets).
        plan: the layer split (validated against the model); its devices are CUDA devices, a device may
            repeat (a virtual split).
        taps: the DSpark tap layers (spec 5.2(q)), as :class:`~ds4c.runtime.step.CompiledStep`: each shard's
            graphs write the taps of its layers into its own ``tap_ring`` (full width; its columns only);
            :meth:`main_hidden` gathers them.
        record_hc: record the final HC state (spec 7.5's ``X_main``), as :class:`~ds4c.runtime.step.CompiledStep`:
            the last shard's graphs write it (it runs the last layer); :meth:`final_hc` and the rest of the MTP
            drafter's interface forward to it.

    Raises:
        StepError: a non-CUDA plan or a device this machine lacks; ShardPlanError: a plan not matching the model.
    """

    def __init__(self, mf: ModelFile, buckets: BucketSpec, plan: ShardPlan, arch: str = "sm_90",
                 cache: KernelCache | None = None, use_graphs: bool = True, artifact: str | Artifact | None = None,
                 taps: tuple[int, ...] = (), record_hc: bool = False):
        plan = validate(plan, mf.config.n_layers)
        if plan.kind != "cuda":
            raise StepError(f"the compiled step runs on CUDA devices, found the plan {plan.describe()}")
        self.mf, self.cfg, self.buckets, self.plan = mf, mf.config, buckets, plan
        cache = cache or KernelCache()
        artifact = None if artifact is None else open_artifact(artifact)  # loaded and verified once for every shard
        self.shards = [CompiledStep(mf, buckets, arch, cache, use_graphs, artifact, plan=plan, shard=k, taps=taps,
                                    record_hc=record_hc) for k in range(plan.n_shards)]
        self.taps: tuple[int, ...] = self.shards[0].taps
        self.record_hc = bool(record_hc)
        """Whether the last shard's graphs record the final HC state (:meth:`final_hc`)."""
        """The DSpark tap layers every step records (empty: none), in ``main_hidden`` order."""
        self.use_graphs = use_graphs
        # the boundary copies: inside the graphs on one device, else after each shard with an event
        self._cross: list[bool] = []
        for a, b in zip(self.shards, self.shards[1:]):
            same = a.dev == b.dev
            if same:
                a.hand_off_to(b.hc_in)
            else:
                _enable_peer(a.dev, b.dev)
            self._cross.append(not same)
        self._events = [torch.cuda.Event() for _ in self.shards]
        last = self.shards[-1]
        last.token_sinks = [s.token_slot() for s in self.shards[:-1] if s.dev == last.dev]
        self._token_far = [s for s in self.shards[:-1] if s.dev != last.dev]
        self._token_event = torch.cuda.Event()
        self.prepare_stats: dict[str, Any] = {}
        self.memory_plan: Any = None
        """The :class:`~ds4c.runtime.memory_plan.MemoryPlan` checked before it was built (set by
        :func:`ds4c.engine.open_engine`), or None."""
        self._undo: tuple[list[int], int] | None = None

    # -------------------------------------------------------------------------------------- the stepper
    @property
    def max_ctx(self) -> int:
        return self.buckets.max_ctx

    @property
    def pos(self) -> int:
        return self.shards[0].pos

    @property
    def capacity(self) -> int:
        return self.shards[0].capacity

    @property
    def captures(self) -> int:
        return sum(s.captures for s in self.shards)

    @property
    def binary_batches(self) -> int:
        return sum(s.binary_batches for s in self.shards)

    @property
    def load_stats(self) -> dict[str, float]:
        """Weight upload of all shards: total bytes and seconds, and the rate."""
        b = sum(s.load_stats.get("bytes", 0.0) for s in self.shards)
        t = sum(s.load_stats.get("seconds", 0.0) for s in self.shards)
        return {"bytes": b, "seconds": t, "gb_per_s": b / t / 1e9 if t > 0 else 0.0}

    def reset(self) -> None:
        for s in self.shards:
            s.reset()
        self._undo = None

    # the final HC state (spec 7.5): the last shard's
    @property
    def records_final_hc(self) -> bool:
        """Whether the last shard records the final HC state (``record_hc``; the MTP drafter's input)."""
        return self.shards[-1].records_final_hc

    @property
    def final_hc_ring(self) -> torch.Tensor | None:
        """The last shard's :attr:`~ds4c.runtime.step.CompiledStep.final_hc_ring` (on its device), or None."""
        return self.shards[-1].final_hc_ring

    @property
    def final_hc_rows(self) -> torch.Tensor | None:
        return self.shards[-1].final_hc_rows

    def record_final_hc(self, on: bool = True) -> None:
        """The last shard's :meth:`~ds4c.runtime.step.CompiledStep.record_final_hc` (raises the same)."""
        self.shards[-1].record_final_hc(on)

    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        """The final HC states of the committed positions ``start .. stop - 1`` from the last shard: bf16
        ``[stop - start, hc, hidden]`` on its device, a copy (raises as
        :meth:`~ds4c.runtime.step.CompiledStep.final_hc`)."""
        return self.shards[-1].final_hc(start, stop)

    def main_hidden(self, start: int, stop: int) -> torch.Tensor:
        """``main_hidden`` of the committed positions ``start .. stop - 1`` (spec 5.2(q)), gathered from the shards
        that hold the tap layers (tap j's columns from the shard of layer ``taps[j]``): bf16 ``[stop - start,
        len(taps) * hidden]`` on the last shard's device (where the logits are), a copy.

        Raises:
            StepError: no taps, or the range is not committed positions the rings still hold
                (:meth:`~ds4c.runtime.step.CompiledStep.tap_rows`).
        """
        if not self.taps:
            raise StepError("main_hidden: this compiled step records no taps (ShardedStep(..., taps=...))")
        D = self.cfg.hidden_size
        dev = self.shards[-1].dev
        rows = {}
        parts = []
        for j, layer in enumerate(self.taps):
            s = next(s for s in self.shards if s.layers[0] <= layer < s.layers[1])
            if s.shard not in rows:
                rows[s.shard] = s.tap_rows(start, stop)
            parts.append(rows[s.shard][:, j * D:(j + 1) * D].to(dev))
        return torch.cat(parts, dim=1)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every shard's :meth:`~ds4c.runtime.step.CompiledStep.snapshot`, in shard order."""
        return [s.snapshot() for s in self.shards]

    def restore(self, snap: list[dict[str, Any]]) -> None:
        for s, sn in zip(self.shards, snap):
            s.restore(sn)

    def prepare_all(self, widths: tuple[int, ...] | None = None, max_ctx: int | None = None,
                    progress: bool = True) -> dict[str, Any]:
        """Every shard's :meth:`~ds4c.runtime.step.CompiledStep.prepare_all` (graphs, binaries, weights,
        captures; nothing is compiled or captured later). Returns the summed costs and ``shards``: each
        shard's own result with its device and layer range."""
        per = []
        for s, d, r in zip(self.shards, self.plan.devices, self.plan.ranges):
            st = s.prepare_all(widths, max_ctx, progress)
            per.append({"device": d, "layers": list(r), **st})
        out: dict[str, Any] = {k: sum(p[k] for p in per) for k in ("graphs", "build_s", "compile_s", "load_s",
                                                                   "capture_s", "graph_bytes", "weight_bytes")}
        out["weights"] = self.load_stats
        out["capture_ms"] = {k: sum(p["capture_ms"].get(k, 0.0) for p in per) for k in per[0]["capture_ms"]}
        out["shards"] = per
        self.prepare_stats = out
        return out

    def step(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Run ``len(tokens)`` rows at ``pos..`` through every shard; returns the last shard's fp32 logits
        [q, vocab] (on its device, valid until its next step of the same width and bucket).

        Raises:
            StepError: as :meth:`~ds4c.runtime.step.CompiledStep.step`.
        """
        q = len(tokens)
        for k, s in enumerate(self.shards):
            if k and self._cross[k - 1]:
                with torch.cuda.device(s.dev):
                    torch.cuda.current_stream().wait_event(self._events[k - 1])
            out = s.step(tokens, pos)
            if k + 1 < len(self.shards) and self._cross[k]:
                nxt = self.shards[k + 1]
                with torch.cuda.device(s.dev):
                    nxt.hc_in[:q].copy_(s.hc_out[:q], non_blocking=True)
                    self._events[k].record()
        return out

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1). Returns fp32 logits [1, vocab]."""
        return self.step([token], pos)

    def verify(self, tokens: list[int], pos: int) -> torch.Tensor:
        """A verify step that can be rolled back on every shard. Returns fp32 logits [q, vocab]."""
        for s in self.shards:
            with torch.cuda.device(s.dev):
                s.arm_undo(tokens, pos)
        self._undo = (list(tokens), pos)
        return self.step(tokens, pos)

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last :meth:`verify` on every shard. A verify of q >= 2 rows:
        each shard's own rollback kernel (nothing crosses a boundary: every shard saved what it overwrote). A
        q = 1 verify: every shard's snapshot restored, then the accepted row replayed through the chain.

        Raises:
            StepError: no verify to roll back, or ``accepted`` outside 0..q.
        """
        if self._undo is None:
            raise StepError("rollback: no verify step to roll back")
        tokens, pos = self._undo
        if not 0 <= accepted <= len(tokens):
            raise StepError(f"rollback: accepted must be in 0..{len(tokens)}, found {accepted}")
        self._undo = None
        if accepted == len(tokens) or all(s.sequence.undo[0] == "kernel" for s in self.shards):
            for s in self.shards:
                s.rollback(accepted)
            return
        for s in self.shards:
            s.restore(s.sequence.undo[1])
            s.sequence.undo = None
        if accepted:
            self.step(tokens[:accepted], pos)

    def decode_tokens(self, token: int, pos: int, n: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, lag: int = 4) -> Iterator[int]:
        """Decode ``n`` tokens after ``token`` (at ``pos``) through every shard with sampling on the last
        shard's device, host-free (module docstring): the split's form of
        :meth:`~ds4c.runtime.step.CompiledStep.decode_tokens`, the same ids for the same seed.

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past ``max_ctx``, ``use_graphs``
                off.
        """
        if not self.use_graphs:
            raise StepError("decode_tokens needs use_graphs=True")
        if pos != self.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.pos}")
        if pos + n > self.max_ctx:
            raise StepError(f"positions {pos}..{pos + n - 1} exceed max_ctx={self.max_ctx}")
        if n <= 0:
            return
        lag = max(1, min(int(lag), 32))
        mode = "greedy" if temperature == 0 else "sample"
        last = self.shards[-1]
        with torch.cuda.device(last.dev):
            sampler = last.loop.sampler()
            sampler.configure(temperature, top_k, top_p, seed)
            host, done = last.loop.ring_host
        ring = sampler.ring_size
        contexts = [self.buckets.bucket(pos + i, 1) for i in range(n)]
        graphs = []
        for s in self.shards:
            with torch.cuda.device(s.dev):
                m = mode if s.is_last else "advance"
                by_c = {c: s.loop.graph(c, m) for c in sorted(set(contexts))}  # captured by prepare_all
                graphs.append([by_c[c] for c in contexts])
                s.scalars.upload([token], pos)
        launched = consumed = 0
        try:
            while consumed < n:
                while launched < n and launched - consumed < lag:
                    i = launched
                    for k, s in enumerate(self.shards):
                        with torch.cuda.device(s.dev):
                            if k == 0 and i and self._token_far:
                                torch.cuda.current_stream().wait_event(self._token_event)
                            if k and self._cross[k - 1]:
                                torch.cuda.current_stream().wait_event(self._events[k - 1])
                            graphs[k][i].replay()
                            if k + 1 < len(self.shards) and self._cross[k]:
                                self.shards[k + 1].hc_in[:1].copy_(s.hc_out[:1], non_blocking=True)
                                self._events[k].record()
                    with torch.cuda.device(last.dev):
                        for far in self._token_far:
                            far.token_slot().copy_(last.token_slot(), non_blocking=True)
                        if self._token_far:
                            self._token_event.record()
                        slot = i % ring
                        host[slot:slot + 1].copy_(sampler.ring[slot:slot + 1], non_blocking=True)
                        done[slot].record()
                    launched += 1
                slot = consumed % ring
                with torch.cuda.device(last.dev):
                    done[slot].synchronize()
                consumed += 1
                yield int(host[slot])
        finally:
            for s in self.shards:
                s.pos = pos + launched

    def time_replays(self, tokens: list[int], pos: int, repeats: int = 50) -> float:
        """Median milliseconds of the whole split step (every shard's graph and the boundary copies) replayed
        ``repeats`` times back to back, CUDA events on the first shard's and the last shard's devices; the
        state is restored afterwards.

        Raises:
            StepError: as :meth:`step`, or ``use_graphs`` is off.
        """
        if not self.use_graphs:
            raise StepError("time_replays needs use_graphs=True")
        snap = self.snapshot()
        self.step(tokens, pos)  # uploads the scalars; captures on first use
        self.restore(snap)
        first, last = self.shards[0], self.shards[-1]
        if first.dev != last.dev:  # CUDA events of two devices cannot be compared: host timing
            return _host_ms(self, tokens, pos, repeats)
        ts = []
        for _ in range(repeats):
            with torch.cuda.device(first.dev):
                a = torch.cuda.Event(enable_timing=True)
                a.record()
            self._replay(len(tokens), pos)
            with torch.cuda.device(last.dev):
                b = torch.cuda.Event(enable_timing=True)
                b.record()
            ts.append((a, b))
        for s in self.shards:
            with torch.cuda.device(s.dev):
                torch.cuda.synchronize()
        self.restore(snap)
        ms = sorted(a.elapsed_time(b) for a, b in ts)
        return ms[len(ms) // 2]

    def _replay(self, q: int, pos: int) -> None:
        """Replay every shard's captured graph of (q, bucket of pos) with the boundary copies, no uploads."""
        for k, s in enumerate(self.shards):
            with torch.cuda.device(s.dev):
                if k and self._cross[k - 1]:
                    torch.cuda.current_stream().wait_event(self._events[k - 1])
                s.graphs.by_key[(q, s.buckets.bucket(pos, q))].cuda_graph.replay()
                if k + 1 < len(self.shards) and self._cross[k]:
                    self.shards[k + 1].hc_in[:q].copy_(s.hc_out[:q], non_blocking=True)
                    self._events[k].record()

    # ------------------------------------------------------------------------------------------ checks
    def bound_tensors(self) -> list[list[torch.Tensor]]:
        """Per shard, every tensor its prepared graphs' launches and rollback kernels are bound to (weights, state,
        arena views, workspaces incl. the undo saves, step scalars, hc_in / hc_out, logits): for checking that shards share no memory and that
        each shard's tensors are on its device."""
        out = []
        for s in self.shards:
            bound = [b for sg in s.graphs.by_key.values() for b in sg.launches + ([sg.rollback] if sg.rollback else [])]
            ts = [a for b in bound for a in b.args if isinstance(a, torch.Tensor)]
            ts += [t for t in (s.hc_in, s.hc_out, s.graphs.logits, s.scalars.buffer) if t is not None]
            out.append(ts)
        return out


def _enable_peer(a: torch.device, b: torch.device) -> None:
    """Peer access between two devices both ways when the hardware offers it (boundary copies then go over
    NVLink/PCIe directly; without it the driver stages them)."""
    try:
        if torch.cuda.can_device_access_peer(a.index, b.index):
            for x, y in ((a, b), (b, a)):
                with torch.cuda.device(x):
                    try:
                        torch.cuda.cudart().cudaDeviceEnablePeerAccess(y.index, 0)
                    except Exception:  # already enabled, or not offered by this torch build
                        pass
    except (RuntimeError, AttributeError):
        pass


def _host_ms(step: ShardedStep, tokens: list[int], pos: int, repeats: int) -> float:
    """Milliseconds per replay of a split over several devices, timed on the host around synchronized runs
    (CUDA events of two devices cannot be compared)."""
    snap = step.snapshot()
    devs = {s.dev for s in step.shards}
    t0 = time.perf_counter()
    for _ in range(repeats):
        step._replay(len(tokens), pos)
    for d in devs:
        with torch.cuda.device(d):
            torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / repeats * 1e3
    step.restore(snap)
    return dt


def free_memory(devices: list[str]) -> list[int]:
    """Free bytes of each CUDA device of ``devices`` now (``cudaMemGetInfo``); a device listed n times (a
    virtual split) offers each of its shards 1/n of it."""
    counts: dict[str, int] = {}
    norm = [str(torch.device(d if d != "cuda" else f"cuda:{torch.cuda.current_device()}")) for d in devices]
    for d in norm:
        counts[d] = counts.get(d, 0) + 1
    out = []
    for d in norm:
        free, _total = torch.cuda.mem_get_info(torch.device(d))
        out.append(free // counts[d])
    return out
