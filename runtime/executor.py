"""Run the compiled step on a CUDA GPU: weights and state on the device, one launch list per (width, context
bucket), captured as a CUDA graph on first use and replayed after.

Per-step scalars (position, row positions, token ids, live lengths) live in one int64 device buffer that the
kernels read; a step uploads them in one copy, so a captured graph replays with new values. A step whose
(width, bucket) has no compiled graph is an error naming the key; there is no fallback.

Data flows one way: this module consumes the lowering (runtime/lower.py), the kernel cache and the model
file; nothing upstream imports it.
"""

from __future__ import annotations

import numbers
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ds4c.buckets import BucketSpec, check_prefill_chunks, prefill_chunk_for
from ds4c.errors import StepError
from ds4c.gguf_file import ModelFile
from ds4c.quant import GGMLType
from ds4c.ir import build_step
from ds4c.ir.builder import FINAL_HC_RING, TAP_RING, check_layers, check_taps, final_hc_ring_type, tap_ring_type
from ds4c.ir.graph import Graph
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.progress import progress_bar
from ds4c.runtime.artifact_manifest import Artifact, open_artifact
from ds4c.runtime.artifact_serve import check_serves, launch_binaries
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.launch import CudaKernel, CudaModule
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lower_step import ROLLBACK_KERNEL
from ds4c.runtime.lowered import Arg, LoweredKernel
from ds4c.runtime.targets import Target, target
from ds4c.runtime.sampler import argmax_chunk, argmax_rows
from ds4c.shard_plan import ShardPlan, validate

def _on_device(fn: Any) -> Any:
    """Run a :class:`CompiledStep` method with the step's device current (its launches, allocations, events
    and graph captures belong to that device). A pipelined speculative request that still has steps queued
    (one left unfinished and not closed, e.g. a token stream no longer read) is ended first: its queued step
    waits on a host flag, and anything enqueued behind it would wait forever."""
    import functools

    @functools.wraps(fn)
    def wrapped(self: "CompiledStep", *args: Any, **kwargs: Any) -> Any:
        pipe = getattr(self, "_greedy_pipeline", None)
        if pipe is not None and pipe.busy:
            pipe.abandon()
        with torch.cuda.device(self.dev):
            return fn(self, *args, **kwargs)

    return wrapped


def device_arch() -> str:
    """The CUDA arch name of the current device (runtime only; AOT never calls this)."""
    major, minor = torch.cuda.get_device_capability()
    return {(8, 0): "sm_80", (9, 0): "sm_90", (10, 0): "sm_100a"}.get((major, minor), f"sm_{major}{minor}")


_DT = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64, "bool": torch.bool, "u8": torch.uint8}


@dataclass
class _Bound:
    kernel: CudaKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: list[Any]
    programmatic: bool = False  # launched with programmatic stream serialization (KernelSource.programmatic_launch)


@dataclass
class _StepGraph:
    width: int
    context: int
    graph: Graph
    kernels: list[LoweredKernel]
    launches: list[_Bound] = field(default_factory=list)
    rollback: _Bound | None = None
    """A verify graph's rollback kernel (runtime/families/undo.py), bound but not part of the step."""
    rollback_args: Any = None
    """Its driver argument array, packed once (the bound tensors never change)."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    cuda_graph: Any = None
    capture_s: float = 0.0


def arena_layout(g: Graph, kernels: list[LoweredKernel], external: set[str]
                 ) -> tuple[dict[str, tuple[int, int, tuple, Any]], int]:
    """The activation arena layout of one lowered graph: ``name -> (byte offset, bytes, shape, dtype)`` for every
    graph value a launch argument names, except ``external`` names (buffers bound elsewhere) and constants, and
    the bytes it needs (256-byte aligned slots, in first-use order)."""
    names = value_names(g)
    by_name = {names[v]: v for v in names}
    consts = {names[op.outputs[0]] for op in g.ops if op.kind == "const"}
    layout: dict[str, tuple[int, int, tuple, Any]] = {}
    off = 0
    for k in kernels:
        for la in k.launches:
            for a in la.args:
                if a.kind != "value" or a.name in external or a.name in consts or a.name in layout \
                        or a.name not in by_name:
                    continue
                v = by_name[a.name]
                shape, dt = tuple(int(d) for d in v.type.shape), _DT[v.type.dtype]
                n = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
                layout[a.name] = (off, n, shape, dt)
                off += (n + 255) // 256 * 256
    return layout, off


def resolve_arg(a: Arg, values: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor], step_buf: torch.Tensor, offsets: dict[str, int],
                workspaces: dict[str, torch.Tensor], weight: Any, dev: torch.device) -> Any:
    """The bound value of one kernel argument of a lowered graph (the compiled step's and the compiled drafter's):
    a weight (``weight(name, form)``), an int, the step buffer from a scalar's offset, a workspace (grown on
    demand, shared by name), a state buffer, a constant (uploaded once into ``values``), or an activation of the
    graph (an arena slot or the logits buffer, already in ``values``)."""
    if a.kind == "weight":
        return weight(a.name, a.form or "f32")
    if a.kind == "int":
        return int(a.value)
    if a.kind == "step":
        return step_buf[offsets[a.name]:]
    if a.kind == "workspace":
        t = workspaces.get(a.name)
        if t is None or t.numel() < a.nbytes:
            t = workspaces[a.name] = torch.empty(a.nbytes, dtype=torch.uint8, device=dev)
        return t
    if a.name in state:
        return state[a.name]
    if a.name in consts:
        t = values.get(a.name)
        if t is None:
            t = values[a.name] = consts[a.name].to(dev).contiguous()
        return t
    return values[a.name]


class CompiledStep:
    """The compiled decode/verify step of one model on one CUDA GPU.

    Args:
        mf: the model file (weights are uploaded as the kernels read them).
        buckets: widths and context buckets to serve; ``buckets.max_ctx`` sizes the state.
        arch: the CUDA arch to compile for (e.g. ``sm_90``).
        cache: the kernel cache (compiles what is missing; an AOT-filled cache compiles nothing).
        use_graphs: capture one CUDA graph per (width, bucket) on first use and replay it.
        artifact: an artifact folder from ``ds4c compile``, or the :class:`~ds4c.runtime.artifact_manifest.Artifact`
            the caller opened (its manifest is then not loaded and verified again): binaries come from it and
            nothing is compiled. It must serve this model (``ds4c.runtime.artifact_serve.check_serves``: config,
            ``buckets`` and weight formats equal, and it holds the chunk graphs of every size in ``prefill_chunks``:
            ``ds4c compile --prefill``); a missing arch or (width, bucket) graph raises ArtifactError.
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
        prefill_chunks: the prefill chunk graphs' row counts C (docs/prefill.md; each in ``MIN_PREFILL_CHUNK ..
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
        self._split = not (self.is_first and self.is_last)
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
        self.last_prefill: dict[str, Any] | None = None
        """How the last :meth:`prefill` ran: ``{"chunks": [[rows, valid], ...], "verify_tokens": n}``."""
        if self.prefill_chunks and self._split:
            raise StepError("prefill chunks (" + ",".join(map(str, self.prefill_chunks)) + ") run on an unsplit step "
                            "(a layer split's chunk graphs are not built); found a layer split")
        with torch.cuda.device(self.dev):
            self._init(arch, cache, use_graphs, artifact)

    def _init(self, arch: str, cache: KernelCache | None, use_graphs: bool, artifact: str | Artifact | None) -> None:
        mf, buckets = self.mf, self.buckets
        self.target: Target = target(arch)
        self.cache = cache or KernelCache()
        self.use_graphs = use_graphs
        #: programmatic dependent launch of the kernels that allow it (sm_90+ devices), opt-in with DS4C_PDL=1:
        #: measured on the H200 (docs/perf.md, session 7) it gave nothing at q = 1 and cost 5% at q = 5, so it
        #: stays off until the trigger placement is tuned; the kernels' DS4C_PDL_ENTRY() is free without it
        self.programmatic = (os.environ.get("DS4C_PDL", "0") == "1"
                             and torch.cuda.get_device_capability(self.dev)[0] >= 9)
        self.artifact = None
        self._manifest = None
        self._types = {n: mf.ggml_type(n) for n in mf.specs}
        if artifact is not None:
            opened = open_artifact(artifact)  # an Artifact the engine opened is not loaded again
            self.artifact, self._manifest = opened.path, opened.manifest
            check_serves(self._manifest, self.artifact, self.cfg, self._types, buckets,
                         None if self.plan is None else self.plan.layers, taps=self.taps, record_hc=self.record_hc,
                         prefill_chunks=self.prefill_chunks)
        self._weights: dict[tuple[str, str], torch.Tensor] = {}
        self._modules: dict[str, CudaModule] = {}
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self.state: dict[str, torch.Tensor] = {}
        self._workspaces: dict[str, torch.Tensor] = {}
        maxq = max(buckets.widths)  # the logits, hand-over and acceptance buffers' rows
        rows = max((maxq,) + self.prefill_chunks)  # the step buffer's: a prefill chunk's positions and tokens
        # step buffer: [pos, live_r..., positions (rows), tokens (rows), accepted, keep, n_valid]
        self._ratios = sorted({r for r in self.cfg.compress_ratios[: self.cfg.n_layers] if r})
        self._off = {"pos": 0}
        for k, r in enumerate(self._ratios):
            self._off[f"live_r{r}"] = 1 + k
        self._off["positions"] = 1 + len(self._ratios)
        self._off["tokens"] = self._off["positions"] + rows
        self._off["accepted"] = self._off["tokens"] + rows  # a rollback's accepted rows (undo family)
        self._off["keep"] = self._off["accepted"] + 1  # the most rows a device-side acceptance keeps
        self._off["n_valid"] = self._off["keep"] + 1  # a prefill chunk's real rows (the rest is padding)
        n_step = self._off["n_valid"] + 1
        self._step_hosts = [torch.zeros(n_step, dtype=torch.int64).pin_memory() for _ in range(2)]
        # numpy views of the same pinned memory: the per-step scalars are written through them (a torch
        # element assignment costs microseconds: ~110 us per q=5 upload, measured on the H200)
        self._step_np = [h.numpy() for h in self._step_hosts]
        self._host_done = [torch.cuda.Event() for _ in range(2)]
        self._host_turn = 0
        self._step_dev = torch.zeros(n_step, dtype=torch.int64, device=self.dev)
        # every graph writes its logits rows into this one buffer; the other activations of all graphs share
        # one arena (graphs never run concurrently), and all captures share one CUDA graph memory pool
        # (the last shard only) and a shard's incoming / outgoing HC state rows have one buffer each
        hc_shape = (maxq, self.cfg.hc_mult, self.cfg.hidden_size)
        self._logits = torch.zeros(maxq, self.cfg.vocab_size, dtype=torch.float32, device=self.dev) \
            if self.is_last else None
        self.hc_in = None if self.is_first else torch.zeros(hc_shape, dtype=torch.bfloat16, device=self.dev)
        """A shard's incoming HC state (bf16 [max width, hc, hidden]; rows [:q] of a step are read)."""
        self.hc_out = None if self.is_last else torch.zeros(hc_shape, dtype=torch.bfloat16, device=self.dev)
        """A shard's outgoing HC state (rows [:q] written by each step)."""
        self._handoff: torch.Tensor | None = None
        self.token_sinks: list[torch.Tensor] = []
        """Where the device sampler also writes each sampled id (the token slots of the other shards of a split
        on this device: :meth:`token_slot`); set before :meth:`prepare_all`."""
        self.decode_modes = ("greedy", "sample") if self.is_last else ("advance",)
        """The decode-loop graphs :meth:`prepare_all` captures per q=1 bucket."""
        self._arena: torch.Tensor | None = None
        self._pool = torch.cuda.graph_pool_handle()
        self._sampler = None
        self._sampler_bodies: dict[str, Any] = {}
        self._decode_graphs: dict[tuple[int, str], Any] = {}
        self.captures = 0
        """CUDA graphs captured so far (step and decode graphs): a test's check that nothing is captured
        after start."""
        self.binary_batches = 0
        """Batches of binaries fetched from the kernel cache (each may compile)."""
        self.load_stats: dict[str, float] = {}
        self.prepare_stats: dict[str, Any] = {}
        """What the last :meth:`prepare_all` returned (empty before one)."""
        self.capacity = buckets.contexts[-1]  # state buffers hold the largest bucket (>= max_ctx)
        self.pos = 0
        self._tap_end = 0  # one past the highest position any step wrote (into the tap and final HC rings)
        self._undo: tuple | None = None
        self._accept_host: tuple[torch.Tensor, Any] | None = None  # verify_greedy's pinned result and its event
        self._argmax_chunk = argmax_chunk(self.cfg.vocab_size)
        self._greedy_pipeline = None  # ds4c.runtime.spec_pipeline.pipeline's, made on first use
        # the greedy acceptance's argmax ids (device, int64 [max width])
        self._accept_ids = torch.zeros(maxq, dtype=torch.int64, device=self.dev)
        self._accept_graphs: dict[tuple[int, int], Any] = {}  # its captured graphs per (width, context)
        self.reset()

    # ------------------------------------------------------------------------------------------ state
    @_on_device
    def reset(self) -> None:
        """A new sequence: every state buffer back to its initial value (KV 0, compressor scores -inf)."""
        from ds4c.ir.builder import state_inputs

        bufs = state_inputs(self.cfg, self.capacity, self.layers)
        if self.local_taps:  # the tap ring is state too: bound by name, in snapshots, reset with the sequence
            bufs[TAP_RING] = tap_ring_type(self.cfg, len(self.taps))
        if self.records_final_hc:  # so is the final HC ring
            bufs[FINAL_HC_RING] = final_hc_ring_type(self.cfg)
        for name, t in bufs.items():
            buf = self.state.get(name)
            if buf is None:
                buf = self.state[name] = torch.empty(tuple(t.shape), dtype=_DT[t.dtype], device=self.dev)
            buf.fill_(float("-inf") if name.endswith("_score") else 0)
        self.pos = 0
        self._tap_end = 0

    @property
    def tap_ring(self) -> torch.Tensor | None:
        """The DSpark tap ring (spec 5.2(q)): bf16 ``[window, len(taps) * hidden]`` on the step's device; row
        ``t % window`` holds ``main_hidden(t)`` of the last position t a step wrote there (columns ``j * hidden ..``
        of tap j; of a shard, only its tap layers' columns are written). None without local taps. The same tensor
        for the step's life (the captured graphs write it): poison it, read it, but do not replace it."""
        return self.state.get(TAP_RING)

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
        ring = self.tap_ring
        if ring is None:
            raise StepError(self._no_taps_reason())
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (start, stop)):
            raise StepError(f"main_hidden: expected int positions, found {start!r}, {stop!r}")
        start, stop = int(start), int(stop)
        lo = max(0, self._tap_end - self.cfg.window)
        if not lo <= start <= stop <= self.pos:
            raise StepError(f"main_hidden: positions {start}..{stop - 1} are not committed positions held by the tap "
                            f"ring: expected a range inside {lo}..{self.pos - 1} (the sequence is at position "
                            f"{self.pos}; the ring keeps the last {self.cfg.window} positions written)")
        idx = torch.arange(start, stop, device=self.dev) % self.cfg.window
        return ring.index_select(0, idx)

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
        return self.state.get(FINAL_HC_RING)

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
        ring = self.final_hc_ring
        if ring is None:
            raise StepError(self._no_final_hc_reason())
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (start, stop)):
            raise StepError(f"final_hc: expected int positions, found {start!r}, {stop!r}")
        start, stop = int(start), int(stop)
        rows = int(ring.shape[0])
        lo = max(0, self.pos - self.cfg.window, self._tap_end - rows)
        if not lo <= start <= stop <= self.pos:
            raise StepError(f"final_hc: positions {start}..{stop - 1} are not committed positions held by the final "
                            f"HC ring: expected a range inside {lo}..{self.pos - 1} (the sequence is at position "
                            f"{self.pos}; the ring keeps the newest {self.cfg.window} committed positions)")
        idx = torch.arange(start, stop, device=self.dev) % rows
        return ring.index_select(0, idx)

    @_on_device
    def snapshot(self) -> dict[str, Any]:
        """A device copy of the sequence state (all buffers) and the position."""
        return {"pos": self.pos, "tap_end": self._tap_end, "state": {k: v.clone() for k, v in self.state.items()}}

    @_on_device
    def restore(self, snap: dict[str, Any]) -> None:
        """Copy a :meth:`snapshot` back (in place: captured graphs keep pointing at the same buffers)."""
        for k, v in snap["state"].items():
            self.state[k].copy_(v)
        self.pos = snap["pos"]
        self._tap_end = snap.get("tap_end", self._tap_end)

    @_on_device
    def verify(self, tokens: list[int], pos: int) -> torch.Tensor:
        """A verify step that can be rolled back (:meth:`rollback`). Returns fp32 logits [q, vocab] (a shard
        before the last: its outgoing HC state rows)."""
        self.arm_undo(tokens, pos)
        return self.step(tokens, pos)

    def arm_undo(self, tokens: list[int], pos: int) -> None:
        """Make the next step (``tokens`` at ``pos``) one :meth:`rollback` can undo. A verify graph (q >= 2)
        saves what it overwrites itself and is undone by its rollback kernel; a q = 1 step is undone from a
        snapshot of the state taken here.

        Raises:
            StepError: as :meth:`step` (no graph for the key).
        """
        sg = self.prepare(len(tokens), self.buckets.bucket(pos, len(tokens))) if pos == self.pos else None
        if sg is not None and sg.rollback is not None:
            self._undo = ("kernel", sg, list(tokens), pos)
        else:
            self._undo = ("snapshot", self.snapshot(), list(tokens), pos)

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
        undo = getattr(self, "_undo", None)
        if undo is None:
            raise StepError("rollback: no verify step to roll back")
        kind, held, tokens, pos = undo
        if not 0 <= accepted <= len(tokens):
            raise StepError(f"rollback: accepted must be in 0..{len(tokens)}, found {accepted}")
        self._undo = None
        if accepted == len(tokens):
            return
        if kind == "kernel":
            self._launch_rollback(held, accepted)
            self.pos = pos + accepted
            return
        self.restore(held)
        if accepted:
            self.step(tokens[:accepted], pos)

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
        verify, the acceptance and the rollback back to back, and only ``q`` ids cross to the host (against a wait for the argmax, the acceptance on the
        host and a second round trip for the rollback). q = 1 is a plain step (its row is kept); a step with no
        rollback kernel (a shard of a split) takes the :meth:`verify` / :meth:`rollback` path.

        Args:
            tokens: the last accepted token then the drafts (q = len, a compiled width); pos: its position.
        Returns:
            the ids the step adds; the next position is ``pos + len(result)``.
        Raises:
            StepError: as :meth:`step`.
        """
        from ds4c.speculative import accept_greedy

        q = len(tokens)
        if q == 1:  # a plain decode: its one row is always kept, so there is nothing to undo (no snapshot)
            return [int(argmax_rows(self.step(tokens, pos), self._argmax_chunk)[0])]
        self.arm_undo(tokens, pos)
        kind, held = self._undo[0], self._undo[1]
        logits = self.step(tokens, pos)
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
        self._undo = None
        new = accept_greedy(h[:q].tolist(), list(tokens[1:]))  # the count the device computed, from the same ids
        self.pos = pos + len(new)
        return new

    def greedy_pipeline(self) -> Any:
        """The pipelined greedy verifier of this step (:mod:`ds4c.runtime.spec_pipeline`), or None when it
        cannot run one (graphs not all captured, a shard of a split, no stream memory operations)."""
        from ds4c.runtime.spec_pipeline import pipeline

        return pipeline(self)

    def accept_on_device(self, sg: _StepGraph, host_ids: torch.Tensor) -> None:
        """Enqueue, behind ``sg``'s step on the current stream, its greedy acceptance (:meth:`_accept_body`) and
        a copy of the rows' argmax ids into ``host_ids`` (pinned int64, >= q). Nothing waits. The acceptance
        replays the CUDA graph :meth:`prepare_all` captured for ``sg`` when there is one (it allocates
        nothing: a stream queued behind a host flag must not reach the allocator, whose cudaMalloc can wait for
        that stream), else runs eagerly."""
        g = self._accept_graphs.get((sg.width, sg.context))
        if g is not None:
            g.replay()
        else:
            self._accept_body(sg)
        host_ids[:sg.width].copy_(self._accept_ids[:sg.width], non_blocking=True)

    def _accept_body(self, sg: _StepGraph) -> None:
        """The greedy acceptance of ``sg``'s step: the rows' argmax into :attr:`_accept_ids`, the accepted count
        (1 + the leading drafts, the step buffer's tokens 1.., equal to their row's argmax; at most the step
        buffer's ``keep``) into its ``accepted`` slot, then ``sg``'s rollback kernel (when it has one: a q = 1
        step keeps its row)."""
        q, d = sg.width, self._step_dev
        t0, acc, keep = self._off["tokens"], self._off["accepted"], self._off["keep"]
        top = argmax_rows(self._logits[:q], self._argmax_chunk)  # [q] int64
        self._accept_ids[:q].copy_(top)
        if sg.rollback is not None:
            n = torch.cumprod((top[:q - 1] == d[t0 + 1:t0 + q]).to(torch.int64), 0).sum(0, keepdim=True) + 1
            d[acc:acc + 1].copy_(torch.minimum(n, d[keep:keep + 1]))
            self._rollback_kernel(sg)

    def _capture_accept(self, sg: _StepGraph) -> None:
        """Capture :meth:`_accept_body` of ``sg`` as a CUDA graph (recorded, not run: the state is untouched)."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._accept_body(sg)
        torch.cuda.synchronize()
        self._accept_graphs[(sg.width, sg.context)] = g
        self.captures += 1

    def _launch_rollback(self, sg: _StepGraph, accepted: int) -> None:
        """The rollback kernel of ``sg`` for ``accepted`` rows: the count uploaded into the step buffer's
        ``accepted`` slot (the verify's ``pos`` is still there), then one launch on the current stream."""
        self._host_turn ^= 1
        h, done = self._step_hosts[self._host_turn], self._host_done[self._host_turn]
        done.synchronize()
        off = self._off["accepted"]
        h[off] = int(accepted)
        self._step_dev[off:off + 1].copy_(h[off:off + 1], non_blocking=True)
        done.record()
        self._rollback_kernel(sg)

    def _rollback_kernel(self, sg: _StepGraph) -> None:
        """Launch ``sg``'s rollback kernel on the current stream (it reads ``accepted`` from the step buffer)."""
        b = sg.rollback
        if sg.rollback_args is None:
            sg.rollback_args = b.kernel.pack(b.args)
        b.kernel.launch_packed(b.grid, b.block, sg.rollback_args, smem=b.smem)

    # ------------------------------------------------------------------------------------------ weights
    def _weight(self, name: str, form: str) -> torch.Tensor:
        key = (name, form)
        if key not in self._weights:
            dev = self.dev if getattr(self.mf, "generates_on_device", False) else None
            self._weights[key] = self._convert(name, form, dev).to(self.dev).contiguous()
        return self._weights[key]

    def _convert(self, name: str, form: str, device: torch.device | None = None) -> torch.Tensor:
        """A weight in the form a kernel reads, on the host (``raw``: the stored bytes, no copy), or made on
        ``device`` by a source that generates there (``generates_on_device``: the synthetic source)."""
        if form == "raw" or (form == "bf16" and self._types.get(name) == GGMLType.BF16):
            t = self.mf.stored(name, device)
            return t if form == "raw" else t.view(torch.bfloat16).reshape(self.mf.specs[name].shape)
        if form == "bf16":
            return self.mf.tensor(name, device=device).to(torch.bfloat16)
        return self.mf.tensor(name, device=device)  # f32, i64

    @_on_device
    def load_weights(self, forms: dict[str, str], progress: bool = True,
                     staging_bytes: int = 64 << 20) -> dict[str, float]:
        """Upload the weights ``forms`` names (GGUF name -> the form kernels read it in, from the lowered
        graphs' arguments: :meth:`prepare_all`), streaming the stored bytes from the memory map through two pinned staging buffers: the host copies
        chunk i+1 into one while the device copies chunk i out of the other (a side stream, events between),
        so page-cache reads and PCIe transfers overlap. Weights read in a converted form (fp32 norms and HC
        parameters, bf16 of a non-BF16 tensor, int64 tid2eid) are converted on the host first. A source that
        makes its tensors on the device (``generates_on_device``: ``synthetic:...``) generates each weight
        straight into device memory instead (nothing staged on the host).

        Returns (and keeps as :attr:`load_stats`): ``bytes``, ``seconds``, ``gb_per_s`` of this call.
        """
        todo = [(n, f) for n, f in forms.items() if (n, f) not in self._weights]
        if getattr(self.mf, "generates_on_device", False):
            return self._generate_weights(todo, progress)
        hosts = [(n, f, self._convert(n, f)) for n, f in todo]
        total = sum(h.numel() * h.element_size() for _n, _f, h in hosts)
        stage = [torch.empty(staging_bytes, dtype=torch.uint8).pin_memory() for _ in range(2)]
        free = [torch.cuda.Event() for _ in range(2)]
        stream = torch.cuda.Stream(self.dev)
        turn = 0
        t0 = time.perf_counter()
        with progress_bar(total, "weights", "B", unit_scale=True, disable=not progress or total < (256 << 20)) as bar:
            for name, form, h in hosts:
                dst = torch.empty(h.shape, dtype=h.dtype, device=self.dev)
                src, out = h.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
                for off in range(0, src.numel(), staging_bytes):
                    n = min(staging_bytes, src.numel() - off)
                    free[turn].synchronize()                 # the device is done with this buffer
                    stage[turn][:n].copy_(src[off:off + n])  # page cache -> pinned (host)
                    with torch.cuda.stream(stream):
                        out[off:off + n].copy_(stage[turn][:n], non_blocking=True)  # pinned -> device
                        free[turn].record(stream)
                    turn ^= 1
                    bar.update(n)
                self._weights[(name, form)] = dst
        stream.synchronize()
        dt = time.perf_counter() - t0
        self.load_stats = {"bytes": float(total), "seconds": dt, "gb_per_s": total / dt / 1e9 if dt > 0 else 0.0}
        return self.load_stats

    def _generate_weights(self, todo: list[tuple[str, str]], progress: bool) -> dict[str, float]:
        """:meth:`load_weights` of a source that makes its tensors on the device (the synthetic source): each
        weight is generated straight into device memory, nothing staged on the host."""
        t0 = time.perf_counter()
        total = 0
        with progress_bar(len(todo), "weights (generated)", "tensor", disable=not progress or len(todo) < 64) as bar:
            for name, form in todo:
                w = self._convert(name, form, self.dev).contiguous()
                self._weights[(name, form)] = w
                total += w.numel() * w.element_size()
                bar.update(1)
        torch.cuda.synchronize(self.dev)
        dt = time.perf_counter() - t0
        self.load_stats = {"bytes": float(total), "seconds": dt, "gb_per_s": total / dt / 1e9 if dt > 0 else 0.0}
        return self.load_stats

    # ------------------------------------------------------------------------------------------ graphs
    @_on_device
    def prepare(self, width: int, context: int) -> _StepGraph:
        """The step graph of (``width``, ``context``): pipelined, lowered, its binaries loaded and its arguments
        bound (once; later calls return it). :meth:`prepare_all` does this for every key at once, before
        the first step; this is the one-key form (tools, tests).

        Raises:
            StepError: the key is not among the compiled widths and context buckets.
            ArtifactError: in artifact mode, the artifact lacks the key or this arch.
        """
        key = (width, context)
        sg = self._graphs.get(key)
        if sg is not None:
            return sg
        g, kernels = self._build(width, context)
        return self._bind(width, context, g, kernels, self._binaries([(key, kernels)], progress=False)[0])

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
        widths = tuple(widths or self.buckets.widths)
        limit = min(max_ctx or self.buckets.max_ctx, self.buckets.max_ctx)
        last = self.buckets.bucket(limit - 1, 1)  # buckets are contiguous: every one up to the last position's
        contexts = [c for c in self.buckets.contexts if c <= last]
        keys = [(w, c) for w in widths for c in contexts if (w, c) not in self._graphs]
        if not any(w in self.prefill_chunks for w in widths):  # default: every prefill chunk graph too
            keys += [(n, c) for n in self.prefill_chunks for c in contexts if n <= c and (n, c) not in self._graphs]
        mem0 = torch.cuda.memory_allocated(self.dev)
        t0 = time.perf_counter()
        built = {k: self._build(*k) for k in keys}
        t1 = time.perf_counter()
        bins = self._binaries([(k, kernels) for k, (_g, kernels) in built.items()], progress=progress)
        t2 = time.perf_counter()
        forms = {a.name: a.form or "f32" for _g, kernels in built.values() for k in kernels for la in k.launches
                 for a in la.args if a.kind == "weight"}
        self.load_weights(forms, progress=progress)
        layouts = [self._layout(g, kernels) for g, kernels in built.values()]
        need = max((n for _l, n in layouts), default=0)
        if need and (self._arena is None or self._arena.numel() < need):
            self._arena = torch.zeros(need, dtype=torch.uint8, device=self.dev)
        mem_w = torch.cuda.memory_allocated(self.dev)
        for (k, (g, kernels)), b, lay in zip(built.items(), bins, layouts):
            self._bind(k[0], k[1], g, kernels, b, lay)
        t3 = time.perf_counter()
        for k in keys:
            self._capture(self._graphs[k])
        if self.is_last and self.use_graphs:  # the greedy acceptance behind each step (speculative decoding)
            for k in keys:
                if k[0] not in self.prefill_chunks:  # a prefill chunk is never verified
                    self._capture_accept(self._graphs[k])
        if 1 in widths:  # the decode loop's graphs: the q=1 step + the sampler, per bucket (a shard before
            for (w, c) in keys:  # the last of a split: the step + advancing its scalars)
                if w == 1:
                    for mode in self.decode_modes:
                        self._decode_graph(c, mode)
        self.reset()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        graph_bytes = torch.cuda.memory_allocated(self.dev) - mem_w + sum(
            t.numel() * t.element_size() for t in (self._logits, self.hc_in, self.hc_out) if t is not None)
        out = {"graphs": len(keys), "build_s": t1 - t0, "compile_s": t2 - t1, "load_s": t3 - t2,
               "capture_s": t4 - t3, "weights": dict(self.load_stats), "graph_bytes": int(graph_bytes),
               "weight_bytes": int(mem_w - mem0), "capture_ms": {f"{w}x{c}": ms for (w, c), ms in
                                                                 self.capture_ms.items()}}
        self.prepare_stats = out
        return out

    def _build(self, width: int, context: int) -> tuple[Graph, list[LoweredKernel]]:
        """The graph and kernels of key (``width``, ``context``): a step of ``width`` rows, or with ``width`` one of
        :attr:`prefill_chunks` (always above the verify widths) the prefill chunk graph of that many rows."""
        chunk = width in self.prefill_chunks
        if not (width in self.buckets.widths or chunk) or context not in self.buckets.contexts \
                or (chunk and width > context):
            raise StepError(f"no compiled graph for (width {width}, context {context}): compiled widths "
                            f"{list(self.buckets.widths)}, prefill chunks {list(self.prefill_chunks)}, contexts "
                            f"{list(self.buckets.contexts)}")
        g = run_pipeline(build_step(self.cfg, width, self.capacity, self.layers if self._split else None,
                                    taps=self.taps, record_hc=self.record_hc, prefill=chunk),
                         "default", context=context).graph
        return g, lower_graph(g, self.cfg, self.target, self._types)

    def _binaries(self, graphs: list[tuple[tuple[int, int], list[LoweredKernel]]],
                  progress: bool) -> list[list[tuple[str, Any]]]:
        """Per graph ``((width, context), kernels)``, per launch: ``(module key, loader)`` where the loader
        returns the binary image; compiles the cache misses of all graphs in one parallel batch (artifact
        mode: the artifact's files, nothing compiled; a key whose width is one of :attr:`prefill_chunks` is the
        artifact's prefill chunk graph ``p{C}_c{context}``)."""
        if self._manifest is not None:
            out = []
            for (w, c), kernels in graphs:
                paths = launch_binaries(self._manifest, self.artifact, self.target.arch, w, c, kernels, self._types,
                                        self.shard if self._split else None, prefill=w in self.prefill_chunks)
                out.append([(str(p), p.read_bytes) for p in paths])
            return out
        self.binary_batches += 1
        srcs = {la.kernel.digest(): la.kernel for _k, ks in graphs for k in ks for la in k.launches}
        compiled = dict(zip(srcs, self.cache.compile_many(list(srcs.values()), progress=progress)))
        return [[(compiled[la.kernel.digest()].key, compiled[la.kernel.digest()].binary)
                 for k in ks for la in k.launches] for _k, ks in graphs]

    def _layout(self, g: Graph, kernels: list[LoweredKernel]) -> tuple[dict[str, tuple[int, int, tuple, Any]], int]:
        """The activation arena layout of one graph (:func:`arena_layout`; state, constants, the logits and the
        HC hand-over buffers live elsewhere)."""
        return arena_layout(g, kernels, set(self.state) | {"logits", "hc_in", "hc_out"})

    # -- what another compiled graph set on this device shares with the step (the DSpark drafter:
    #    runtime/dspark_exec.py)
    def shared_weight(self, name: str, form: str) -> torch.Tensor:
        """The device tensor of weight ``name`` in ``form`` as the step's kernels read it (uploaded now if no graph
        of the step read it yet): one copy for the step and whatever else reads it (the DSpark drafter reads the
        target's embedding and head)."""
        with torch.cuda.device(self.dev):
            return self._weight(name, form)

    def module(self, key: str, image: Any) -> CudaModule:
        """The loaded binary of kernel-cache ``key`` (``image()`` returns its bytes), loaded once per step and
        shared by every graph bound here."""
        mod = self._modules.get(key)
        if mod is None:
            with torch.cuda.device(self.dev):
                mod = self._modules[key] = CudaModule(image())
        return mod

    def _bind(self, width: int, context: int, g: Graph, kernels: list[LoweredKernel],
              binaries: list[tuple[str, Any]], layout: tuple[dict, int] | None = None) -> _StepGraph:
        sg = _StepGraph(width, context, g, kernels)
        names = value_names(g)
        consts = {names[op.outputs[0]]: op.attrs["data"] for op in g.ops if op.kind == "const"}
        slots, need = layout or self._layout(g, kernels)
        if self._arena is None or self._arena.numel() < need:
            # a graph prepared on its own after the others: a larger arena for it and later ones (earlier
            # graphs keep the buffer they were bound to)
            self._arena = torch.zeros(max(need, 1), dtype=torch.uint8, device=self.dev)
        for name, (off, n, shape, dt) in slots.items():
            sg.values[name] = self._arena[off:off + n].view(dt).view(shape)
        if self._logits is not None:  # a prefill chunk's head reads its last valid row only: one logits row
            sg.values["logits"] = self._logits[:1 if width in self.prefill_chunks else width]
        for name, buf in (("hc_in", self.hc_in), ("hc_out", self.hc_out)):
            if buf is not None:
                sg.values[name] = buf[:width]
        pairs = [(k.name, la) for k in kernels for la in k.launches]
        for (kname, la), (mkey, image) in zip(pairs, binaries):
            fn = self.module(mkey, image).function(la.kernel.entry, la.smem)
            args = [self._resolve(a, sg, consts) for a in la.args]
            bound = _Bound(fn, la.grid, la.block, la.smem, args, self.programmatic and la.kernel.programmatic_launch)
            if kname == ROLLBACK_KERNEL:
                sg.rollback = bound
            else:
                sg.launches.append(bound)
        self._graphs[(width, context)] = sg
        return sg

    def _resolve(self, a: Arg, sg: _StepGraph, consts: dict[str, torch.Tensor]) -> Any:
        return resolve_arg(a, sg.values, consts, self.state, self._step_dev, self._off, self._workspaces,
                           self._weight, self.dev)

    # ------------------------------------------------------------------------------------------ steps
    def _begin(self, tokens: list[int], pos: int) -> _StepGraph:
        """Check that ``pos`` is the sequence's next position, get the step graph of (``len(tokens)``, bucket)
        and upload the step's scalars. Raises StepError as :meth:`step`."""
        if pos != self.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.pos}")
        sg = self.prepare(len(tokens), self.buckets.bucket(pos, len(tokens)))
        self._upload(tokens, pos)
        return sg

    def _upload(self, tokens: list[int], pos: int, rows: int | None = None) -> None:
        """Write the step's scalars into the pinned host buffer and copy them to the device (one copy);
        ``rows``: a prefill chunk's row count (:meth:`fill_scalars`)."""
        # two pinned host buffers used in turn; a buffer is rewritten only after its last copy has run
        self._host_turn ^= 1
        h, done = self._step_hosts[self._host_turn], self._host_done[self._host_turn]
        done.synchronize()
        self.fill_scalars(self._step_np[self._host_turn], tokens, pos, rows=rows)
        self._step_dev.copy_(h, non_blocking=True)  # the one upload of the step
        done.record()

    def fill_scalars(self, a: np.ndarray, tokens: list[int], pos: int, keep: int | None = None,
                     rows: int | None = None) -> None:
        """Write a step's scalars (``pos``, ``live_r`` = (pos + q) // r, the rows' positions and tokens, ``keep``,
        the most rows :meth:`accept_on_device` may keep: default all, and ``n_valid`` = q) into ``a``, an int64
        numpy view of a host copy of the step buffer (layout :attr:`step_offsets`). ``rows`` (a prefill chunk
        of C >= q rows): the padded rows q..C-1 get positions pos + q .. pos + C - 1 and token 0 (computed,
        never kept: the chunk's kernels write no state past ``n_valid``)."""
        q, off = len(tokens), self._off
        n = q if rows is None else rows
        a[off["pos"]] = pos
        a[off["keep"]] = q if keep is None else keep
        a[off["n_valid"]] = q
        for r in self._ratios:
            a[off[f"live_r{r}"]] = (pos + q) // r
        a[off["positions"]:off["positions"] + n] = range(pos, pos + n)
        a[off["tokens"]:off["tokens"] + q] = tokens
        a[off["tokens"] + q:off["tokens"] + n] = 0

    @property
    def step_offsets(self) -> dict[str, int]:
        """Where each scalar sits in the int64 step buffer the kernels read (``pos``, ``live_r{r}``,
        ``positions``, ``tokens``, ``accepted``, ``keep``, ``n_valid``)."""
        return dict(self._off)

    @_on_device
    def step(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Run ``len(tokens)`` rows at ``pos..``; returns fp32 logits [q, vocab] (a device tensor, valid until
        the next step of the same width and bucket); a shard before the last of a split returns its outgoing HC
        state rows (:attr:`hc_out` ``[:q]``).

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past max_ctx, or no compiled
                graph for the (width, bucket) key.
        """
        sg = self._begin(tokens, pos)
        self._go(sg, pos + len(tokens))
        return sg.values["logits"] if self.is_last else sg.values["hc_out"]

    def _go(self, sg: _StepGraph, end: int) -> None:
        """Run ``sg`` (its scalars uploaded): replay its CUDA graph, or launch its kernels without graphs; the
        sequence then ends at position ``end``."""
        if self.use_graphs:
            if sg.cuda_graph is None:
                # first use without prepare_all: the warm-up run inside _capture is this step's result
                self._capture(sg)
            else:
                sg.cuda_graph.replay()
        else:
            self._run(sg)
        self.pos = end
        self._tap_end = max(self._tap_end, self.pos)

    @_on_device
    def prefill(self, tokens: list[int], pos: int, chunks: tuple[int, ...] | None = None) -> torch.Tensor:
        """Ingest ``tokens`` at ``pos..`` (a prompt, or the rest of one) and return the fp32 logits of the last
        one, ``[1, vocab]`` (a device tensor, valid until the next step). With :attr:`prefill_chunks`: chunk
        graphs picked by :func:`~ds4c.buckets.prefill_chunk_for` (a padded chunk at least half full, else the largest full one,
        a tail under ``MIN_PREFILL_CHUNK`` tokens as verify steps of the widest width); without: verify steps
        only. The state afterwards is what token-wise decoding leaves (the chunk kernels write no state past
        ``n_valid``; docs/prefill.md). Nothing here can be rolled back. ``chunks``: a subset of
        :attr:`prefill_chunks` to use instead (``()``: verify steps only; the benchmark's baseline).

        :attr:`last_prefill` then says how: ``{"chunks": [[rows, valid], ...], "verify_tokens": n}``.

        Raises:
            StepError: ``pos`` is not the sequence's next position, no tokens, positions past max_ctx, or
                ``chunks`` not among the prepared chunk sizes.
        """
        use = self.prefill_chunks if chunks is None else tuple(sorted(chunks))
        if not set(use) <= set(self.prefill_chunks):
            raise StepError(f"prefill chunks {list(use)}: this step holds chunk graphs of {list(self.prefill_chunks)}")
        if pos != self.pos:
            raise StepError(f"prefill at position {pos}, but the sequence's next position is {self.pos}")
        n = len(tokens)
        if n == 0:
            raise StepError("prefill of no tokens (expected at least one)")
        if pos + n > self.buckets.max_ctx:
            raise StepError(f"positions {pos}..{pos + n - 1} exceed max_ctx={self.buckets.max_ctx}")
        self._undo = None  # a rollback after this would restore what the chunk overwrote: nothing to restore
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
            logits = self._chunk(tokens[i:i + k], pos + i, c)
            i += k
            plan["chunks"].append([c, k])
        self.last_prefill = plan
        return logits

    def _chunk(self, tokens: list[int], pos: int, rows: int) -> torch.Tensor:
        """One prefill chunk graph of ``rows`` rows over ``tokens`` (``len(tokens) <= rows``; the rest padding) at
        ``pos``; returns its logits ``[1, vocab]``."""
        sg = self._begin_chunk(tokens, pos, rows)
        self._go(sg, pos + len(tokens))
        return sg.values["logits"]

    def _begin_chunk(self, tokens: list[int], pos: int, rows: int) -> _StepGraph:
        """The chunk graph of ``rows`` rows in the smallest context bucket holding ``pos + rows``, its scalars
        uploaded (as :meth:`_begin` for a step)."""
        sg = self.prepare(rows, next(c for c in self.buckets.contexts if pos + rows <= c))
        self._upload(tokens, pos, rows=rows)
        return sg

    # the stepper interface of ds4c.generate.generate
    @property
    def max_ctx(self) -> int:
        return self.buckets.max_ctx

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1). Returns fp32 logits [1, vocab]."""
        return self.step([token], pos)

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
        if not self.use_graphs:
            raise StepError("decode_tokens needs use_graphs=True")
        if self._split:
            raise StepError("decode_tokens runs an unsplit step; a layer split's shards are driven by ShardedStep")
        if pos != self.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.pos}")
        if pos + n > self.buckets.max_ctx:
            raise StepError(f"positions {pos}..{pos + n - 1} exceed max_ctx={self.buckets.max_ctx}")
        if n <= 0:
            return
        lag = max(1, min(int(lag), 32))
        mode = "greedy" if temperature == 0 else "sample"
        with torch.cuda.device(self.dev):
            sampler = self._device_sampler()
            sampler.configure(temperature, top_k, top_p, seed)
            ring = sampler.ring_size
            host, done = self._ring_host
            contexts = [self.buckets.bucket(pos + i, 1) for i in range(n)]
            graphs = {c: self._decode_graph(c, mode) for c in sorted(set(contexts))}  # captured by prepare_all
            graphs = [graphs[c] for c in contexts]
            self._upload([token], pos)
        launched = consumed = 0
        try:
            while consumed < n:
                with torch.cuda.device(self.dev):  # not held across the yield: the caller's device is its own
                    while launched < n and launched - consumed < lag:
                        graphs[launched].replay()
                        slot = launched % ring
                        host[slot:slot + 1].copy_(sampler.ring[slot:slot + 1], non_blocking=True)
                        done[slot].record()
                        launched += 1
                    slot = consumed % ring
                    done[slot].synchronize()
                consumed += 1
                yield int(host[slot])
        finally:
            self.pos = pos + launched
            self._tap_end = max(self._tap_end, self.pos)

    def _device_sampler(self):
        from ds4c.runtime.sampler import DeviceSampler

        if self._sampler is None:
            self._sampler = DeviceSampler(self.cfg.vocab_size, self.dev, ring=64)
            # where the ids come back: a pinned copy of the ring and one event per slot (allocated once:
            # pinning memory costs milliseconds)
            self._ring_host = (torch.zeros(64, dtype=torch.int64).pin_memory(),
                               [torch.cuda.Event() for _ in range(64)])
        return self._sampler

    def _sampler_body(self, mode: str) -> Any:
        """The sampler + advance operations of ``mode`` (``greedy`` or ``sample``) as a closure to capture: reads
        logits row 0, writes the id to the ring and the next step's token slot (and to every tensor of
        :attr:`token_sinks`: the token slots of the other shards of a split on this device), and moves the step
        scalars one position on (``pos``, ``live_r`` = (pos + 1) // r, ``positions[0]``). Mode ``advance`` (a
        shard before the last of a split) only moves the scalars on. Run once eagerly on first use
        (allocator, kernels), its effects undone."""
        body = self._sampler_bodies.get(mode)
        if body is not None:
            return body
        sampler = self._device_sampler() if mode != "advance" else None
        d, off = self._step_dev, self._off
        sinks = list(self.token_sinks)
        head = torch.tensor([off["pos"]] + [off[f"live_r{r}"] for r in self._ratios] + [off["positions"]],
                            dtype=torch.int64, device=self.dev)
        add = torch.tensor([1] + [2] * len(self._ratios) + [1], dtype=torch.int64, device=self.dev)
        div = torch.tensor([1] + list(self._ratios) + [1], dtype=torch.int64, device=self.dev)

        def body() -> None:
            # pos' = pos + 1, live_r = (pos' + 1) // r, positions[0] = pos': one vector op from the old pos
            if mode == "advance":
                d.index_copy_(0, head, torch.div(d[off["pos"]] + add, div, rounding_mode="floor"))
                return
            tok = sampler.greedy(self._logits[0]) if mode == "greedy" else sampler.sample(self._logits[0])
            d.index_copy_(0, head, torch.div(d[off["pos"]] + add, div, rounding_mode="floor"))
            d[off["tokens"]:off["tokens"] + 1].copy_(tok)
            for t in sinks:
                t.copy_(tok)

        keep = [d] + sinks + ([] if sampler is None else [sampler.counter, sampler.ring])
        saved = [t.clone() for t in keep]
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for t, v in zip(keep, saved):
            t.copy_(v)
        self._sampler_bodies[mode] = body
        return body

    def _decode_graph(self, context: int, mode: str) -> Any:
        """One CUDA graph of a decode step in bucket ``context`` followed by the sampler of ``mode``
        (:meth:`_sampler_body`): what :meth:`decode_tokens` replays once per token. Capturing records without
        running, so it leaves the sequence as it was."""
        g = self._decode_graphs.get((context, mode))
        if g is not None:
            return g
        sg = self.prepare(1, context)
        body = self._sampler_body(mode)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._run(sg)
            body()
        torch.cuda.synchronize()
        self._decode_graphs[(context, mode)] = g
        self.captures += 1
        return g

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
        if rows is None:
            sg = self._begin(tokens, pos)
        else:
            if rows not in self.prefill_chunks or len(tokens) > rows or pos != self.pos:
                raise StepError(f"time_launches: expected a chunk of {list(self.prefill_chunks)} rows holding "
                                f"{len(tokens)} tokens at the next position {self.pos}, found rows={rows} pos={pos}")
            sg = self._begin_chunk(tokens, pos, rows)
        snap = self.snapshot()
        pairs = [(k, la) for k in sg.kernels if k.name != ROLLBACK_KERNEL for la in k.launches]  # as sg.launches
        assert len(pairs) == len(sg.launches), (len(pairs), len(sg.launches))
        evs = [[torch.cuda.Event(enable_timing=True) for _ in range(len(pairs) + 1)] for _ in range(repeats)]
        for r in range(repeats):
            self.restore(snap)
            evs[r][0].record()
            for i, b in enumerate(sg.launches):
                b.kernel(b.grid, b.block, b.args, smem=b.smem)
                evs[r][i + 1].record()
        torch.cuda.synchronize()
        self.restore(snap)
        out = []
        for i, (k, la) in enumerate(pairs):
            ts = sorted(evs[r][i].elapsed_time(evs[r][i + 1]) * 1e3 for r in range(repeats))
            out.append({"kernel": k.name, "family": k.family, "layer": k.layer, "entry": la.kernel.entry,
                        "us": ts[len(ts) // 2]})
        return out

    @_on_device
    def time_replays(self, tokens: list[int], pos: int, repeats: int = 50) -> float:
        """Median milliseconds of the step's CUDA graph replayed ``repeats`` times back to back (CUDA events
        between replays, no host work in between); the graph is captured first if needed. The state is
        snapshotted and restored, so the sequence is unchanged.

        Raises:
            StepError: as :meth:`step`, or ``use_graphs`` is off.
        """
        if not self.use_graphs:
            raise StepError("time_replays needs use_graphs=True")
        snap = self.snapshot()
        self.step(tokens, pos)  # captures the graph on first use; uploads this step's scalars
        self.restore(snap)
        sg = self._graphs[(len(tokens), self.buckets.bucket(pos, len(tokens)))]
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        evs[0].record()
        for i in range(repeats):
            sg.cuda_graph.replay()
            evs[i + 1].record()
        torch.cuda.synchronize()
        self.restore(snap)
        ts = sorted(evs[i].elapsed_time(evs[i + 1]) for i in range(repeats))
        return ts[len(ts) // 2]

    def values(self, width: int, context: int) -> dict[str, torch.Tensor]:
        """The device tensors of the (``width``, ``context``) graph by IR value name, e.g. ``l3.route.ids``;
        empty when the graph was never prepared. Activations live in the arena all graphs share: they hold what
        the last step of any graph left there, so read them right after a step of this graph."""
        sg = self._graphs.get((width, context))
        return {} if sg is None else sg.values

    @property
    def capture_ms(self) -> dict[tuple[int, int], float]:
        """Milliseconds each captured (width, context) graph took to capture."""
        return {k: g.capture_s * 1e3 for k, g in self._graphs.items() if g.cuda_graph is not None}

    def _capture(self, sg: _StepGraph) -> None:
        """Run ``sg`` once eagerly (module loads, lazy attributes), then capture it as a CUDA graph in the
        shared pool. The eager run writes the state: in :meth:`step` it is that step's result (its scalars
        were uploaded); :meth:`prepare_all` resets the state afterwards."""
        self._run(sg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sg.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sg.cuda_graph, pool=self._pool):
            self._run(sg)
        torch.cuda.synchronize()
        sg.capture_s = time.perf_counter() - t0
        self.captures += 1

    def _run(self, sg: _StepGraph) -> None:
        for b in sg.launches:
            b.kernel(b.grid, b.block, b.args, smem=b.smem, programmatic=b.programmatic)
        if self._handoff is not None:  # the next shard is on this device: its hc_in, copied inside the graph
            self._handoff[:sg.width].copy_(self.hc_out[:sg.width])

    def token_slot(self) -> torch.Tensor:
        """The device view of the next step's first token id (int64 [1]) in this step's scalar buffer: where
        a split's last shard writes the sampled id."""
        return self._step_dev[self._off["tokens"]:self._off["tokens"] + 1]

    def hand_off_to(self, dst: torch.Tensor) -> None:
        """Make every step of this shard end by copying its outgoing HC state rows into ``dst`` (the next
        shard's :attr:`hc_in`, on this same device), inside the captured graphs. Call before :meth:`prepare_all`
        (graphs captured earlier do not copy).

        Raises:
            StepError: this shard is the last one, or ``dst`` is on another device or of another shape.
        """
        if self.hc_out is None:
            raise StepError("hand_off_to: the last shard has no outgoing HC state")
        if dst.device != self.dev or dst.shape != self.hc_out.shape or dst.dtype != self.hc_out.dtype:
            raise StepError(f"hand_off_to: expected a {self.hc_out.dtype} {list(self.hc_out.shape)} tensor on "
                            f"{self.dev}, found {dst.dtype} {list(dst.shape)} on {dst.device}")
        self._handoff = dst
