"""Run the compiled step on a CUDA GPU: weights and state on the device, one launch list per (width, context
bucket), captured as a CUDA graph on first use and replayed after.

Per-step scalars (position, row positions, token ids, live lengths) live in one int64 device buffer that the
kernels read; a step uploads them in one copy, so a captured graph replays with new values. A step whose
(width, bucket) has no compiled graph is an error naming the key; there is no fallback.

Data flows one way: this module consumes the lowering (runtime/lower.py), the kernel cache and the model
file; nothing upstream imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ds4c.buckets import BucketSpec
from ds4c.errors import StepError
from ds4c.gguf_file import ModelFile
from ds4c.ir import build_step
from ds4c.ir.graph import Graph, Value
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.launch import CudaKernel, CudaModule
from ds4c.runtime.lower import Arg, LoweredKernel, lower_graph
from ds4c.runtime.targets import Target, target

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


@dataclass
class _StepGraph:
    width: int
    context: int
    graph: Graph
    kernels: list[LoweredKernel]
    launches: list[_Bound] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    cuda_graph: Any = None
    capture_s: float = 0.0


class CompiledStep:
    """The compiled decode/verify step of one model on one CUDA GPU.

    Args:
        mf: the model file (weights are uploaded as the kernels read them).
        buckets: widths and context buckets to serve; ``buckets.max_ctx`` sizes the state.
        arch: the CUDA arch to compile for (e.g. ``sm_90``).
        cache: the kernel cache (compiles what is missing; an AOT-filled cache compiles nothing).
        use_graphs: capture one CUDA graph per (width, bucket) on first use and replay it.
        artifact: an artifact folder from ``ds4c compile``: binaries come from it and nothing is compiled.
            It must serve this model (``ds4c.runtime.artifact.check_serves``: config, ``buckets`` and weight
            formats equal); a missing arch or (width, bucket) graph raises ArtifactError.

    Raises:
        StepError: no CUDA device.
        ArtifactError: the artifact is corrupt or edited, or does not serve this model (the first tensor whose
            format differs is named).
    """

    def __init__(self, mf: ModelFile, buckets: BucketSpec, arch: str = "sm_90", cache: KernelCache | None = None,
                 use_graphs: bool = True, artifact: str | None = None):
        if not torch.cuda.is_available():
            raise StepError("the compiled step needs a CUDA device (torch.cuda.is_available() is False)")
        self.mf, self.cfg, self.buckets = mf, mf.config, buckets
        self.target: Target = target(arch)
        self.cache = cache or KernelCache()
        self.use_graphs = use_graphs
        self.artifact = artifact
        self._manifest = None
        self._types = {n: mf.ggml_type(n) for n in mf.specs}
        if artifact is not None:
            from ds4c.runtime.artifact import check_serves, load_manifest

            self._manifest = load_manifest(artifact)
            check_serves(self._manifest, artifact, self.cfg, self._types, buckets)
        self.dev = torch.device("cuda")
        self._weights: dict[tuple[str, str], torch.Tensor] = {}
        self._modules: dict[str, CudaModule] = {}
        self._graphs: dict[tuple[int, int], _StepGraph] = {}
        self.state: dict[str, torch.Tensor] = {}
        self._workspaces: dict[str, torch.Tensor] = {}
        maxq = max(buckets.widths)
        # step buffer: [pos, live_r..., positions (maxq), tokens (maxq)]
        self._ratios = sorted({r for r in self.cfg.compress_ratios[: self.cfg.n_layers] if r})
        self._off = {"pos": 0}
        for k, r in enumerate(self._ratios):
            self._off[f"live_r{r}"] = 1 + k
        self._off["positions"] = 1 + len(self._ratios)
        self._off["tokens"] = self._off["positions"] + maxq
        n_step = self._off["tokens"] + maxq
        self._step_hosts = [torch.zeros(n_step, dtype=torch.int64).pin_memory() for _ in range(2)]
        self._host_done = [torch.cuda.Event() for _ in range(2)]
        self._host_turn = 0
        self._step_dev = torch.zeros(n_step, dtype=torch.int64, device=self.dev)
        self.capacity = buckets.contexts[-1]  # state buffers hold the largest bucket (>= max_ctx)
        self.pos = 0
        self._undo: tuple | None = None
        self.reset()

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """A new sequence: every state buffer back to its initial value (KV 0, compressor scores -inf)."""
        from ds4c.ir.builder import state_inputs

        for name, t in state_inputs(self.cfg, self.capacity).items():
            buf = self.state.get(name)
            if buf is None:
                buf = self.state[name] = torch.empty(tuple(t.shape), dtype=_DT[t.dtype], device=self.dev)
            buf.fill_(float("-inf") if name.endswith("_score") else 0)
        self.pos = 0

    def snapshot(self) -> dict[str, Any]:
        """A device copy of the sequence state (all buffers) and the position."""
        return {"pos": self.pos, "state": {k: v.clone() for k, v in self.state.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Copy a :meth:`snapshot` back (in place: captured graphs keep pointing at the same buffers)."""
        for k, v in snap["state"].items():
            self.state[k].copy_(v)
        self.pos = snap["pos"]

    def verify(self, tokens: list[int], pos: int) -> torch.Tensor:
        """A verify step that can be rolled back: snapshots the state, runs the step, remembers the tokens.
        Returns fp32 logits [q, vocab]."""
        self._undo = (self.snapshot(), list(tokens), pos)
        return self.step(tokens, pos)

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last :meth:`verify`: restore the state from before it and
        replay the accepted rows as one step of width ``accepted`` (exactly the state sequential decoding of
        that prefix leaves, up to the kernels' own rounding).

        Raises:
            StepError: no verify to roll back, or ``accepted`` outside 0..q.
        """
        undo = getattr(self, "_undo", None)
        if undo is None:
            raise StepError("rollback: no verify step to roll back")
        snap, tokens, pos = undo
        if not 0 <= accepted <= len(tokens):
            raise StepError(f"rollback: accepted must be in 0..{len(tokens)}, found {accepted}")
        self._undo = None
        if accepted == len(tokens):
            return
        self.restore(snap)
        if accepted:
            self.step(tokens[:accepted], pos)

    # ------------------------------------------------------------------------------------------ weights
    def _weight(self, name: str, form: str) -> torch.Tensor:
        key = (name, form)
        if key not in self._weights:
            if form == "raw":
                raw = np.ascontiguousarray(self.mf.raw(name))
                t = torch.from_numpy(raw.view(np.uint8).copy())
            elif form == "i64":
                t = self.mf.tensor(name)
            elif form == "bf16":
                t = self.mf.tensor(name).to(torch.bfloat16)
            else:
                t = self.mf.tensor(name)
            self._weights[key] = t.to(self.dev).contiguous()
        return self._weights[key]

    # ------------------------------------------------------------------------------------------ graphs
    def prepare(self, width: int, context: int) -> _StepGraph:
        """The step graph of (``width``, ``context``): pipelined, lowered, its binaries loaded and its arguments
        bound (once; later calls return it). A server calls it for every key it will serve before the first
        request, so no request pays for loading.

        Raises:
            StepError: the key is not among the compiled widths and context buckets.
            ArtifactError: in artifact mode, the artifact lacks the key or this arch.
        """
        key = (width, context)
        sg = self._graphs.get(key)
        if sg is not None:
            return sg
        if width not in self.buckets.widths or context not in self.buckets.contexts:
            raise StepError(f"no compiled graph for (width {width}, context {context}): compiled widths "
                            f"{list(self.buckets.widths)}, contexts {list(self.buckets.contexts)}")
        g = run_pipeline(build_step(self.cfg, width, self.capacity), "default", context=context).graph
        kernels = lower_graph(g, self.cfg, self.target, self._types)
        if self._manifest is not None:
            from ds4c.runtime.artifact import launch_binaries

            paths = launch_binaries(self._manifest, self.artifact, self.target.arch, width, context, kernels,
                                    self._types)
            binary_of = {id(la): p for la, p in zip([la for k in kernels for la in k.launches], paths)}
        else:
            srcs = {la.kernel.digest(): la.kernel for k in kernels for la in k.launches}
            compiled = dict(zip(srcs, self.cache.compile_many(list(srcs.values()), progress=False)))
        sg = _StepGraph(width, context, g, kernels)
        names = value_names(g)
        by_name = {names[v]: v for v in names}
        consts = {names[op.outputs[0]]: op.attrs["data"] for op in g.ops if op.kind == "const"}
        for k in kernels:
            for la in k.launches:
                if self._manifest is not None:
                    path = binary_of[id(la)]
                    mkey = str(path)
                else:
                    e = compiled[la.kernel.digest()]
                    mkey, path = e.key, None
                mod = self._modules.get(mkey)
                if mod is None:
                    image = path.read_bytes() if path is not None else e.binary()
                    mod = self._modules[mkey] = CudaModule(image)
                fn = mod.function(la.kernel.entry, la.smem)
                args = [self._resolve(a, sg, by_name, consts) for a in la.args]
                sg.launches.append(_Bound(fn, la.grid, la.block, la.smem, args))
        self._graphs[key] = sg
        return sg

    def _resolve(self, a: Arg, sg: _StepGraph, by_name: dict[str, Value], consts: dict[str, torch.Tensor]) -> Any:
        if a.kind == "weight":
            return self._weight(a.name, a.form or "f32")
        if a.kind == "int":
            return int(a.value)
        if a.kind == "step":
            off = self._off[a.name]
            return self._step_dev[off:]
        if a.kind == "workspace":
            t = self._workspaces.get(a.name)
            if t is None or t.numel() < a.nbytes:
                t = self._workspaces[a.name] = torch.empty(a.nbytes, dtype=torch.uint8, device=self.dev)
            return t
        # a graph value: a state buffer, a constant, or an activation of this graph
        if a.name in self.state:
            return self.state[a.name]
        if a.name in consts:
            t = sg.values.get(a.name)
            if t is None:
                t = sg.values[a.name] = consts[a.name].to(self.dev).contiguous()
            return t
        t = sg.values.get(a.name)
        if t is None:
            v = by_name[a.name]
            t = sg.values[a.name] = torch.full(tuple(int(d) for d in v.type.shape), 0, dtype=_DT[v.type.dtype],
                                               device=self.dev)
        return t

    # ------------------------------------------------------------------------------------------ steps
    def _begin(self, tokens: list[int], pos: int) -> _StepGraph:
        """Check that ``pos`` is the sequence's next position, get the step graph of (``len(tokens)``, bucket)
        and upload the step's scalars. Raises StepError as :meth:`step`."""
        if pos != self.pos:
            raise StepError(f"step at position {pos}, but the sequence's next position is {self.pos}")
        sg = self.prepare(len(tokens), self.buckets.bucket(pos, len(tokens)))
        self._upload(tokens, pos)
        return sg

    def _upload(self, tokens: list[int], pos: int) -> None:
        """Write the step's scalars into the pinned host buffer and copy them to the device (one copy)."""
        q = len(tokens)
        # two pinned host buffers used in turn; a buffer is rewritten only after its last copy has run
        self._host_turn ^= 1
        h, done = self._step_hosts[self._host_turn], self._host_done[self._host_turn]
        done.synchronize()
        h[self._off["pos"]] = pos
        for r in self._ratios:
            h[self._off[f"live_r{r}"]] = (pos + q) // r
        for i, t in enumerate(tokens):
            h[self._off["positions"] + i] = pos + i
            h[self._off["tokens"] + i] = int(t)
        self._step_dev.copy_(h, non_blocking=True)  # the one upload of the step
        done.record()

    def step(self, tokens: list[int], pos: int) -> torch.Tensor:
        """Run ``len(tokens)`` rows at ``pos..``; returns fp32 logits [q, vocab] (a device tensor, valid until
        the next step of the same width and bucket).

        Raises:
            StepError: ``pos`` is not the sequence's next position, positions past max_ctx, or no compiled
                graph for the (width, bucket) key.
        """
        sg = self._begin(tokens, pos)
        if self.use_graphs:
            if sg.cuda_graph is None:
                self._run(sg)  # warm-up outside the capture (module loads, attributes)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                sg.cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(sg.cuda_graph):
                    self._run(sg)
                torch.cuda.synchronize()
                sg.capture_s = time.perf_counter() - t0
                # capturing records the launches without running them: the warm-up run is this step's result
            else:
                sg.cuda_graph.replay()
        else:
            self._run(sg)
        self.pos = pos + len(tokens)
        return sg.values["logits"]

    # the stepper interface of ds4c.generate.generate
    @property
    def max_ctx(self) -> int:
        return self.buckets.max_ctx

    def decode(self, token: int, pos: int) -> torch.Tensor:
        """One decode step (q = 1). Returns fp32 logits [1, vocab]."""
        return self.step([token], pos)

    def time_launches(self, tokens: list[int], pos: int, repeats: int = 20) -> list[dict[str, Any]]:
        """Time every launch of the step at (``len(tokens)``, bucket of ``pos``) on its own with CUDA events
        (median of ``repeats`` eager runs of the whole launch list; the state is snapshotted and restored, so
        the sequence is unchanged). Returns one dict per launch: ``kernel`` (plan name), ``family``,
        ``layer``, ``entry``, ``us`` (median microseconds).

        Raises:
            StepError: as :meth:`step`.
        """
        sg = self._begin(tokens, pos)
        snap = self.snapshot()
        pairs = [(k, la) for k in sg.kernels for la in k.launches]
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
        """The device tensors of the (``width``, ``context``) graph by IR value name (activations as the last
        run of that graph left them, e.g. ``l3.route.ids``); empty when the graph was never prepared."""
        sg = self._graphs.get((width, context))
        return {} if sg is None else sg.values

    @property
    def capture_ms(self) -> dict[tuple[int, int], float]:
        """Milliseconds each captured (width, context) graph took to capture."""
        return {k: g.capture_s * 1e3 for k, g in self._graphs.items() if g.cuda_graph is not None}

    def _run(self, sg: _StepGraph) -> None:
        for b in sg.launches:
            b.kernel(b.grid, b.block, b.args, smem=b.smem)
