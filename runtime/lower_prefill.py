"""Lowering of a prefill chunk graph (docs/prefill.md: ``build_step(cfg, C, max_ctx, prefill=True)`` after the default
pipeline) to family launches over C rows. Entered through :func:`ds4c.runtime.lower.lower_graph`, which hands
every graph with ``meta["prefill"]`` to :func:`lower_prefill`; the decode / verify lowering is untouched.

What each plan kernel lowers to at C rows (the audit behind it: docs/prefill.md, with file:line evidence):

* ``multi_gemv`` / ``linear`` (projections): the prologue norm (q_norm) and the epilogue chains as row-chain
  launches over C rows (grid ``(groups, C)``, one block per (group, row); the row-chain source does not depend
  on C), the linears as GEMM-family calls (:mod:`ds4c.runtime.families.gemm`, ``GemmSpec(prequant=True)``):
  per group one ``actq`` launch (x quantized once: ``xq`` f16 ``[C, K]``, ``xs`` fp32 ``[C, K/128]``, workspaces
  ``ds4c_gemm_xq`` / ``ds4c_gemm_xs``) shared by every output that uses it (:func:`gemm.uses_prequant`: MXFP4 /
  Q8_0 fp8act on sm_89+ CUDA), then one GEMM launch per output; bf16 weights and modes ``bf16`` / ``f32``
  (indexer head weights, compressor kv / gate, router) are the in-tile GEMM on bf16 ``x``. A group whose
  input has fewer than :data:`GEMM_MIN_ROWS` rows (the head's ``take_row`` output, 1 row) stays a GEMV. An
  epilogue with a fused ``ring_write`` is refused (pending): the row-chain ring store has no ``n_valid`` and
  races for C > window.
* ``hc_embed_pre`` / ``hc_post_pre`` / ``hc_pre`` / ``hc_post_out``: the HC family with
  ``HcSpec.row_block`` (stage mix grid ``(hidden/32, C/row_block)``, row_block 4 for C % 4 == 0; stage norm
  is one block per row already); the FFN-side router linear as a GEMM (above).
* ``hc_post_head`` with the head's ``take_row`` (the default graph): a take-row launch
  (:mod:`ds4c.runtime.families.takerow`: row ``n_valid - 1`` of the HC post's four inputs into 1-row
  workspaces), then the decode ``post_head`` HC kernel at q = 1; the logits linear (1 row) is the decode GEMV.
  When a tap / ``record_hc`` reads the last layer's streams, an HC ``post_out`` launch over C rows writes them
  first.
  An ``all_logits`` graph's head lowers like ``hc_post_pre`` at C rows (row blocks, GEMM logits).
* ``compressor``: the compressor family with ``CompressorSpec.valid`` (a device-side ``n_valid`` after ``pos``:
  rows ``>= n_valid`` write no state, flush or row); no undo. By default parallel over the chunk's flushes (one
  block per flush reading its slots from the chunk's rows or the state the chunk found, then one launch setting the
  state); ``DS4C_PREFILL_CMP_PARALLEL=0``: the serial kernel, rows in order by one block per compressor.
* ``sparse_attention``: (unless ``DS4C_PREFILL_ATTN_MMA=0``) the matrix-unit chunk attention
  (:mod:`ds4c.runtime.families.chunk_attention`: one block per (64 heads, row), scores and value product by
  ``mma.sync`` on CUDA, MFMA / WMMA on gfx90a / gfx942 / gfx1100 / gfx1151); elsewhere (gfx1201) the decode SIMT
  kernel at ``q = C``. Both keep the decode kernel's lists (per-row positions and causal
  limits; the window rule ``t < pos``: ring slot, else this chunk's kv row, holds for C > window; no split).
* ``indexer_topk``, ``route``: the decode kernels at ``q = C`` unchanged (one block per row, or per (head, row);
  per-row positions and causal limits).
* ``grouped_linear`` (wo_a + its fused ring write): :func:`_lower_grouped`: a valid-gated ring-write row chain
  (``RowChainSpec.ring_valid``), an inverse-RoPE row chain into a workspace, one grouped GEMM
  (``GemmSpec.groups``).
* ``moe_experts``: :func:`lower_routed_experts`: the grouped-experts family (:mod:`ds4c.runtime.families.moe_gemm`):
  the routed call with ``moe_sum`` fused into its combine, the shared expert as a ``dense`` call (CUDA sm_89+; HIP
  on MFMA (every format) / WMMA (MXFP4 / Q8_0); sm_80, gfx1201 and K-quant experts on wave-32 RDNA pending).
* ``dspark_tap`` / ``record_hc`` with ``n_valid``: :func:`_lower_tap`: the tap family with ``TapSpec.valid``
  (device ``n_valid`` after ``pos``; only the last ``R`` valid rows write, R the ring's rows: one writer per slot).

Per-step scalars the executor must provide for a chunk at ``pos`` with ``n_valid`` valid rows: ``pos``,
``tokens`` [C], ``positions`` [C] (``pos + i``), ``n_valid`` and ``live_r<ratio>`` = ``(pos + n_valid) // ratio``
(the IR's ``live_rows`` with ``n_valid``). Not GPU-run yet.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ds4c import settings
from ds4c.config import Ds4Config
from ds4c.ir.graph import Graph, Op, Value
from ds4c.quant import GGMLType
from ds4c.runtime import lower_step as L
from ds4c.runtime.families import attention as _att
from ds4c.runtime.families import chunk_attention as _ca
from ds4c.runtime.families import chunk_indexer as _ci
from ds4c.runtime.families import compressor as _cmp
from ds4c.runtime.families import gemm as _gm
from ds4c.runtime.families import hc as _hc
from ds4c.runtime.families import moe_gemm as _mg
from ds4c.runtime.families import rowchain as _rc
from ds4c.runtime.families import takerow as _tr
from ds4c.runtime.families import tap as _tap
from ds4c.runtime.lower_step import _Ctx, _launch
from ds4c.runtime.lowered import Arg, Launch, LoweredKernel, LoweringError
from ds4c.runtime.render import RenderError as _RenderError
from ds4c.runtime.targets import Target
from ds4c.tensors import storage_types

#: inputs with fewer rows than this run as GEMVs (the GEMM's 64-row tiles would be mostly padding): the head's
#: 1-row input after ``take_row``
GEMM_MIN_ROWS = 16

#: the family of the experts at C rows (runtime/families/moe_gemm.py), named in the refusals
GROUPED_EXPERTS_FAMILY = "moe_gemm"


class PendingLowering(LoweringError):
    """A plan kernel of a prefill chunk graph whose C-row kernel is not written yet (the message names it)."""


@dataclass(frozen=True)
class PendingKernel:
    """A plan kernel :func:`lower_prefill` skipped: its name (as :class:`LoweredKernel` names it), pattern, layer
    and the one-line reason."""

    name: str
    pattern: str
    layer: int
    message: str




def _hc_row_block(q: int) -> int:
    """Stage-mix rows per block at ``q`` rows: the largest of 4, 2, 1 dividing ``q`` (decode-size loops)."""
    return next(n for n in (4, 2, 1) if q % n == 0)


def _gemm_linears(c: _Ctx, name: str, x: Value, linears: list[Op], act_quant: bool) -> list[Launch]:
    """Linears sharing ``x`` (bf16 ``[rows, K]``) as GEMM calls: one ``actq`` launch for every output whose call
    uses prequant (they all quantize the same ``x``), then one GEMM per output (``y`` its IR output, bf16 or
    fp32 ``[rows, N]``). Fewer than :data:`GEMM_MIN_ROWS` rows: the GEMV lowering (``q = rows``).

    Raises:
        LoweringError: a weight that is not a model tensor or whose storage the GEMM family does not read (F32),
            or ``K`` not a multiple of 128.
        PendingLowering: K-quant / IQ4_XS weights on a target or mode that does not decode them (sm_80, wave-32
            RDNA, gfx1201, act_quant off: the f16 MMA path on CUDA sm_89+ and the wave-64 AMD matrix cores do).
    """
    rows, k = (int(d) for d in x.type.shape)
    if rows < GEMM_MIN_ROWS:
        return L._gemv(c, name, x, linears, act_quant, q=rows)
    gname = name.replace("gemv", "gemm")
    out: list[Launch] = []
    xq = xs = None
    for j, lin in enumerate(linears):
        w = c.weight_name(lin.inputs[1])
        if w is None:
            raise LoweringError(f"{name}: linear weight is not a model tensor")
        fmt = c.fmt(w)
        if fmt not in _gm.FORMATS:
            raise LoweringError(f"{name}: weight {w} is stored as {fmt}; the GEMM family reads {_gm.FORMATS}")
        mode = lin.attrs["mode"]
        spec = _gm.GemmSpec(rows, int(lin.outputs[0].type.shape[-1]), k, fmt, mode,
                            act_quant=bool(act_quant and lin.attrs.get("act_quant", True)) if mode == "fp8act" else True,
                            out_dtype=lin.outputs[0].type.dtype, prequant=True, bn=c.gemm_bn,
                            stages=c.stages or 2, xfmt=c.gemm_xq)
        if fmt in _gm.KQUANTS:  # the f16 MMA path (CUDA sm_89+) and wave-64 xm decode them (fp8act): pending elsewhere
            try:
                _gm.plan(spec, c.target)
            except _RenderError as e:
                raise PendingLowering(f"{name}: weight {w}: {e}") from None
        srcs = _gm.render_call(spec, c.target, f"{gname}{j}")
        names = _gm.arg_names(spec, c.target)
        ws = _gm.workspaces(spec, c.target)
        b = {"x": c.arg(x), "w": Arg("weight", w, form="raw"), "y": Arg("value", c.names[lin.outputs[0]])}
        if ws:
            nb = {n: math.prod(sh) * dt.itemsize for n, (sh, dt) in ws.items()}
            b["xq"] = Arg("workspace", "ds4c_gemm_xq", nbytes=nb["xq"])
            b["xs"] = Arg("workspace", "ds4c_gemm_xs", nbytes=nb["xs"])
        for src, la in zip(srcs, _gm.launch_shapes(spec, c.target)):
            if la.kernel == "actq":
                if xq is not None:  # x already quantized by this group's first prequant call
                    continue
                xq = xs = True
            out.append(_launch(src, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]]))
    return out


def _lower_linears(c: _Ctx, op: Op) -> list[Launch]:
    """``multi_gemv`` / ``linear`` at C rows: :func:`ds4c.runtime.lower_step._lower_gemv_group` with the GEMM calls of
    :func:`_gemm_linears`. Pending: a fused ``ring_write`` epilogue."""
    if any(b.kind == "ring_write" for b in (op.body or [])):
        raise PendingLowering("a ring write fused into a projection epilogue: the row-chain ring store has no "
                              "n_valid and races for C > window")
    return L._lower_gemv_group(c, op)


def _lower_hc(c: _Ctx, op: Op) -> list[Launch]:
    """The HC kernels at C rows (``HcSpec.row_block``); the head with ``take_row``: :func:`_lower_head`."""
    if any(b.kind == "take_row" for b in (op.body or [])):
        return _lower_head(c, op)
    return L._lower_hc(c, op)


def _lower_head(c: _Ctx, op: Op) -> list[Launch]:
    """``hc_post_head`` of a prefill chunk whose head reads row ``n_valid - 1`` (``hc_post`` on C rows, then
    ``take_row``, then the 1-row mix / gate / pre-mix / norm): the take-row family copies row ``n_valid - 1`` of
    the HC post's four inputs (out bf16 [C, D], x bf16 [C, hc, D], post f32 [C, hc], comb f32 [C, hc, hc]) into
    the workspaces ``ds4c_head_{out,x,post,comb}``, then the decode ``post_head`` HC kernel at q = 1 runs on them
    (the post of one row does not depend on the others, so this is the row of the C-row post).

    When the last layer's new streams are also a plan kernel output (a DSpark tap or ``record_hc`` reads all C
    rows of them), a ``post_out`` HC launch over C rows (``HcSpec.row_block``; the streams ``post_pre`` /
    the decode head's ``streams`` variant write, bit for bit) writes them first.
    """
    body = op.body or []
    post = next(b for b in body if b.kind == "hc_post")
    cfg = c.cfg
    out: list[Launch] = []
    if post.outputs[0] in op.outputs:
        pspec = _hc.HcSpec("post_out", c.q, cfg.hidden_size, cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult,
                           cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, cfg.hc_eps, row_block=c.row_block)
        (src,) = _hc.render_hc(pspec, c.target, c.name(op, "post_streams"))
        (la,) = _hc.launch_shapes(pspec)
        pb = {"out": c.arg(post.inputs[0]), "x": c.arg(post.inputs[1]), "post": c.arg(post.inputs[2]),
              "comb": c.arg(post.inputs[3]), "x_new": Arg("value", c.names[post.outputs[0]])}
        out.append(_launch(src, la.grid, la.block, la.smem, [pb[n] for n in _hc.arg_names(pspec)["mix"]]))
    mix = next(b for b in body if b.kind == "hc_mix")
    norm = next(b for b in body if b.kind == "rms_norm")
    gate = next(b for b in body if b.kind == "hc_head_gate")
    premix = next((b for b in body if b.kind == "hc_premix"), None)
    head_out = premix is not None and premix.outputs[0] in op.outputs
    srcs_in = post.inputs[:4]
    tspec = _tr.TakeRowSpec(c.q, tuple(v.type.nbytes() // c.q for v in srcs_in))
    ws = [Arg("workspace", f"ds4c_head_{n}", nbytes=b) for n, b in zip(("out", "x", "post", "comb"), tspec.row_bytes)]
    tb = {"n_valid": Arg("step", "n_valid")}
    for k, (v, w) in enumerate(zip(srcs_in, ws)):
        tb[f"src{k}"], tb[f"dst{k}"] = c.arg(v), w
    la = _tr.launch_shape(tspec)
    out += [_launch(_tr.render_take_row(tspec, c.target, c.name(op, "take_row")), la.grid, la.block, la.smem,
                   [tb[n] for n in _tr.arg_names(tspec)])]
    spec = _hc.HcSpec("post_head", 1, cfg.hidden_size, cfg.hc_mult, int(mix.outputs[0].type.shape[-1]),
                      cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps, cfg.hc_eps, head_out=head_out)
    b = {"fn": c.arg(mix.inputs[1]), "scale": c.arg(gate.inputs[1]), "base": c.arg(gate.inputs[2]),
         "norm_w": c.arg(norm.inputs[1]), "y": Arg("value", c.names[norm.outputs[0]]),
         "ws": Arg("workspace", c.name(op, "hc_ws"), nbytes=4 * max(_hc.workspace_floats(spec), 1)),
         "out": ws[0], "x": ws[1], "post": ws[2], "comb": ws[3]}
    if head_out:
        b["y_pre"] = Arg("value", c.names[premix.outputs[0]])
    names = _hc.arg_names(spec)
    for s, la in zip(_hc.render_hc(spec, c.target, c.name(op, "post_head")), _hc.launch_shapes(spec)):
        out.append(_launch(s, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]]))
    return out


def _lower_compressor(c: _Ctx, op: Op) -> list[Launch]:
    """The compressor family over C rows with the device-side ``n_valid`` (``CompressorSpec.valid``), no undo: by
    default two launches parallel over the chunk's flushes (``render_compressor_chunk``: one block per flush, then
    the state as the rows leave it); with ``DS4C_PREFILL_CMP_PARALLEL=0`` the row-serial kernel (one block per
    compressor walks the rows in order, every flush in place). Both leave the same bits."""
    comps = [b for b in (op.body or [op]) if b.kind == "compress"]
    specs, binding = [], [Arg("step", "pos"), Arg("step", "n_valid")]
    for b in comps:
        a = b.attrs
        if len(b.inputs) < 10:
            raise LoweringError(f"compressor (layer {op.layer}): a prefill compress op without its n_valid input")
        specs.append(_cmp.CompressorSpec(a["ratio"], a["d"], a["indexer"], a["emulate"], a["nope"], c.cfg.rope_dim,
                                         c.q, a["eps"], valid=True))
        binding += [c.arg(b.inputs[i]) for i in (0, 1, 2, 3, 4, 5, 6, 8)]
    if c.cmp_parallel:
        return [_launch(src, la.grid, la.block, la.smem, binding) for src, la in
                zip(_cmp.render_compressor_chunk(specs, c.target, c.name(op, "compressor")),
                    _cmp.chunk_launch_shapes(specs))]
    src = _cmp.render_compressor(specs, c.target, c.name(op, "compressor"))
    la = _cmp.launch_shape(specs)
    return [_launch(src, la.grid, la.block, la.smem, binding)]


def _lower_attention(c: _Ctx, op: Op) -> list[Launch]:
    """The chunk's attention on matrix units (:mod:`ds4c.runtime.families.chunk_attention`) where the target and
    shapes allow it (the default; ``DS4C_PREFILL_ATTN_MMA=0`` turns it off); else (gfx1201) the decode SIMT kernel at
    q = C. Both take the same arguments."""
    if not c.attn_mma:
        return L._lower_attention(c, op)
    sa, spec = L.attention_spec(c, op)
    try:  # both check the target and shapes (chunk_attention.check)
        src = _ca.render_chunk_attention(spec, c.target, c.name(op, f"attn_mma_{spec.kind}"))
        la = _ca.launch_shape(spec, c.target)
    except _RenderError:
        return L._lower_attention(c, op)
    b = L.attention_bindings(c, op, sa, spec)
    return [_launch(src, la.grid, la.block, la.smem, [b[n] for n in _att.arg_names(spec)["main"]])]


def _lower_indexer(c: _Ctx, op: Op) -> list[Launch]:
    """``indexer_topk`` at C rows: the scores on tensor cores (:mod:`ds4c.runtime.families.chunk_indexer`) where the
    target has them and ``DS4C_PREFILL_INDEXER_MMA=1`` (off by default until a GPU has timed it), then the decode
    select stage; else both decode stages at q = C. The two scores kernels take the same arguments."""
    def scores(spec):
        try:
            return (_ci.render_chunk_scores(spec, c.target, c.name(op, "indexer_mma_scores")),
                    _ci.launch_shape(spec))
        except _RenderError:
            return None

    return L._lower_indexer(c, op, scores if c.indexer_mma else None)


def _lower_grouped(c: _Ctx, op: Op) -> list[Launch]:
    """``grouped_linear`` (wo_a, spec 5.2(j),(k)) with its fused ring write (5.2(h.1)) at C rows, three launches:

    1. the ring write: a row chain with no ops and ``ring_valid`` (x = out = kv bf16 ``[C, head_dim]``, in
       place), row ``i`` writing slot ``(pos + i) % window`` only when ``n_valid - window <= i < n_valid``: one
       writer per slot, the ring left as token-wise decoding leaves it (after attention, which read the old ring);
    2. the inverse RoPE of the attention output: a row chain over ``[C, H, head_dim]`` into the workspace
       ``ds4c_wo_a_x`` (bf16 ``[C, H * head_dim]``, the grouped kernel's prologue as its own launch);
    3. the projection: one grouped GEMM call (``GemmSpec(groups=G)``, bf16 weights as the grouped family reads
       them, mode bf16, fp32 accumulation): ``z[:, g] = x[:, g*K:(g+1)*K] @ wo_a[g*R:(g+1)*R]^T``, z bf16
       ``[C, G, R]``.

    The decode kernel (runtime/families/rowchain.py GroupedSpec) is not used: it stages all rows of a group in
    static shared memory (``GL_Q * K * 2`` bytes: 8 KB per row at K = 4096) and its ring write has no n_valid.

    Raises:
        LoweringError: a ring write without its ``n_valid`` input.
    """
    body = op.body or [op]
    gl = next(b for b in body if b.kind == "grouped_linear")
    rope = next((b for b in body if b.kind == "rope"), None)
    ring = next((b for b in body if b.kind == "ring_write"), None)
    cfg, launches = c.cfg, []
    if ring is not None:
        if len(ring.inputs) < 4:
            raise LoweringError(f"grouped_linear (layer {op.layer}): a prefill ring write without its n_valid input")
        kv = ring.inputs[1]
        spec = _rc.RowChainSpec(1, int(kv.type.shape[-1]), (), ring_window=int(ring.attrs["window"]), pos_dtype="i64",
                                ring_valid=True)
        b = {"x": c.arg(kv), "out": c.arg(kv), "pos": Arg("step", "pos"), "ring": c.arg(ring.inputs[0]),
             "n_valid": Arg("step", "n_valid")}
        la = _rc.rowchain_launch(spec, c.q)
        launches.append(_launch(_rc.render_rowchain(spec, c.target, c.name(op, "ring_write")), la.grid, la.block,
                                la.smem, [b[a.name] for a in _rc.rowchain_args(spec)]))
    o = rope.inputs[0] if rope is not None else gl.inputs[0]
    rows, heads, hd = (int(d) for d in o.type.shape)
    groups = int(gl.attrs["groups"])
    x = c.arg(o)
    if rope is not None:
        spec = _rc.RowChainSpec(heads, hd, (_rc.rope(cfg.rope_dim, inverse=rope.attrs["inverse"]),), pos_dtype="i64")
        x = Arg("workspace", "ds4c_wo_a_x", nbytes=2 * rows * heads * hd)
        b = {"x": c.arg(o), "out": x, "pos": Arg("step", "pos"), "freqs0": c.arg(rope.inputs[2])}
        la = _rc.rowchain_launch(spec, rows)
        launches.append(_launch(_rc.render_rowchain(spec, c.target, c.name(op, "wo_a_rope")), la.grid, la.block,
                                la.smem, [b[a.name] for a in _rc.rowchain_args(spec)]))
    w = c.weight_name(gl.inputs[1])
    if w is None:
        raise LoweringError(f"grouped_linear (layer {op.layer}): its weight is not a model tensor")
    k = heads // groups * hd
    spec = _gm.GemmSpec(rows, int(gl.outputs[0].type.shape[-1]), k, "bf16", "bf16",
                        out_dtype=gl.outputs[0].type.dtype, groups=groups, bn=c.gemm_bn)
    b = {"x": x, "w": Arg("weight", w, form="bf16"), "y": Arg("value", c.names[gl.outputs[0]])}
    names = _gm.arg_names(spec, c.target)
    for src, la in zip(_gm.render_call(spec, c.target, c.name(op, "wo_a_gemm")), _gm.launch_shapes(spec, c.target)):
        launches.append(_launch(src, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]]))
    return launches


def _lower_tap(c: _Ctx, op: Op) -> list[Launch]:
    """``dspark_tap`` (spec 5.2(q)) / ``record_hc`` (7.5, the tap family's copy mode) of a prefill chunk: one tap
    launch with ``TapSpec(valid=True)`` over C rows, ``n_valid`` the step scalar: only rows ``n_valid - R <= i <
    n_valid`` write (R = the ring's rows: the window for the tap ring, window + MAX_WIDTH for the final HC ring),
    one writer per ring slot, so the ring is left as token-wise decoding leaves it (the IR ops write rows ``0 ..
    n_valid - 1`` in order); the grid covers ``min(C, R)`` rows. Bindings as the decode lowering's
    (:func:`ds4c.runtime.lower_step._lower_tap`) plus ``n_valid``.

    Raises:
        LoweringError: a tap op without its ``n_valid`` input (an unpadded graph has no prefill lowering).
    """
    t = next(b for b in (op.body or [op]) if b.kind in ("dspark_tap", "record_hc"))
    copy = t.kind == "record_hc"
    slots = (0,) if copy else tuple(t.attrs["slots"])
    xs = t.inputs[2:2 + len(slots)]
    if len(t.inputs) != 3 + len(slots):
        raise LoweringError(f"{t.kind} (layer {op.layer}): a prefill tap op without its n_valid input")
    ring = t.inputs[0]
    d = int(xs[0].type.shape[-1])
    layers = tuple(c.prod[x].layer if x in c.prod else -1 for x in xs)
    n_taps = 1 if copy else int(ring.type.shape[1]) // d
    try:
        spec = _tap.TapSpec(c.q, d, int(xs[0].type.shape[1]), int(ring.type.shape[0]), n_taps, slots, layers,
                            copy=copy, valid=True)
    except _RenderError as e:
        raise LoweringError(f"{t.kind} (layer {op.layer}): {e}") from None
    src = _tap.render_tap(spec, c.target, c.name(op, t.kind))
    la = _tap.launch_shape(spec)
    b = {"pos": Arg("step", "pos"), "n_valid": Arg("step", "n_valid"), "ring": c.arg(ring),
         **{f"x{k}": c.arg(x) for k, x in enumerate(xs)}}
    return [_launch(src, la.grid, la.block, la.smem, [b[n] for n in _tap.arg_names(spec)])]


def _experts_fmt(c: _Ctx, names: tuple[str, ...], what: str) -> str:
    """The one moe_gemm storage format (``mxfp4`` | ``q8_0`` | a K-quant | ``iq4_xs``) of the weights ``names``.

    Raises:
        PendingLowering: a weight stored otherwise (BF16 or F32: moe_gemm has no decoder for them), or the names
            in different formats."""
    fmts = {c.fmt(n) for n in names}
    if len(fmts) != 1 or next(iter(fmts)) not in _mg.FORMATS:
        raise PendingLowering(f"moe_experts at {c.q} rows: the {what} weights are stored as {sorted(fmts)}; the "
                              f"grouped-experts family ({GROUPED_EXPERTS_FAMILY}) reads {'/'.join(_mg.FORMATS)} only")
    return next(iter(fmts))


def _buildable(spec: _mg.MoeGemmSpec, target: Target) -> _mg.MoeGemmSpec:
    """``spec`` as ``target`` builds it (both phases planned, which checks the target); on HIP 64 wide where the
    128-wide tile does not fit the LDS (``DS4C_PREFILL_MOE_BN=128`` is a CUDA A/B knob).

    Raises:
        RenderError: what the target does not build (moe_gemm.check_target / plan)."""
    try:
        for phase in ("up", "down"):
            _mg.plan(spec, target, phase)
        return spec
    except _RenderError:
        if target.vendor != "hip" or spec.bn in (0, 64):
            raise
    return _buildable(dataclasses.replace(spec, bn=64), target)


def lower_routed_experts(c: _Ctx, op: Op) -> list[Launch]:
    """The ``moe_experts`` plan kernel of a prefill chunk (spec 5.2 o.5-o.7) on the grouped-experts family
    (:mod:`ds4c.runtime.families.moe_gemm`). The fused op's body: ``routed_experts`` (x bf16 ``[C, D]``, ids i64
    ``[C, k]``, weights fp32 ``[C, k]`` -> fp32 ``[C, D]``), the shared expert (``linear`` fp8act gate / up on
    the same x, bf16 ``[C, I_sh]``; ``swiglu`` fp32; ``cast`` bf16; ``linear`` fp8act down, bf16 ``[C, D]``) and
    ``moe_sum`` (``bf16(routed + fp32(shared))``, the plan kernel's output bf16 ``[C, D]``). Nine launches:

    1. the routed call (``MoeGemmSpec(shared=True)``, ``ffn_{gate,up,down}_exps`` stored [E, rows, row bytes]):
       route, actq_x, up, actq_h, down;
    2. the shared expert as a dense call (``MoeGemmSpec(dense=True)``: E = 1, k = 1, every row its own pair of
       weight 1, no routing, no weight multiply), ``ffn_{gate,up,down}_shexp`` (one [rows, row bytes] matrix =
       expert 0): up, actq_h, down, reading the routed call's quantized x (the same x, quantized once) and
       writing the workspace ``ds4c_moe_shared`` bf16 ``[C, D]``; its actq_x launch is dropped;
    3. the routed combine with the shared output fused (``moe_sum``): the sum over the row's slots in ascending
       expert id, + fp32(shared), one bf16 rounding, into the plan kernel's output.

    The IR's shared expert and a weight-1 routed expert are the same computation (both fp8act with act_quant,
    g / u rounded to bf16, swiglu in fp32, h rounded to bf16 before the down linear, y bf16), so the dense call
    is exact up to fp32 summation order, like the routed one. Every row of the chunk is computed, padded ones
    too (their ids come from the router on the padded rows: valid distinct expert ids in the IR; but no launch
    reads out of bounds for any id value: ``route`` skips ids outside [0, E) and ``combine`` indexes ``ybuf`` by
    (row, slot), so a bad id only spoils its own, never kept, row).

    Workspaces (shared by name across layers, sized for C rows): ``ds4c_moe_{perm,tiles,xq,xs,h,hq,hs,y}`` (the
    routed call, :func:`moe_gemm.arg_shapes`), ``ds4c_moe_sh_{h,hq,hs}`` and ``ds4c_moe_shared`` (the dense
    call).

    Raises:
        PendingLowering: a target moe_gemm does not build (sm_80: no e4m3 cvt; gfx1201), expert weights not
            MXFP4 / Q8_0 / a K-quant / IQ4_XS (on wave-32 RDNA: not MXFP4 / Q8_0), or the FP8 activation quant off
            (``emulate`` / ``act_quant`` False).
        LoweringError: a body that is not routed_experts + the SwiGLU shared expert + moe_sum, a shared weight
            that is not a model tensor, or sizes the family refuses.
    """
    try:
        _mg.check_target(c.target)
    except _RenderError as e:
        raise PendingLowering(f"moe_experts at {c.q} rows: the grouped-experts family ({GROUPED_EXPERTS_FAMILY}) "
                              f"does not build for {c.target.slug} ({e})") from None
    body = op.body or []
    try:
        re_ = next(b for b in body if b.kind == "routed_experts")
        moe = next(b for b in body if b.kind == "moe_sum")
        sw = next(b for b in body if b.kind == "swiglu")
        lin = [b for b in body if b.kind == "linear"]
        gate = next(l for l in lin if l.outputs[0] is sw.inputs[0])
        up = next(l for l in lin if l.outputs[0] is sw.inputs[1])
        down = next(l for l in lin if l not in (gate, up))
        cast = next(b for b in body if b.kind == "cast" and b.inputs[0] is sw.outputs[0])
    except StopIteration:
        raise LoweringError(f"moe_experts (layer {op.layer}): the body is not routed_experts + a SwiGLU shared "
                            f"expert + moe_sum") from None
    x = re_.inputs[0]
    if not (gate.inputs[0] is x and up.inputs[0] is x and down.inputs[0] is cast.outputs[0]
            and cast.attrs.get("dtype") == "bf16" and moe.inputs[0] is re_.outputs[0]
            and moe.inputs[1] is down.outputs[0] and moe.outputs[0] in op.outputs):
        raise LoweringError(f"moe_experts (layer {op.layer}): the shared expert does not read the routed x, or "
                            f"moe_sum does not add the two (a dataflow moe_gemm does not implement)")
    if not (re_.attrs["emulate"] and all(l.attrs["mode"] == "fp8act" and l.attrs.get("act_quant", True)
                                          for l in (gate, up, down))):
        raise PendingLowering(f"moe_experts at {c.q} rows: the FP8 activation quant is off (emulate=False); "
                              f"{GROUPED_EXPERTS_FAMILY} builds the quantized path only")
    cfg, layer = c.cfg, re_.attrs["layer"]
    p = f"blk.{layer}."
    sh = [c.weight_name(l.inputs[1]) for l in (gate, up, down)]
    if any(w is None for w in sh):
        raise LoweringError(f"moe_experts (layer {op.layer}): a shared expert weight is not a model tensor")
    rows, d = (int(v) for v in x.type.shape)
    k = int(re_.inputs[1].type.shape[-1])
    ex = [p + f"ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
    fmts = (_experts_fmt(c, tuple(ex[:2]), "routed gate/up"), _experts_fmt(c, (ex[2],), "routed down"),
            _experts_fmt(c, tuple(sh[:2]), "shared gate/up"), _experts_fmt(c, (sh[2],), "shared down"))
    hip = c.target.vendor == "hip"
    try:
        wg_bn = _mg.wg_width(c.moe_wg_bn, d)
        rmma = "sync" if c.moe_mma == "sync" else _mg.auto_mma(fmts[0], fmts[1], wg_bn, c.stages, c.target,
                                                                 c.moe_mma, hidden=d)
        # the quantized activations as one-byte e4m3 codes (DS4C_PREFILL_MOE_XQ=e4m3; always under the fp8 MMA): both
        # calls, so the shared expert reads the routed call's x (not on HIP, nor the wgmma call's bf16 tile)
        e4 = not hip and (c.moe_xq == "e4m3" or rmma in ("fp8", "wgmma8"))
        # HIP: the CUDA A/B knobs (stages 3, the L2 prefetch) do not apply; its body has the 2-stage loop
        wgm = rmma in _mg.WG_MMAS
        rstages = 2 if hip else c.stages or (0 if wgm else _mg.auto_stages(fmts[0], fmts[1], c.moe_bn))
        pf = 0 if hip else c.l2_prefetch
        rspec = _mg.MoeGemmSpec(rows, d, cfg.moe_inter, k, cfg.n_experts, fmts[0], fmts[1], limit=re_.attrs["limit"],
                                shared=True, bn=wg_bn if wgm else c.moe_bn, mma=rmma,
                                prefetch=pf, cols_first=c.moe_cols_first, stages=rstages,
                                xfmt="e4m3" if e4 and rmma != "wgmma" else "f16")
        dspec = _mg.MoeGemmSpec(rows, d, int(gate.outputs[0].type.shape[-1]), 1, 1, fmts[2], fmts[3],
                                limit=sw.attrs["limit"], dense=True, bn=c.moe_bn, prefetch=pf,
                                cols_first=c.moe_cols_first, xfmt="e4m3" if e4 else "f16",
                                stages=2 if hip else c.stages or _mg.auto_stages(fmts[2], fmts[3], c.moe_bn))
    except _RenderError as e:
        raise LoweringError(f"moe_experts (layer {op.layer}): {e}") from None
    try:  # what the target does not build is pending (HIP: a 128-wide tile past its LDS runs 64 wide)
        rspec, dspec = (_buildable(s, c.target) for s in (rspec, dspec))
    except _RenderError as e:
        raise PendingLowering(f"moe_experts at {c.q} rows: {e}") from None

    def ws(spec: _mg.MoeGemmSpec, arg: str, name: str) -> Arg:
        shape, dt = _mg.arg_shapes(spec)[arg]
        return Arg("workspace", c.name(op, name), nbytes=math.prod(shape) * dt.itemsize)

    shared = ws(dspec, "out", "moe_shared")
    rb = {"ids": c.arg(re_.inputs[1]), "weights": c.arg(re_.inputs[2]), "x": c.arg(x),
          **{n: Arg("weight", w, form="raw") for n, w in zip(("w1", "w3", "w2"), ex)},
          **{n: ws(rspec, n, "moe_" + {"hbuf": "h", "ybuf": "y"}.get(n, n)) for n in _mg.workspaces(rspec)},
          "shared": shared, "out": Arg("value", c.names[moe.outputs[0]])}
    # the shared expert reads the routed call's quantized x when both take the same form (mma.sync: f16s or e4m3s); a
    # routed call on wgmma holds x in form bf16p, so the shared expert (Q8_0: mma.sync) quantizes x once more, its own
    # way
    same_x = _mg.act_form(rspec) == _mg.act_form(dspec)
    xq = ({"xq": rb["xq"], "xs": rb["xs"]} if same_x else {n: ws(dspec, n, "moe_sh_" + n) for n in ("xq", "xs")})
    db = {"x": rb["x"], **xq, **{n: Arg("weight", w, form="raw") for n, w in zip(("w1", "w3", "w2"), sh)},
          **{n: ws(dspec, n, "moe_sh_" + {"hbuf": "h"}.get(n, n)) for n in ("hbuf", "hq", "hs")}, "out": shared}
    calls = []
    for spec, b, nm in ((rspec, rb, "moe_gemm"), (dspec, db, "moe_shexp")):
        names = _mg.arg_names(spec)
        calls.append({la.kernel: _launch(src, la.grid, la.block, la.smem, [b[n] for n in names[la.kernel]])
                      for src, la in zip(_mg.render_moe_gemm(spec, c.target, c.name(op, nm)),
                                         _mg.launch_shapes(spec, c.target))})
    r, dn = calls
    return ([r["route"], r["actq_x"], r["up"], r["actq_h"], r["down"]] + ([] if same_x else [dn["actq_x"]])
            + [dn["up"], dn["actq_h"], dn["down"], r["combine"]])


_PATTERNS = {
    "hc_embed_pre": _lower_hc, "hc_post_pre": _lower_hc, "hc_post_head": _lower_hc, "hc_pre": _lower_hc,
    "hc_post_out": _lower_hc,
    "multi_gemv": _lower_linears, "linear": _lower_linears,
    "compressor": _lower_compressor, "indexer_topk": _lower_indexer, "sparse_attention": _lower_attention,
    "route": L._lower_route, "moe_experts": lower_routed_experts,
    "grouped_linear": _lower_grouped,
    "dspark_tap": _lower_tap, "record_hc": _lower_tap,
}

#: the family of each prefill plan kernel's launches (a GEMM group's launches are GEMMs and row chains)
FAMILY_OF = {**L.FAMILY_OF, "multi_gemv": "gemm", "linear": "gemm", "grouped_linear": "gemm", "moe_experts": "moe_gemm"}


def lower_prefill(g: Graph, cfg: Ds4Config, target: Target, weight_types: dict[str, GGMLType] | None = None,
                  pending: list[PendingKernel] | None = None) -> list[LoweredKernel]:
    """The launches of every plan kernel of the prefill chunk graph ``g`` (C = ``meta["width"]`` rows, after the
    default pipeline) for ``target``; no rollback kernel (a chunk is never rolled back).

    Args:
        pending: when given, each plan kernel whose C-row kernel is pending (:class:`PendingLowering`) is
            appended to it as a :class:`PendingKernel` and skipped; otherwise the first one raises.

    Raises:
        PendingLowering: (without ``pending``) the first pending plan kernel, e.g. ``"l0.grouped_linear: ..."``.
        LoweringError: a pattern with no prefill lowering, a weight no kernel reads, or a spec that does not fit.
    """
    if not g.meta.get("prefill"):
        raise LoweringError("lower_prefill needs a prefill chunk graph (build_step(..., prefill=True))")
    types = weight_types or storage_types(cfg, "official")
    L.check_expert_formats(types)
    c = _Ctx(g, cfg, target, types)
    c.row_block = _hc_row_block(c.q)
    # AttentionSpec.heads_per_block at C rows: one block computes this many heads of a row, so each KV row it
    # gathers (window, selected compressed rows; shared by every head, MQA) is read once per head group instead
    # of once per head (1 where it does not divide the heads or the shared memory would not fit; docs/perf.md,
    # "Optimisation 7: 4 heads per block at C rows"); and AttentionSpec.threads (0: automatic). Both are
    # environment settings (DS4C_PREFILL_ATTN_HPB / _THREADS, ds4c.settings).
    c.attn_heads_per_block = settings.prefill_attn_heads_per_block()
    c.attn_threads = settings.prefill_attn_threads()
    # the matrix-unit chunk attention (the default on CUDA and the HIP archs with a matrix body; DS4C_PREFILL_ATTN_MMA=0
    # and gfx1201 keep the SIMT kernel, whose settings the two above are)
    c.attn_mma = settings.prefill_attn_mma()
    # the indexer's scores on tensor cores (CUDA, DS4C_PREFILL_INDEXER_MMA=1; else and on HIP: the SIMT stage)
    c.indexer_mma = settings.prefill_indexer_mma()
    # the chunk's compressors parallel over its flushes (the default; DS4C_PREFILL_CMP_PARALLEL=0: row-serial)
    c.cmp_parallel = settings.prefill_cmp_parallel()
    # weight rows per CTA of the projection GEMMs and of the grouped experts (DS4C_PREFILL_GEMM_BN / _MOE_BN: A/B
    # knobs, 64 by default)
    c.gemm_bn = settings.prefill_gemm_bn()
    c.moe_bn = settings.prefill_moe_bn()
    # K-step stages (DS4C_PREFILL_STAGES; unset: 0, auto per launch: the cp.async pipeline for the grouped experts
    # whose weights are cp.async-staged K-quants, 2 stages elsewhere)
    c.stages = settings.prefill_stages()
    # the routed experts' up / down MMA where moe_gemm.auto_mma allows (DS4C_PREFILL_MOE_MMA: sync, the default, wgmma,
    # wgmma8 or fp8), DS4C_PREFILL_MOE_WG_BN weight rows a CTA on wgmma / wgmma8; the grouped experts' quantized
    # activations as e4m3 codes (DS4C_PREFILL_MOE_XQ: e4m3, the default, or f16)
    c.moe_mma = settings.prefill_moe_mma()
    c.moe_xq = settings.prefill_moe_xq()
    # the projection GEMMs' quantized x as e4m3 codes (DS4C_PREFILL_GEMM_XQ: f16 or e4m3)
    c.gemm_xq = settings.prefill_gemm_xq()
    c.moe_wg_bn = settings.prefill_moe_wg_bn()
    # the L2 prefetch size of the grouped experts' cp.async copies (DS4C_PREFILL_L2_PREFETCH: 0, 128 or 256)
    c.l2_prefetch = settings.prefill_l2_prefetch()
    # the grouped experts' grids with the column blocks first (DS4C_PREFILL_MOE_COLS_FIRST: 0 or 1)
    c.moe_cols_first = settings.prefill_moe_cols_first()
    c.linears = _gemm_linears
    out: list[LoweredKernel] = []
    for name, pattern, op in L.plan_kernels(g):
        fn = _PATTERNS.get(pattern)
        if fn is None:
            raise LoweringError(f"no prefill lowering for the plan kernel pattern {pattern!r} (layer {op.layer})")
        try:
            launches = fn(c, op)
        except PendingLowering as e:
            if pending is None:
                raise PendingLowering(f"{name}: {e}") from None
            pending.append(PendingKernel(name, pattern, op.layer, str(e)))
            continue
        fam = FAMILY_OF[pattern]
        if fam == "gemm" and not any(la.kernel.family == "gemm" for la in launches):
            fam = "gemv"  # a group of fewer than GEMM_MIN_ROWS rows (the 1-row head)
        out.append(LoweredKernel(name, fam, op.layer, launches))
    return out
