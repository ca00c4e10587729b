"""``torch.compile`` of the reference decode/verify step: the "torch.compile" baseline of ``ds4c bench``.

The eager :class:`~ds4c.reference.Reference` cannot be handed to ``torch.compile`` as it is: its step is full
of Python control flow on positions (window list length, compressor flushes ``(p + 1) % r``, live lengths
``(p + 1) // r``, chunk skipping ``if not ok.any()``) and of data-dependent host reads (``int(valid.sum())``,
the routed expert ids), so dynamo would specialize on every position (one recompile per token) or break the
graph dozens of times per layer. :class:`CompiledReference` runs the same step (docs/model.md sections 5-6,
same primitives, same order of rounding) rewritten in a compile-friendly form:

* **one compiled graph per layer** ("front": HC pre, projections, indexer, both compressors, sparse attention,
  wo_a/wo_b, HC post, FFN HC pre, router, shared expert), specialized only on the layer kind (SWA / CSA / HCA,
  hash or scored router, first layer) and the verify width q; positions enter as an int64 tensor, compressor
  flushes and window/compressed-list validity are tensor masks (``torch.where``), never Python branches;
* the context-dependent operands (compressed rows, indexer keys) enter as views of the state buffers whose
  row count is a **dynamic dimension** (``torch._dynamo.mark_dynamic``), rounded up to ``span_bucket`` rows,
  so a new position does not recompile;
* **one compiled graph per routed-expert row** (the routed experts of one row, ascending id, fp32 sum): the
  expert ids go to the host once per layer (data-dependent: the weights come from the
  :class:`~ds4c.reference.weights.ExpertStore`), the only host round trip of a layer. Every graph is
  captured whole (``fullgraph=True``): no silent graph breaks;
* **one compiled head** (last FFN HC post, HC head, final norm, lm head).

What differs numerically from the eager reference (all within rounding, see tolerances below): products are
one matmul over the q rows instead of :func:`~ds4c.reference.primitives.matmul_rows`' row-by-row products
(batch-invariance is a property of the oracle, not of this baseline); the sparse attention evaluates all
chunks of 64 list entries at once (per-chunk running max by ``cummax``, the same bf16 rounding of ``exp``
against the running max, the chunk sums combined by ``exp(m_c - m)`` weights instead of the sequential
rescale); the indexer dot products are one product instead of tiles of 64; inductor fuses and reorders
fp32 work. Casts to bf16 stay roundings (``emulate_precision_casts`` is on).

State: every graph is functional (reads the state, never writes it); the state writes of the step (window
ring, compressor slots and overlap shift, flushed compressed rows and indexer keys) are then applied in the
reference's order through :meth:`SequenceState.write`, so the undo journal, :meth:`rollback`,
:meth:`snapshot` / :meth:`restore` behave exactly as in the reference.

Tolerances, measured on the tiny model on the CPU (inductor "default", teacher-forced from the eager state,
120 rows of q = 1..5 steps over positions 0..119; relative L2 error of each logits row; state: largest relative
L2 difference of a state tensor after the step):

=====================================  =========  =========  ========  =============  ==========
configuration                           median     90%        max       argmax flips   state
=====================================  =========  =========  ========  =============  ==========
batched products, quant emulation on    1e-7       1.8e-2     5.9e-2    1 / 120        3.0e-2
row-by-row products, emulation on       0          3.8e-3     3.3e-2    0 / 120        1.9e-2
batched products, emulation off         3.9e-3     5.5e-3     0.12      3 / 120        2.8e-2
=====================================  =========  =========  ========  =============  ==========

(Under ``backend="eager"`` with row-by-row products the step equals the reference bit for bit but for one
row at 1e-3, the attention's chunk combination.) The tiny model's random weights give near-flat logits, so a
1-ulp fp32 difference that flips a bf16 or FP8 rounding, or moves a router score across a near tie to another
expert, shows up as 1e-2..1e-1 on a few rows -- the same spread as the reference on CPU vs CUDA. Compare the
distribution of per-row errors (the tests: median < 1e-2, 90% < 3e-2, max < 0.25), not the max.

Cost, measured on the tiny model (2-core CPU, 1 thread, median of 8 steps; eager reference / compiled):
q = 1 22 ms / 6.2 ms, q = 5 62 ms / 13 ms (modes default, reduce-overhead and max-autotune-no-cudagraphs
alike: the CPU has no CUDA graphs and autotuning finds nothing better). Compiling one width with a cold
inductor cache takes ~95 s (7 graphs, mostly the C++ compiler), so all five widths ~7.5 min; with a warm
cache (a second process) ~7 s per width, dynamo tracing. ``dynamic=True`` is slower (7.9 / 16.8 ms, 150-235 s
per width) and still recompiled twice in a timed loop; ``dynamic=False`` recompiles whenever a span changes.

On a GPU, watch for: (1) ``reduce-overhead``: weights and state buffers (and the span views, slices of them
at offset 0) are marked static addresses (``mark_static_address(guard=False)``: no copies into the graph
pool, no guards on identity); a graph shared by several layers is recorded once per layer (cudagraph trees
re-record on a static address change without counting it against ``cudagraph_unexpected_rerecord_limit``),
and once per span bucket; the graphs never mutate their inputs; :meth:`reset` and :meth:`restore` refill the
state in place so the addresses stay. (2) Outside the graphs remain: the embedding gather, the journaled
state writes (a few small copies per row and layer), one ``ids.tolist()`` sync per layer and the routed
experts' graphs (never CUDA graphs: their weights come from the expert cache, different tensors per
routing), so launch gaps remain part of this baseline. (3) :meth:`verify` clones the logits under CUDA graphs
(a later replay would overwrite them). (4) Warm every width (and the benchmark's context bucket) before
timing and check :attr:`CompiledReference.graphs` did not grow while timing.

Usage::

    ref = Reference(ReferenceWeights.load(open_model(path)), max_ctx=4096)
    cref = compile_reference(ref, mode="default")       # compiles lazily, on the first step of each width
    logits = cref.verify([t0, t1, t2], pos=0)             # fp32 [3, vocab], as ref.verify
    cref.rollback(2); logits = cref.decode(t, pos=2)      # same API as Reference
    results = try_modes(ref, [t0, t1, t2], pos=0)         # which torch.compile modes work here
"""

from __future__ import annotations

import time
import types
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch

from ds4c import settings
from ds4c.config import Ds4Config
from ds4c.errors import StepError
from ds4c.reference import blocks as B
from ds4c.reference import primitives as P
from ds4c.reference.model import Reference
from ds4c.reference.state import CompressorState, SequenceState
from ds4c.reference.weights import ReferenceWeights

BF16, F32 = torch.bfloat16, torch.float32

#: torch.compile modes in the order a benchmark prefers them on a GPU (fastest first when they work).
MODES = ("reduce-overhead", "max-autotune-no-cudagraphs", "default")
#: backends accepted besides "inductor": dynamo capture without inductor (fast to compile; for tests).
DEBUG_BACKENDS = ("eager", "aot_eager")


# ================================================================================================ math
# Batched products (one matmul over all rows; the oracle's matmul_rows loops rows for batch invariance).

def _lin_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.to(F32) @ w.T


def _lin_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.to(F32) @ w.T).to(BF16)


def _lin_q(x: torch.Tensor, w: torch.Tensor, emu: bool) -> torch.Tensor:
    xa = P.act_quant_dequant(x, 128) if emu else x.to(F32)
    return (xa @ w.T).to(BF16)


class _Ops(NamedTuple):
    """The three products: batched (one matmul over the rows) or the oracle's row-by-row ones."""

    f32: Callable
    bf16: Callable
    q: Callable


BATCHED = _Ops(_lin_f32, _lin_bf16, _lin_q)
ROWWISE = _Ops(P.linear_f32, P.linear_bf16, P.linear_q)


def _hc_mix(L: _Ops, x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.to(F32)
    flat = xf.flatten(-2)
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return L.f32(flat, fn) * r, xf


def _hc_pre(L: _Ops, x, fn, scale, base, iters, hc_eps, norm_eps):
    m, xf = _hc_mix(L, x, fn, norm_eps)
    pre, post, comb = P.sinkhorn_split(m, scale, base, x.shape[-2], iters, hc_eps)
    return (pre.unsqueeze(-1) * xf).sum(dim=-2).to(x.dtype), post, comb


def _ffn_rows(L: _Ops, x, w1, w3, w2, limit: float, emu: bool) -> torch.Tensor:
    """The shared expert on all rows at once. x bf16 [q, D] -> bf16 [q, D]."""
    h = P.clamped_swiglu(L.q(x, w1, emu).to(F32), L.q(x, w3, emu).to(F32), limit)
    return L.q(h.to(BF16), w2, emu)


def chunked_attention(q: torch.Tensor, kv: torch.Tensor, ok: torch.Tensor, sink: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """P9 for R rows at once, every chunk of 64 list entries evaluated in parallel.

    Equal (within fp32 reassociation) to :func:`~ds4c.reference.primitives.sparse_attention` row by row:
    the list is padded with masked entries to a multiple of 64; chunk ``c``'s probabilities are
    ``exp(s - m_c)`` with ``m_c`` the running max after chunk ``c`` (``cummax`` of the chunk maxima), rounded
    to bf16 for the PV product as in the reference; chunk sums are combined with ``exp(m_c - m_last)``; the
    sink joins the denominator only. A fully masked chunk after the first contributes exactly nothing, as the
    reference's skipped chunk. The first entry of every row's list must be valid (the window list starts
    with the row's own position).

    Args:
        q: bf16 [R, H, hd]; kv: bf16 [R, L, hd] (K = V; masked entries may hold anything finite);
        ok: bool [R, L]; sink: fp32 [H]; scale: softmax scale.
    Returns:
        bf16 [R, H, hd].
    """
    R, L, hd = kv.shape
    n_chunks = (L + P.ATTN_CHUNK - 1) // P.ATTN_CHUNK
    pad = n_chunks * P.ATTN_CHUNK - L
    kv = torch.cat((kv, kv.new_zeros(R, pad, hd)), dim=1)
    ok = torch.cat((ok, ok.new_zeros(R, pad)), dim=1).view(R, n_chunks, P.ATTN_CHUNK)
    kvf = torch.where(ok.unsqueeze(-1), kv.view(R, n_chunks, P.ATTN_CHUNK, hd).to(F32),
                      torch.zeros((), dtype=F32, device=kv.device))
    s = torch.einsum("rhd,rcjd->rhcj", q.to(F32), kvf) * scale  # [R, H, C, 64]
    s = s.masked_fill(~ok.unsqueeze(1), float("-inf"))
    m = torch.cummax(s.amax(dim=-1), dim=-1).values  # running max after each chunk [R, H, C]
    p = torch.exp(s - m.unsqueeze(-1))
    acc_c = torch.einsum("rhcj,rcjd->rhcd", p.to(BF16).to(F32), kvf)
    m_last = m[..., -1:]
    wgt = torch.exp(m - m_last)
    den = (p.sum(-1) * wgt).sum(-1) + torch.exp(sink - m_last.squeeze(-1))
    acc = (acc_c * wgt.unsqueeze(-1)).sum(-2)
    return (acc / den.unsqueeze(-1)).to(BF16)


def _compress_rows(kv, score, v, g_raw, ape, pos, r: int, d: int):
    """Compressor state updates of q consecutive tokens (spec 5.3), sequential over the rows, functional.

    kv, score: fp32 [slots, c*d] before the step; v, g_raw: fp32 [q, c*d] projections; ape fp32 [r, c*d];
    pos int64 [q]. Returns (pooled fp32 [q, d] -- meaningful on flush rows only --, flush bool [q],
    g fp32 [q, c*d] = g_raw + ape[pos % r], the value the score slot receives)."""
    g = g_raw + ape[pos % r]
    slots = torch.arange(kv.shape[0], device=kv.device)
    pooled, flush = [], []
    for j in range(v.shape[0]):
        p = pos[j]
        hit = (slots == (4 + p % 4 if r == 4 else p % r)).unsqueeze(-1)
        kv = torch.where(hit, v[j], kv)
        score = torch.where(hit, g[j], score)
        fl = (p + 1) % r == 0
        if r == 4:  # overlap: previous block's first half + current block's second half, then shift
            kvs = torch.cat((kv[:4, :d], kv[4:, d:]))
            sc = torch.cat((score[:4, :d], score[4:, d:]))
            kv = torch.where(fl, torch.cat((kv[4:], kv[4:])), kv)
            score = torch.where(fl, torch.cat((score[4:], score[4:])), score)
        else:
            kvs, sc = kv, score
        pooled.append((kvs * sc.softmax(dim=0)).sum(dim=0))
        flush.append(fl)
    return torch.stack(pooled), torch.stack(flush), g


def _finish_rows(pooled, norm, pos, r: int, freqs, eps: float, indexer: bool, emu: bool, nope: int):
    """:func:`~ds4c.reference.blocks.finish_compressed_row` on q rows. pooled fp32 [q, d] -> bf16 [q, d]."""
    c = P.rms_norm(pooled.to(BF16), norm, eps)
    c = P.apply_rope(c, pos + 1 - r, freqs)
    if indexer:
        c = P.hadamard(c)
        return P.fp4_fake_quant(c, 32) if emu else c
    return B.kv_fake_quant(c, nope, emu)


def _merge_rows(buf: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, flush: torch.Tensor) -> torch.Tensor:
    """``buf`` with ``buf[idx[j]] = rows[j]`` for the flushing rows j (functional). buf [n, d]."""
    ar = torch.arange(buf.shape[0], device=buf.device)
    for j in range(rows.shape[0]):
        buf = torch.where(((ar == idx[j]) & flush[j]).unsqueeze(-1), rows[j], buf)
    return buf


def _index_select(keys, n_keys, qi, hw, topk: int) -> torch.Tensor:
    """(f.6-7) for q rows: :func:`~ds4c.reference.primitives.index_scores` over the first ``n_keys[j]`` keys,
    the ids of the top ``min(topk, n_keys[j])`` (descending score, ties to the lower id), then -1.

    keys bf16 [m, d]; n_keys int64 [q]; qi bf16 [q, heads, d]; hw bf16 [q, heads]. Returns int64
    [q, topk] (entries past the live ones are -1)."""
    m = keys.shape[0]
    valid = torch.arange(m, device=keys.device) < n_keys.unsqueeze(-1)  # [q, m]
    dots = torch.einsum("qhd,md->qhm", qi.to(F32), keys.to(F32)).to(BF16)
    weighted = (torch.relu(dots).to(F32) * hw.to(F32).unsqueeze(-1)).to(BF16).to(F32)
    acc = weighted[:, 0]
    for h in range(1, weighted.shape[1]):  # head sum in head order, as the reference
        acc = acc + weighted[:, h]
    score = acc.to(BF16).masked_fill(~valid, float("-inf"))
    # padded with topk -inf entries so the top-k is always topk wide, whatever m (no guard on m)
    score = torch.cat((score, score.new_full((score.shape[0], topk), float("-inf"))), dim=-1)
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :topk]
    live = torch.arange(topk, device=keys.device) < torch.clamp(n_keys, max=topk).unsqueeze(-1)
    return torch.where(live, order, torch.full_like(order, -1))


# ================================================================================================ graphs

class _LayerW(NamedTuple):
    """The tensors one layer graph reads (None where the layer kind has none)."""

    hc_attn: tuple
    hc_ffn: tuple
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor
    sink: torch.Tensor
    freqs: torch.Tensor
    comp: tuple | None  # wkv, wgate, ape, norm
    idx_wq_b: torch.Tensor | None
    idx_proj: torch.Tensor | None
    idx_comp: tuple | None
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    sh: tuple  # w1, w3, w2


class _LayerS(NamedTuple):
    """State the layer graph reads: the ring, and views of the compressed rows / indexer keys (span rows)."""

    ring: torch.Tensor
    comp: torch.Tensor | None
    comp_kv: torch.Tensor | None
    comp_score: torch.Tensor | None
    idx_keys: torch.Tensor | None
    idx_kv: torch.Tensor | None
    idx_score: torch.Tensor | None


@dataclass(frozen=True)
class _Kind:
    ratio: int
    hash_routed: bool
    first: bool


def _ffn_out(x, moe):
    """Last FFN's output (routed fp32 rows + shared bf16, rounded once) through HC post."""
    routed, shared, post, comb = moe
    acc = torch.cat(routed) + shared.to(F32)
    return P.hc_post(acc.to(BF16), x, post, comb)


def _make_layer_fn(cfg: Ds4Config, kind: _Kind, L: _Ops) -> Callable:
    """The function of one layer kind, traced by dynamo: everything of a layer but the routed experts."""
    r, emu, eps = kind.ratio, cfg.quant_emulation, cfg.norm_eps
    H, hd, window, nope = cfg.n_heads, cfg.head_dim, cfg.window, cfg.nope_dim
    scale = hd ** -0.5

    def layer(x, moe, tok, pos, W: _LayerW, S: _LayerS):
        q = x.shape[0]
        if moe is not None:
            x = _ffn_out(x, moe)
        y, post, comb = _hc_pre(L, x, *W.hc_attn, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        a = P.rms_norm(y, W.attn_norm, eps)
        # (c) query path, (d) window KV of the step's tokens
        qr = P.rms_norm(L.q(a, W.wq_a, emu), W.q_norm, eps)
        qh = L.q(qr, W.wq_b, emu).view(q, H, hd)
        qh = P.apply_rope(P.head_rms(qh, eps), pos, W.freqs)
        kv = P.rms_norm(L.q(a, W.wkv, emu), W.kv_norm, eps)
        kv = B.kv_fake_quant(P.apply_rope(kv, pos, W.freqs), nope, emu)
        # (e) window lists of every row: positions first..p (ring before the step, the step's own rows after)
        p0 = pos[0]
        t = torch.clamp(pos - window + 1, min=0).unsqueeze(-1) + torch.arange(window, device=pos.device)
        w_ok = t <= pos.unsqueeze(-1)
        w_kv = torch.where((t < p0).unsqueeze(-1), S.ring[t % window], kv[torch.clamp(t - p0, 0, q - 1)])
        lst, ok = w_kv, w_ok
        idx_out = comp_out = None
        if r == 4:  # (f) indexer query, head weights, indexer compressor (first), top-k selection
            qi = L.q(qr, W.idx_wq_b, emu).view(q, cfg.index_n_heads, cfg.index_head_dim)
            qi = P.hadamard(P.apply_rope(qi, pos, W.freqs))
            if emu:
                qi = P.fp4_fake_quant(qi, 32)
            hscale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
            hw = (L.bf16(a, W.idx_proj).to(F32) * hscale).to(BF16)
            iw, ig, iape, inorm = W.idx_comp
            iv = L.f32(a, iw)
            pooled, iflush, ig2 = _compress_rows(S.idx_kv, S.idx_score, iv, L.f32(a, ig), iape, pos, 4,
                                                 cfg.index_head_dim)
            ifin = _finish_rows(pooled, inorm, pos, 4, W.freqs, eps, True, emu, nope)
            keys = _merge_rows(S.idx_keys, ifin, pos // 4, iflush)
            sel = _index_select(keys, (pos + 1) // 4, qi, hw, cfg.index_topk)
            idx_out = (iv, ig2, ifin)
        if r:  # (h.2) main compressor, then the compressed list: (g) all completed rows / CSA selected rows
            cw, cg, cape, cnorm = W.comp
            cv = L.f32(a, cw)
            pooled, cflush, cg2 = _compress_rows(S.comp_kv, S.comp_score, cv, L.f32(a, cg), cape, pos, r, hd)
            cfin = _finish_rows(pooled, cnorm, pos, r, W.freqs, eps, False, emu, nope)
            comp_out = (cv, cg2, cfin)
            blk = pos // r
            if r == 4:
                c_kv = S.comp[torch.clamp(sel, min=0)]  # [q, k, hd]; rows flushed in this step patched in
                for j in range(q):
                    c_kv = torch.where(((sel == blk[j]) & cflush[j]).unsqueeze(-1), cfin[j], c_kv)
                c_ok = sel >= 0
            else:
                rows = _merge_rows(S.comp, cfin, blk, cflush)
                c_kv = rows.unsqueeze(0).expand(q, -1, -1)
                c_ok = torch.arange(rows.shape[0], device=pos.device) < ((pos + 1) // r).unsqueeze(-1)
            lst, ok = torch.cat((lst, c_kv), dim=1), torch.cat((ok, c_ok), dim=1)
        o = chunked_attention(qh, lst, ok, W.sink, scale)  # (i)
        o = P.apply_rope(o, pos, W.freqs, inverse=True)  # (j)
        og = o.view(q, cfg.o_groups, cfg.heads_per_group * hd)  # (k) grouped wo_a, then wo_b
        woa = W.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        if L is ROWWISE:
            z = torch.stack([L.bf16(og[:, g], woa[g]) for g in range(cfg.o_groups)], dim=1)
        else:
            z = torch.einsum("qgk,gnk->qgn", og.to(F32), woa).to(BF16)
        out = L.q(z.reshape(q, -1), W.wo_b, emu)
        x = P.hc_post(out, x, post, comb)  # (l)
        y, post_f, comb_f = _hc_pre(L, x, *W.hc_ffn, cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)  # (m)
        b = P.rms_norm(y, W.ffn_norm, eps)  # (n)
        s = P.sqrtsoftplus(L.f32(b, W.gate))  # (o) router
        ids, wts = B.route(s, W.gate_bias, W.tid2eid[tok] if kind.hash_routed else None,
                           cfg.n_active_experts, cfg.route_scale)
        ids, perm = torch.sort(ids, dim=-1, stable=True)  # routed experts run in ascending id
        shared = _ffn_rows(L, b, *W.sh, cfg.swiglu_limit, emu)
        return x, post_f, comb_f, b, shared, ids, wts.gather(-1, perm), kv, comp_out, idx_out

    return layer


def _make_routed_fn(cfg: Ds4Config) -> Callable:
    emu, limit = cfg.quant_emulation, cfg.swiglu_limit

    def routed(x, w1s, w3s, w2s, wts):
        """(o.5) the routed experts of one row in the given (ascending id) order: fp32 [1, D]."""
        acc = torch.zeros(1, x.shape[-1], dtype=F32, device=x.device)
        for j in range(len(w1s)):
            acc = acc + B.expert_ffn(x, w1s[j], w3s[j], w2s[j], wts[j], limit, emu).to(F32)
        return acc

    return routed


def _make_head_fn(cfg: Ds4Config, L: _Ops) -> Callable:
    def head(x, moe, fn, scale, base, out_norm, head_w):
        """Last FFN HC post, then 5.4: HC head, final norm, fp32 logits [q, vocab]."""
        x = _ffn_out(x, moe)
        m, xf = _hc_mix(L, x, fn, cfg.norm_eps)
        pre = torch.sigmoid(m * scale[0] + base) + cfg.hc_eps
        y = (pre.unsqueeze(-1) * xf).sum(dim=-2).to(x.dtype)
        return L.f32(P.rms_norm(y, out_norm, cfg.norm_eps), head_w)

    return head


def _fresh_code(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object: dynamo keeps compiled variants (and counts recompiles)
    per code object, so every (stepper, layer kind) gets its own cache and its own recompile budget."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# ================================================================================================ backend

class _CountingBackend:
    """Wraps a dynamo backend and counts the graphs it compiles (first compiles and recompiles)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.graphs = 0
        self.compile_s = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        self.graphs += 1
        t0 = time.perf_counter()
        try:
            return self.inner(gm, example_inputs)
        finally:
            self.compile_s += time.perf_counter() - t0


def _backend(backend: str, mode: str, dynamic: bool | None, options: dict | None) -> Any:
    if backend == "inductor":
        opts = {"emulate_precision_casts": True, **(options or {})}
        return torch._TorchCompileInductorWrapper(None if mode == "default" else mode, opts, dynamic)
    if backend in DEBUG_BACKENDS:
        return torch._dynamo.lookup_backend(backend)
    raise StepError(f"backend must be 'inductor' or one of {DEBUG_BACKENDS}, found {backend!r}")


def _uses_cudagraphs(mode: str, options: dict | None) -> bool:
    try:
        opts = {**torch._inductor.list_mode_options(None if mode == "default" else mode), **(options or {})}
    except RuntimeError as e:
        raise StepError(f"unknown torch.compile mode {mode!r}: {e}") from None
    return bool(opts.get("triton.cudagraphs"))


# ================================================================================================ stepper

class CompiledReference(Reference):
    """The reference step through ``torch.compile``: same API, state, journal and errors as
    :class:`~ds4c.reference.Reference` (``reset``, ``verify``, ``decode``, ``rollback``, ``snapshot``,
    ``restore``, ``max_ctx``, ``state``); logits equal the eager reference's within rounding (see the
    module docstring for the measured tolerance).

    Build it with :func:`compile_reference`. Graphs compile lazily: the first step of each width q compiles
    one graph per layer kind (about 4 kinds), the routed-expert graph and the head; later steps of any
    position and any tokens reuse them (:attr:`graphs` counts compiled graphs, so a benchmark can check
    that timed steps did not recompile).

    Args:
        weights: the reference's weights (shared, not copied).
        max_ctx: positions the state holds (as :class:`Reference`).
        mode: ``torch.compile`` mode: ``"default"``, ``"reduce-overhead"`` (CUDA graphs; on a CPU it runs as
            default) or ``"max-autotune-no-cudagraphs"`` (and any other inductor mode).
        dynamic: ``None`` (default): only the context spans (compressed rows, indexer keys) are dynamic
            dimensions, marked with ``mark_dynamic``; everything else is static and q is specialized.
            ``True``: ``torch.compile(dynamic=True)``, every dimension symbolic. ``False``: all static, one
            graph per span length (use a large ``span_bucket``).
        backend: ``"inductor"``, or ``"eager"`` / ``"aot_eager"`` (dynamo capture only; fast to compile, for
            testing the capture and the state handling).
        span_bucket: the context spans handed to the graphs are rounded up to a multiple of this many rows
            (capped by the state's capacity); larger buckets mean fewer distinct shapes (CUDA graphs record
            one graph per shape) and more masked rows scanned.
        options: extra inductor options (merged over the mode's options; ``emulate_precision_casts`` is on
            unless overridden).
        batch_rows: True (default): every product is one matmul over the q rows (what a tuned torch
            baseline does: the weight is read once per step). False: the oracle's row-by-row products
            (:func:`~ds4c.reference.primitives.matmul_rows`), which make the step equal the eager reference
            bit for bit under ``backend="eager"`` except the attention's chunk combination (for tests).

    Raises:
        StepError: bad ``max_ctx`` (as Reference), unknown mode or backend, ``span_bucket`` < 1, the weights of
            a shard (a layer range, not the whole model). Compile
            errors of torch (dynamo ``Unsupported``, ``BackendCompilerFailed``, ...) surface on the first step
            of a width (:func:`try_modes` catches and reports them).
    """

    records_taps = False
    """Its compiled step records no DSpark taps (the drafter refuses it)."""
    records_final_hc = False
    """Nor the final HC state the MTP drafter reads (the drafter refuses it)."""

    def __init__(self, weights: ReferenceWeights, max_ctx: int = 4096, mode: str = "default",
                 dynamic: bool | None = None, backend: str = "inductor", span_bucket: int = 64,
                 options: dict | None = None, batch_rows: bool = True):
        if weights.dataflow != "bf16":
            raise StepError(f"the compiled reference runs the spec's bf16 dataflow; these weights were loaded for "
                            f"{weights.dataflow!r} (use the eager Reference)")
        if not weights.is_whole:
            raise StepError(f"the compiled reference runs the whole model; these weights hold layers "
                            f"[{weights.layer_range[0]},{weights.layer_range[1]}) (use the eager Reference.run or "
                            f"ShardedReference)")
        super().__init__(weights, max_ctx)
        if span_bucket < 1:
            raise StepError(f"span_bucket must be >= 1, found {span_bucket}")
        cfg = self.cfg
        self.mode, self.dynamic, self.backend_name, self.span_bucket = mode, dynamic, backend, span_bucket
        self.batch_rows = batch_rows
        ops = BATCHED if batch_rows else ROWWISE
        uses_cudagraphs = _uses_cudagraphs(mode, options)  # also validates the mode name
        self.cudagraphs = backend == "inductor" and uses_cudagraphs and self.device.type == "cuda"
        self._backend = _CountingBackend(_backend(backend, mode, dynamic, options))
        # routed experts: never CUDA graphs (their weights change address with every routing decision)
        routed_opts = {**(options or {}), "triton.cudagraphs": False}
        self._routed_backend = _CountingBackend(_backend(backend, mode, dynamic, routed_opts))

        def comp(f: Callable, be: _CountingBackend) -> Callable:
            return torch.compile(_fresh_code(f), backend=be, dynamic=dynamic, fullgraph=True)

        self._kinds = [_Kind(cfg.ratio(i), cfg.is_hash_layer(i), i == 0) for i in range(cfg.n_layers)]
        self._layer_fns = {k: comp(_make_layer_fn(cfg, k, ops), self._backend) for k in set(self._kinds)}
        self._routed_fn = comp(_make_routed_fn(cfg), self._routed_backend)
        self._head_fn = comp(_make_head_fn(cfg, ops), self._backend)
        w = weights
        self._layer_w = []
        for i, lw in enumerate(w.layers):
            c, ic = lw.compressor, lw.idx_compressor
            self._layer_w.append(_LayerW(
                lw.hc_attn, lw.hc_ffn, lw.attn_norm, lw.ffn_norm, lw.wq_a, lw.q_norm, lw.wq_b, lw.wkv, lw.kv_norm,
                lw.wo_a, lw.wo_b, lw.sink, self._freqs[cfg.uses_yarn(i)],
                None if c is None else (c.wkv, c.wgate, c.ape, c.norm), lw.idx_wq_b, lw.idx_proj,
                None if ic is None else (ic.wkv, ic.wgate, ic.ape, ic.norm), lw.gate, lw.gate_bias, lw.tid2eid,
                (lw.sh_w1, lw.sh_w3, lw.sh_w2)))
        self._head_w = (*w.hc_head, w.out_norm, w.head)
        if self.cudagraphs:  # weights and state never move: no per-replay copies into the graph pool
            for t in self._static_tensors():
                torch._dynamo.mark_static_address(t, guard=False)

    # ---------------------------------------------------------------------------------------------- API
    @property
    def graphs(self) -> int:
        """Graphs compiled so far by this stepper (first compiles plus recompiles, all functions)."""
        return self._backend.graphs + self._routed_backend.graphs

    @property
    def backend_compile_s(self) -> float:
        """Seconds spent inside the backend (inductor lowering + codegen + C++/Triton compile) so far;
        dynamo tracing is not included (see :func:`try_modes` for the wall time of a first step)."""
        return self._backend.compile_s + self._routed_backend.compile_s

    def reset(self) -> None:
        """Start a new sequence: the state buffers are refilled in place (their addresses stay, which CUDA
        graphs and static-address marks rely on), pos = 0."""
        self.state.restore(SequenceState.new(self.cfg, self.max_ctx, self.device))

    def verify(self, tokens: list[int] | torch.Tensor, pos: int) -> torch.Tensor:
        """As :meth:`Reference.verify`: fp32 logits [q, vocab] (a fresh tensor, also under CUDA graphs).

        Raises:
            StepError: as :meth:`Reference.verify`.
        """
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        out = super().verify(tokens, pos)
        return out.clone() if self.cudagraphs else out

    # ---------------------------------------------------------------------------------------------- step
    def _static_tensors(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []

        def walk(v: Any) -> None:
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (tuple, list)):
                for u in v:
                    walk(u)

        walk(self._layer_w)
        walk(self._head_w)
        for ls in self.state.layers:
            walk(ls.tensors())
        return out

    def _span(self, live: int, cap: int, minimum: int) -> int:
        b = self.span_bucket
        return min(cap, -(-max(live, minimum) // b) * b)

    def _view(self, buf: torch.Tensor, rows: int) -> torch.Tensor:
        v = buf[:rows]
        if self.dynamic is None and rows >= 2:
            torch._dynamo.mark_dynamic(v, 0)
        if self.cudagraphs:
            torch._dynamo.mark_static_address(v, guard=False)
        return v

    def _step(self, toks: list[int], p0: int) -> torch.Tensor:
        cfg, w, st = self.cfg, self.w, self.state
        q = len(toks)
        st.begin_step(q)
        tok = torch.tensor(toks, dtype=torch.int64, device=self.device)
        pos = torch.arange(p0, p0 + q, dtype=torch.int64, device=self.device)
        x = w.embed[tok].unsqueeze(1).expand(q, cfg.hc_mult, cfg.hidden_size).contiguous()  # 5.1
        moe = None
        for i, kind in enumerate(self._kinds):
            ls, r = st.layers[i], kind.ratio
            comp = idx = None
            if r:
                live = (p0 + q) // r  # compressed rows after this step's flushes
                n = self._span(live, ls.comp.shape[0], max(2, cfg.index_topk) if r == 4 else 2)
                comp = self._view(ls.comp, n)
                if r == 4:
                    idx = self._view(ls.idx_keys, n)
            S = _LayerS(ls.ring, comp, *((ls.comp_state.kv, ls.comp_state.score) if r else (None, None)), idx,
                        *((ls.idx_state.kv, ls.idx_state.score) if r == 4 else (None, None)))
            x, post_f, comb_f, b, shared, ids, wts, kv, comp_out, idx_out = self._layer_fns[kind](
                x, moe, tok, pos, self._layer_w[i], S)
            for row in range(q):  # state writes in the reference's order, journaled per row
                p = p0 + row
                if r == 4:
                    self._compressor_writes(ls.idx_state, ls.idx_keys, idx_out, row, p, 4)
                if r:
                    self._compressor_writes(ls.comp_state, ls.comp, comp_out, row, p, r)
            for row in range(q):  # (h.1) ring writes after every row attended
                st.write(ls.ring, (p0 + row) % cfg.window, kv[row], row)
            rows = []
            for row, eids in enumerate(ids.tolist()):  # the only host sync of a layer: routed expert ids
                ws = [w.experts.get(i, e) for e in eids]
                rows.append(self._routed_fn(b[row:row + 1], [t[0] for t in ws], [t[1] for t in ws],
                                            [t[2] for t in ws], wts[row]))
            moe = (tuple(rows), shared, post_f, comb_f)
        logits = self._head_fn(x, moe, *self._head_w)
        st.pos = p0 + q
        return logits

    def _compressor_writes(self, cs: CompressorState, rows: torch.Tensor, out: tuple, row: int, p: int,
                           r: int) -> None:
        """The writes of :func:`~ds4c.reference.blocks.compress_token` and ``Reference._compress`` for the
        token at ``p``, with the values the graph computed, in the same order and journaled the same way."""
        v, g, fin = out
        st = self.state
        slot = 4 + p % 4 if r == 4 else p % r
        st.write(cs.kv, slot, v[row], row)
        st.write(cs.score, slot, g[row], row)
        if (p + 1) % r:
            return
        if r == 4:
            st.write(cs.kv, slice(0, 4), cs.kv[4:].clone(), row)
            st.write(cs.score, slice(0, 4), cs.score[4:].clone(), row)
        st.write(rows, p // r, fin[row], row)


def compile_reference(ref: Reference | ReferenceWeights, mode: str = "default", dynamic: bool | None = None,
                      backend: str = "inductor", span_bucket: int = 64, max_ctx: int | None = None,
                      options: dict | None = None, batch_rows: bool = True) -> CompiledReference:
    """A :class:`CompiledReference` over ``ref``'s weights (shared) with a fresh sequence state.

    Args:
        ref: an eager :class:`Reference` (its weights and ``max_ctx`` are used; its state is not touched
            -- copy it over with ``cref.restore(ref.snapshot())``) or :class:`ReferenceWeights`.
        mode, dynamic, backend, span_bucket, options, batch_rows: see :class:`CompiledReference`.
        max_ctx: overrides ``ref.max_ctx`` (required when ``ref`` is weights; default 4096 then).
    Returns:
        the stepper; nothing is compiled until its first step.
    Raises:
        StepError: as :class:`CompiledReference`.
    """
    if isinstance(ref, Reference):
        weights, mc = ref.w, ref.max_ctx
    else:
        weights, mc = ref, 4096
    return CompiledReference(weights, max_ctx if max_ctx is not None else mc, mode=mode, dynamic=dynamic,
                             backend=backend, span_bucket=span_bucket, options=options, batch_rows=batch_rows)


# ================================================================================================ modes

@dataclass
class ModeResult:
    """What :func:`try_modes` found for one mode (unpacks as ``ok, error, compile_s``).

    Attributes:
        ok: the compiled step ran and gave finite logits.
        error: why not: the exception's type and first message line (None when ok).
        compile_s: wall seconds of the first (compiling) step.
        step_s: the fastest of three repeats of the same step from the same state, compiled (a rough
            figure: a benchmark should time its own loop).
        rel_err: max per-row relative L2 error of the logits against the eager step.
        graphs: graphs compiled.
        stepper: the compiled stepper, warm for that width (None when it failed), so a benchmark can time
            it without compiling again.
    """

    ok: bool
    error: str | None
    compile_s: float
    step_s: float | None = None
    rel_err: float | None = None
    graphs: int = 0
    stepper: CompiledReference | None = field(default=None, repr=False)

    def __iter__(self):  # unpacks as (ok, error, compile_s)
        return iter((self.ok, self.error, self.compile_s))


def rel_err_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row relative L2 error ``|a - b| / |a|`` of fp32 logits [q, V] (``a`` the reference). -> fp32 [q]."""
    a, b = a.float().cpu(), b.float().cpu()
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-30)


def try_modes(ref: Reference, tokens: Sequence[int], pos: int, modes: Sequence[str] = MODES,
              dynamic: bool | None = None, backend: str = "inductor", span_bucket: int = 64,
              options: dict | None = None) -> dict[str, ModeResult]:
    """Compile the step ``ref.verify(tokens, pos)`` in each ``mode`` and report which work on this device.

    ``ref``'s state must be at ``pos`` (its next position); it is left unchanged (snapshot, restore). For
    every mode a :class:`CompiledReference` gets a copy of the state, runs the step once (compiling), then
    three more times from the same state (timed), and its logits are compared with the eager step's. A mode
    whose compile or run raises is reported with ``ok=False`` and the error; nothing is raised.
    On a CPU ``reduce-overhead`` runs without CUDA graphs (inductor skips them), so it equals ``default``.

    Args:
        ref: the eager reference (weights, ``max_ctx`` and the current state are used).
        tokens: 1..5 token ids; pos: ``ref``'s next position.
        modes: torch.compile modes to try, in order.
    Returns:
        mode -> :class:`ModeResult` (unpacks as ``ok, error, compile_s``).
    Raises:
        StepError: the eager step itself is invalid (bad tokens, width or position).
    """
    snap = ref.snapshot()
    want = ref.verify(list(tokens), pos)
    ref.restore(snap)
    results: dict[str, ModeResult] = {}
    for mode in modes:
        t0 = time.perf_counter()
        cref = None
        try:
            cref = compile_reference(ref, mode=mode, dynamic=dynamic, backend=backend, span_bucket=span_bucket,
                                     options=options)
            cref.restore(snap)
            got = cref.verify(list(tokens), pos)
            _sync(cref.device)
            compile_s = time.perf_counter() - t0
            step_s = float("inf")
            for _ in range(3):  # CUDA graph trees: warm-up run, recording run, then replays
                cref.restore(snap)
                t1 = time.perf_counter()
                got = cref.verify(list(tokens), pos)
                _sync(cref.device)
                step_s = min(step_s, time.perf_counter() - t1)
            cref.restore(snap)
            results[mode] = ModeResult(True, None, compile_s, step_s, float(rel_err_rows(want, got).max()),
                                       cref.graphs, cref)
        except Exception as e:  # noqa: BLE001 - any compile/run failure is a result, not a crash
            msg = f"{type(e).__name__}: {e}".strip().splitlines()
            first = next((ln for ln in msg if ln.strip()), type(e).__name__)
            results[mode] = ModeResult(False, first[:500], time.perf_counter() - t0,
                                       graphs=0 if cref is None else cref.graphs)
            if settings.debug():
                traceback.print_exc()
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

