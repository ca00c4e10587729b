"""The DSpark drafter compiled (docs/model.md section 7; docs/drafter.md): its commit and draft
graphs (:mod:`ds4c.ir.dspark`) through the target's passes, lowering, kernel families and kernel cache, bound on the
target :class:`~ds4c.runtime.step.CompiledStep`'s device, captured as CUDA graphs at :meth:`CompiledDSpark.prepare`
and replayed after.

What it shares with the target step (no second copy): the embedding ``token_embd`` and the head ``output``
(:meth:`CompiledStep.shared_weight`), the loaded kernel binaries (:meth:`CompiledStep.module`: the HC, GEMV, router,
experts and row-chain kernels of the stages are the target's when the shapes agree), the kernel cache and the arena
layout rule (:func:`~ds4c.runtime.step.arena_layout`). Its own: the stages' weights (uploaded from the drafter
file in the forms the kernels read), the three rings bf16 [window, head_dim], an activation arena, a per-step scalar
buffer in device memory (``pos``, ``positions``, ``tokens``: each replay reads its position and anchor from there, so
one capture serves every step) and the ``main_hidden`` input rows of a commit.

Ring rollback: the rings hold only committed positions. :meth:`commit` is called with the positions the target
accepted since the last call (the loop's next proposal commits what the last verify accepted, as the reference
:class:`~ds4c.drafters.dspark_model.DSparkModel` does), and a draft writes no state, so a rejected verify leaves
nothing in the drafter to undo.

Launches per proposal on the official shapes: a commit (fc GEMV, its norm, the three stages' wkv GEMV and three
row chains that also write the rings: 7 launches with the activation quantization kernels) and a draft (per stage
the target's 9 kernels, 20 launches; the HC head, the head GEMV, B Markov depths, the final argmax and the
confidence: 3 x 20 + 3 + B + 2 ~ 70). A sampling request replays a third graph, the draft with the Markov chain drawn
on the device (:meth:`CompiledDSpark.draft_sampled`). docs/drafter.md has the plan and its byte estimate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.drafters.dspark_file import DSparkFile
from ds4c.errors import StepError
from ds4c.ir.dspark import COMMIT_PIPELINE, DRAFT_PIPELINE, MAX_COMMIT_ROWS, build_dspark_commit, build_dspark_draft
from ds4c.ir.graph import Graph
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.quant import GGMLType
from ds4c.runtime.step import Bound, CompiledStep, arena_layout, resolve_arg
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lowered import LoweredKernel

SHARED = ("token_embd.weight", "output.weight")
"""The target's tensors the drafter reads (7: "all stages reuse the main model's embed and head")."""


@dataclass
class _Graph:
    key: str
    graph: Graph
    kernels: list[LoweredKernel]
    launches: list[Bound] = field(default_factory=list)
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    cuda_graph: Any = None
    runner: Any = None
    """A run of the graph other than its launches in order (the sampling draft: launches and device draws)."""


@dataclass
class CompiledDraft:
    """One compiled proposal (7.3): ``tokens`` ``out_1 .. out_B`` (host ints); ``base`` / ``logits`` fp32 [B, V]
    device tensors (the head's logits and the Markov-corrected ones; valid until the drafter's next graph run);
    ``confidence`` fp32 [B] device tensor (raw logits) or None without the confidence head; ``q`` fp32 [B, V] device
    tensor, the distributions the tokens were drawn from (sampling; None when greedy)."""

    tokens: list[int]
    base: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor | None
    q: torch.Tensor | None = None


GRAPH_KEYS = tuple(f"commit{n}" for n in range(1, MAX_COMMIT_ROWS + 1)) + ("draft",)
"""The drafter's graphs: the commits of 1..5 rows and the draft."""
STEP_SCALARS = ("pos", "positions", "tokens")
"""The per-step scalars the drafter's step buffer holds (a kernel asking for another is an error)."""


def build_graph(key: str, stage: Any, dfile: DSparkFile, target: Any, types: dict[str, GGMLType]
                ) -> tuple[Graph, list[LoweredKernel]]:
    """Graph ``key`` (:data:`GRAPH_KEYS`) of ``dfile``'s drafter for the stages' config ``stage``: built
    (:mod:`ds4c.ir.dspark`), through its pipeline, and lowered for ``target`` with the weights' storage ``types``.

    Raises:
        StepError: an unknown key; LoweringError: a weight stored in a format no kernel reads.
    """
    if key == "draft":
        g = run_pipeline(build_dspark_draft(stage, dfile.block_size, dfile.markov_rank, dfile.has_confidence,
                                            dfile.has_conf_bias), DRAFT_PIPELINE, context=stage.window).graph
    elif key in GRAPH_KEYS:
        g = run_pipeline(build_dspark_commit(stage, len(dfile.taps), int(key[len("commit"):])), COMMIT_PIPELINE).graph
    else:
        raise StepError(f"no DSpark graph {key!r}: expected one of {list(GRAPH_KEYS)}")
    return g, lower_graph(g, stage, target, types)


def sampling_sources(kernels: list[LoweredKernel], target: Any) -> list[Any]:
    """The sampling chain's ``depth`` kernels of a lowered draft graph: for each greedy ``depth`` launch of its
    ``markov_chain`` kernel, the same render with ``sampled`` (runtime/families/dspark.py; same arguments)."""
    from ds4c.runtime.families import dspark as _dsp

    mk = next(k for k in kernels if k.name == "markov_chain")
    out = []
    for la in mk.launches[:-1]:  # the depths (the last launch is ``final``)
        p = la.kernel.params
        spec = _dsp.MarkovSpec(p["rows"], p["vocab"], p["rank"], p["hidden"], bias=p["bias"], threads=p["threads"],
                               rows_per_block=p["rows_per_block"], sampled=True)
        out.append(_dsp.render_markov(spec, target, la.kernel.name[:-len("_depth")] + "_sampled")["depth"])
    return out


def check_bindings(g: Graph, kernels: list[LoweredKernel], dfile: DSparkFile, state: set[str]) -> None:
    """Check that every launch argument of a drafter graph has a buffer the runtime provides: a step scalar of
    :data:`STEP_SCALARS`, a weight of the drafter file or a shared target tensor (:data:`SHARED`), a ring
    (``state``), the commit input ``main_hidden``, a constant, or an activation (:func:`arena_layout`).

    Raises:
        StepError: naming the first argument with none (a lowering the drafter's runtime does not serve).
    """
    names = value_names(g)
    known = set(state) | {"main_hidden"} | {names[op.outputs[0]] for op in g.ops if op.kind == "const"}
    known |= set(arena_layout(g, kernels, known)[0])
    for k in kernels:
        for la in k.launches:
            for a in la.args:
                bad = (a.kind == "step" and a.name not in STEP_SCALARS) or (a.kind == "value" and a.name not in known) \
                    or (a.kind == "weight" and a.name not in dfile.specs and a.name not in SHARED)
                if bad:
                    raise StepError(f"DSpark graph {g.meta.get('dspark')}: kernel {la.kernel.entry} ({k.name}) reads "
                                    f"{a.kind} {a.name!r}, which the compiled drafter does not provide")


class CompiledDSpark:
    """The DSpark drafter on the target step's GPU (module docstring).

    Args:
        dfile: the opened drafter file (:func:`ds4c.drafters.dspark_sources.open_dspark`), or the synthetic source
            (``synthetic:PRESET``, :class:`~ds4c.drafters.dspark_source.SyntheticDSpark`): its weights are then
            generated in device memory, nothing uploaded from the host.
        step: the target's :class:`CompiledStep` (whole model, no layer split): its device, kernel cache,
            embedding and head are used.
        use_graphs: capture each graph at :meth:`prepare` and replay it (else launch the kernels one by one).

    Raises:
        ModelFileError: the drafter does not fit the target (:meth:`DSparkFile.check_target`).
        StepError: the step is a layer-split shard, has an artifact (the drafter's kernels come from the kernel
            cache; an artifact carries none yet), or the block size is outside 1..5.

    Attributes: ``cfg`` (the stages' config), ``block_size``, ``taps``, ``noise_id``, ``window``, ``ring_pos``
    (positions ``0 .. ring_pos-1`` committed), ``captures`` (CUDA graphs captured so far), ``rows_written``.
    """

    def __init__(self, dfile: DSparkFile, step: CompiledStep, use_graphs: bool = True):
        dfile.check_target(step.cfg)
        if step.is_split:
            raise StepError("the compiled DSpark drafter needs the whole target on one device (its embedding and "
                            "head); found a layer-split shard")
        if step.artifact is not None:
            raise StepError("the compiled DSpark drafter compiles its kernels through the kernel cache; a target "
                            "loaded from an artifact has no drafter kernels (run it without --artifact)")
        self.file, self.step, self.use_graphs = dfile, step, use_graphs
        self.cfg = dfile.config.replace(quant_emulation=step.cfg.quant_emulation)
        self.block_size, self.taps, self.noise_id = dfile.block_size, dfile.taps, dfile.noise_id
        self.window = self.cfg.window
        if not 1 <= self.block_size <= 5:
            raise StepError(f"the compiled DSpark drafter drafts blocks of 1..5 rows, the file has block_size "
                            f"{self.block_size}")
        self.dev = step.dev
        self._types: dict[str, GGMLType] = {n: dfile.ggml_type(n) for n in dfile.specs}
        self._types.update({n: step.mf.ggml_type(n) for n in SHARED})
        self._graphs: dict[str, _Graph] = {}
        self._weights: dict[tuple[str, str], torch.Tensor] = {}
        self._workspaces: dict[str, torch.Tensor] = {}
        self._arena: torch.Tensor | None = None
        self.captures = 0
        self.rows_written = 0
        self.ring_pos = 0
        self.prepare_stats: dict[str, Any] = {}
        with torch.cuda.device(self.dev):
            hd, D = self.cfg.head_dim, self.cfg.hidden_size
            self.state = {f"l{s}.ring": torch.zeros(self.window, hd, dtype=torch.bfloat16, device=self.dev)
                          for s in range(self.cfg.n_layers)}
            self._main_hidden = torch.zeros(MAX_COMMIT_ROWS, len(self.taps) * D, dtype=torch.bfloat16,
                                            device=self.dev)
            # step buffer: [pos, positions (5), tokens (B)]
            self._off = {"pos": 0, "positions": 1, "tokens": 1 + MAX_COMMIT_ROWS}
            n = 1 + MAX_COMMIT_ROWS + self.block_size
            self._hosts = [torch.zeros(n, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._host_done = [torch.cuda.Event() for _ in range(2)]
            self._turn = 0
            self._step_dev = torch.zeros(n, dtype=torch.int64, device=self.dev)
            self._pool = torch.cuda.graph_pool_handle()
        self.sampler: Any = None
        """The :class:`~ds4c.runtime.sampler.DeviceSampler` of :meth:`draft_sampled` (made at :meth:`prepare`)."""
        self._q: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ state
    def reset(self) -> None:
        """A new sequence: the rings back to zero, ``ring_pos`` 0."""
        for t in self.state.values():
            t.zero_()
        self.ring_pos = self.rows_written = 0

    def ring(self, stage: int) -> torch.Tensor:
        """Stage ``stage``'s ring, bf16 [window, head_dim] on the device (position t at slot t mod window)."""
        return self.state[f"l{stage}.ring"]

    # ------------------------------------------------------------------------------------------ graphs
    def _build(self, key: str) -> tuple[Graph, list[LoweredKernel]]:
        g, kernels = build_graph(key, self.cfg, self.file, self.step.target, self._types)
        check_bindings(g, kernels, self.file, set(self.state))
        return g, kernels

    def prepare(self, progress: bool = True) -> dict[str, Any]:
        """Build, lower, compile (what the kernel cache lacks, one parallel batch), load, upload the weights, bind
        and capture every graph: the commits of 1..5 rows, the draft and the sampling draft. After this no proposal
        compiles, loads or captures anything. The rings are reset. Returns (and keeps as :attr:`prepare_stats`)
        ``graphs``, ``build_s``, ``compile_s``, ``load_s``, ``capture_s``, ``weight_bytes`` (the drafter's own; the
        target's embedding and head are shared) and ``launches`` per graph.

        Raises:
            CompileError: a kernel failed to compile; LoweringError: a weight format no kernel reads.
        """
        todo = [k for k in GRAPH_KEYS if k not in self._graphs]
        with torch.cuda.device(self.dev):
            t0 = time.perf_counter()
            built = {k: self._build(k) for k in todo}
            t1 = time.perf_counter()
            srcs = {la.kernel.digest(): la.kernel for _g, ks in built.values() for k in ks for la in k.launches}
            sampled = sampling_sources(built["draft"][1], self.step.target) if "draft" in built else []
            srcs.update({s.digest(): s for s in sampled})
            compiled = dict(zip(srcs, self.step.cache.compile_many(list(srcs.values()), progress=progress)))
            t2 = time.perf_counter()
            mem0 = torch.cuda.memory_allocated(self.dev)
            layouts = {}
            for k, (g, kernels) in built.items():
                layouts[k] = arena_layout(g, kernels, set(self.state) | {"main_hidden"})
            need = max((n for _l, n in layouts.values()), default=0)
            if self._arena is None or self._arena.numel() < need:
                self._arena = torch.zeros(max(need, 1), dtype=torch.uint8, device=self.dev)
            for k, (g, kernels) in built.items():
                self._bind(k, g, kernels, compiled, layouts[k][0])
            if sampled:
                self._bind_sampling(sampled, compiled)
                todo.append("draft_sample")
            mem1 = torch.cuda.memory_allocated(self.dev)
            t3 = time.perf_counter()
            if self.use_graphs:
                for k in todo:
                    self._capture(self._graphs[k])
            self.reset()
            torch.cuda.synchronize(self.dev)
            t4 = time.perf_counter()
        self.prepare_stats = {"graphs": len(todo), "build_s": t1 - t0, "compile_s": t2 - t1, "load_s": t3 - t2,
                              "capture_s": t4 - t3, "weight_bytes": int(mem1 - mem0),
                              "launches": {k: len(sg.launches) for k, sg in self._graphs.items()}}
        return self.prepare_stats

    def _bind_sampling(self, sources: list[Any], compiled: dict[str, Any]) -> None:
        """The sampling draft ``draft_sample``: the draft graph's launches up to the Markov chain, then per depth the
        ``sampled`` depth kernel (the greedy launch's arguments) and a device draw from that depth's logits
        (:meth:`DeviceSampler.sample_with_probs`: the id into ``drafts[i]``, the distribution into ``q[i]``), then
        the confidence; one CUDA graph."""
        from ds4c.runtime.sampler import DeviceSampler

        sg = self._graphs["draft"]
        counts = [len(k.launches) for k in sg.kernels]
        names = [k.name for k in sg.kernels]
        at = sum(counts[:names.index("markov_chain")])
        pre, greedy = sg.launches[:at], sg.launches[at:at + self.block_size]
        post = sg.launches[at + self.block_size + 1:]  # after ``final``: the confidence
        depth = []
        for b, src in zip(greedy, sources):
            c = compiled[src.digest()]
            fn = self.step.module(c.key, c.binary).function(src.entry, b.smem)
            depth.append(Bound(fn, b.grid, b.block, b.smem, b.args))
        self.sampler = DeviceSampler(self.cfg.vocab_size, self.dev, ring=64)
        self._q = torch.zeros(self.block_size, self.cfg.vocab_size, dtype=torch.float32, device=self.dev)
        logits, drafts = sg.values["markov.logits"], sg.values["markov.drafts"]
        sampler, q = self.sampler, self._q

        def run() -> None:
            for b in pre:
                b.kernel(b.grid, b.block, b.args, smem=b.smem)
            for i, b in enumerate(depth):
                b.kernel(b.grid, b.block, b.args, smem=b.smem)
                tok, qi = sampler.sample_with_probs(logits[i])
                drafts[i:i + 1].copy_(tok)
                q[i].copy_(qi)
            for b in post:
                b.kernel(b.grid, b.block, b.args, smem=b.smem)

        self.sampler.configure(1.0, 0, 1.0, 0)  # any request's values: the graph reads them from device memory
        self._graphs["draft_sample"] = _Graph("draft_sample", sg.graph, sg.kernels, pre + depth + post, sg.values,
                                              runner=run)

    def configure_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> None:
        """A sampling request's parameters for :meth:`draft_sampled` (device tensors the captured graph reads; the
        draw counter restarts). Validation is :func:`ds4c.generate.check_sampling`'s.

        Raises:
            StepError: before :meth:`prepare`, or ``temperature`` <= 0 (greedy drafts are :meth:`draft`'s)."""
        if self.sampler is None:
            raise StepError("CompiledDSpark.configure_sampling before prepare()")
        if not temperature > 0:
            raise StepError(f"CompiledDSpark sampling needs temperature > 0, found {temperature!r} (greedy: draft())")
        self.sampler.configure(temperature, top_k, top_p, seed)

    def _weight(self, name: str, form: str) -> torch.Tensor:
        if name in SHARED:
            return self.step.shared_weight(name, form)
        key = (name, form)
        t = self._weights.get(key)
        if t is None:
            f = self.file
            dev = self.dev if getattr(f, "generates_on_device", False) else None  # synthetic: made on the device
            if form == "raw" or (form == "bf16" and self._types.get(name) == GGMLType.BF16):
                h = f.stored(name, dev)
                if form == "bf16":
                    h = h.view(torch.bfloat16).reshape(f.specs[name].shape)
            elif form == "bf16":
                h = f.tensor(name, device=dev).to(torch.bfloat16)
            else:
                h = f.tensor(name, device=dev)
            t = self._weights[key] = h.to(self.dev).contiguous()
        return t

    def _bind(self, key: str, g: Graph, kernels: list[LoweredKernel], compiled: dict[str, Any],
              slots: dict[str, tuple[int, int, tuple, Any]]) -> None:
        sg = _Graph(key, g, kernels)
        names = value_names(g)
        consts = {names[op.outputs[0]]: op.attrs["data"] for op in g.ops if op.kind == "const"}
        assert self._arena is not None
        for name, (off, n, shape, dt) in slots.items():
            sg.values[name] = self._arena[off:off + n].view(dt).view(shape)
        if "main_hidden" in g.inputs:
            sg.values["main_hidden"] = self._main_hidden[:int(g.inputs["main_hidden"].type.shape[0])]
        for k in kernels:
            for la in k.launches:
                c = compiled[la.kernel.digest()]
                fn = self.step.module(c.key, c.binary).function(la.kernel.entry, la.smem)
                sg.launches.append(Bound(fn, la.grid, la.block, la.smem, [self._resolve(a, sg, consts)
                                                                           for a in la.args]))
        self._graphs[key] = sg

    def _resolve(self, a: Any, sg: _Graph, consts: dict[str, torch.Tensor]) -> Any:
        # step scalar names were checked by check_bindings
        return resolve_arg(a, sg.values, consts, self.state, self._step_dev, self._off, self._workspaces,
                           self._weight, self.dev)

    def _capture(self, sg: _Graph) -> None:
        """Run ``sg`` once eagerly (module loads, lazy attributes), then capture it (the state is reset after
        :meth:`prepare`'s captures)."""
        self._run(sg)
        torch.cuda.synchronize(self.dev)
        sg.cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sg.cuda_graph, pool=self._pool):
            self._run(sg)
        torch.cuda.synchronize(self.dev)
        self.captures += 1

    def _run(self, sg: _Graph) -> None:
        if sg.runner is not None:
            sg.runner()
            return
        for b in sg.launches:
            b.kernel(b.grid, b.block, b.args, smem=b.smem)

    def _replay(self, key: str) -> _Graph:
        sg = self._graphs.get(key)
        if sg is None:
            raise StepError(f"CompiledDSpark: graph {key!r} was not prepared: call prepare() before the first "
                            f"proposal")
        if sg.cuda_graph is not None:
            sg.cuda_graph.replay()
        else:
            self._run(sg)
        return sg

    def _upload(self, pos: int, tokens: list[int] | None = None, rows: int = 0) -> None:
        """The step scalars into the pinned host buffer, then one copy to the device (two host buffers in turn)."""
        self._turn ^= 1
        h, done = self._hosts[self._turn], self._host_done[self._turn]
        done.synchronize()
        h[self._off["pos"]] = pos
        for i in range(rows):
            h[self._off["positions"] + i] = pos + i
        for i, t in enumerate(tokens or ()):
            h[self._off["tokens"] + i] = int(t)
        self._step_dev.copy_(h, non_blocking=True)
        done.record()

    # ------------------------------------------------------------------------------------------ rings
    def commit(self, start: int, main_hidden: torch.Tensor) -> int:
        """Write the ring rows of the committed positions ``start .. start + n - 1`` from their ``main_hidden``
        (act dtype [n, len(taps) * D], any device; spec 5.2(q)); only the last ``window`` are computed (the
        earlier ones would be overwritten), in chunks of at most 5 (one captured commit graph per chunk size).
        Returns the rows computed per stage.

        Raises:
            StepError: ``start`` is not :attr:`ring_pos` (a position skipped or written twice), a wrong shape, or
                before :meth:`prepare`.
        """
        want = len(self.taps) * self.cfg.hidden_size
        if start != self.ring_pos:
            raise StepError(f"DSpark ring: expected the rows of positions from {self.ring_pos} on, found {start}")
        if main_hidden.dim() != 2 or main_hidden.shape[1] != want:
            raise StepError(f"DSpark ring: expected main_hidden [n, {want}], found {list(main_hidden.shape)}")
        n = int(main_hidden.shape[0])
        skip = max(0, n - self.window)
        with torch.cuda.device(self.dev):
            for off in range(skip, n, MAX_COMMIT_ROWS):
                k = min(MAX_COMMIT_ROWS, n - off)
                self._main_hidden[:k].copy_(main_hidden[off:off + k], non_blocking=True)
                self._upload(start + off, rows=k)
                self._replay(f"commit{k}")
        self.ring_pos = start + n
        self.rows_written += n - skip
        return n - skip

    def commit_taps(self, start: int, stop: int, tap_ring: torch.Tensor) -> int:
        """:meth:`commit` of the positions ``start .. stop-1`` read from the target's tap ring ``tap_ring`` (a device
        tensor bf16 [window, len(taps) * D] whose row ``t % window`` holds ``main_hidden(t)`` of every position the
        target step ran; the rows are gathered on the device). Raises StepError as :meth:`commit`, or when the
        positions are more than ``window`` behind ``stop`` (already overwritten in the tap ring) -- only the last
        ``window`` are ever read."""
        W = int(tap_ring.shape[0])
        lo = max(start, stop - min(W, self.window))
        if start != self.ring_pos:
            raise StepError(f"DSpark ring: expected the rows of positions from {self.ring_pos} on, found {start}")
        if stop <= start:
            return 0
        idx = (torch.arange(lo, stop, dtype=torch.int64) % W).to(tap_ring.device, non_blocking=True)
        rows = tap_ring.index_select(0, idx)
        self.ring_pos = lo  # the skipped positions are older than the window: never attended
        return self.commit(lo, rows) if rows.shape[0] else 0

    # ------------------------------------------------------------------------------------------ draft
    def draft(self, t0: int) -> CompiledDraft:
        """7.2-7.3, greedy: the block ``[t0, noise x (B-1)]`` at positions ``ring_pos .. ring_pos + B - 1`` through the
        stages (attending the ``min(window, ring_pos)`` committed ring rows), the head, the Markov chain (argmax) and
        the confidence logits. Reads the ids back (one synchronisation). Writes no drafter state.

        Raises:
            StepError: ``t0`` outside the vocabulary, or before :meth:`prepare`.
        """
        sg, tokens = self._run_block(t0, "draft")
        return CompiledDraft(tokens, sg.values["base"], sg.values["markov.logits"], sg.values.get("confidence"))

    def _run_block(self, t0: int, key: str) -> tuple[Any, list[int]]:
        """Upload the block ``[t0, noise x (B-1)]`` at ``ring_pos`` and replay the draft graph ``key``; returns the
        graph and its drafted ids (one synchronisation). Raises StepError for ``t0`` outside the vocabulary."""
        if isinstance(t0, bool) or not 0 <= int(t0) < self.cfg.vocab_size:
            raise StepError(f"DSpark anchor token must be in 0..{self.cfg.vocab_size - 1}, found {t0!r}")
        with torch.cuda.device(self.dev):
            self._upload(self.ring_pos, [int(t0)] + [self.noise_id] * (self.block_size - 1), rows=self.block_size)
            sg = self._replay(key)
            return sg, sg.values["markov.drafts"].tolist()

    def draft_sampled(self, t0: int) -> CompiledDraft:
        """:meth:`draft` with the Markov chain sampled on the device (7.3.3 with ``sample``): per depth the logits,
        then a draw from ``softmax(filter(logits_i) / temperature)`` with the request's parameters
        (:meth:`configure_sampling`; counter-based noise, runtime/sampler.py), the chain conditioned on the drawn ids.
        ``q`` holds the distributions (fp32 [B, V], device). Reads the ids back (one synchronisation).

        Raises:
            StepError: ``t0`` outside the vocabulary, or before :meth:`prepare`.
        """
        sg, tokens = self._run_block(t0, "draft_sample")
        return CompiledDraft(tokens, sg.values["base"], sg.values["markov.logits"], sg.values.get("confidence"),
                             self._q)

    def values(self, key: str = "draft") -> dict[str, torch.Tensor]:
        """The device tensors of graph ``key`` (``draft``, ``commit1`` .. ``commit5``) by IR value name (the arena is
        shared by the drafter's graphs: read right after a run of that graph)."""
        sg = self._graphs.get(key)
        return {} if sg is None else sg.values

    def time_propose(self, t0: int, commit_rows: int = 1, repeats: int = 50) -> dict[str, float]:
        """Median milliseconds of one commit of ``commit_rows`` rows and of one draft, each replayed ``repeats`` times
        back to back (CUDA events; the rings are saved and restored, so the sequence is unchanged). For the per-step
        cost the issue asks to measure (docs/drafter.md).

        Raises:
            StepError: before :meth:`prepare`, or ``commit_rows`` outside 1..5.
        """
        if not 1 <= commit_rows <= MAX_COMMIT_ROWS:
            raise StepError(f"time_propose: commit_rows must be in 1..{MAX_COMMIT_ROWS}, found {commit_rows}")
        with torch.cuda.device(self.dev):
            saved = {k: v.clone() for k, v in self.state.items()}
            out = {}
            for key, toks in ((f"commit{commit_rows}", None), ("draft", [int(t0)] + [self.noise_id] *
                                                              (self.block_size - 1))):
                self._upload(max(self.ring_pos, 1), toks, rows=commit_rows if toks is None else self.block_size)
                self._replay(key)
                evs = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
                evs[0].record()
                for i in range(repeats):
                    self._replay(key)
                    evs[i + 1].record()
                torch.cuda.synchronize(self.dev)
                ts = sorted(evs[i].elapsed_time(evs[i + 1]) for i in range(repeats))
                out[key] = ts[len(ts) // 2]
            for k, v in saved.items():
                self.state[k].copy_(v)
        out["propose_ms"] = out[f"commit{commit_rows}"] + out["draft"]
        return out
