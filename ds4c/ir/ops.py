"""The op registry of the step IR.

Each op declares its inputs, outputs and attributes, a shape/type inference function and a torch
implementation used by the interpreter. Implementations call the same primitives and sub-block functions as
the reference (:mod:`ds4c.reference.primitives`, :mod:`ds4c.reference.blocks`), so the interpreter
reproduces the reference bit for bit.

Dtypes: ``bf16`` in a type is the activation dtype of the dataflow (``ds4c.reference.primitives.dataflow``):
bf16 as the spec runs, fp32 in the fp32 dataflow, where the implementations round nothing to bf16.

Row convention: activations are ``[q, ...]`` with one row per verify row; ``positions`` is int64 [q] with
``positions[i] = pos + i``.

Spans: ``live_rows`` gives the compressed rows a step can see, ``[n, d]`` with ``n`` a :class:`Sym`
(``(pos+q) // ratio``); after ``pad_compressed_kv``, ``bucket_rows`` gives ``[capacity, d]`` and
``span_mask`` says per row which entries are live and causal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ds4c.ir.graph import Dim, Sym, TensorType
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P

F32 = torch.float32


class RunCtx:
    """What op implementations need beyond their inputs: the config, weight lookup and the step."""

    def __init__(self, cfg: Any, weight: Callable[[str], Any], expert: Callable[[int, int], tuple],
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.weight = weight
        self.expert = expert
        self.device = torch.device(device)


Infer = Callable[[list[TensorType], dict[str, Any]], list[TensorType]]
Run = Callable[[RunCtx, list[Any], dict[str, Any]], list[Any]]


@dataclass(frozen=True)
class OpDef:
    """An op kind: named inputs (a trailing ``*`` name is variadic/optional), named outputs, required attrs,
    type inference, implementation, whether it can be folded at compile time (``pure`` with no dynamic
    inputs), and whether it reads weights (``weight_input`` = index of the weight operand)."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: tuple[str, ...]
    infer: Infer
    run: Run
    doc: str
    foldable: bool = False


OPS: dict[str, OpDef] = {}


def register(kind: str, inputs: tuple[str, ...], outputs: tuple[str, ...], attrs: tuple[str, ...] = (),
             foldable: bool = False) -> Callable[[type], type]:
    """Class decorator: the class provides static ``infer`` and ``run``; its docstring documents the op."""

    def deco(cls: type) -> type:
        OPS[kind] = OpDef(kind, inputs, outputs, attrs, cls.infer, cls.run, (cls.__doc__ or "").strip(), foldable)
        return cls

    return deco


def T(shape: tuple[Dim, ...], dtype: str) -> TensorType:
    return TensorType(tuple(shape), dtype)


def _rows(t: TensorType) -> Dim:
    return t.shape[0]


def _min_dim(k: int, n: Dim) -> Dim:
    return min(k, n) if isinstance(n, int) else Sym(f"min({k},{n})")


# ---------------------------------------------------------------------------------------------- leaves

@register("param", (), ("w",), ("weight", "shape", "dtype"))
class Param:
    """A model weight by GGUF name (dequantized as the reference holds it: fp32, bf16 embedding, int64
    tid2eid; ``handle`` for a layer's routed-expert bank, read by expert id)."""

    @staticmethod
    def infer(ins, a):
        return [T(a["shape"], a["dtype"])]

    @staticmethod
    def run(ctx, ins, a):
        return [ctx.weight(a["weight"])]


@register("const", (), ("c",), ("data",))
class Const:
    """A compile-time constant tensor (made by constant folding)."""

    @staticmethod
    def infer(ins, a):
        d = a["data"]
        return [T(tuple(d.shape), {torch.float32: "f32", torch.bfloat16: "bf16", torch.int64: "i64"}[d.dtype])]

    @staticmethod
    def run(ctx, ins, a):
        return [a["data"].to(ctx.device)]


@register("rope_freqs", (), ("freqs",), ("rope_dim", "base", "yarn", "factor", "orig_len", "beta_fast", "beta_slow"),
          foldable=True)
class RopeFreqs:
    """P6: the rope_dim/2 inverse frequencies of a layer kind (fp32)."""

    @staticmethod
    def infer(ins, a):
        return [T((a["rope_dim"] // 2,), "f32")]

    @staticmethod
    def run(ctx, ins, a):
        return [P.rope_freqs(a["rope_dim"], a["base"], a["yarn"], a["factor"], a["orig_len"], a["beta_fast"],
                             a["beta_slow"])]


@register("row_positions", ("tokens", "pos"), ("positions",))
class RowPositions:
    """``positions[i] = pos + i`` for the q rows (int64 [q])."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]),), "i64")]

    @staticmethod
    def run(ctx, ins, a):
        tok, pos = ins
        return [torch.arange(tok.shape[0], device=tok.device) + pos.to(tok.device)]


# ---------------------------------------------------------------------------------------------- HC

@register("embed", ("tokens", "table"), ("e",))
class Embed:
    """5.1: embedding rows, bf16 [q, D]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), ins[1].shape[1]), "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        return [ins[1][ins[0]].to(P.act_dtype())]  # fp32 in the fp32 dataflow


@register("hc_expand", ("e",), ("x",), ("hc",))
class HcExpand:
    """5.1: copy the embedding into the hc residual streams, bf16 [q, hc, D]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), a["hc"], ins[0].shape[1]), "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        e = ins[0]
        return [e.unsqueeze(1).expand(e.shape[0], a["hc"], e.shape[1]).contiguous()]


@register("hc_mix", ("x", "fn"), ("m",), ("eps",))
class HcMix:
    """5.2(a): the HC mixing-logit GEMV with the square-sum: ``(fn . xf) * rsqrt(mean(xf^2) + eps)``,
    fp32 [q, n_mix]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), ins[1].shape[0]), "f32")]

    @staticmethod
    def run(ctx, ins, a):
        return [P.hc_mix_logits(ins[0], ins[1], a["eps"])[0]]


@register("sinkhorn", ("m", "scale", "base"), ("pre", "post", "comb"), ("hc", "iters", "eps"))
class Sinkhorn:
    """P8: pre [q, hc], post [q, hc], doubly-stochastic comb [q, hc, hc] (fp32)."""

    @staticmethod
    def infer(ins, a):
        q, hc = _rows(ins[0]), a["hc"]
        return [T((q, hc), "f32"), T((q, hc), "f32"), T((q, hc, hc), "f32")]

    @staticmethod
    def run(ctx, ins, a):
        return list(P.sinkhorn_split(ins[0], ins[1], ins[2], a["hc"], a["iters"], a["eps"]))


@register("hc_head_gate", ("m", "scale", "base"), ("pre",), ("eps",))
class HcHeadGate:
    """5.4.1: ``sigmoid(m * scale[0] + base) + eps``, fp32 [q, hc]."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        m, scale, base = ins
        return [torch.sigmoid(m * scale[0] + base) + a["eps"]]


@register("hc_premix", ("x", "pre"), ("y",))
class HcPremix:
    """5.2(a): ``y = bf16(sum_c pre_c * xf_c)``, bf16 [q, D]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), ins[0].shape[2]), "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        x, pre = ins
        return [(pre.unsqueeze(-1) * x.to(F32)).sum(dim=-2).to(P.act_dtype())]


@register("hc_post", ("out", "x", "post", "comb"), ("x_new",))
class HcPost:
    """5.2(l): ``X'_k = bf16(post_k out + sum_j comb[j,k] X_j)``, bf16 [q, hc, D]."""

    @staticmethod
    def infer(ins, a):
        return [ins[1]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.hc_post(*ins)]


# ---------------------------------------------------------------------------------------------- dense math

@register("rms_norm", ("x", "w"), ("y",), ("eps",))
class RmsNorm:
    """P1 over the last dim, output in the input dtype."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.rms_norm(ins[0], ins[1], a["eps"])]


LINEAR_MODES = ("fp8act", "bf16", "f32")


@register("linear", ("x", "w"), ("y",), ("mode",))
class Linear:
    """A GEMV/GEMM ``x @ w.T`` over rows. ``mode``: ``fp8act`` = a projection whose official weight is
    FP8/FP4 (spec 2.3: FP8 activation quantization in blocks of 128 when the ``act_quant`` attr is true,
    fp32 accumulate, bf16 out); ``bf16`` = bf16 x bf16 -> bf16; ``f32`` = fp32 -> fp32."""

    @staticmethod
    def infer(ins, a):
        if a["mode"] not in LINEAR_MODES:
            raise ValueError(f"linear mode {a['mode']!r} not in {LINEAR_MODES}")
        if ins[0].shape[-1] != ins[1].shape[-1]:
            raise ValueError(f"linear: input width {ins[0].shape[-1]} != weight in-features {ins[1].shape[-1]}")
        return [T(ins[0].shape[:-1] + (ins[1].shape[0],), "f32" if a["mode"] == "f32" else "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        x, w = ins
        if a["mode"] == "fp8act":
            return [P.linear_q(x, w, a.get("act_quant", True))]
        return [P.linear_bf16(x, w) if a["mode"] == "bf16" else P.linear_f32(x, w)]


@register("reshape", ("x",), ("y",), ("tail",))
class Reshape:
    """Keep the row dim, set the trailing dims to ``tail``."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]),) + tuple(a["tail"]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        return [ins[0].reshape(ins[0].shape[0], *a["tail"])]


@register("head_rms", ("x",), ("y",), ("eps",))
class HeadRms:
    """P2: unweighted per-head RMS in bf16 arithmetic."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.head_rms(ins[0], a["eps"])]


@register("rope", ("x", "positions", "freqs"), ("y",), ("inverse",))
class Rope:
    """P7: interleaved RoPE on the last rope dims at each row's position (inverse: -theta)."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.apply_rope(ins[0], ins[1], ins[2], inverse=a["inverse"])]


@register("kv_fake_quant", ("x",), ("y",), ("nope", "enabled"))
class KvFakeQuant:
    """P3 on the first ``nope`` dims (blocks of 64); identity when ``enabled`` is false."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [B.kv_fake_quant(ins[0], a["nope"], a["enabled"])]


@register("fp4_fake_quant", ("x",), ("y",), ("block",))
class Fp4FakeQuant:
    """P4 over blocks of ``block`` along the last dim."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.fp4_fake_quant(ins[0], a["block"]).to(ins[0].dtype)]  # bf16-exact values; fp32 in the fp32 dataflow


@register("hadamard", ("x",), ("y",))
class Hadamard:
    """P5 on the last dim."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.hadamard(ins[0])]


@register("mul_scalar", ("x",), ("y",), ("value",))
class MulScalar:
    """``bf16(fp32(x) * value)`` (the indexer head-weight scale)."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [(ins[0].to(F32) * a["value"]).to(ins[0].dtype)]


@register("add", ("a", "b"), ("y",))
class Add:
    """Elementwise ``a + b`` (same type)."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [ins[0] + ins[1]]


@register("take_row", ("x", "n_valid"), ("y",))
class TakeRow:
    """The last valid row of a prefill chunk: ``x[n_valid - 1 : n_valid]`` ([1, ...]; the head's input when
    only the next token's logits are wanted)."""

    @staticmethod
    def infer(ins, a):
        return [T((1,) + tuple(ins[0].shape[1:]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        x, n = ins
        n = int(n)
        if not 1 <= n <= x.shape[0]:
            raise ValueError(f"take_row: n_valid must be in 1..{x.shape[0]}, found {n}")
        return [x[n - 1:n]]


@register("lane_rows", ("x",), ("y",), ("start", "rows"))
class LaneRows:
    """The rows of one lane of a lanes step (``build_step(..., lanes=...)``): ``x[start : start + rows]``. A view:
    no kernel, the lowering binds the lane's rows at their offset."""

    @staticmethod
    def infer(ins, a):
        return [T((a["rows"],) + tuple(ins[0].shape[1:]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        return [ins[0][a["start"]: a["start"] + a["rows"]]]


@register("concat_rows", ("x*",), ("y",))
class ConcatRows:
    """The lanes' rows back in one tensor, in lane order (the attention outputs of a lanes step). No kernel: each
    lane's producer writes its rows in place, at their offset."""

    @staticmethod
    def infer(ins, a):
        return [T((sum(int(t.shape[0]) for t in ins),) + tuple(ins[0].shape[1:]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        return [torch.cat(list(ins))]


@register("cast", ("x",), ("y",), ("dtype",))
class Cast:
    """Round to ``dtype`` (bf16 or f32; bf16 is the activation dtype: f32 in the fp32 dataflow)."""

    @staticmethod
    def infer(ins, a):
        return [T(ins[0].shape, a["dtype"])]

    @staticmethod
    def run(ctx, ins, a):
        return [ins[0].to({"bf16": P.act_dtype(), "f32": F32}[a["dtype"]])]


# ---------------------------------------------------------------------------------------------- state

def _valid_rows(ins: list[Any], k: int, q: int) -> int:
    """Rows that are real tokens: the optional ``n_valid`` input at index ``k`` (a prefill chunk's padded
    graph), else all ``q``."""
    return int(ins[k]) if len(ins) > k else q


@register("ring_write", ("ring", "kv", "positions", "n_valid*"), ("ring_new",), ("window",))
class RingWrite:
    """5.2(h.1): write each row's KV into ring slot ``pos mod window`` (after every row attended), in row order
    (a prefill chunk longer than the window leaves the last ``window`` rows, as token-wise decoding does); with
    ``n_valid`` (a padded prefill chunk) only rows ``0 .. n_valid-1``."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        ring, kv, positions = ins[:3]
        out = ring.clone()
        for i, p in enumerate(positions.tolist()[:_valid_rows(ins, 3, kv.shape[0])]):
            out[p % a["window"]] = kv[i]
        return [out]


@register("dspark_tap", ("ring", "positions", "x*"), ("ring_new",), ("slots", "window"))
class DsparkTap:
    """5.2(q): the DSpark taps of the step's rows. Inputs: the tap ring bf16 ``[window, n_taps * D]``, the row
    positions, then one HC state bf16 ``[q, hc, D]`` per entry of ``slots`` (the output of a tapped layer), then
    optionally ``n_valid`` (a padded prefill chunk). For each x with slot j, each row i at position p: ring row
    ``p mod window``, columns ``j*D .. (j+1)*D``, = the bf16 mean of x[i] over the hc streams (``x.mean(-2)``,
    as the reference records ``tap_rows``), rows written in order (only rows ``0 .. n_valid-1`` with
    ``n_valid``); other columns and rows kept. A ring row is so ``main_hidden(p)`` once every slot is written."""

    @staticmethod
    def infer(ins, a):
        ring, positions = ins[0], ins[1]
        slots = tuple(a["slots"])
        xs = ins[2:2 + len(slots)]
        rest = ins[2 + len(slots):]
        bad_valid = bool(rest) and (rest[0].shape, rest[0].dtype) != ((), "i64")
        if not slots or len(xs) != len(slots) or len(rest) > 1 or bad_valid:
            raise ValueError(f"dspark_tap: expected ring, positions, {len(slots)} HC states (one per slot) and an "
                             f"optional i64 n_valid, found {', '.join(map(str, ins))}")
        if ring.dtype != "bf16" or len(ring.shape) != 2 or ring.shape[0] != a["window"]:
            raise ValueError(f"dspark_tap: ring must be bf16 [{a['window']}, n_taps*D], found {ring}")
        d = xs[0].shape[-1]
        if any(x.dtype != "bf16" or len(x.shape) != 3 or x.shape[-1] != d or x.shape[0] != positions.shape[0]
               for x in xs):
            raise ValueError(f"dspark_tap: HC states must be bf16 [q, hc, D] of one D, found "
                             f"{', '.join(map(str, xs))}")
        width = ring.shape[1]
        if not isinstance(d, int) or not isinstance(width, int) or width % d:
            raise ValueError(f"dspark_tap: ring width {width} is not a multiple of D = {d}")
        if len(set(slots)) != len(slots) or any(not 0 <= s < width // d for s in slots):
            raise ValueError(f"dspark_tap: slots {list(slots)} must be distinct in 0..{width // d - 1}")
        return [ring]

    @staticmethod
    def run(ctx, ins, a):
        ring, positions = ins[0], ins[1]
        slots = tuple(a["slots"])
        out = ring.clone()
        n = _valid_rows(ins, 2 + len(slots), positions.shape[0])
        rows = [p % a["window"] for p in positions.tolist()[:n]]
        for s, x in zip(slots, ins[2:2 + len(slots)]):
            d = x.shape[-1]
            m = x.mean(dim=-2)  # as Reference._step records tap_rows
            for i, r in enumerate(rows):
                out[r, s * d:(s + 1) * d] = m[i]
        return [out]


@register("record_hc", ("ring", "positions", "x", "n_valid*"), ("ring_new",), ("rows",))
class RecordHc:
    """7.5: the final HC state ``X_main`` of the step's rows (the MTP drafter's input). Inputs: the ring bf16
    ``[rows, hc, D]``, the row positions, the last layer's output streams x bf16 ``[q, hc, D]`` (the HC head's
    input, spec 5.4.1), optionally ``n_valid`` (a padded prefill chunk). Each row i at position p: ring row
    ``p mod rows`` = x[i], a copy (rows written in order; only rows ``0 .. n_valid-1`` with ``n_valid``); other
    rows kept. Lowered to the tap family's copy mode (runtime/families/tap.py)."""

    @staticmethod
    def infer(ins, a):
        if len(ins) not in (3, 4) or (len(ins) == 4 and (ins[3].shape, ins[3].dtype) != ((), "i64")):
            raise ValueError(f"record_hc: expected ring, positions, HC state and an optional i64 n_valid, found "
                             f"{', '.join(map(str, ins))}")
        ring, positions, x = ins[:3]
        if ring.dtype != "bf16" or len(ring.shape) != 3 or ring.shape[0] != a["rows"]:
            raise ValueError(f"record_hc: ring must be bf16 [{a['rows']}, hc, D], found {ring}")
        if x.dtype != "bf16" or len(x.shape) != 3 or tuple(x.shape[1:]) != tuple(ring.shape[1:]) \
                or x.shape[0] != positions.shape[0]:
            raise ValueError(f"record_hc: the HC state must be bf16 [q, {ring.shape[1]}, {ring.shape[2]}] (one row "
                             f"per position), found {x}")
        return [ring]

    @staticmethod
    def run(ctx, ins, a):
        ring, positions, x = ins[:3]
        out = ring.clone()
        for i, p in enumerate(positions.tolist()[:_valid_rows(ins, 3, x.shape[0])]):
            out[p % a["rows"]] = x[i]
        return [out]


@register("compress", ("v", "g", "ape", "norm", "kv_state", "score_state", "rows", "positions", "freqs", "n_valid*"),
          ("kv_state_new", "score_state_new", "rows_new"), ("ratio", "d", "indexer", "emulate", "nope", "eps"))
class Compress:
    """5.3: compressor update for every row in position order (state kv/score, and on a flush the finished
    row ``p // ratio`` written into ``rows``; a prefill chunk crosses any number of flushes). v, g: fp32
    [q, c*d] projections; ape fp32 [ratio, c*d]. With ``n_valid`` only rows ``0 .. n_valid-1``."""

    @staticmethod
    def infer(ins, a):
        return [ins[4], ins[5], ins[6]]

    @staticmethod
    def run(ctx, ins, a):
        v, g, ape, norm, kv, score, rows, positions, freqs = ins[:9]
        kv, score, rows = kv.clone(), score.clone(), rows.clone()
        r, d = a["ratio"], a["d"]
        for i, p in enumerate(positions.tolist()[:_valid_rows(ins, 9, v.shape[0])]):
            cvec = B.compress_token(kv, score, v[i], g[i] + ape[p % r], p, r, d, B.plain_write)
            if cvec is not None:
                rows[p // r] = B.finish_compressed_row(cvec, norm, p, r, freqs, a["eps"], a["indexer"],
                                                       a["emulate"], a["nope"])
        return [kv, score, rows]


@register("live_rows", ("rows", "tokens", "pos", "n_valid*"), ("span",), ("ratio", "sym"))
class LiveRows:
    """The compressed rows a step can see: ``rows[: (pos+q) // ratio]`` (``q`` = ``n_valid`` in a padded
    prefill chunk: padded rows see no row the valid ones did not write), [n, d] with n symbolic."""

    @staticmethod
    def infer(ins, a):
        return [T((Sym(a["sym"]), ins[0].shape[1]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        rows, tok, pos = ins[:3]
        return [rows[: (int(pos) + _valid_rows(ins, 3, tok.shape[0])) // a["ratio"]]]


@register("bucket_rows", ("rows", "live"), ("span",), ("capacity",))
class BucketRows:
    """``rows[:capacity]`` (a fixed span; entries at or past ``live`` are masked by ``span_mask``)."""

    @staticmethod
    def infer(ins, a):
        return [T((a["capacity"], ins[0].shape[1]), ins[0].dtype)]

    @staticmethod
    def run(ctx, ins, a):
        rows, live = ins
        if int(live) > a["capacity"]:
            raise ValueError(f"bucket_rows: live length {int(live)} exceeds the bucket capacity {a['capacity']}")
        return [rows[: a["capacity"]]]


@register("span_mask", ("span", "positions", "live*"), ("mask",), ("ratio",))
class SpanMask:
    """Per row i, which span entries j are visible: ``j < (pos_i + 1) // ratio`` (and ``j < live`` when the
    live length is given). bool [q, n]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[1]), ins[0].shape[0]), "bool")]

    @staticmethod
    def run(ctx, ins, a):
        span, positions = ins[0], ins[1]
        j = torch.arange(span.shape[0], device=span.device)
        m = j.unsqueeze(0) < ((positions + 1) // a["ratio"]).unsqueeze(1)
        if len(ins) > 2:
            m = m & (j.unsqueeze(0) < ins[2])
        return [m]


# ---------------------------------------------------------------------------------------------- attention

@register("indexer_topk", ("qi", "keys", "hw", "mask"), ("sel",), ("topk",))
class IndexerTopk:
    """5.2(f.6-7): per row, index scores of the visible keys and the top-k block ids (descending score,
    ties to the lower id, -1 padding). int64 [q, min(topk, n)]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), _min_dim(a["topk"], ins[1].shape[0])), "i64")]

    @staticmethod
    def run(ctx, ins, a):
        qi, keys, hw, mask = ins
        return [torch.stack([B.indexer_select(keys, mask[i], qi[i], hw[i], a["topk"]) for i in range(qi.shape[0])])]


ATTENTION_KINDS = ("swa", "csa", "hca", "dspark")


@register("sparse_attention", ("q", "ring", "kv", "positions", "sink", "comp*", "sel_or_mask*"), ("o",),
          ("kind", "window", "scale"))
class SparseAttention:
    """5.2(e, i) with P9: per row, the window list (ring rows of earlier steps, this step's own KV rows)
    then the compressed list: none (``swa``), the selected rows ``comp[sel]`` (``csa``), or every visible
    row of the span (``hca``, with its mask). bf16 [q, H, hd]. Kind ``dspark`` (7.2.3, the DSpark drafter's
    block attention; no compressed inputs): every row attends the same list, the ring slots
    ``0 .. min(window, pos)-1`` in slot order (``pos`` = ``positions[0]``, the block's first position = the
    committed positions) then all ``q`` block rows ``kv``, non-causally."""

    @staticmethod
    def infer(ins, a):
        if a["kind"] not in ATTENTION_KINDS:
            raise ValueError(f"sparse_attention kind {a['kind']!r} not in {ATTENTION_KINDS}")
        if a["kind"] in ("swa", "dspark") and len(ins) != 5:
            raise ValueError(f"sparse_attention kind {a['kind']} takes 5 inputs (q, ring, kv, positions, sink), "
                             f"found {len(ins)}")
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        q, ring, kv, positions, sink = ins[:5]
        p0 = int(positions[0])
        outs = []
        if a["kind"] == "dspark":  # 7.2.3: ring slots 0 .. min(W, p0)-1 in slot order, then every block row
            lst = torch.cat((ring[:min(a["window"], p0)], kv))
            ok = torch.ones(lst.shape[0], dtype=torch.bool, device=lst.device)
            return [torch.stack([P.sparse_attention(q[i], lst, ok, sink, a["scale"]) for i in range(q.shape[0])])]
        for i, p in enumerate(positions.tolist()):
            comp = ok = None
            if a["kind"] == "csa":
                sel = ins[6][i]
                comp, ok = ins[5][sel.clamp(min=0)], sel >= 0
            elif a["kind"] == "hca":
                comp, ok = ins[5], ins[6][i]
            outs.append(B.attention_row(q[i], ring, kv, p, p0, a["window"], comp, ok, sink, a["scale"]))
        return [torch.stack(outs)]


@register("grouped_linear", ("o", "w"), ("z",), ("groups",))
class GroupedLinear:
    """5.2(k): ``z_g = wo_a[g] . o_g`` for each head group g, bf16 einsum -> bf16 [q, groups, rank]."""

    @staticmethod
    def infer(ins, a):
        return [T((_rows(ins[0]), a["groups"], ins[1].shape[0] // a["groups"]), "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        o, w = ins
        G = a["groups"]
        og = o.reshape(o.shape[0], G, -1)
        wg = w.view(G, w.shape[0] // G, -1)
        return [torch.stack([P.linear_bf16(og[:, g], wg[g]) for g in range(G)], dim=1)]


# ---------------------------------------------------------------------------------------------- MoE

@register("router_scores", ("z",), ("s",))
class RouterScores:
    """P10: sqrt(softplus(z)), fp32."""

    @staticmethod
    def infer(ins, a):
        return [ins[0]]

    @staticmethod
    def run(ctx, ins, a):
        return [P.sqrtsoftplus(ins[0])]


@register("route", ("s", "tokens", "table"), ("ids", "weights"), ("k", "scale", "hash"))
class Route:
    """5.2(o.3-4): expert ids (hash: ``table = tid2eid`` looked up by token; scored: top-k of ``s + table``
    where table is the selection bias) and normalised, scaled weights. int64 / fp32 [q, k]."""

    @staticmethod
    def infer(ins, a):
        q = _rows(ins[0])
        return [T((q, a["k"]), "i64"), T((q, a["k"]), "f32")]

    @staticmethod
    def run(ctx, ins, a):
        s, tok, table = ins
        if a["hash"]:
            return list(B.route(s, None, table[tok], a["k"], a["scale"]))
        return list(B.route(s, table, None, a["k"], a["scale"]))


@register("routed_experts", ("x", "ids", "weights", "bank"), ("acc",), ("layer", "limit", "emulate"))
class RoutedExperts:
    """5.2(o.5): per row, the fp32 sum of the routed clamped-SwiGLU experts in ascending id. fp32 [q, D]."""

    @staticmethod
    def infer(ins, a):
        return [T(ins[0].shape, "f32")]

    @staticmethod
    def run(ctx, ins, a):
        x, ids, wts, _bank = ins
        return [torch.cat([B.routed_sum(x[i:i + 1], ids[i], wts[i], lambda e: ctx.expert(a["layer"], e),
                                        a["limit"], a["emulate"]) for i in range(x.shape[0])])]


@register("swiglu", ("g", "u"), ("h",), ("limit",))
class Swiglu:
    """P11 on the bf16 gate/up projections, fp32 out."""

    @staticmethod
    def infer(ins, a):
        return [T(ins[0].shape, "f32")]

    @staticmethod
    def run(ctx, ins, a):
        return [P.clamped_swiglu(ins[0].to(F32), ins[1].to(F32), a["limit"])]


@register("moe_sum", ("routed", "shared"), ("y",))
class MoeSum:
    """5.2(o.7): ``bf16(routed_fp32 + fp32(shared))``."""

    @staticmethod
    def infer(ins, a):
        return [T(ins[0].shape, "bf16")]

    @staticmethod
    def run(ctx, ins, a):
        return [(ins[0] + ins[1].to(F32)).to(P.act_dtype())]


# ---------------------------------------------------------------------------------------------- DSpark head

def _check_markov(base: TensorType, tokens: TensorType, w1: TensorType, w2: TensorType) -> None:
    if len(base.shape) != 2 or base.dtype != "f32":
        raise ValueError(f"expected base f32 [B, V], found {base}")
    if tokens.dtype != "i64" or len(tokens.shape) != 1 or tokens.shape[0] != base.shape[0]:
        raise ValueError(f"expected tokens i64 [{base.shape[0]}] (the block's ids, t0 first), found {tokens}")
    for name, w in (("markov_w1", w1), ("markov_w2", w2)):
        if len(w.shape) != 2 or w.shape[0] != base.shape[1] or w.dtype != "f32":
            raise ValueError(f"expected {name} f32 [{base.shape[1]}, rank], found {w}")
    if w1.shape[1] != w2.shape[1]:
        raise ValueError(f"markov_w1 rank {w1.shape[1]} != markov_w2 rank {w2.shape[1]}")


@register("markov_chain", ("base", "tokens", "w1", "w2"), ("drafts", "logits"))
class MarkovChain:
    """7.3.3, greedy: for depth ``i = 0 .. B-1``: ``emb_i = w1[out_i]`` (``out_0 = tokens[0]``, the anchor),
    ``logits_i = base_i + w2 . emb_i`` (fp32), ``out_{i+1} = argmax(logits_i)`` (ties to the lower id).
    base f32 [B, V]; tokens i64 [B]; w1, w2 f32 [V, rank] (bf16 values). Outputs ``drafts`` i64 [B]
    (``out_1 .. out_B``) and ``logits`` f32 [B, V]."""

    @staticmethod
    def infer(ins, a):
        base, tok, w1, w2 = ins
        _check_markov(base, tok, w1, w2)
        return [T((base.shape[0],), "i64"), T(base.shape, "f32")]

    @staticmethod
    def run(ctx, ins, a):
        base, tok, w1, w2 = ins
        prev = int(tok[0])
        out, rows = [], []
        for i in range(base.shape[0]):
            li = base[i] + P.linear_f32(w1[prev], w2)
            rows.append(li)
            prev = int(torch.argmax(li))
            out.append(prev)
        return [torch.tensor(out, dtype=torch.int64, device=base.device), torch.stack(rows)]


@register("dspark_confidence", ("hx", "tokens", "drafts", "w1", "proj", "bias*"), ("conf",))
class DsparkConfidence:
    """7.3.4: ``conf_i = proj . [fp32(hx_i) ; w1[prev_i]] (+ bias)`` with ``prev_0 = tokens[0]`` (the anchor)
    and ``prev_i = drafts[i-1]``: the raw confidence logit of each depth. hx bf16 [B, D] (the pre-norm HC-head
    output); tokens, drafts i64 [B]; w1 f32 [V, rank]; proj f32 [1, D + rank]; bias f32 [1]. fp32 [B]."""

    @staticmethod
    def infer(ins, a):
        hx, tok, drafts, w1, proj = ins[:5]
        rows = hx.shape[0]
        if len(hx.shape) != 2:
            raise ValueError(f"expected hx [B, D], found {hx}")
        for name, t in (("tokens", tok), ("drafts", drafts)):
            if t.dtype != "i64" or t.shape != (rows,):
                raise ValueError(f"expected {name} i64 [{rows}], found {t}")
        if len(w1.shape) != 2 or proj.shape != (1, hx.shape[1] + w1.shape[1]):
            raise ValueError(f"expected proj [1, {hx.shape[1]} + rank {w1.shape[1] if len(w1.shape) == 2 else '?'}]"
                             f", found {proj}")
        if len(ins) > 5 and ins[5].shape != (1,):
            raise ValueError(f"expected the confidence bias [1], found {ins[5]}")
        return [T((rows,), "f32")]

    @staticmethod
    def run(ctx, ins, a):
        hx, tok, drafts, w1, proj = ins[:5]
        prev = [int(tok[0])] + [int(d) for d in drafts[:-1]]
        out = []
        for i, t in enumerate(prev):
            c = P.linear_f32(torch.cat((hx[i].to(F32), w1[t])), proj)
            out.append(c + ins[5] if len(ins) > 5 else c)
        return [torch.cat(out)]


def infer_op(kind: str, in_types: list[TensorType], attrs: dict[str, Any]) -> list[TensorType]:
    """Output types of ``kind`` on ``in_types``. Raises KeyError for an unknown kind."""
    return OPS[kind].infer(in_types, attrs)
