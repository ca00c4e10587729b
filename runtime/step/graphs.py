"""The compiled step's graphs: one launch list per (width, context bucket) key, built from the IR (``build_step``),
through the pass pipeline and lowered; its binaries compiled through the kernel cache (or taken from an AOT
artifact) and loaded once per step; its arguments bound to the weights, the sequence state, the step buffer, the
workspaces and one activation arena all graphs share; captured as a CUDA graph (one memory pool) and replayed.

Every graph writes its logits rows into one buffer (the last shard of a split only); a shard's incoming / outgoing
HC state rows have one buffer each (``hc_in`` / ``hc_out``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.ir import build_step
from ds4c.ir.graph import Graph
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.quant import GGMLType
from ds4c.runtime.artifact_serve import launch_binaries
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.launch import CudaModule
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lower_step import ROLLBACK_KERNEL
from ds4c.runtime.lowered import Arg, LoweredKernel
from ds4c.runtime.step.binding import Bound, StepGraph, arena_layout, lane_of, lane_segments, resolve_arg
from ds4c.runtime.step.lane_batch import bind_lane_args
from ds4c.runtime.step.scalars import StepScalars
from ds4c.runtime.step.weights import StepWeights
from ds4c.runtime.targets import Target


class StepGraphs:
    """Every graph of one compiled step (or shard), keyed ``(width, context)``.

    Args:
        cfg, buckets, capacity: the model's config, the widths and context buckets served, the state's positions.
        layers, split: the layer range the graphs run, and whether it is a shard of a layer split (``shard``: its
            index, for the artifact's binaries).
        taps, record_hc: the DSpark taps and the final HC recording every graph writes.
        prefill_chunks: the prefill chunk graphs' row counts (a key whose width is one of them is that chunk graph).
        types: each weight's storage type; target: the kernel target; cache: the kernel cache.
        manifest, artifact: an AOT artifact's loaded manifest and folder (binaries from it, nothing compiled), or
            None.
        programmatic: launch the kernels that allow it with programmatic stream serialization.
        weights, state, scalars: what the arguments are bound to: the step's weights, the sequence's buffers
            (``StepSequence.buffers``: bound by name, never replaced) and the step buffer.
        is_first, is_last: the shard embeds the tokens / runs the head (the logits buffer).
        dev: the step's CUDA device.

    Attributes: ``by_key`` (``(width, context) -> StepGraph``), ``modules`` (loaded binaries by kernel-cache key),
    ``workspaces``, ``arena``, ``pool`` (the CUDA graph memory pool of every capture of the step), ``logits`` (fp32
    ``[max width, vocab]``, None before the last shard), ``hc_in`` / ``hc_out`` (bf16 ``[max width, hc, hidden]``:
    None on the first / last shard), ``handoff`` (the next shard's ``hc_in`` on this device, copied inside the
    graphs, or None), ``captures`` (CUDA graphs captured so far, all kinds), ``binary_batches`` (batches fetched
    from the kernel cache).
    """

    def __init__(self, *, cfg: Any, buckets: Any, capacity: int, layers: tuple[int, int], split: bool, shard: int,
                 taps: tuple[int, ...], record_hc: bool, prefill_chunks: tuple[int, ...],
                 types: dict[str, GGMLType], target: Target, cache: KernelCache, manifest: Any,
                 artifact: str | None, programmatic: bool, weights: StepWeights, state: dict[str, torch.Tensor],
                 scalars: StepScalars, is_first: bool, is_last: bool, dev: torch.device):
        self.cfg, self.buckets, self.capacity, self.layers = cfg, buckets, capacity, layers
        self.split, self.shard, self.taps, self.record_hc = split, shard, taps, record_hc
        self.prefill_chunks, self.types, self.target, self.cache = prefill_chunks, types, target, cache
        self.manifest, self.artifact, self.programmatic = manifest, artifact, programmatic
        self.weights, self.state, self.scalars, self.dev = weights, state, scalars, dev
        self.by_key: dict[tuple[int, int], StepGraph] = {}
        self.modules: dict[str, CudaModule] = {}
        self.workspaces: dict[str, torch.Tensor] = {}
        maxq = max(buckets.widths)  # the logits and hand-over buffers' rows
        hc_shape = (maxq, cfg.hc_mult, cfg.hidden_size)
        self.logits = torch.zeros(maxq, cfg.vocab_size, dtype=torch.float32, device=dev) if is_last else None
        self.hc_in = None if is_first else torch.zeros(hc_shape, dtype=torch.bfloat16, device=dev)
        self.hc_out = None if is_last else torch.zeros(hc_shape, dtype=torch.bfloat16, device=dev)
        self.handoff: torch.Tensor | None = None
        self.arena: torch.Tensor | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.binary_batches = 0
        #: a lanes step's graphs (ds4c.runtime.step.lanes): each lane's per-lane launches (attention, compressor,
        #: indexer, ring write) on a stream of its own, forked after and joined before the row-wise launches, so
        #: the lanes' small kernels run side by side instead of one after another; 0 = every launch on the
        #: current stream. Set before the first bind (per-lane launches then get per-lane workspaces).
        self.lane_streams = 0
        self._streams: list[torch.cuda.Stream] = []

    # ------------------------------------------------------------------------------------------ build
    def prepare(self, width: int, context: int) -> StepGraph:
        """The graph of (``width``, ``context``), built, lowered, its binaries loaded and its arguments bound once
        (later calls return it). Raises StepError for a key not served; ArtifactError as :meth:`binaries`."""
        key = (width, context)
        sg = self.by_key.get(key)
        if sg is not None:
            return sg
        g, kernels = self.build(width, context)
        return self.bind(width, context, g, kernels, self.binaries([(key, kernels)], progress=False)[0])

    def build(self, width: int, context: int) -> tuple[Graph, list[LoweredKernel]]:
        """The graph and kernels of key (``width``, ``context``): a step of ``width`` rows, or with ``width`` one of
        :attr:`prefill_chunks` (always above the verify widths) the prefill chunk graph of that many rows."""
        chunk = width in self.prefill_chunks
        if not (width in self.buckets.widths or chunk) or context not in self.buckets.contexts \
                or (chunk and width > context):
            raise StepError(f"no compiled graph for (width {width}, context {context}): compiled widths "
                            f"{list(self.buckets.widths)}, prefill chunks {list(self.prefill_chunks)}, contexts "
                            f"{list(self.buckets.contexts)}")
        g = run_pipeline(build_step(self.cfg, width, self.capacity, self.layers if self.split else None,
                                    taps=self.taps, record_hc=self.record_hc, prefill=chunk),
                         "default", context=context).graph
        return g, lower_graph(g, self.cfg, self.target, self.types)

    def binaries(self, graphs: list[tuple[tuple[int, int], list[LoweredKernel]]],
                 progress: bool) -> list[list[tuple[str, Any]]]:
        """Per graph ``((width, context), kernels)``, per launch: ``(module key, loader)`` where the loader
        returns the binary image; compiles the cache misses of all graphs in one parallel batch (artifact
        mode: the artifact's files, nothing compiled; a key whose width is one of :attr:`prefill_chunks` is the
        artifact's prefill chunk graph ``p{C}_c{context}``)."""
        if self.manifest is not None:
            out = []
            for (w, c), kernels in graphs:
                paths = launch_binaries(self.manifest, self.artifact, self.target.arch, w, c, kernels, self.types,
                                        self.shard if self.split else None, prefill=w in self.prefill_chunks)
                out.append([(str(p), p.read_bytes) for p in paths])
            return out
        self.binary_batches += 1
        srcs = {la.kernel.digest(): la.kernel for _k, ks in graphs for k in ks for la in k.launches}
        compiled = dict(zip(srcs, self.cache.compile_many(list(srcs.values()), progress=progress)))
        return [[(compiled[la.kernel.digest()].key, compiled[la.kernel.digest()].binary)
                 for k in ks for la in k.launches] for _k, ks in graphs]

    def layout(self, g: Graph, kernels: list[LoweredKernel], state: dict[str, torch.Tensor] | None = None
               ) -> tuple[dict[str, tuple[int, int, tuple, Any]], int]:
        """The activation arena layout of one graph (:func:`arena_layout`; state (``state``, default the step's),
        constants, the logits and the HC hand-over buffers live elsewhere)."""
        return arena_layout(g, kernels, set(self.state if state is None else state) | {"logits", "hc_in", "hc_out"})

    def module(self, key: str, image: Any) -> CudaModule:
        """The loaded binary of kernel-cache ``key`` (``image()`` returns its bytes), loaded once per step and
        shared by every graph bound here."""
        mod = self.modules.get(key)
        if mod is None:
            with torch.cuda.device(self.dev):
                mod = self.modules[key] = CudaModule(image())
        return mod

    def bind(self, width: int, context: int, g: Graph, kernels: list[LoweredKernel],
             binaries: list[tuple[str, Any]], layout: tuple[dict, int] | None = None, key: Any = None,
             state: dict[str, torch.Tensor] | None = None) -> StepGraph:
        """Bind every launch of the graph (``binaries``: :meth:`binaries`' entry for it; ``layout``: its arena
        layout, :meth:`layout` when None) and keep it under ``key`` (default ``(width, context)``). ``state``: the
        state buffers by name (default the step's; a lanes graph with a prompt lane binds that lane to another
        slot)."""
        sg = StepGraph(width, context, g, kernels)
        state = self.state if state is None else state
        names = value_names(g)
        consts = {names[op.outputs[0]]: op.attrs["data"] for op in g.ops if op.kind == "const"}
        slots, need = layout or self.layout(g, kernels, state)
        if self.arena is None or self.arena.numel() < need:
            # a graph prepared on its own after the others: a larger arena for it and later ones (earlier
            # graphs keep the buffer they were bound to)
            self.arena = torch.zeros(max(need, 1), dtype=torch.uint8, device=self.dev)
        for name, (off, n, shape, dt) in slots.items():
            sg.values[name] = self.arena[off:off + n].view(dt).view(shape)
        if self.logits is not None:  # a prefill chunk's head reads its last valid row only: one logits row
            sg.values["logits"] = self.logits[:1 if width in self.prefill_chunks else width]
        for name, buf in (("hc_in", self.hc_in), ("hc_out", self.hc_out)):
            if buf is not None:
                sg.values[name] = buf[:width]
        pairs = [(k.name, la) for k in kernels for la in k.launches]
        for (kname, la), (mkey, image) in zip(pairs, binaries):
            fn = self.module(mkey, image).function(la.kernel.entry, la.smem)
            lane = lane_of(la.args) if self.lane_streams and not la.lanes else None
            if lane is not None:  # lanes run side by side: a per-lane launch's scratch is its lane's own
                la = dataclasses.replace(la, args=tuple(
                    dataclasses.replace(a, name=f"{a.name}@lane{lane}") if a.kind == "workspace" else a
                    for a in la.args))
            if la.lanes:  # one launch over the lanes (runtime/step/lane_batch.py)
                args = bind_lane_args(la, lambda a, q, la=la: self._resolve_lane(a, sg, consts, state, q,
                                                                                 len(la.lanes)))
            else:
                args = [self._resolve(a, sg, consts, state) for a in la.args]
            bound = Bound(fn, la.grid, la.block, la.smem, args, self.programmatic and la.kernel.programmatic_launch,
                          lane)
            if kname == ROLLBACK_KERNEL:
                sg.rollback = bound
            else:
                sg.launches.append(bound)
        self.by_key[(width, context) if key is None else key] = sg
        return sg

    def _resolve_lane(self, a: Arg, sg: StepGraph, consts: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                      lane: int, lanes: int) -> Any:
        """One lane's argument of a lane-batched launch: a workspace is that lane's part of one buffer of ``lanes``
        equal parts (so the lanes' scratch sits a constant stride apart); anything else as :meth:`_resolve`."""
        if a.kind != "workspace":
            return self._resolve(a, sg, consts, state)
        part = (a.nbytes + 255) // 256 * 256
        whole = self._resolve(dataclasses.replace(a, name=f"{a.name}@x{lanes}", nbytes=part * lanes), sg, consts,
                              state)
        return whole[lane * part:]

    def _resolve(self, a: Arg, sg: StepGraph, consts: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> Any:
        return resolve_arg(a, sg.values, consts, state, self.scalars.buffer, self.scalars.offsets,
                           self.workspaces, self.weights.get, self.dev)

    # ------------------------------------------------------------------------------------------ run
    def capture(self, sg: StepGraph) -> None:
        """Run ``sg`` once eagerly (module loads, lazy attributes), then capture it as a CUDA graph in the
        shared pool. The eager run writes the state: in a step it is that step's result (its scalars were
        uploaded); ``prepare_all`` resets the state afterwards."""
        self.run(sg)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sg.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sg.cuda_graph, pool=self.pool):
            self.run(sg)
        torch.cuda.synchronize()
        sg.capture_s = time.perf_counter() - t0
        self.captures += 1

    def run(self, sg: StepGraph) -> None:
        """Launch ``sg``'s kernels on the current stream (and the hand-over copy to the next shard on this device);
        with :attr:`lane_streams`, each run of per-lane launches on the lanes' streams (forked from and joined back
        into the current stream: a captured graph holds them as parallel branches)."""
        if not self.lane_streams:
            for b in sg.launches:
                b.kernel(b.grid, b.block, b.args, smem=b.smem, programmatic=b.programmatic)
        else:
            self._run_lanes(sg)
        if self.handoff is not None:  # the next shard is on this device: its hc_in, copied inside the graph
            self.handoff[:sg.width].copy_(self.hc_out[:sg.width])

    def _run_lanes(self, sg: StepGraph) -> None:
        main = torch.cuda.current_stream(self.dev)
        while len(self._streams) < self.lane_streams:
            self._streams.append(torch.cuda.Stream(device=self.dev))
        ls = sg.launches
        for i, j, parallel in lane_segments([b.lane for b in ls]):
            if not parallel:
                b = ls[i]
                b.kernel(b.grid, b.block, b.args, smem=b.smem, programmatic=b.programmatic)
                continue
            fork = torch.cuda.Event()
            fork.record(main)
            used = sorted({b.lane % self.lane_streams for b in ls[i:j]})
            for k in used:
                self._streams[k].wait_event(fork)
            for b in ls[i:j]:
                with torch.cuda.stream(self._streams[b.lane % self.lane_streams]):
                    b.kernel(b.grid, b.block, b.args, smem=b.smem)  # no programmatic hand-over across streams
            for k in used:
                done = torch.cuda.Event()
                done.record(self._streams[k])
                main.wait_event(done)

    def capture_ms(self) -> dict[tuple[int, int], float]:
        """Milliseconds each captured (width, context) graph took to capture."""
        return {k: g.capture_s * 1e3 for k, g in self.by_key.items() if g.cuda_graph is not None}

    def values(self, width: int, context: int) -> dict[str, torch.Tensor]:
        """The device tensors of the (``width``, ``context``) graph by IR value name (empty when never prepared)."""
        sg = self.by_key.get((width, context))
        return {} if sg is None else sg.values
