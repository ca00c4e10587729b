"""The compiled step on a CUDA GPU: weights and state on the device, one launch list per (width, context bucket),
captured as a CUDA graph on first use and replayed after.

Per-step scalars (position, row positions, token ids, live lengths) live in one int64 device buffer that the
kernels read; a step uploads them in one copy, so a captured graph replays with new values. A step whose
(width, bucket) has no compiled graph is an error naming the key; there is no fallback.

:class:`CompiledStep` is a facade over parts with one job each:

* :mod:`~ds4c.runtime.step.weights`: the weights on the device, uploaded in the forms the kernels read;
* :mod:`~ds4c.runtime.step.graphs`: build, lower, binaries, activation arena, binding, CUDA graph capture;
* :mod:`~ds4c.runtime.step.scalars`: the per-step scalar buffer and its uploads;
* :mod:`~ds4c.runtime.step.sequence`: the per-sequence state (window rings, compressor and indexer state, the
  drafters' tap and final HC rings, position, rollback journal): allocate, reset, snapshot, restore;
* :mod:`~ds4c.runtime.step.driver`: the step and prefill drivers;
* :mod:`~ds4c.runtime.step.verify`: verify, rollback and the greedy acceptance on the device;
* :mod:`~ds4c.runtime.step.decode_loop`: device sampling and the host-free decode loop;
* :mod:`~ds4c.runtime.step.timing`: launch and replay timings.

Data flows one way: the step consumes the lowering (runtime/lower.py), the kernel cache and the model file; nothing
upstream imports it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ds4c import settings
from ds4c.buckets import BucketSpec, check_prefill_chunks
from ds4c.errors import StepError
from ds4c.gguf_file import ModelFile
from ds4c.ir.builder import check_layers, check_taps
from ds4c.runtime.artifact_manifest import Artifact, open_artifact
from ds4c.runtime.artifact_serve import check_serves
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.launch import CudaModule
from ds4c.runtime.spec_pipeline import GreedyPipeline, pipeline
from ds4c.runtime.step.binding import StepGraph
from ds4c.runtime.step.decode_loop import DecodeLoop
from ds4c.runtime.step.driver import StepDriver
from ds4c.runtime.step.graphs import StepGraphs
from ds4c.runtime.step.scalars import StepScalars
from ds4c.runtime.step.sequence import StepSequence
from ds4c.runtime.step.timing import time_launches, time_replays
from ds4c.runtime.step.verify import Verifier
from ds4c.runtime.step.weights import StepWeights
from ds4c.runtime.targets import Target, target
from ds4c.shard_plan import ShardPlan, validate


def _on_device(fn: Any) -> Any:
    """Run a :class:`CompiledStep` method with the step's device current (its launches, allocations, events
    and graph captures belong to that device). A pipelined speculative request that still has steps queued
    (one left unfinished and not closed, e.g. a token stream no longer read) is ended first: its queued step
    waits on a host flag, and anything enqueued behind it would wait forever."""

    @functools.wraps(fn)
    def wrapped(self: "CompiledStep", *args: Any, **kwargs: Any) -> Any:
        pipe = self.verifier.pipeline
        if pipe is not None and pipe.busy:
            pipe.abandon()
        with torch.cuda.device(self.dev):
            return fn(self, *args, **kwargs)

    return wrapped


def device_arch() -> str:
    """The CUDA arch name of the current device (runtime only; AOT never calls this)."""
    major, minor = torch.cuda.get_device_capability()
    return {(8, 0): "sm_80", (9, 0): "sm_90", (10, 0): "sm_100a"}.get((major, minor), f"sm_{major}{minor}")


class CompiledStep:
    """The compiled decode/verify step of one model on one CUDA GPU.

    A facade over its parts, one job each (module docstring): :attr:`weights`
    (:class:`~ds4c.runtime.step.weights.StepWeights`), :attr:`graphs` (:class:`~ds4c.runtime.step.graphs.StepGraphs`),
    :attr:`scalars` (:class:`~ds4c.runtime.step.scalars.StepScalars`), :attr:`sequence` (the per-sequence state,
    :class:`~ds4c.runtime.step.sequence.StepSequence`), :attr:`driver` (:class:`~ds4c.runtime.step.driver.StepDriver`),
    :attr:`verifier` (:class:`~ds4c.runtime.step.verify.Verifier`) and :attr:`loop`
    (:class:`~ds4c.runtime.step.decode_loop.DecodeLoop`). It satisfies :class:`ds4c.engine_protocol.CompiledEngine`
    and, unsplit, every capability of :mod:`ds4c.engine_protocol`.

    Args:
        mf: the model file (weights are uploaded as the kernels read them).
        buckets: widths and context buckets to serve; ``buckets.max_ctx`` sizes the state.
        arch: the CUDA arch to compile for (e.g. ``sm_90``).
        cache: the kernel cache (compiles what is missing; an AOT-filled cache compiles nothing).
        use_graphs: capture one CUDA graph per (width, bucket) on first use and replay it.
        artifact: an artifact folder from ``ds4c compile``, or the :class:`~ds4c.runtime.artifact_manifest.Artifact`
            the caller opened (its manifest is then not loaded and verified again): binaries come from it and
            nothing is compiled. It must serve this model (``ds4c.runtime.artifact_serve.check_serves``: config,
            ``buckets`` and weight formats equal, and it holds the chunk graphs of every size in ``prefill_chunks``: ``ds4c compile
            --prefill``); a missing arch or (width, bucket) graph raises ArtifactError.
        plan, shard: shard ``shard`` of the layer split ``plan`` (``ds4c.shard_plan.ShardPlan``;
            ``ds4c.runtime.sharded.ShardedStep`` chains the shards): only the layers ``plan.ranges[shard]`` --
            their weights, state and kernels -- on the device ``plan.devices[shard]``. A shard after the first
            reads the incoming HC state from :attr:`hc_in` (bf16 ``[max width, hc, hidden]``, rows ``[:q]`` per
            step); one before the last writes its outgoing HC state to :attr:`hc_out` and has no logits and no
            sampler. None: the whole model on the current CUDA device. Every entry point selects the step's
            device, so shards on several GPUs each run on their own.
        taps: the DSpark tap layers (spec 5.2(q); the drafter file's target layers, in its order, e.g. the official
            ``(40, 41, 42)``; ``ds4c.ir.builder.check_taps``). Every step graph (each width and bucket, verify and
            decode, the decode-loop graphs) then writes, for each of its rows at position t, ``main_hidden(t)``
            (bf16 ``[len(taps) * hidden]``) into row ``t % window`` of :attr:`tap_ring`; :meth:`main_hidden` reads
            the committed ones. A shard writes the columns of the tap layers it holds (a shard holding none has no
            ring). Empty (the default): no tap kernel, the graphs are those of a step without taps.
        record_hc: record the final HC state (spec 7.5's ``X_main``, the MTP drafter's input: the HC streams after
            the last layer, before the HC head, bf16 ``[hc, hidden]``) of every step row: each graph that holds
            the last layer (the whole model; of a split, the last shard's) then writes row
            ``t % (window + MAX_WIDTH)`` of :attr:`final_hc_ring` (one copy-mode kernel of the tap family);
            :meth:`final_hc` reads the committed ones (:attr:`records_final_hc`). False (the default): the graphs
            are those of a step without it.
        prefill_chunks: the prefill chunk graphs' row counts C (issue 12; each in ``MIN_PREFILL_CHUNK ..
            MAX_PREFILL_ROWS``, e.g. ``(256, 2048)``): :meth:`prefill` then ingests a prompt in chunks of these
            sizes (the last one padded, masked by ``n_valid``; a tail under ``MIN_PREFILL_CHUNK`` rows as verify
            steps), one graph per chunk size and context bucket, built from ``build_step(..., prefill=True)``
            (docs/prefill.md). Empty (the default): :meth:`prefill` runs verify steps of the widest width.
            Not with a layer split (its chunk graphs are not built); with taps or ``record_hc`` the chunk graphs
            write the tap / final HC rings as token-wise decoding leaves them (``TapSpec.valid``). With an
            ``artifact``, the chunk graphs (keys ``p{C}_c{context}``) come from it: it must have been compiled
            with these chunk sizes or more (``ds4c compile --prefill``).

    Raises:
        StepError: no CUDA device; taps that are not distinct layer ids; prefill chunk sizes out of range, or
            asked for with a layer split.
        ArtifactError: the artifact is corrupt or edited, or does not serve this model (the first tensor whose
            format differs is named), or was compiled with other taps or another ``record_hc``, or lacks chunk
            graphs of ``prefill_chunks`` (what it holds and what was asked).
    """

    def __init__(self, mf: ModelFile, buckets: BucketSpec, arch: str = "sm_90", cache: KernelCache | None = None,
                 use_graphs: bool = True, artifact: str | Artifact | None = None, plan: ShardPlan | None = None,
                 shard: int = 0, taps: tuple[int, ...] = (), record_hc: bool = False,
                 prefill_chunks: tuple[int, ...] = ()):
        self.taps: tuple[int, ...] = check_taps(mf.config, taps)
        """The DSpark tap layers every step records (empty: none), in ``main_hidden`` order."""
        self.record_hc = bool(record_hc)
        """Whether the graphs record the final HC state (the split-wide option: only a graph holding the last
        layer writes it; :attr:`records_final_hc`)."""
        if not torch.cuda.is_available():
            raise StepError("the compiled step needs a CUDA device (torch.cuda.is_available() is False)")
        self.mf, self.cfg, self.buckets = mf, mf.config, buckets
        self.plan = None if plan is None else validate(plan, mf.config.n_layers)
        self.shard = int(shard)
        if self.plan is not None and not 0 <= self.shard < self.plan.n_shards:
            raise StepError(f"shard {shard}: the plan {self.plan.describe()} has shards 0..{self.plan.n_shards - 1}")
        device = "cuda" if self.plan is None else self.plan.devices[self.shard]
        self.layers = check_layers(mf.config, None if self.plan is None else self.plan.ranges[self.shard])
        self.is_first, self.is_last = self.layers[0] == 0, self.layers[1] == mf.config.n_layers
        self.is_split = not (self.is_first and self.is_last)
        """A shard of a layer split (not the whole model)."""
        self.local_taps = tuple(l for l in self.taps if self.layers[0] <= l < self.layers[1])
        """The tap layers this step's graphs write (of a shard: those in its layer range)."""
        self.dev = torch.device(device)
        if self.dev.type != "cuda":
            raise StepError(f"the compiled step runs on a CUDA device, found device {device!r}")
        if self.dev.index is None:
            self.dev = torch.device("cuda", torch.cuda.current_device())
        if self.dev.index >= torch.cuda.device_count():
            raise StepError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        self.prefill_chunks = check_prefill_chunks(prefill_chunks)
        """The prefill chunk sizes :meth:`prefill` uses (ascending; empty: verify steps only)."""
        if self.prefill_chunks and self.is_split:
            raise StepError("prefill chunks (" + ",".join(map(str, self.prefill_chunks)) + ") run on an unsplit step "
                            "(a layer split's chunk graphs are not built); found a layer split")
        self.memory_plan: Any = None
        """The :class:`~ds4c.runtime.memory_plan.MemoryPlan` checked before it was built (set by
        :func:`ds4c.engine.open_engine`), or None."""
        with torch.cuda.device(self.dev):
            self._init(arch, cache, use_graphs, artifact)

    def _init(self, arch: str, cache: KernelCache | None, use_graphs: bool, artifact: str | Artifact | None) -> None:
        mf, buckets = self.mf, self.buckets
        self.target: Target = target(arch)
        self.cache = cache or KernelCache()
        self.use_graphs = use_graphs
        #: programmatic dependent launch of the kernels that allow it (sm_90+ devices), opt-in with DS4C_PDL=1
        #: (:func:`ds4c.settings.pdl`): measured on the H200 (docs/perf.md, session 7) it gave nothing at q = 1 and
        #: cost 5% at q = 5, so it stays off until the trigger placement is tuned; the kernels' DS4C_PDL_ENTRY() is
        #: free without it
        self.programmatic = (settings.pdl()
                             and torch.cuda.get_device_capability(self.dev)[0] >= 9)
        self.artifact = None
        manifest = None
        types = {n: mf.ggml_type(n) for n in mf.specs}
        if artifact is not None:
            opened = open_artifact(artifact)  # an Artifact the engine opened is not loaded again
            self.artifact, manifest = opened.path, opened.manifest
            check_serves(manifest, self.artifact, self.cfg, types, buckets,
                         None if self.plan is None else self.plan.layers, taps=self.taps, record_hc=self.record_hc,
                         prefill_chunks=self.prefill_chunks)
        self.capacity = buckets.contexts[-1]  # state buffers hold the largest bucket (>= max_ctx)
        self.weights = StepWeights(mf, types, self.dev)
        """The weights on the device (:class:`~ds4c.runtime.step.weights.StepWeights`)."""
        # the step buffer's rows: a verify step's, or a prefill chunk's positions and tokens
        self.scalars = StepScalars(self.cfg, max((max(buckets.widths),) + self.prefill_chunks), self.dev)
        """The per-step scalars (:class:`~ds4c.runtime.step.scalars.StepScalars`)."""
        self.sequence = StepSequence(self.cfg, self.capacity, self.layers, len(self.taps) if self.local_taps else 0,
                                     self.records_final_hc, self.dev)
        """The per-sequence state (:class:`~ds4c.runtime.step.sequence.StepSequence`)."""
        self.graphs = StepGraphs(cfg=self.cfg, buckets=buckets, capacity=self.capacity, layers=self.layers,
                                 split=self.is_split, shard=self.shard, taps=self.taps, record_hc=self.record_hc,
                                 prefill_chunks=self.prefill_chunks, types=types, target=self.target,
                                 cache=self.cache, manifest=manifest, artifact=self.artifact,
                                 programmatic=self.programmatic, weights=self.weights, state=self.sequence.buffers,
                                 scalars=self.scalars, is_first=self.is_first, is_last=self.is_last, dev=self.dev)
        """The graphs and their binding (:class:`~ds4c.runtime.step.graphs.StepGraphs`)."""
        self.driver = StepDriver(self.graphs, self.scalars, self.sequence, buckets, self.prefill_chunks,
                                 self.is_last, use_graphs)
        """The step and prefill drivers (:class:`~ds4c.runtime.step.driver.StepDriver`)."""
        self.verifier = Verifier(self.driver, buckets, self.cfg, self.is_last, self.dev)
        """Verify, rollback, device-side acceptance (:class:`~ds4c.runtime.step.verify.Verifier`)."""
        self.loop = DecodeLoop(self.graphs, self.scalars, self.sequence, self.prepare, self.cfg, buckets,
                               self.is_last, self.is_split, use_graphs, self.dev)
        """Device sampling and the decode loop (:class:`~ds4c.runtime.step.decode_loop.DecodeLoop`)."""
        self.prepare_stats: dict[str, Any] = {}
        """What the last :meth:`prepare_all` returned (empty before one)."""
        self.reset()

    # ------------------------------------------------------------------------------------------ state
    @_on_device
    def reset(self) -> None:
        """A new sequence: every state buffer back to its initial value (KV 0, compressor scores -inf)."""
        self.sequence.reset()

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The sequence state's buffers by name (``l{i}.ring``, ...; :attr:`StepSequence.buffers
        <ds4c.runtime.step.sequence.StepSequence.buffers>`): write them in place, never replace one."""
        return self.sequence.buffers

    @property
    def pos(self) -> int:
        """The sequence's next position."""
        return self.sequence.pos

    @pos.setter
    def pos(self, value: int) -> None:
        self.sequence.pos = value

    @_on_device
    def snapshot(self) -> dict[str, Any]:
        """A device copy of the sequence state (all buffers) and the position."""
        return self.sequence.snapshot()

    @_on_device
    def restore(self, snap: dict[str, Any]) -> None:
        """Copy a :meth:`snapshot` back (in place: captured graphs keep pointing at the same buffers)."""
        self.sequence.restore(snap)

    @property
    def tap_ring(self) -> torch.Tensor | None:
        """The DSpark tap ring (spec 5.2(q)): bf16 ``[window, len(taps) * hidden]`` on the step's device; row
        ``t % window`` holds ``main_hidden(t)`` of the last position t a step wrote there (columns ``j * hidden ..``
        of tap j; of a shard, only its tap layers' columns are written). None without local taps. The same tensor
        for the step's life (the captured graphs write it): poison it, read it, but do not replace it."""
        return self.sequence.tap_ring

    def main_hidden(self, start: int, stop: int) -> torch.Tensor:
        """``main_hidden`` of the committed positions ``start .. stop - 1`` (spec 5.2(q)): the taps concatenated in
        :attr:`taps` order, bf16 ``[stop - start, len(taps) * hidden]``, a device tensor (a copy of the
        :attr:`tap_ring` rows, safe to keep across steps).

        Raises:
            StepError: no taps; a shard that does not hold every tap layer (read a split through
                ``ShardedStep.main_hidden``); positions that are not committed or no longer in the ring (only
                the last ``window`` positions any step wrote are).
        """
        if self.local_taps != self.taps or not self.taps:
            raise StepError(self._no_taps_reason())
        return self.tap_rows(start, stop)

    def _no_taps_reason(self) -> str:
        if not self.taps:
            return "main_hidden: this compiled step records no taps (CompiledStep(..., taps=...))"
        return (f"main_hidden: shard {self.shard} (layers {list(self.layers)}) holds the taps {list(self.local_taps)} "
                f"of {list(self.taps)}; read the split's taps with ShardedStep.main_hidden")

    @_on_device
    def tap_rows(self, start: int, stop: int) -> torch.Tensor:
        """The :attr:`tap_ring` rows of positions ``start .. stop - 1`` (bf16 ``[stop - start, len(taps) *
        hidden]``, a copy; of a shard only its tap layers' columns are meaningful): :meth:`main_hidden` without
        the check that every tap is local.

        Raises:
            StepError: no tap ring (no local taps); the range is not inside the committed positions the ring still
                holds: ``max(0, end - window) <= start <= stop <= pos`` with ``end`` one past the highest position
                written (a rejected verify row overwrites the slot of the position ``window`` before it).
        """
        if self.sequence.tap_ring is None:
            raise StepError(self._no_taps_reason())
        return self.sequence.tap_rows(start, stop)

    # -------------------------------------------------------------------- the final HC state (spec 7.5)
    @property
    def records_final_hc(self) -> bool:
        """True when the step's graphs record the final HC state (built with ``record_hc`` and holding the last
        layer): what the MTP drafter (``ds4c.drafters.mtp.MTPDrafter``) needs of its target."""
        return self.record_hc and self.is_last

    @property
    def final_hc_ring(self) -> torch.Tensor | None:
        """The final HC state ring (spec 7.5's ``X_main``): bf16 ``[window + MAX_WIDTH, hc, hidden]`` on the step's
        device; row ``t % (window + MAX_WIDTH)`` holds the HC state after the last layer of the last position t a
        step wrote there. None when the step does not record it. The same tensor for the step's life (the captured
        graphs write it): poison it, read it, but do not replace it."""
        return self.sequence.final_hc_ring

    @property
    def final_hc_rows(self) -> torch.Tensor | None:
        """:attr:`final_hc_ring` (the reference's attribute name: ``MTPDrafter.prepare`` reads it to see that
        recording is on)."""
        return self.final_hc_ring

    def _no_final_hc_reason(self) -> str:
        if not self.is_last:
            return (f"final_hc: shard {self.shard} (layers {list(self.layers)}) does not run the last layer "
                    f"({self.cfg.n_layers - 1}), whose output the final HC state is; read it through ShardedStep")
        return ("final_hc: this compiled step records no final HC state: build it with CompiledStep(..., "
                "record_hc=True) (open_engine / Model record_hc=True; ds4c generate --draft mtp opens it so)")

    def record_final_hc(self, on: bool = True) -> None:
        """The reference's switch (``Reference.record_final_hc``), for ``MTPDrafter.prepare``: the compiled graphs
        record from the start when built with ``record_hc``, so ``on`` checks that they do and changes nothing.

        Raises:
            StepError: ``on`` and the step does not record (built without ``record_hc``, or a shard before the
                last); ``on`` False (recording is part of the compiled graphs; it cannot be turned off).
        """
        if not on:
            raise StepError("record_final_hc(False): the compiled step's recording is part of its graphs "
                            "(CompiledStep(..., record_hc=...)); it cannot be turned off")
        if not self.records_final_hc:
            raise StepError(self._no_final_hc_reason())

    @_on_device
    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        """The final HC states ``X_main`` of the committed positions ``start .. stop - 1`` (spec 7.5): bf16
        ``[stop - start, hc, hidden]``, a device tensor (a copy of the :attr:`final_hc_ring` rows, safe to keep
        across steps). A rejected verify row's ring row is left as it is (the rollback does not touch the ring) and
        overwritten when the position is computed again, so only committed positions are readable.

        Raises:
            StepError: the step records no final HC state (:meth:`record_final_hc`); non-int positions; the range
                is not inside the newest committed positions the ring holds: ``lo <= start <= stop <= pos`` with
                ``lo = max(0, pos - window, end - (window + MAX_WIDTH))``, ``end`` one past the highest position
                any step wrote.
        """
        if self.sequence.final_hc_ring is None:
            raise StepError(self._no_final_hc_reason())
        return self.sequence.final_hc(start, stop)

    # ------------------------------------------------------------------------------------------ verify
    @_on_device
    def verify(self, tokens: list[int], pos: int) -> torch.Tensor:
        """A verify step that can be rolled back (:meth:`rollback`). Returns fp32 logits [q, vocab] (a shard
        before the last: its outgoing HC state rows)."""
        return self.verifier.verify(tokens, pos)

    @_on_device
    def arm_undo(self, tokens: list[int], pos: int) -> None:
        """Make the next step (``tokens`` at ``pos``) one :meth:`rollback` can undo. A verify graph (q >= 2)
        saves what it overwrites itself and is undone by its rollback kernel; a q = 1 step is undone from a
        snapshot of the state taken here.

        Raises:
            StepError: as :meth:`step` (no graph for the key).
        """
        self.verifier.arm_undo(tokens, pos)

    @_on_device
    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last :meth:`verify` and undo the rest.

        A verify of q >= 2 rows: one launch of its rollback kernel (runtime/families/undo.py): the ring rows
        of the rejected rows and the ratio-4 compressor states are put back from what the step saved, so every
        value a later step reads is what sequential decoding of the accepted prefix leaves (the accepted rows'
        values are the verify's own); nothing is replayed. A q = 1 verify: its snapshot is restored.

        Raises:
            StepError: no verify to roll back, or ``accepted`` outside 0..q.
        """
        self.verifier.rollback(accepted)

    @_on_device
    def verify_greedy(self, tokens: list[int], pos: int) -> list[int]:
        """A verify step with greedy acceptance and its rollback on the device: the tokens the step adds (the
        accepted prefix of the drafts ``tokens[1:]`` then the target's own token, 1..q ids), with the state
        holding exactly those rows (as :meth:`verify` then :meth:`rollback` of ``len(result)``).

        The host enqueues, behind the verify graph: each row's argmax (ties to the lower id, as the CPU
        sampler), the accepted count (1 + the leading drafts equal to their row's argmax) written into the
        step buffer's ``accepted`` slot, the verify's rollback kernel (which reads it there; with every row
        accepted it rewrites what the verify left) and one copy of the argmax ids to pinned host memory;
        then it waits once and accepts on the host from the same ids (so the same count). So the GPU runs the
        verify, the acceptance and the rollback back to back, and only ``q`` ids cross to the host (against a wait
        for the argmax, the acceptance on the host and a second round trip for the rollback). q = 1 is a plain
        step (its row is kept); a step with no rollback kernel (a shard of a split) takes the :meth:`verify` /
        :meth:`rollback` path.

        Args:
            tokens: the last accepted token then the drafts (q = len, a compiled width); pos: its position.
        Returns:
            the ids the step adds; the next position is ``pos + len(result)``.
        Raises:
            StepError: as :meth:`step`.
        """
        return self.verifier.verify_greedy(tokens, pos)

    def greedy_pipeline(self) -> GreedyPipeline | None:
        """The pipelined greedy verifier of this step (:mod:`ds4c.runtime.spec_pipeline`), or None when it
        cannot run one (graphs not all captured, a shard of a split, no stream memory operations)."""
        return pipeline(self)

    def accept_on_device(self, sg: StepGraph, host_ids: torch.Tensor) -> None:
        """Enqueue, behind ``sg``'s step on the current stream, its greedy acceptance (the rows' argmax, the
        accepted count into the step buffer's ``accepted`` slot, at most its ``keep``, then ``sg``'s rollback
        kernel) and a copy of the rows' argmax ids into ``host_ids`` (pinned int64, >= q). Nothing waits. The
        acceptance replays the CUDA graph :meth:`prepare_all` captured for ``sg`` when there is one (it allocates
        nothing: a stream queued behind a host flag must not reach the allocator, whose cudaMalloc can wait for
        that stream), else runs eagerly."""
        self.verifier.accept_on_device(sg, host_ids)

    # ------------------------------------------------------------------------------------------ weights
    @_on_device
    def load_weights(self, forms: dict[str, str], progress: bool = True,
                     staging_bytes: int = 64 << 20) -> dict[str, float]:
        """Upload the weights ``forms`` names (GGUF name -> the form kernels read it in, from the lowered
        graphs' arguments: :meth:`prepare_all`), streaming the stored bytes through two pinned staging buffers
        (:meth:`StepWeights.load <ds4c.runtime.step.weights.StepWeights.load>`).

        Returns (and keeps as :attr:`load_stats`): ``bytes``, ``seconds``, ``gb_per_s`` of this call.
        """
        return self.weights.load(forms, progress, staging_bytes)

    @property
    def load_stats(self) -> dict[str, float]:
        """What the last :meth:`load_weights` measured: ``bytes``, ``seconds``, ``gb_per_s`` (empty before one)."""
        return self.weights.stats

    def shared_weight(self, name: str, form: str) -> torch.Tensor:
        """The device tensor of weight ``name`` in ``form`` as the step's kernels read it (uploaded now if no graph
        of the step read it yet): one copy for the step and whatever else reads it (the DSpark drafter reads the
        target's embedding and head: runtime/dspark_exec.py)."""
        with torch.cuda.device(self.dev):
            return self.weights.get(name, form)

    # ------------------------------------------------------------------------------------------ graphs
    @_on_device
    def prepare(self, width: int, context: int) -> StepGraph:
        """The step graph of (``width``, ``context``): pipelined, lowered, its binaries loaded and its arguments
        bound (once; later calls return it). :meth:`prepare_all` does this for every key at once, before
        the first step; this is the one-key form (tools, tests).

        Raises:
            StepError: the key is not among the compiled widths and context buckets.
            ArtifactError: in artifact mode, the artifact lacks the key or this arch.
        """
        return self.graphs.prepare(width, context)

    @_on_device
    def prepare_all(self, widths: tuple[int, ...] | None = None, max_ctx: int | None = None,
                    progress: bool = True) -> dict[str, Any]:
        """Make every (width, context bucket) graph up to ``max_ctx`` ready before the first step: build and
        lower them, compile what the kernel cache lacks in parallel (one progress bar; nothing with an
        artifact), load the binaries, upload the weights (:meth:`load_weights`), bind the arguments (one
        activation arena for all graphs) and capture every CUDA graph (one memory pool), and per q=1 bucket
        the decode loop's step + sampler graphs (greedy and sampling). The sequence state is reset
        afterwards. After this no step or :meth:`decode_tokens` compiles, loads or captures anything.

        Args:
            widths: the widths to prepare (default: all the buckets'); max_ctx: prepare the buckets that
                positions below it can use (default: all).
            progress: print the compile line and progress bars to stderr.

        Returns:
            ``graphs`` (number), ``build_s``, ``compile_s``, ``load_s`` (binaries, weights, binding),
            ``capture_s``, ``weights`` (:attr:`load_stats`), ``graph_bytes`` (GPU memory the graphs take:
            arena, logits, constants and captures) and ``capture_ms`` per key; kept as :attr:`prepare_stats`.

        Raises:
            StepError, ArtifactError, CompileError: as :meth:`prepare`.
        """
        gr = self.graphs
        widths = tuple(widths or self.buckets.widths)
        limit = min(max_ctx or self.buckets.max_ctx, self.buckets.max_ctx)
        last = self.buckets.bucket(limit - 1, 1)  # buckets are contiguous: every one up to the last position's
        contexts = [c for c in self.buckets.contexts if c <= last]
        keys = [(w, c) for w in widths for c in contexts if (w, c) not in gr.by_key]
        if not any(w in self.prefill_chunks for w in widths):  # default: every prefill chunk graph too
            keys += [(n, c) for n in self.prefill_chunks for c in contexts if n <= c and (n, c) not in gr.by_key]
        mem0 = torch.cuda.memory_allocated(self.dev)
        t0 = time.perf_counter()
        built = {k: gr.build(*k) for k in keys}
        t1 = time.perf_counter()
        bins = gr.binaries([(k, kernels) for k, (_g, kernels) in built.items()], progress=progress)
        t2 = time.perf_counter()
        forms = {a.name: a.form or "f32" for _g, kernels in built.values() for k in kernels for la in k.launches
                 for a in la.args if a.kind == "weight"}
        self.load_weights(forms, progress=progress)
        layouts = [gr.layout(g, kernels) for g, kernels in built.values()]
        need = max((n for _l, n in layouts), default=0)
        if need and (gr.arena is None or gr.arena.numel() < need):
            gr.arena = torch.zeros(need, dtype=torch.uint8, device=self.dev)
        mem_w = torch.cuda.memory_allocated(self.dev)
        for (k, (g, kernels)), b, lay in zip(built.items(), bins, layouts):
            gr.bind(k[0], k[1], g, kernels, b, lay)
        t3 = time.perf_counter()
        for k in keys:
            gr.capture(gr.by_key[k])
        if self.is_last and self.use_graphs:  # the greedy acceptance behind each step (speculative decoding)
            for k in keys:
                if k[0] not in self.prefill_chunks:  # a prefill chunk is never verified
                    self.verifier.capture_accept(gr.by_key[k])
        if 1 in widths:  # the decode loop's graphs: the q=1 step + the sampler, per bucket (a shard before
            for (w, c) in keys:  # the last of a split: the step + advancing its scalars)
                if w == 1:
                    for mode in self.loop.modes:
                        self.loop.graph(c, mode)
        self.reset()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        graph_bytes = torch.cuda.memory_allocated(self.dev) - mem_w + sum(
            t.numel() * t.element_size() for t in (gr.logits, gr.hc_in, gr.hc_out) if t is not None)
        out = {"graphs": len(keys), "build_s": t1 - t0, "compile_s": t2 - t1, "load_s": t3 - t2,
               "capture_s": t4 - t3, "weights": dict(self.load_stats), "graph_bytes": int(graph_bytes),
               "weight_bytes": int(mem_w - mem0), "capture_ms": {f"{w}x{c}": ms for (w, c), ms in
                                                                 self.capture_ms.items()}}
        self.prepare_stats = out
        return out

    def module(self, key: str, image: Any) -> CudaModule:
        """The loaded binary of kernel-cache ``key`` (``image()`` returns its bytes), loaded once per step and
        shared by every graph bound here (and by the compiled DSpark drafter's)."""
        return self.graphs.module(key, image)

    def values(self, width: int, context: int) -> dict[str, torch.Tensor]:
        """The device tensors of the (``width``, ``context``) graph by IR value name, e.g. ``l3.route.ids``;
        empty when the graph was never prepared. Activations live in the arena all graphs share: they hold what
        the last step of any graph left there, so read them right after a step of this graph."""
        return self.graphs.values(width, context)

    @property
    def capture_ms(self) -> dict[tuple[int, int], float]:
        """Milliseconds each captured (width, context) graph took to capture."""
        return self.graphs.capture_ms()

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (step, acceptance and decode graphs): a test's check that nothing is
        captured after start."""
        return self.graphs.captures

    @property
    def binary_batches(self) -> int:
        """Batches of binaries fetched from the kernel cache (each may compile)."""
        return self.graphs.binary_batches

    @property
    def hc_in(self) -> torch.Tensor | None:
        """A shard's incoming HC state (bf16 [max width, hc, hidden]; rows [:q] of a step are read); None on the
        first shard."""
        return self.graphs.hc_in

    @property
    def hc_out(self) -> torch.Tensor | None:
        """A shard's outgoing HC state (rows [:q] written by each step); None on the last shard."""
        return self.graphs.hc_out

    def hand_off_to(self, dst: torch.Tensor) -> None:
        """Make every step of this shard end by copying its outgoing HC state rows into ``dst`` (the next
        shard's :attr:`hc_in`, on this same device), inside the captured graphs. Call before :meth:`prepare_all`
        (graphs captured earlier do not copy).

        Raises:
            StepError: this shard is the last one, or ``dst`` is on another device or of another shape.
        """
        out = self.hc_out
        if out is None:
            raise StepError("hand_off_to: the last shard has no outgoing HC state")
        if dst.device != self.dev or dst.shape != out.shape or dst.dtype != out.dtype:
            raise StepError(f"hand_off_to: expected a {out.dtype} {list(out.shape)} tensor on "
                            f"{self.dev}, found {dst.dtype} {list(dst.shape)} on {dst.device}")
        self.graphs.handoff = dst

    # ------------------------------------------------------------------------------------------ steps
    @property
    def step_offsets(self) -> dict[str, int]:
        """Where each scalar sits in the int64 step buffer the kernels read (``pos``, ``live_r{r}``,
        ``positions``, ``tokens``, ``accepted``, ``keep``, ``n_valid``)."""
        return dict(self.scalars.offsets)

    def fill_scalars(self, a: np.ndarray, tokens: list[int], pos: int, keep: int | None = None,
                     rows: int | None = None) -> None:
        """Write a step's scalars (``pos``, ``live_r`` = (pos + q) // r, the rows' positions and tokens, ``keep``,
        the most rows :meth:`accept_on_device` may keep: default all, and ``n_valid`` = q) into ``a``, an int64
        numpy view of a host copy of the step buffer (layout :attr:`step_offsets`). ``rows`` (a prefill chunk
        of C >= q rows): the padded rows q..C-1 get positions pos + q .. pos + C - 1 and token 0 (computed,
        never kept: the chunk's kernels write no state past ``n_valid``)."""
        self.scalars.fill(a, tokens, pos, keep, rows)

    def token_slot(self) -> torch.Tensor:
        """The device view of the next step's first token id (int64 [1]) in this step's scalar buffer: where
        a split's last shard writes the sampled id."""
        return self.scalars.token_slot()

    @_on_device
    def step(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Run ``len(tokens)`` rows at ``pos..``; returns fp32 logits [q, vocab] (a device tensor, valid until
        the next step of the same width and bucket); a shard before the last of a split returns its outgoing HC
        state rows (:attr:`hc_out` ``[:q]``).

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past max_ctx, or no compiled
                graph for the (width, bucket) key.
        """
        return self.driver.step(tokens, pos)

    @_on_device
    def prefill(self, tokens: list[int], pos: int, chunks: tuple[int, ...] | None = None) -> torch.Tensor:
        """Ingest ``tokens`` at ``pos..`` (a prompt, or the rest of one) and return the fp32 logits of the last
        one, ``[1, vocab]`` (a device tensor, valid until the next step). With :attr:`prefill_chunks`: chunk
        graphs picked by :func:`~ds4c.buckets.prefill_chunk_for` (a padded chunk at least half full, else the
        largest full one, a tail under ``MIN_PREFILL_CHUNK`` tokens as verify steps of the widest width); without:
        verify steps only. The state afterwards is what token-wise decoding leaves (the chunk kernels write no
        state past ``n_valid``; docs/prefill.md). Nothing here can be rolled back. ``chunks``: a subset of
        :attr:`prefill_chunks` to use instead (``()``: verify steps only; the benchmark's baseline).

        :attr:`last_prefill` then says how: ``{"chunks": [[rows, valid], ...], "verify_tokens": n}``.

        Raises:
            StepError: ``pos`` is not the sequence's next position, no tokens, positions past max_ctx, or
                ``chunks`` not among the prepared chunk sizes.
        """
        return self.driver.prefill(tokens, pos, chunks)

    @property
    def last_prefill(self) -> dict[str, Any] | None:
        """How the last :meth:`prefill` ran: ``{"chunks": [[rows, valid], ...], "verify_tokens": n}``."""
        return self.driver.last_prefill

    @property
    def max_ctx(self) -> int:
        """Positions a sequence may hold (the buckets' ``max_ctx``)."""
        return self.buckets.max_ctx

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1). Returns fp32 logits [1, vocab]."""
        return self.step([token], pos)

    # ------------------------------------------------------------------------------------------ decode loop
    def decode_tokens(self, token: int, pos: int, n: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, lag: int = 4) -> Iterator[int]:
        """Decode ``n`` tokens after ``token`` (at ``pos``) with sampling on the device, host-free: each step
        replays one captured graph: the (1, bucket) step, then the sampler
        (:class:`~ds4c.runtime.sampler.DeviceSampler`: greedy, or temperature/top-k/top-p with seeded
        counter-based noise) writing the sampled id into the next step's token slot and advancing the step
        scalars on the device. The host only picks each step's
        bucket graph (positions are known ahead) and reads the ids back asynchronously, ``lag`` steps behind,
        so the graphs run back to back. Yields the ids in order; closing the generator (EOS, a stop string)
        stops launching (the state then holds up to ``lag`` more positions than were consumed, and ``pos``
        says how far it went).

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past ``max_ctx``, ``use_graphs``
                off. Decode graphs :meth:`prepare_all` did not capture are captured before the first launch.
        """
        return self.loop.decode_tokens(token, pos, n, temperature, top_k, top_p, seed, lag)

    @property
    def token_sinks(self) -> list[torch.Tensor]:
        """Where the device sampler also writes each sampled id (the token slots of the other shards of a split
        on this device: :meth:`token_slot`); set before :meth:`prepare_all`."""
        return self.loop.token_sinks

    @token_sinks.setter
    def token_sinks(self, sinks: list[torch.Tensor]) -> None:
        self.loop.token_sinks = sinks

    @property
    def decode_modes(self) -> tuple[str, ...]:
        """The decode-loop graphs :meth:`prepare_all` captures per q=1 bucket."""
        return self.loop.modes

    # ------------------------------------------------------------------------------------------ timing
    @_on_device
    def time_launches(self, tokens: list[int], pos: int, repeats: int = 20,
                      rows: int | None = None) -> list[dict[str, Any]]:
        """Time every launch of the step at (``len(tokens)``, bucket of ``pos``) on its own with CUDA events
        (median of ``repeats`` eager runs of the whole launch list; the state is snapshotted and restored, so
        the sequence is unchanged). ``rows``: time the prefill chunk graph of that many rows instead (one of
        :attr:`prefill_chunks`, ``len(tokens) <= rows``, the rest padding). Returns one dict per launch:
        ``kernel`` (plan name), ``family``, ``layer``, ``entry``, ``us`` (median microseconds).

        Raises:
            StepError: as :meth:`step`; ``rows`` not a prepared chunk size, or fewer than ``len(tokens)``.
        """
        return time_launches(self.driver, tokens, pos, repeats, rows)

    @_on_device
    def time_replays(self, tokens: list[int], pos: int, repeats: int = 50) -> float:
        """Median milliseconds of the step's CUDA graph replayed ``repeats`` times back to back (CUDA events
        between replays, no host work in between); the graph is captured first if needed. The state is
        snapshotted and restored, so the sequence is unchanged.

        Raises:
            StepError: as :meth:`step`, or ``use_graphs`` is off.
        """
        return time_replays(self.driver, tokens, pos, repeats)
