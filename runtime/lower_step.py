"""Lowering of a decode / verify step graph (and of the DSpark drafter's graphs) to launches of the kernel
families: each plan kernel by its pattern (:data:`_PATTERNS`), then, for a verify graph, its rollback kernel. Entered
through :func:`ds4c.runtime.lower.lower_graph`; the prefill chunk lowering (:mod:`ds4c.runtime.lower_prefill`)
builds on the per-pattern lowerings here. The records it makes are :mod:`ds4c.runtime.lowered`'s.

Data flows one way: this module reads the graph and the config and renders templates; it knows nothing of
devices, caches or files.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Iterator
from typing import Any, Callable

from ds4c import settings
from ds4c.config import Ds4Config
from ds4c.ir.graph import Graph, Op, Value
from ds4c.ir.printer import value_names
from ds4c.quant import GGMLType
from ds4c.runtime.families import attention as _att
from ds4c.runtime.families import compressor as _cmp
from ds4c.runtime.families import dspark as _dsp
from ds4c.runtime.families import experts as _exp
from ds4c.runtime.families import gemv as _gv
from ds4c.runtime.families import hc as _hc
from ds4c.runtime.families import indexer as _idx
from ds4c.runtime.families import router as _rt
from ds4c.runtime.families import rowchain as _rc
from ds4c.runtime.families import tap as _tap
from ds4c.runtime.families import undo as _undo
from ds4c.runtime.lowered import Arg, Launch, LoweredKernel, LoweringError
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target
from ds4c.tensors import storage_types

# GGUF storage type -> the ``fmt`` string of the GEMV and experts families (runtime/families/gemv.py FORMATS,
# experts.py FORMATS); both read the K-quants and IQ4_XS. A type missing here is a one-line LoweringError naming
# the tensor: _Ctx.fmt, check_expert_formats. The weights read converted at load (token_embd and wo_a as bf16,
# norms and HC parameters as f32) take any type ds4c.quant decodes, K-quants included.
_FMT = {GGMLType.BF16: "bf16", GGMLType.F32: "f32", GGMLType.Q8_0: "q8_0", GGMLType.MXFP4: "mxfp4",
        **{GGMLType[f.upper()]: f for f in _gv.KQUANTS}}
#: ... of the experts family (no F32)
_EXPERT_FMT = {GGMLType.BF16: "bf16", GGMLType.Q8_0: "q8_0", GGMLType.MXFP4: "mxfp4",
               **{GGMLType[f.upper()]: f for f in _exp.KQUANTS}}
ELEMENTWISE_CHAIN = ("rms_norm", "head_rms", "rope", "kv_fake_quant", "fp4_fake_quant", "hadamard", "mul_scalar")


class _Ctx:
    """What the per-pattern lowerings share: value names, producers, weight formats, the target."""

    def __init__(self, g: Graph, cfg: Ds4Config, target: Target, weight_types: dict[str, GGMLType]):
        self.g, self.cfg, self.target = g, cfg, target
        self.names = value_names(g)
        self.prod: dict[Value, Op] = {}
        for op in g.ops:
            for leaf in op.walk():
                for v in leaf.outputs:
                    self.prod[v] = leaf
        self.types = weight_types
        self.q = int(g.meta["width"])
        # in-place state updates: a new state value lives in the buffer of the state it replaces
        self.alias: dict[Value, Value] = {}
        for leaf in g.leaf_ops():
            if leaf.kind == "compress":
                for k in range(3):
                    self.alias[leaf.outputs[k]] = leaf.inputs[4 + k]
            elif leaf.kind in ("ring_write", "dspark_tap", "record_hc"):
                self.alias[leaf.outputs[0]] = leaf.inputs[0]
        self.inputs = {v: k for k, v in g.inputs.items()}
        #: a lanes step (ds4c.ir.builder.build_step(lanes=...)): the rows of each lane, else None. Its per-lane
        #: kernels bind lane views at their first row (Arg.row); positions are read per row (pos_mode "rows"), a
        #: lane's first position is the positions entry at its first row
        self.lanes = g.meta.get("lanes")
        #: a concat_rows input (a lane's attention output) -> (the concat, its first row): written in place
        self.concat_at: dict[Value, tuple[Value, int]] = {}
        for leaf in g.leaf_ops():
            if leaf.kind == "concat_rows":
                row = 0
                for v in leaf.inputs:
                    self.concat_at[v] = (leaf.outputs[0], row)
                    row += int(v.type.shape[0])
        # what a prefill chunk graph changes (runtime/lower_prefill.py sets them; decode / verify keep these):
        #: HcSpec.row_block of the HC kernels (0: every stage-mix block loops over all q rows)
        self.row_block = 0
        #: AttentionSpec.heads_per_block of the attention kernels (the decode / verify steps: 1)
        self.attn_heads_per_block = 1
        #: AttentionSpec.threads of the attention kernels (0: the family's automatic block size)
        self.attn_threads = 0
        #: the prefill chunks' attention on tensor cores (runtime/lower_prefill.py; decode keeps the SIMT kernel)
        self.attn_mma = False
        #: the prefill chunks' indexer scores on tensor cores (runtime/lower_prefill.py; decode keeps the SIMT stage)
        self.indexer_mma = False
        #: the prefill chunks' compressors parallel over the flushes (runtime/lower_prefill.py)
        self.cmp_parallel = False
        #: weight rows per CTA of the prefill chunks' GEMMs and grouped experts (GemmSpec.bn / MoeGemmSpec.bn), the
        #: K-step stages of both (GemmSpec.stages, MoeGemmSpec.stages)
        self.gemm_bn = self.moe_bn = 64
        self.stages = 2
        #: the prefill chunks' routed experts' MMA where moe_gemm.auto_mma allows (sync, wgmma, wgmma8, fp8), and their
        #: quantized activations' storage (MoeGemmSpec.xfmt: f16, e4m3) (runtime/lower_prefill.py)
        self.moe_mma = "sync"
        self.moe_xq = "f16"
        #: the prefill chunks' projection GEMMs' quantized x (GemmSpec.xfmt: f16, e4m3)
        self.gemm_xq = "f16"
        self.moe_wg_bn = 256
        self.l2_prefetch = 0
        self.moe_cols_first = False
        #: the lowering of a group of linears sharing an input x: (ctx, name, x, linears, act_quant) -> launches
        self.linears = _gemv

    # -- bindings
    def weight_name(self, v: Value) -> str | None:
        p = self.prod.get(v)
        return p.attrs["weight"] if p is not None and p.kind == "param" else None

    def arg(self, v: Value) -> Arg:
        """Binding of a value: a weight by GGUF name, a per-step scalar, or a graph value by name (views of
        state buffers resolve to the buffer they view)."""
        while v in self.alias:
            v = self.alias[v]
        if v in self.concat_at:
            base, row = self.concat_at[v]
            a = self.arg(base)
            return dataclasses.replace(a, row=a.row + row)
        w = self.weight_name(v)
        if w is not None:
            form = "bf16" if w == "token_embd.weight" else "i64" if w.endswith("tid2eid.weight") else "f32"
            return Arg("weight", w, form=form)
        p = self.prod.get(v)
        if p is not None and p.kind in ("bucket_rows", "live_rows", "reshape"):
            return self.arg(p.inputs[0])
        if p is not None and p.kind == "lane_rows":
            a = self.arg(p.inputs[0])
            return dataclasses.replace(a, row=a.row + int(p.attrs["start"]))
        if p is not None and p.kind == "row_positions":
            return Arg("step", "positions")
        name = self.inputs.get(v)
        if name is not None and (name in ("tokens", "pos", "n_valid", "positions")
                                 or name.rsplit(".", 1)[-1].startswith("live_r")):
            return Arg("step", name)
        return Arg("value", self.names[v])

    def by_name(self) -> dict[str, Value]:
        """Graph values by printed name."""
        if not hasattr(self, "_by_name"):
            self._by_name = {n: v for v, n in self.names.items()}
        return self._by_name

    def pos_arg(self, positions: Value) -> Arg:
        """The ``pos`` argument (the first row's position) of a kernel of one sequence reading ``positions``: the
        step's ``pos``, or in a lanes step the positions entry at the lane's first row."""
        return self.arg(positions) if self.lanes else Arg("step", "pos")

    def row_pos(self) -> tuple[str, Arg]:
        """``(pos_mode, pos argument)`` of a row-wise kernel that reads positions (row chains, grouped wo_a):
        ``pos + i`` in a one-sequence step, each row's own position in a lanes step."""
        return ("rows", Arg("step", "positions")) if self.lanes else ("base", Arg("step", "pos"))

    def fmt(self, weight: str) -> str:
        """The kernel ``fmt`` string of ``weight``'s stored type (:data:`_FMT`); LoweringError for a type no
        kernel reads."""
        t = self.types.get(weight, GGMLType.BF16)
        if t not in _FMT:
            raise LoweringError(f"weight {weight}: storage {getattr(t, 'name', t)} has no GEMV kernel (expected "
                                f"BF16/F32/Q8_0/MXFP4/Q2_K..Q6_K/IQ4_XS){_reference_hint(t)}")
        return _FMT[t]

    def expert_fmt(self, weights: tuple[str, ...]) -> str:
        """The one experts-family ``fmt`` of ``weights`` (matrices one experts kernel reads in one format:
        routed gate + up, routed down, or the shared expert's three); LoweringError when they differ or a type
        has no experts kernel."""
        types = [self.types.get(w, GGMLType.BF16) for w in weights]
        found = ", ".join(f"{w} {getattr(t, 'name', t)}" for w, t in zip(weights, types))
        if any(t not in _EXPERT_FMT for t in types):
            raise LoweringError(f"the experts kernel reads MXFP4, Q8_0, BF16, Q2_K..Q6_K or IQ4_XS; found {found}")
        if len(set(types)) > 1:
            raise LoweringError(f"the experts kernel reads these matrices in one format; found {found}")
        return _EXPERT_FMT[types[0]]

    def name(self, op: Op, suffix: str) -> str:
        """Kernel (entry) name: by role, not by layer, so identical kernels of different layers render the
        same source and share one binary (the plan kernel keeps the layer in its own name)."""
        del op
        return f"ds4c_{suffix}"


def _launch(src: KernelSource, grid: Any, block: Any, smem: int, args: list[Arg]) -> Launch:
    g = tuple(grid) + (1,) * (3 - len(tuple(grid)))
    b = tuple(block) + (1,) * (3 - len(tuple(block)))
    return Launch(src, g, b, int(smem), tuple(args))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- GEMV
#: Verify widths from which an FP8-quantized GEMV activation is quantized once by its own small kernel
#: (``templates/actq``) instead of by every block of the GEMV. Every block quantizes all q rows of x before its
#: first product, so the prologue grows with q and runs in each of the ~264 blocks: on the H200 (session 7,
#: ``gpu_kernel_check.py --only gemv``) wq_a took 27.6 us at q = 5 quantizing in-block against 9.3 us reading a
#: plain bf16 x, for ~2-3 us of extra launch in a CUDA graph; at q = 1 the in-block prologue costs 0.5 us.
PREQUANT_MIN_Q = 2


def _gemv(c: _Ctx, name: str, x: Value, linears: list[Op], act_quant: bool, q: int | None = None) -> list[Launch]:
    """One multi-output GEMV over ``x``. With FP8-quantized activations (``fp8act`` outputs, ``act_quant``) the
    activation is quantized either by each block into shared memory (q below :data:`PREQUANT_MIN_Q`), or once
    into a bf16 workspace by a small kernel (``templates/actq``; e4m3 values times powers of two are exact in
    bf16) that the GEMV then reads in plain bf16 mode: the same products and sums. The second form is also the
    fallback when the quantized activation does not fit in shared memory (HIP: 64 KiB, e.g. K = 8192 at q = 5).
    ``q``: the rows of ``x`` (default: the graph's width; a prefill chunk's 1-row head passes 1)."""
    qq = c.q if q is None else q
    if qq > settings.gemv_rows():  # a lanes step's rows in passes (_lower_rows)
        raise RenderError(f"{name}: {qq} rows, one GEMV launch takes at most {settings.gemv_rows()} (DS4C_GEMV_ROWS)")
    k = int(linears[0].inputs[0].type.shape[-1])
    outs = []
    for lin in linears:
        w = c.weight_name(lin.inputs[1])
        if w is None:
            raise LoweringError(f"{name}: linear weight is not a model tensor")
        outs.append(_gv.GemvOutput(int(lin.outputs[0].type.shape[-1]), c.fmt(w), lin.attrs["mode"]))
    wargs = [Arg("weight", c.weight_name(l.inputs[1]) or "", form="raw") for l in linears] + \
        [Arg("value", c.names[l.outputs[0]]) for l in linears]
    spec = _gv.GemvSpec(k, qq, tuple(outs), act_quant)
    can_prequant = act_quant and any(o.mode == "fp8act" for o in outs) and all(o.mode != "f32" for o in outs)
    if not (can_prequant and qq >= PREQUANT_MIN_Q):
        try:
            src = _gv.render_gemv(spec, c.target, name)
            grid, block, smem = _gv.launch_shape(spec, c.target)
            return [_launch(src, grid, block, smem, [c.arg(x)] + wargs)]
        except RenderError:
            if not can_prequant:
                raise
    xq = Arg("workspace", name + "_xq", nbytes=2 * qq * k)
    pre = _launch(render("actq/act_quant.cu.j2", name + "_actq", "gemv", c.target, {"k": k}),
                  (k // 128, qq), (128,), 0, [c.arg(x), xq])
    plain = tuple(_gv.GemvOutput(o.n, o.fmt, "bf16" if o.mode == "fp8act" else o.mode, o.out_dtype) for o in outs)
    spec = _gv.GemvSpec(k, qq, plain, False)
    src = _gv.render_gemv(spec, c.target, name)
    grid, block, smem = _gv.launch_shape(spec, c.target)
    return [pre, _launch(src, grid, block, smem, [xq] + wargs)]


def _chain_op(c: _Ctx, op: Op) -> _rc.ChainOp | None:
    k, a = op.kind, op.attrs
    if k == "rms_norm":
        return _rc.rms_norm(a["eps"])
    if k == "head_rms":
        return _rc.head_rms(a["eps"])
    if k == "rope":
        return _rc.rope(c.cfg.rope_dim, inverse=a["inverse"])
    if k == "kv_fake_quant":
        return _rc.kv_fq(a["nope"]) if a["enabled"] else None
    if k == "fp4_fake_quant":
        return _rc.fp4_fq(a["block"])
    if k == "hadamard":
        return _rc.hadamard()
    if k == "mul_scalar":
        return _rc.mul_scalar(a["value"])
    raise LoweringError(f"no row-chain op for {k}")


def _rowchain(c: _Ctx, name: str, x: Value, chain: list[Op], ring: Op | None = None) -> Launch:
    """A row-chain launch applying ``chain`` (elementwise leaf ops, reshapes skipped) to ``x``; with ``ring`` (a
    ``ring_write`` of the chain's result) the kernel also stores each row into its ring slot."""
    ops = [o for o in chain if o.kind != "reshape"]
    last = chain[-1].outputs[0]
    shape = last.type.shape
    groups, width = (int(shape[1]), int(shape[2])) if len(shape) == 3 else (1, int(shape[-1]))
    cops = [(_chain_op(c, o), o) for o in ops]
    mode, pos = c.row_pos()
    spec = _rc.RowChainSpec(groups, width, tuple(co for co, _ in cops if co is not None), pos_dtype="i64",
                            ring_window=0 if ring is None else int(ring.attrs["window"]), pos_mode=mode)
    src = _rc.render_rowchain(spec, c.target, name)
    la = _rc.rowchain_launch(spec, c.q)
    binding: dict[str, Arg] = {"x": c.arg(x), "out": Arg("value", c.names[last]), "pos": pos}
    if ring is not None:
        binding["ring"] = c.arg(ring.inputs[0])
    kept = [o for co, o in cops if co is not None]
    for i, o in enumerate(kept):
        if o.kind == "rms_norm":
            binding[f"w{i}"] = c.arg(o.inputs[1])
        if o.kind == "rope":
            binding[f"freqs{i}"] = c.arg(o.inputs[2])
    args = [binding[a.name] for a in _rc.rowchain_args(spec)]
    return _launch(src, la.grid, la.block, la.smem, args)


def _chains_from(c: _Ctx, body: list[Op], start: Value) -> list[list[Op]]:
    """Maximal chains of elementwise ops (and reshapes) in ``body`` reading ``start``, each op reading the
    previous op's output."""
    chains = []
    for op in body:
        if op.kind in ELEMENTWISE_CHAIN + ("reshape",) and op.inputs[0] is start:
            chain, cur = [op], op
            while True:
                nxt = [o for o in body if o.kind in ELEMENTWISE_CHAIN + ("reshape",) and o.inputs[0] is cur.outputs[0]]
                if len(nxt) != 1:
                    break
                cur = nxt[0]
                chain.append(cur)
            if any(o.kind != "reshape" for o in chain):
                chains.append(chain)
    return chains


def _lower_gemv_group(c: _Ctx, op: Op) -> list[Launch]:
    body = op.body or [op]
    linears = [b for b in body if b.kind == "linear"]
    launches: list[Launch] = []
    x = linears[0].inputs[0]
    pre = c.prod.get(x)
    if pre is not None and pre in body and pre.kind == "rms_norm":  # prologue norm (q_norm)
        launches.append(_rowchain(c, c.name(op, "qnorm"), pre.inputs[0], [pre]))
    act = all(l.attrs.get("act_quant", True) for l in linears if l.attrs["mode"] == "fp8act")
    launches += c.linears(c, c.name(op, "gemv"), x, linears, act)
    rings = {b.inputs[1]: b for b in body if b.kind == "ring_write"}  # fused by partition (no attention after)
    for j, lin in enumerate(linears):
        for k, chain in enumerate(_chains_from(c, body, lin.outputs[0])):
            launches.append(_rowchain(c, c.name(op, f"epi{j}_{k}"), lin.outputs[0], chain,
                                      rings.pop(chain[-1].outputs[0], None)))
    if rings:
        raise LoweringError(f"{op.attrs.get('pattern')} (layer {op.layer}): a ring write of a value no epilogue "
                            f"chain of this GEMV computes")
    return launches


# ------------------------------------------------------------------------------------------------- HC
def _lower_hc(c: _Ctx, op: Op) -> list[Launch]:
    body = op.body or []
    pattern = op.attrs["pattern"]
    variant = {"hc_embed_pre": "embed_pre", "hc_post_pre": "post_pre", "hc_post_head": "post_head",
               "hc_pre": "pre", "hc_post_out": "post_out"}[pattern]
    cfg = c.cfg
    if variant == "post_out":  # a layer-split shard's last HC post: its streams are the shard's output
        post = next(x for x in body if x.kind == "hc_post")
        spec = _hc.HcSpec(variant, c.q, cfg.hidden_size, cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult,
                          cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, cfg.hc_eps, row_block=c.row_block)
        (src,) = _hc.render_hc(spec, c.target, c.name(op, variant))
        (la,) = _hc.launch_shapes(spec)
        args = {"out": c.arg(post.inputs[0]), "x": c.arg(post.inputs[1]), "post": c.arg(post.inputs[2]),
                "comb": c.arg(post.inputs[3]), "x_new": Arg("value", c.names[post.outputs[0]])}
        return [_launch(src, la.grid, la.block, la.smem, [args[n] for n in _hc.arg_names(spec)["mix"]])]
    mix = next(b for b in body if b.kind == "hc_mix")
    norm = next(b for b in body if b.kind == "rms_norm")
    post = next((x for x in body if x.kind == "hc_post"), None)
    # the head's new streams are written only when a later kernel reads them (the DSpark tap of the last layer)
    streams = variant == "post_head" and post is not None and post.outputs[0] in op.outputs
    premix = next((b for b in body if b.kind == "hc_premix"), None)
    head_out = variant == "post_head" and premix is not None and premix.outputs[0] in op.outputs  # 7.3.4's input
    spec = _hc.HcSpec(variant, c.q, cfg.hidden_size, cfg.hc_mult, int(mix.outputs[0].type.shape[-1]),
                      cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, cfg.hc_eps, streams=streams, head_out=head_out,
                      row_block=c.row_block)
    srcs = _hc.render_hc(spec, c.target, c.name(op, variant + ("_streams" if streams else "")))
    gate = next(b for b in body if b.kind in ("sinkhorn", "hc_head_gate"))
    b: dict[str, Arg] = {"fn": c.arg(mix.inputs[1]), "scale": c.arg(gate.inputs[1]), "base": c.arg(gate.inputs[2]),
                         "norm_w": c.arg(norm.inputs[1]), "y": Arg("value", c.names[norm.outputs[0]]),
                         "ws": Arg("workspace", c.name(op, "hc_ws"), nbytes=4 * max(_hc.workspace_floats(spec), 1))}
    if head_out:
        b["y_pre"] = Arg("value", c.names[premix.outputs[0]])
    if variant == "embed_pre":
        emb = next(x for x in body if x.kind == "embed")
        b.update(tokens=Arg("step", "tokens"), table=c.arg(emb.inputs[1]), n_vocab=Arg("int", "n_vocab", value=cfg.vocab_size),
                 x=Arg("value", c.names[next(x for x in body if x.kind == "hc_expand").outputs[0]]))
    elif variant == "pre":
        b.update(x=c.arg(mix.inputs[0]))
    else:
        post = next(x for x in body if x.kind == "hc_post")
        b.update(out=c.arg(post.inputs[0]), x=c.arg(post.inputs[1]), post=c.arg(post.inputs[2]),
                 comb=c.arg(post.inputs[3]), x_new=Arg("value", c.names[post.outputs[0]]))
    if variant != "post_head":
        b.update(post_new=Arg("value", c.names[gate.outputs[1]]), comb_new=Arg("value", c.names[gate.outputs[2]]))
    names = _hc.arg_names(spec)
    launches = [_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]])
                for s, la in zip(srcs, _hc.launch_shapes(spec))]
    router = [x for x in body if x.kind == "linear"]
    if router:  # router with the FFN norm: its GEMV follows the norm stage
        launches += c.linears(c, c.name(op, "router_gemv"), norm.outputs[0], router, True)
    return launches


# ------------------------------------------------------------------------------------------------- others
def _lower_compressor(c: _Ctx, op: Op) -> list[Launch]:
    comps = [b for b in (op.body or [op]) if b.kind == "compress"]
    specs, binding = [], [c.pos_arg(comps[0].inputs[7])]
    for b in comps:
        a = b.attrs
        q = int(b.inputs[0].type.shape[0])  # the step's rows, or in a lanes step the lane's
        undo = q > 1 and not c.lanes  # a verify step saves what its rollback needs (lanes: no rollback yet)
        specs.append(_cmp.CompressorSpec(a["ratio"], a["d"], a["indexer"], a["emulate"], a["nope"], c.cfg.rope_dim,
                                         q, a["eps"], undo=undo))
        binding += [c.arg(b.inputs[i]) for i in (0, 1, 2, 3, 4, 5, 6, 8)]
        if undo:
            w = specs[-1].state_width
            binding.append(Arg("workspace", _undo.workspace_name(op.layer, "idx" if a["indexer"] else "comp"),
                               nbytes=4 * _undo.compressor_undo_floats(a["ratio"], w)))
    src = _cmp.render_compressor(specs, c.target, c.name(op, "compressor"))
    la = _cmp.launch_shape(specs)
    return [_launch(src, la.grid, la.block, la.smem, binding)]


def indexer_spec(c: _Ctx, op: Op) -> tuple[_idx.IndexerSpec, dict[str, Arg]]:
    """The :class:`IndexerSpec` of plan kernel ``op``'s ``indexer_topk`` op and the bindings of its kernels'
    arguments by name (the prefill lowering swaps the scores kernel and binds the same names)."""
    it = next(b for b in (op.body or [op]) if b.kind == "indexer_topk")
    qi, keys, hw = it.inputs[0], it.inputs[1], it.inputs[2]
    cap = int(keys.type.shape[0])
    if cap > _idx.MAX_CAP:  # the context, not a kernel parameter, is what the user chose: say so in one line
        raise LoweringError(f"a context bucket of {cap * 4} positions needs {cap} indexer keys per CSA layer; the "
                            f"compiled indexer holds at most {_idx.MAX_CAP}, so the compiled step serves max_ctx <= "
                            f"{_idx.MAX_CAP * 4} (ask for a smaller --max-ctx)")
    q = int(qi.type.shape[0])
    spec = _idx.IndexerSpec(q, int(qi.type.shape[1]), int(qi.type.shape[2]), it.attrs["topk"], cap, 4)
    mask = c.prod[it.inputs[3]]  # span_mask(span, positions, live)
    b = {"qi": c.arg(qi), "keys": c.arg(keys), "hw": c.arg(hw), "positions": c.arg(mask.inputs[1]),
         "live": c.arg(mask.inputs[2]), "out": c.arg(it.outputs[0]),
         "scores": Arg("workspace", c.name(op, "idx_scores"), nbytes=2 * q * cap)}
    return spec, b


def _lower_indexer(c: _Ctx, op: Op, scores: Callable[[_idx.IndexerSpec], tuple[Any, Any] | None] | None = None
                   ) -> list[Launch]:
    """The indexer's two launches (scores, select); ``scores``: a function of the spec giving another scores kernel
    and its launch shape (same arguments), or None to keep the SIMT stage (the prefill lowering's hook)."""
    spec, b = indexer_spec(c, op)
    srcs = _idx.render_indexer(spec, c.target, c.name(op, "indexer"))
    shapes = _idx.launch_shapes(spec)
    alt = scores(spec) if scores is not None else None
    if alt is not None:
        srcs[0], shapes[0] = alt
    names = _idx.arg_names(spec)
    return [_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]]) for s, la in zip(srcs, shapes)]


def attention_spec(c: _Ctx, op: Op) -> tuple[Op, _att.AttentionSpec]:
    """The ``sparse_attention`` op of plan kernel ``op`` and its :class:`AttentionSpec` (rows, heads, lists, scale;
    the SIMT kernel's heads per block and threads from the context)."""
    sa = next(b for b in (op.body or [op]) if b.kind == "sparse_attention")
    a = sa.attrs
    kind = a["kind"]
    cap = int(sa.inputs[5].type.shape[0]) if kind in ("csa", "hca") else 0
    topk = int(sa.inputs[6].type.shape[1]) if kind == "csa" else 0
    ratio = 0
    if kind == "hca":
        ratio = c.prod[sa.inputs[6]].attrs["ratio"]
    heads = int(sa.inputs[0].type.shape[1])
    hpb = c.attn_heads_per_block if heads % c.attn_heads_per_block == 0 else 1
    spec = _att.AttentionSpec(kind, int(sa.inputs[0].type.shape[0]), heads, int(sa.inputs[0].type.shape[2]),
                              a["window"], cap, topk, ratio, heads_per_block=hpb, scale=a["scale"])
    if c.attn_threads:
        try:
            spec = dataclasses.replace(spec, threads=c.attn_threads)
        except RenderError:
            pass  # a block size this head_dim cannot take: the automatic one
    if spec.smem_bytes() > _att.STATIC_SMEM_LIMIT and hpb > 1:
        spec = dataclasses.replace(spec, heads_per_block=1, threads=0)
    return sa, spec


def attention_bindings(c: _Ctx, op: Op, sa: Op, spec: _att.AttentionSpec) -> dict[str, Arg]:
    """The argument of every name in :func:`ds4c.runtime.families.attention.arg_names` for ``sa``."""
    kind = spec.kind
    b = {"q": c.arg(sa.inputs[0]), "ring": c.arg(sa.inputs[1]), "kv_new": c.arg(sa.inputs[2]),
         "sink": c.arg(sa.inputs[4]), "out": c.arg(sa.outputs[0]), "pos": c.pos_arg(sa.inputs[3]),
         "ws": Arg("workspace", c.name(op, "attn_ws"), nbytes=4 * max(_att.workspace_floats(spec), 1))}
    if kind in ("csa", "hca"):
        b["comp"] = c.arg(sa.inputs[5])
    if kind == "csa":
        b["sel"] = c.arg(sa.inputs[6])
    if kind == "hca":
        b["live"] = c.arg(c.prod[sa.inputs[6]].inputs[2])  # span_mask(span, positions, live)
    return b


def _lower_attention(c: _Ctx, op: Op) -> list[Launch]:
    sa, spec = attention_spec(c, op)
    srcs = _att.render_attention(spec, c.target, c.name(op, f"attn_{spec.kind}"))
    b = attention_bindings(c, op, sa, spec)
    names = _att.arg_names(spec)
    return [_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]])
            for s, la in zip(srcs, _att.launch_shapes(spec))]


def _lower_grouped(c: _Ctx, op: Op) -> list[Launch]:
    body = op.body or [op]
    gl = next(b for b in body if b.kind == "grouped_linear")
    rope = next((b for b in body if b.kind == "rope"), None)
    ring = next((b for b in body if b.kind == "ring_write"), None)
    o = rope.inputs[0] if rope is not None else gl.inputs[0]
    cfg = c.cfg
    spec = _rc.GroupedSpec(c.q, cfg.n_heads, cfg.head_dim, gl.attrs["groups"], cfg.o_lora_rank,
                           rope_dim=cfg.rope_dim if rope is not None else 0,
                           ring_window=cfg.window if ring is not None else 0,
                           kv_width=cfg.head_dim if ring is not None else 0, pos_dtype="i64",
                           ring_undo=ring is not None and c.q > 1, pos_mode=c.row_pos()[0])
    src = _rc.render_grouped(spec, c.target, c.name(op, "wo_a"))
    la = _rc.grouped_launch(spec, c.target)
    b = {"o": c.arg(o), "w": Arg("weight", c.weight_name(gl.inputs[1]) or "", form="bf16"),
         "z": Arg("value", c.names[gl.outputs[0]]), "pos": c.row_pos()[1]}
    if rope is not None:
        b["freqs"] = c.arg(rope.inputs[2])
    if ring is not None:
        b["kv"], b["ring"] = c.arg(ring.inputs[1]), c.arg(ring.inputs[0])
        if spec.ring_undo:
            b["ring_undo"] = Arg("workspace", _undo.workspace_name(op.layer, "ring"), nbytes=_undo.ring_undo_bytes(cfg))
    return [_launch(src, la.grid, la.block, la.smem, [b[a.name] for a in _rc.grouped_args(spec)])]


def _lower_ring_write(c: _Ctx, op: Op) -> list[Launch]:
    """A lane's ring write in a lanes step (partition keeps it apart from the grouped ``wo_a`` over all rows): a
    row chain with no ops storing each of the lane's KV rows into its ring slot (in place: out is x)."""
    ring = next(b for b in (op.body or [op]) if b.kind == "ring_write")
    kv = ring.inputs[1]
    spec = _rc.RowChainSpec(1, int(kv.type.shape[-1]), (), ring_window=int(ring.attrs["window"]), pos_dtype="i64")
    src = _rc.render_rowchain(spec, c.target, c.name(op, "ring_write"))
    la = _rc.rowchain_launch(spec, int(kv.type.shape[0]))
    binding = {"x": c.arg(kv), "out": c.arg(kv), "pos": c.pos_arg(ring.inputs[2]), "ring": c.arg(ring.inputs[0])}
    return [_launch(src, la.grid, la.block, la.smem, [binding[a.name] for a in _rc.rowchain_args(spec)])]


def _lower_route(c: _Ctx, op: Op) -> list[Launch]:
    body = op.body or [op]
    r = next(b for b in body if b.kind == "route")
    rs = next((b for b in body if b.kind == "router_scores"), None)
    z = rs.inputs[0] if rs is not None else r.inputs[0]
    spec = _rt.RouterSpec(c.q, c.cfg.n_experts, r.attrs["k"], r.attrs["hash"], r.attrs["scale"],
                          from_logits=rs is not None)
    srcs = _rt.render_router(spec, c.target, c.name(op, "route"))
    b = {"z": c.arg(z), "tokens": Arg("step", "tokens"), "table": c.arg(r.inputs[2]),
         "ids": Arg("value", c.names[r.outputs[0]]), "weights": Arg("value", c.names[r.outputs[1]])}
    names = _rt.arg_names(spec)
    return [_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]])
            for s, la in zip(srcs, _rt.launch_shapes(spec))]


#: the experts' activations are quantized once per launch instead of in every block (ExpertsSpec.prequant): on
#: since the H200 A/B of session 10 (docs/perf.md, Optimisation 6: experts q = 5 357 -> 160 us, flash-l4 step
#: q = 1 1.178 -> 1.082 ms, q = 5 2.661 -> 1.970 ms); ``DS4C_XP_PREQUANT=0`` turns it off for an A/B
#: (:func:`ds4c.settings.experts_prequant`, read at each lowering).


def _lower_experts(c: _Ctx, op: Op) -> list[Launch]:
    body = op.body or []
    re_ = next(b for b in body if b.kind == "routed_experts")
    lin = [b for b in body if b.kind == "linear"]
    moe = next(b for b in body if b.kind == "moe_sum")
    sw = next(b for b in body if b.kind == "swiglu")
    gate = next(l for l in lin if l.outputs[0] is sw.inputs[0])
    up = next(l for l in lin if l.outputs[0] is sw.inputs[1])
    down = next(l for l in lin if l not in (gate, up))
    layer = re_.attrs["layer"]
    p = f"blk.{layer}."
    cfg = c.cfg
    sh_gate, sh_up, sh_down = (c.weight_name(x.inputs[1]) or "" for x in (gate, up, down))
    spec = _exp.ExpertsSpec(c.q, cfg.hidden_size, cfg.moe_inter, cfg.n_active_experts, cfg.n_experts,
                            c.expert_fmt((p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight")),
                            c.expert_fmt((sh_gate, sh_up)), bool(re_.attrs["emulate"]), re_.attrs["limit"],
                            down_fmt=c.expert_fmt((p + "ffn_down_exps.weight",)),
                            shared_down_fmt=c.expert_fmt((sh_down,)), prequant=settings.experts_prequant(),
                            down_split=settings.experts_down_split())
    srcs = _exp.render_experts(spec, c.target, c.name(op, "experts"))
    rows_h = c.q * (cfg.n_active_experts + 1)  # hbuf rows: per step row its k routed slots and the shared one
    hbuf = Arg("workspace", c.name(op, "experts_h"), nbytes=2 * rows_h * cfg.moe_inter)
    b = {"x": c.arg(re_.inputs[0]), "ids": c.arg(re_.inputs[1]), "weights": c.arg(re_.inputs[2]),
         "w1": Arg("weight", p + "ffn_gate_exps.weight", form="raw"),
         "w3": Arg("weight", p + "ffn_up_exps.weight", form="raw"),
         "w2": Arg("weight", p + "ffn_down_exps.weight", form="raw"),
         "sh_w1": Arg("weight", c.weight_name(gate.inputs[1]) or "", form="raw"),
         "sh_w3": Arg("weight", c.weight_name(up.inputs[1]) or "", form="raw"),
         "sh_w2": Arg("weight", c.weight_name(down.inputs[1]) or "", form="raw"), "hbuf": hbuf,
         "out": Arg("value", c.names[moe.outputs[0]]),
         # prequant (ExpertsSpec.prequant): x and h quantized once, the e4m3 values as f16 and the per-128 scales
         "xq": Arg("workspace", c.name(op, "experts_xq"), nbytes=2 * c.q * cfg.hidden_size),
         "xs": Arg("workspace", c.name(op, "experts_xs"), nbytes=4 * c.q * (cfg.hidden_size // 128)),
         "hq": Arg("workspace", c.name(op, "experts_hq"), nbytes=2 * rows_h * cfg.moe_inter),
         "hs": Arg("workspace", c.name(op, "experts_hs"), nbytes=4 * rows_h * (cfg.moe_inter // 128)),
         # down_split > 1: every slot's y_e, summed by the call's last launch
         "ybuf": Arg("workspace", c.name(op, "experts_y"), nbytes=2 * rows_h * cfg.hidden_size)}
    names = _exp.arg_names(spec, c.target)
    return [_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]])
            for s, la in zip(srcs, _exp.launch_shapes(spec, c.target))]


def _lower_tap(c: _Ctx, op: Op) -> list[Launch]:
    """The DSpark taps (spec 5.2(q)): one launch of the tap family writing every tapped layer of the graph into the
    tap ring (in place: the op's output is the ring it updates). ``record_hc`` (spec 7.5's ``X_main``): the same
    kernel in copy mode, the last layer's streams into the final HC ring."""
    t = next(b for b in (op.body or [op]) if b.kind in ("dspark_tap", "record_hc"))
    copy = t.kind == "record_hc"
    slots = (0,) if copy else tuple(t.attrs["slots"])
    xs = t.inputs[2:2 + len(slots)]
    if len(t.inputs) > 2 + len(slots):
        raise LoweringError(f"{t.kind}: a masked (prefill chunk) tap has no kernel")
    ring = t.inputs[0]
    d = int(xs[0].type.shape[-1])
    layers = tuple(c.prod[x].layer if x in c.prod else -1 for x in xs)
    n_taps = 1 if copy else int(ring.type.shape[1]) // d
    spec = _tap.TapSpec(c.q, d, int(xs[0].type.shape[1]), int(ring.type.shape[0]), n_taps, slots, layers, copy=copy)
    src = _tap.render_tap(spec, c.target, c.name(op, t.kind))
    la = _tap.launch_shape(spec)
    b = {"pos": Arg("step", "pos"), "ring": c.arg(ring), **{f"x{k}": c.arg(x) for k, x in enumerate(xs)}}
    return [_launch(src, la.grid, la.block, la.smem, [b[n] for n in _tap.arg_names(spec)])]


def _lower_markov(c: _Ctx, op: Op) -> list[Launch]:
    """7.3.3: the greedy Markov chain, one ``depth`` launch per block row, then ``final``
    (runtime/families/dspark.py)."""
    mc = next(b for b in (op.body or [op]) if b.kind == "markov_chain")
    base, _tok, w1, w2 = mc.inputs
    spec = _mk_spec(c, mc)
    srcs = _dsp.render_markov(spec, c.target, c.name(op, "markov"))
    shapes = _dsp.launch_shapes(spec)
    b = {"base": c.arg(base), "w1": _bf16_weight(c, w1), "w2": _bf16_weight(c, w2), "tokens": Arg("step", "tokens"),
         "part": Arg("workspace", c.name(op, "markov_part"), nbytes=_dsp.workspace_bytes(spec)),
         "logits": Arg("value", c.names[mc.outputs[1]]), "drafts": Arg("value", c.names[mc.outputs[0]])}
    names = _dsp.arg_names(spec)
    out = []
    for i in range(spec.rows):
        la = shapes["depth"]
        out.append(_launch(srcs["depth"], la.grid, la.block, la.smem,
                           [Arg("int", "depth", value=i) if n == "depth" else b[n] for n in names["depth"]]))
    la = shapes["final"]
    out.append(_launch(srcs["final"], la.grid, la.block, la.smem, [b[n] for n in names["final"]]))
    return out


def _mk_spec(c: _Ctx, mc: Op, conf: Op | None = None) -> _dsp.MarkovSpec:
    base, w1 = mc.inputs[0], mc.inputs[2]
    hidden = int(conf.inputs[0].type.shape[1]) if conf is not None else c.cfg.hidden_size
    return _dsp.MarkovSpec(int(base.type.shape[0]), int(base.type.shape[1]), int(w1.type.shape[1]), hidden,
                           confidence=conf is not None, bias=conf is not None and len(conf.inputs) > 5)


def _bf16_weight(c: _Ctx, v: Value) -> Arg:
    name = c.weight_name(v)
    if name is None:
        raise LoweringError("the DSpark head reads model tensors only")
    return Arg("weight", name, form="bf16")


def _lower_confidence(c: _Ctx, op: Op) -> list[Launch]:
    """7.3.4: the confidence logits, one block per block row (runtime/families/dspark.py)."""
    conf = next(b for b in (op.body or [op]) if b.kind == "dspark_confidence")
    hx, _tok, drafts, w1, proj = conf.inputs[:5]
    mc = c.prod.get(drafts)
    if mc is None or mc.kind != "markov_chain":
        raise LoweringError("dspark_confidence: its drafts are not a markov_chain's")
    spec = _mk_spec(c, mc, conf)
    src = _dsp.render_markov(spec, c.target, c.name(op, "markov"))["conf"]
    la = _dsp.launch_shapes(spec)["conf"]
    b = {"hx": c.arg(hx), "w1": _bf16_weight(c, w1), "proj": c.arg(proj), "tokens": Arg("step", "tokens"),
         "drafts": c.arg(drafts), "conf": Arg("value", c.names[conf.outputs[0]])}
    if spec.bias:
        b["bias"] = c.arg(conf.inputs[5])
    return [_launch(src, la.grid, la.block, la.smem, [b[n] for n in _dsp.arg_names(spec)["conf"]])]


_PATTERNS = {
    "hc_embed_pre": _lower_hc, "hc_post_pre": _lower_hc, "hc_post_head": _lower_hc, "hc_pre": _lower_hc,
    "hc_post_out": _lower_hc,
    "multi_gemv": _lower_gemv_group, "linear": _lower_gemv_group,
    "compressor": _lower_compressor, "indexer_topk": _lower_indexer, "sparse_attention": _lower_attention,
    "grouped_linear": _lower_grouped, "route": _lower_route, "moe_experts": _lower_experts,
    "dspark_tap": _lower_tap, "record_hc": _lower_tap, "markov_chain": _lower_markov,
    "dspark_confidence": _lower_confidence, "ring_write": _lower_ring_write,
}

FAMILY_OF = {"hc_embed_pre": "hc", "hc_post_pre": "hc", "hc_post_head": "hc", "hc_pre": "hc", "hc_post_out": "hc", "multi_gemv": "gemv",
             "linear": "gemv", "compressor": "compressor", "indexer_topk": "indexer",
             "sparse_attention": "attention", "grouped_linear": "grouped", "route": "router",
             "moe_experts": "experts", "dspark_tap": "tap", "record_hc": "tap", "markov_chain": "dspark",
             "dspark_confidence": "dspark", "ring_write": "rowchain"}


EXPERT_FORMATS = tuple(_EXPERT_FMT)


def check_expert_formats(types: dict[str, GGMLType]) -> None:
    """The experts kernels read routed and shared expert weights stored as MXFP4, Q8_0, BF16, a K-quant
    (Q2_K..Q6_K) or IQ4_XS.

    Raises:
        LoweringError: naming the first expert tensor stored otherwise (e.g. an ``--formats f32`` model).
    """
    for name, t in types.items():
        if ("_exps." in name or "_shexp." in name) and t not in EXPERT_FORMATS:
            raise LoweringError(f"the compiled step reads expert weights stored as MXFP4, Q8_0, BF16, Q2_K..Q6_K "
                                f"or IQ4_XS; {name} is {getattr(t, 'name', t)}{_reference_hint(t)}")


def _reference_hint(t: object) -> str:
    """What to do with a weight no compiled kernel reads (every K-quant / IQ4_XS is read by some kernel now)."""
    return (" (an --formats f32 model runs on the reference only: make it with --formats official or bf16 to "
            "compile it)") if t == GGMLType.F32 else ""


def lower_step(g: Graph, cfg: Ds4Config, target: Target,
               weight_types: dict[str, GGMLType] | None = None) -> list[LoweredKernel]:
    """The launches of every plan kernel of the partitioned decode / verify (or drafter) graph ``g`` for
    ``target``, and the rollback kernel of a verify graph (q >= 2, not a drafter's) last.

    Args:
        weight_types: GGUF storage type per weight name (default: the official formats of ``cfg``).

    Raises:
        LoweringError: a plan kernel whose pattern no family implements, or a weight stored in a format no
            kernel reads.
    """
    types = weight_types or storage_types(cfg, "official")
    check_expert_formats(types)
    c = _Ctx(g, cfg, target, types)
    out: list[LoweredKernel] = []
    for name, pattern, op in plan_kernels(g):
        fn = _PATTERNS.get(pattern)
        if fn is None:
            raise LoweringError(f"no kernel family lowers the plan kernel pattern {pattern!r} (layer {op.layer})")
        out.append(LoweredKernel(name, FAMILY_OF[pattern], op.layer, _lower_rows(c, fn, op) if c.lanes else fn(c, op)))
    # the drafter's graphs are never rolled back (ds4c.ir.dspark); a lanes step has no rollback yet
    if c.q > 1 and not g.meta.get("dspark") and not c.lanes:
        out.append(_lower_rollback(c))
    return out


def _lower_rows(c: _Ctx, fn: Any, op: Op) -> list[Launch]:
    """A plan kernel of a lanes step: lowered at all its rows, or, when its family does not take that many at once
    (the GEMV kernel holds at most ``settings.gemv_rows()`` rows, 16 by default, and fewer where x does not fit in
    shared memory; the experts kernel 8; the grouped ``wo_a`` 5 of flash's K = 4096 in shared memory,
    HIP's experts fewer), over chunks of rows, the widest that lower, each launch bound at its chunk's first row:
    the chunk's weights are then read once per chunk."""
    try:
        return fn(c, op)
    except RenderError as e:
        first = e
    rows = c.q
    try:
        for chunk in range(rows - 1, 0, -1):
            try:
                out = []
                for r0 in range(0, rows, chunk):
                    c.q = min(chunk, rows - r0)
                    out += [_shift_rows(c, la, r0, rows) for la in fn(c, op)]
                return out
            except RenderError:
                continue
    finally:
        c.q = rows
    raise first


def _shift_rows(c: _Ctx, la: Launch, r0: int, rows: int) -> Launch:
    """``la`` bound ``r0`` rows further into every row-wise buffer (a value with ``rows`` rows, the step's positions
    and tokens)."""
    if not r0:
        return la
    by_name = c.by_name()

    def row_wise(a: Arg) -> bool:
        if a.kind == "step":
            return a.name in ("positions", "tokens")
        v = by_name.get(a.name) if a.kind == "value" else None
        return v is not None and v.type.shape[:1] == (rows,)

    return dataclasses.replace(la, args=tuple(dataclasses.replace(a, row=a.row + r0) if row_wise(a) else a
                                              for a in la.args))


def plan_kernels(g: Graph) -> Iterator[tuple[str, str, Op]]:
    """The plan kernels of a partitioned graph in order: ``(name, pattern, op)`` per fused op, named
    ``l{layer}.{pattern}`` (``{pattern}`` outside the layers), ``.2``, ``.3`` ... for repeats in a layer."""
    seen: dict[str, int] = {}
    for op in g.ops:
        if op.kind != "fused":
            continue
        pattern = op.attrs.get("pattern", "")
        base = f"l{op.layer}.{pattern}" if op.layer >= 0 else pattern
        seen[base] = seen.get(base, 0) + 1
        yield (base if seen[base] == 1 else f"{base}.{seen[base]}"), pattern, op


ROLLBACK_KERNEL = "rollback"
"""The last plan kernel of every verify graph (q >= 2): its rollback (``runtime/families/undo.py``). The
executor binds it apart and launches it only on a rollback; it is not part of the step."""


def _lower_rollback(c: _Ctx) -> LoweredKernel:
    """The rollback kernel of a verify graph: every layer's ring (graph inputs ``l{i}.ring``) and every ratio-4
    compressor's state, with the undo workspaces the step's kernels fill."""
    cfg = c.cfg
    layers = sorted({int(k[1:].split(".")[0]) for k in c.g.inputs if k.endswith(".ring")})
    comps, args = [], [Arg("step", "pos"), Arg("step", "accepted")]
    for i in layers:
        args += [Arg("value", f"l{i}.ring"), Arg("workspace", _undo.workspace_name(i, "ring"),
                                                 nbytes=_undo.ring_undo_bytes(cfg))]
    tail = []
    for i in layers:
        r = cfg.ratio(i)
        if not r:
            continue
        for what, d in (("comp", cfg.head_dim), ("idx", cfg.index_head_dim))[:2 if r == 4 else 1]:
            w = 2 * d if r == 4 else d
            comps.append((r, w))
            tail += [Arg("value", f"l{i}.{what}_kv"), Arg("value", f"l{i}.{what}_score"),
                     Arg("workspace", _undo.workspace_name(i, what), nbytes=4 * _undo.compressor_undo_floats(r, w))]
    spec = _undo.RollbackSpec(c.q, cfg.window, cfg.head_dim, len(layers), tuple(comps))
    src = _undo.render_rollback(spec, c.target, f"rollback_q{c.q}")
    la = _undo.launch_shape(spec)
    return LoweredKernel(ROLLBACK_KERNEL, "undo", -1, [_launch(src, la.grid, la.block, la.smem, args + tail)])
