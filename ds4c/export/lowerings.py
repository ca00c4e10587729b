"""Static-shape torch implementations of the IR ops, for tracing a step into one ``torch.export`` program.

The interpreter's implementations (:mod:`ds4c.ir.ops`) run one row or one token at a time in Python and read
tensor values to steer (``positions.tolist()``, ``int(pos)``, the expert ids); a traced program cannot. Here every
op is tensor operations of shapes fixed by the graph's types, with the data-dependent parts as tensor ops:

* ring / tap / final-HC writes and the compressed-row writes: a "last writer wins" select over the buffer rows
  (:func:`scatter_last`), so rows written in order keep the interpreter's semantics (also past the window in a
  prefill chunk, and only the ``n_valid`` rows of a padded one);
* the compressor: the state entries of the positions before the step and the step's projections form one history
  of positions, every row's pooling window is a fixed gather from it, the flushed rows are finished all at once;
* attention: each row's window list (ring rows before the step, its own KV rows after) is a gather with computed
  indices, the compressed list a gather by the selected ids or the span with its mask; the online softmax runs
  over the same chunks of 64 entries (an all-masked chunk leaves the running values as they were);
* top-k with ties to the lower index (indexer and scored router): a top-k of float64 keys that are unique by
  construction (:func:`topk_lower_index`), so any sort, stable or not, gives the interpreter's order;
* routed experts: the k experts of each row gathered from the stacked banks ``[E, ...]``, summed in ascending id;
* FP8 / FP4 fake quantization and the FP8 activation quantization: the same arithmetic with the power-of-two
  scale and the e4m3 / e2m1 rounding written with comparisons against exact tables and ``round`` (no ``frexp``,
  no float8 type: torch-mlir lowers neither to LLVM).

The other ops call the interpreter's own implementation (``OPS[kind].run``) inside
:func:`ds4c.reference.primitives.batched_rows`, so each is one batched op instead of one per row.

Every lowering takes ``(ctx, inputs, attrs)`` like :class:`ds4c.ir.ops.OpDef` ``run`` and returns the outputs.
Preconditions the interpreter checks and a traced program cannot (a live length within its bucket, ``n_valid`` in
``1..C``, positions ``pos + i``) are the caller's, as they are a compiled step's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ds4c.config import Ds4Config
from ds4c.errors import ExportError
from ds4c.ir.graph import Op
from ds4c.ir.ops import OPS
from ds4c.quant import _FP4_AMAX_FLOOR, _FP8_AMAX_FLOOR, FP4_E2M1_MAX, FP8_E4M3_MAX
from ds4c.reference import primitives as P

F32, F64, I64 = torch.float32, torch.float64, torch.int64

#: ops with no static lowering, with the reason (a one-line error names them: :func:`unsupported`)
NOT_LOWERED = {
    "live_rows": "its span grows with the position (a dynamic shape): export after pad_compressed_kv",
    "markov_chain": "a DSpark drafter op, not part of a step graph",
    "dspark_confidence": "a DSpark drafter op, not part of a step graph",
}


@dataclass
class LowerCtx:
    """What lowerings need beyond their inputs: the config and the weight lookup (name -> tensor; an expert bank
    ``blk.{i}.experts`` -> the tuple of its stacked ``(gate, up, down)`` tensors). Also what the reused interpreter
    implementations read of their :class:`ds4c.ir.ops.RunCtx` (``device``: the host)."""

    cfg: Ds4Config
    weight: Callable[[str], Any]
    device: torch.device = torch.device("cpu")


Lowering = Callable[[LowerCtx, list[Any], dict[str, Any]], list[Any]]


def _reuse(kind: str) -> Lowering:
    run = OPS[kind].run

    def lower(ctx: LowerCtx, ins: list[Any], a: dict[str, Any]) -> list[Any]:
        with P.batched_rows():
            return run(ctx, ins, a)  # type: ignore[arg-type]  (they read cfg and device only)

    return lower


# ---------------------------------------------------------------------------------------------- helpers

def scatter_last(buf: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """``buf`` with rows written in row order: for each ``i`` with ``ok[i]``, ``buf[idx[i]] = vals[i]`` (a later row
    overwrites an earlier one at the same index). buf [N, ...]; idx int64 [Q]; vals [Q, ...] (cast to buf's dtype);
    ok bool [Q]. Returns a new tensor like ``buf``."""
    n, q = buf.shape[0], idx.shape[0]
    hit = ok.unsqueeze(1) & (idx.unsqueeze(1) == torch.arange(n, dtype=I64).unsqueeze(0))  # [Q, N]
    order = torch.arange(1, q + 1, dtype=I64).unsqueeze(1) * hit.to(I64)
    last = order.amax(dim=0) - 1  # [N]: the last row writing each buffer row, -1 for none
    src = vals.to(buf.dtype).index_select(0, last.clamp(min=0))
    keep = (last >= 0).reshape(n, *([1] * (buf.dim() - 1)))
    return torch.where(keep, src, buf)


def _valid(ins: list[Any], k: int, q: int) -> torch.Tensor:
    """bool [q]: the rows that are real tokens (``n_valid`` at input index ``k`` when present)."""
    rows = torch.arange(q, dtype=I64)
    return rows < ins[k] if len(ins) > k else torch.ones(q, dtype=torch.bool)


#: float64 keys stay unique for up to this many candidates (see :func:`topk_lower_index`)
MAX_TOPK_CANDIDATES = 1 << 15


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`ds4c.reference.primitives.topk_lower_index` as a top-k of unique keys: indices of the ``k`` largest
    scores along the last dim, by descending score, ties to the lower index. int64 [..., k].

    ``key = s - (|s| + 2^-900) * i * 2^-40`` in float64 (``-1e300 * (1 + i * 2^-40)`` for ``-inf``). For fp32 or
    bf16 scores s (24 significant bits or fewer) and ``i < 2^15`` the subtracted term is below a quarter of an
    fp32 ulp of s, so distinct scores keep their order, and equal scores order by index, the rounding of the
    float64 operations (relative 2^-53) being far below both margins. Zero scores get the distinct keys
    ``-i * 2^-940``, between the smallest positive and negative fp32 values.

    Raises:
        ExportError: more than :data:`MAX_TOPK_CANDIDATES` candidates (the keys could tie).
    """
    n = scores.shape[-1]
    if n > MAX_TOPK_CANDIDATES:
        raise ExportError(f"top-k over {n} candidates: the export's unique keys hold at most {MAX_TOPK_CANDIDATES}")
    s = scores.to(F64)
    i = torch.arange(n, dtype=F64)
    key = s - (s.abs() + 2.0 ** -900) * i * 2.0 ** -40
    key = torch.where(torch.isneginf(s), -1e300 * (1 + i * 2.0 ** -40), key)
    return torch.topk(key, k, dim=-1).indices


# powers of two 2^-149 .. 2^127 and inf (2^128): the exact UE8M0 scales
_POW2 = [2.0 ** e for e in range(-149, 128)] + [float("inf")]
# e4m3 step by the number of normal binades 2^-6 .. 2^8 at or below |z|: 2^-9 (subnormal and the first) .. 2^5
_E4M3_BINADES = [2.0 ** e for e in range(-6, 9)]
_E4M3_STEPS = [2.0 ** -9] + [2.0 ** (c - 10) for c in range(1, 16)]


def pow2_ceil_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """:func:`ds4c.quant.pow2_ceil_scale` without ``frexp``: the smallest power of two >= ``amax / qmax`` (fp32
    division), from an exact table (2^-149 for a quotient <= 0, inf for inf). fp32, shape of ``amax``."""
    y = amax.to(F32) / qmax
    table = torch.tensor(_POW2, dtype=F32)
    n = (table < y.unsqueeze(-1)).sum(-1)
    return table[n.clamp(max=len(_POW2) - 1)]


def e4m3_round(z: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``z`` (|z| <= 448) to the FP8 e4m3 grid, round-to-nearest-even, as a cast to
    ``torch.float8_e4m3fn`` and back does: ``round(z / step) * step`` with the step of |z|'s binade (exact)."""
    c = (torch.tensor(_E4M3_BINADES, dtype=F32) <= z.abs().unsqueeze(-1)).sum(-1)
    step = torch.tensor(_E4M3_STEPS, dtype=F32)[c]
    return torch.round(z / step) * step


def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """:func:`ds4c.quant.e2m1_round` in float arithmetic: RNE to {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6} (saturating;
    zero as +0.0)."""
    a = y.abs().clamp(max=FP4_E2M1_MAX)
    m = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.where(m == 0, torch.zeros_like(m), torch.where(y < 0, -m, m))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.to(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_fake_quant(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """P3 as :func:`ds4c.quant.fp8_fake_quant` (bf16 out)."""
    b = _blocks(x, block)
    s = pow2_ceil_scale(b.abs().amax(-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR), FP8_E4M3_MAX)
    q = e4m3_round((b / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    return (q * s).to(torch.bfloat16).reshape(x.shape)


def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """P4 as :func:`ds4c.quant.fp4_fake_quant` (bf16 out)."""
    b = _blocks(x, block)
    s = pow2_ceil_scale(b.abs().amax(-1, keepdim=True).clamp(min=_FP4_AMAX_FLOOR), FP4_E2M1_MAX)
    q = e2m1_round((b / s).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX))
    return (q * s).to(torch.bfloat16).reshape(x.shape)


def act_quant_dequant(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Spec 2.3 step 1 as :func:`ds4c.quant.act_quant_dequant`: the fp32 activation ``e4m3(x/s) * s`` a quantized
    projection multiplies."""
    b = _blocks(x, block)
    s = pow2_ceil_scale(b.abs().amax(-1, keepdim=True).clamp(min=_FP8_AMAX_FLOOR), FP8_E4M3_MAX)
    q = e4m3_round((b / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    return (q * s).reshape(x.shape)


def kv_fake_quant(kv: torch.Tensor, nope: int, emulate: bool) -> torch.Tensor:
    """:func:`ds4c.reference.blocks.kv_fake_quant`: P3 on the first ``nope`` dims."""
    if not emulate:
        return kv
    return torch.cat((fp8_fake_quant(kv[..., :nope], 64).to(kv.dtype), kv[..., nope:]), dim=-1)


def linear_q(x: torch.Tensor, w: torch.Tensor, act_quant: bool) -> torch.Tensor:
    """:func:`ds4c.reference.primitives.linear_q` over all rows."""
    xa = act_quant_dequant(x, 128) if act_quant else x.to(F32)
    return (xa @ w.transpose(-1, -2)).to(P.act_dtype())


# ---------------------------------------------------------------------------------------------- leaves

def _param(ctx, ins, a):
    return [ctx.weight(a["weight"])]


def _linear(ctx, ins, a):
    if a["mode"] == "fp8act":
        return [linear_q(ins[0], ins[1], a.get("act_quant", True))]
    return _reuse("linear")(ctx, ins, a)


def _take_row(ctx, ins, a):
    x, n = ins
    return [x.index_select(0, (n - 1).reshape(1))]


def _kv_fake_quant(ctx, ins, a):
    return [kv_fake_quant(ins[0], a["nope"], a["enabled"])]


def _fp4_fake_quant(ctx, ins, a):
    return [fp4_fake_quant(ins[0], a["block"]).to(ins[0].dtype)]


# ---------------------------------------------------------------------------------------------- state

def _ring_write(ctx, ins, a):
    ring, kv, positions = ins[:3]
    return [scatter_last(ring, positions % a["window"], kv, _valid(ins, 3, kv.shape[0]))]


def _record_hc(ctx, ins, a):
    ring, positions, x = ins[:3]
    return [scatter_last(ring, positions % a["rows"], x, _valid(ins, 3, x.shape[0]))]


def _dspark_tap(ctx, ins, a):
    ring, positions = ins[0], ins[1]
    slots = tuple(a["slots"])
    ok = _valid(ins, 2 + len(slots), positions.shape[0])
    idx = positions % a["window"]
    out = ring
    for s, x in zip(slots, ins[2:2 + len(slots)]):
        d = x.shape[-1]
        cols = scatter_last(out[:, s * d:(s + 1) * d], idx, x.mean(dim=-2), ok)
        out = torch.cat((out[:, :s * d], cols, out[:, (s + 1) * d:]), dim=1)
    return [out]


def _compress(ctx, ins, a):
    """5.3 for every row at once (see the module docstring). The history holds positions ``pos - S .. pos + q - 1``
    (S = the state's slots): before ``pos`` the state's entries (the current block's slot of a position; with the
    overlap of ratio 4 the previous, already flushed block from slots 0..3), from ``pos`` on the step's rows."""
    v, g, ape, norm, kv, score, rows, positions, freqs = ins[:9]
    r, d = a["ratio"], a["d"]
    q, S = v.shape[0], kv.shape[0]
    ok = _valid(ins, 9, q)
    g = g + ape.index_select(0, positions % r)
    pos = positions[0]
    t = pos - S + torch.arange(S, dtype=I64)  # history positions before the step
    start = pos - pos % r  # the first position of the block open at the step's start
    if r == 4:  # slots 4..7 the open block, 0..3 the previous (flushed) block
        slot = torch.where(t >= start, 4 + t % 4, t % 4)
    else:
        slot = t % r
    hist_kv = torch.cat((kv.index_select(0, slot), v))  # [S + q, c*d]
    hist_sc = torch.cat((score.index_select(0, slot), g))
    w = 8 if r == 4 else r  # pooled entries of a flush at row i: history rows S + i - w + 1 .. S + i
    win = (S + torch.arange(q, dtype=I64).unsqueeze(1) - (w - 1) + torch.arange(w, dtype=I64).unsqueeze(0))
    wkv, wsc = hist_kv[win], hist_sc[win]  # [q, w, c*d]
    if r == 4:  # previous block's first half, current block's second half
        wkv = torch.cat((wkv[:, :4, :d], wkv[:, 4:, d:]), dim=1)
        wsc = torch.cat((wsc[:, :4, :d], wsc[:, 4:, d:]), dim=1)
    cvec = (wkv * wsc.softmax(dim=1)).sum(dim=1)  # [q, d]: meaningful at the flushing rows
    flush = ok & ((positions + 1) % r == 0)
    c = P.rms_norm(cvec.to(P.act_dtype()), norm, a["eps"])
    with P.batched_rows():
        c = P.apply_rope(c, positions + 1 - r, freqs)
    if a["indexer"]:
        c = P.hadamard(c)
        c = fp4_fake_quant(c, 32) if a["emulate"] else c
    else:
        c = kv_fake_quant(c, a["nope"], a["emulate"])
    rows_new = scatter_last(rows, positions // r, c, flush)
    if r == 4:
        open_kv = scatter_last(kv[4:], positions % 4, v, ok)
        open_sc = scatter_last(score[4:], positions % 4, g, ok)
        # slots 0..3 = the last flushed block of the step (history rows S + i - 3 .. S + i), else unchanged
        last = (torch.arange(1, q + 1, dtype=I64) * flush.to(I64)).amax() - 1
        blk = S + last.clamp(min=0) - 3 + torch.arange(4, dtype=I64)
        prev_kv = torch.where(last >= 0, hist_kv.index_select(0, blk), kv[:4])
        prev_sc = torch.where(last >= 0, hist_sc.index_select(0, blk), score[:4])
        return [torch.cat((prev_kv, open_kv)), torch.cat((prev_sc, open_sc)), rows_new]
    return [scatter_last(kv, positions % r, v, ok), scatter_last(score, positions % r, g, ok), rows_new]


def _bucket_rows(ctx, ins, a):
    return [ins[0][: a["capacity"]]]


# ---------------------------------------------------------------------------------------------- attention

def _indexer_topk(ctx, ins, a):
    """:func:`ds4c.reference.blocks.indexer_select` (scores as :func:`ds4c.reference.primitives.index_scores`)
    for every row."""
    qi, keys, hw, mask = ins
    act = P.act_dtype()
    dots = (qi.to(F32) @ keys.to(F32).T).to(act)  # [q, H, T]
    weighted = (torch.relu(dots).to(F32) * hw.to(F32).unsqueeze(-1)).to(act).to(F32)
    acc = weighted[:, 0]
    for h in range(1, weighted.shape[1]):  # the heads summed in order, in fp32
        acc = acc + weighted[:, h]
    score = acc.to(act).masked_fill(~mask, float("-inf"))
    k = min(a["topk"], keys.shape[0])
    sel = topk_lower_index(score, k)
    n_valid = mask.sum(-1).clamp(max=a["topk"])
    return [torch.where(torch.arange(k, dtype=I64).unsqueeze(0) < n_valid.unsqueeze(1), sel, -1)]


def _sparse_attention(ctx, ins, a):
    """:func:`ds4c.reference.blocks.attention_row` for every row: the window list (positions ``p - n + 1 .. p``,
    ``n = min(window, p + 1)``, from the ring before the step's first position, else the step's KV rows), then the
    compressed list, attended as :func:`ds4c.reference.primitives.sparse_attention`."""
    q, ring, kv, positions, sink = ins[:5]
    W, Q = a["window"], q.shape[0]
    p0 = positions[0]
    j = torch.arange(W, dtype=I64).unsqueeze(0)
    n = (positions + 1).clamp(max=W).unsqueeze(1)
    t = positions.unsqueeze(1) - n + 1 + j  # [Q, W]
    ok = j < n
    own = kv[(t - p0).clamp(0, Q - 1)]
    lst = torch.where((t < p0).unsqueeze(-1), ring[t % W], own)
    if a["kind"] == "csa":
        sel = ins[6]
        lst = torch.cat((lst, ins[5][sel.clamp(min=0)]), dim=1)
        ok = torch.cat((ok, sel >= 0), dim=1)
    elif a["kind"] == "hca":
        comp = ins[5]
        lst = torch.cat((lst, comp.unsqueeze(0).expand(Q, *comp.shape)), dim=1)
        ok = torch.cat((ok, ins[6]), dim=1)
    return [_attend(q, lst, ok, sink, a["scale"])]


def _attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """P9 (:func:`ds4c.reference.primitives.sparse_attention`) for every row: q [Q, H, hd]; kv [Q, L, hd]; valid
    bool [Q, L]; sink fp32 [H]. Chunks of 64 list entries, an all-masked chunk skipped. Returns [Q, H, hd]."""
    Q, H, hd = q.shape
    chunk = P.ATTN_CHUNK
    pad = -kv.shape[1] % chunk
    if pad:
        kv = torch.cat((kv, kv.new_zeros(Q, pad, hd)), dim=1)
        valid = torch.cat((valid, valid.new_zeros(Q, pad)), dim=1)
    qf = q.to(F32)
    kvf = torch.where(valid.unsqueeze(-1), kv.to(F32), torch.zeros((), dtype=F32))
    m = torch.full((Q, H), float("-inf"), dtype=F32)
    l = torch.zeros(Q, H, dtype=F32)
    acc = torch.zeros(Q, H, hd, dtype=F32)
    for c0 in range(0, kv.shape[1], chunk):
        k = kvf[:, c0:c0 + chunk]  # [Q, 64, hd]
        okc = valid[:, c0:c0 + chunk]
        s = (qf @ k.transpose(1, 2)) * scale  # [Q, H, 64]
        s = s.masked_fill(~okc.unsqueeze(1), float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        run = okc.any(dim=-1).unsqueeze(-1)  # [Q, 1]: a chunk with no valid entry changes nothing
        l = torch.where(run, l * alpha + p.sum(-1), l)
        acc = torch.where(run.unsqueeze(-1), acc * alpha.unsqueeze(-1) + p.to(P.act_dtype()).to(F32) @ k, acc)
        m = torch.where(run, m_new, m)
    l = l + torch.exp(sink - m)
    return (acc / l.unsqueeze(-1)).to(P.act_dtype())


# ---------------------------------------------------------------------------------------------- MoE

def _route(ctx, ins, a):
    s, tok, table = ins
    if a["hash"]:
        return _reuse("route")(ctx, ins, a)
    ids = topk_lower_index(s + table, a["k"])
    wts = s.gather(-1, ids)
    return [ids, wts / wts.sum(-1, keepdim=True) * a["scale"]]


def _routed_experts(ctx, ins, a):
    """:func:`ds4c.reference.blocks.routed_sum` for every row: the k experts of a row in ascending id, each a
    clamped SwiGLU of the row's gathered expert weights, summed in fp32."""
    x, ids, wts, bank = ins
    w1, w3, w2 = bank  # [E, F, D], [E, F, D], [E, D, F]
    ids, order = torch.sort(ids, dim=-1)
    wts = wts.gather(-1, order)
    xa = act_quant_dequant(x, 128) if a["emulate"] else x.to(F32)  # [Q, D]
    acc = torch.zeros(x.shape, dtype=F32)
    act = P.act_dtype()
    for j in range(ids.shape[1]):
        e = ids[:, j]
        g = (w1[e] @ xa.unsqueeze(-1)).squeeze(-1).to(act).to(F32)  # [Q, F]
        u = (w3[e] @ xa.unsqueeze(-1)).squeeze(-1).to(act).to(F32)
        with P.batched_rows():
            h = wts[:, j:j + 1] * P.clamped_swiglu(g, u, a["limit"])
        ha = act_quant_dequant(h.to(act), 128) if a["emulate"] else h.to(act).to(F32)
        acc = acc + (w2[e] @ ha.unsqueeze(-1)).squeeze(-1).to(act).to(F32)
    return [acc]


LOWERINGS: dict[str, Lowering] = {
    "param": _param,
    "linear": _linear,
    "take_row": _take_row,
    "kv_fake_quant": _kv_fake_quant,
    "fp4_fake_quant": _fp4_fake_quant,
    "ring_write": _ring_write,
    "record_hc": _record_hc,
    "dspark_tap": _dspark_tap,
    "compress": _compress,
    "bucket_rows": _bucket_rows,
    "indexer_topk": _indexer_topk,
    "sparse_attention": _sparse_attention,
    "route": _route,
    "routed_experts": _routed_experts,
}
for _kind in ("const", "rope_freqs", "row_positions", "embed", "hc_expand", "hc_mix", "sinkhorn", "hc_head_gate",
              "hc_premix", "hc_post", "rms_norm", "reshape", "head_rms", "rope", "hadamard", "mul_scalar", "add", "cast",
              "span_mask", "grouped_linear", "router_scores", "swiglu", "moe_sum"):
    LOWERINGS[_kind] = _reuse(_kind)


def unsupported(op: Op) -> str | None:
    """Why ``op`` (a leaf op) has no lowering, or None when it has one."""
    if op.kind in NOT_LOWERED:
        return NOT_LOWERED[op.kind]
    if op.kind not in LOWERINGS:
        return "no lowering is written for this op kind"
    if op.kind == "sparse_attention" and op.attrs.get("kind") == "dspark":
        return "the DSpark drafter's block attention (kind dspark) is not lowered"
    n = op.inputs[1].type.shape[0] if op.kind == "indexer_topk" else 0
    if isinstance(n, int) and n > MAX_TOPK_CANDIDATES:  # a symbolic span is reported by its live_rows op
        return (f"a top-k over {n} compressed rows, the export's unique keys hold at most {MAX_TOPK_CANDIDATES}: "
                f"a smaller ctx")
    return None
