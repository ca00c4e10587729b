"""Numeric primitives of DeepSeek-V4-Flash, written from docs/model.md section 3 (P1-P12) and the
quantized linear of section 2.3.

Conventions: activations are bf16 tensors whose last dim is the feature dim and whose leading dims are rows;
"fp32 accumulate, bf16 result" products are computed as fp32 matmuls of the upcast operands, rounded once.
Every row is computed on its own (:func:`matmul_rows`), so a batch of q rows gives bit-identical results to
q single-row calls (the verify == sequential-decode rule of section 6 holds bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ds4c.quant import act_quant_dequant, fp4_fake_quant, fp8_fake_quant  # noqa: F401  (re-exported for P.*)

BF16 = torch.bfloat16
F32 = torch.float32

# The dtype activations are rounded to between operations: bf16 as the official checkpoint runs (the spec's
# dataflow), or fp32 for token-exact comparisons with ports that keep fp32 activations (llama.cpp's CPU and
# CUDA backends with an F32 KV cache). Set for the duration of a step by :func:`dataflow`.
_ACT: list[torch.dtype] = [BF16]
DATAFLOWS = {"bf16": BF16, "fp32": F32}
# True inside :func:`batched_rows`: row-wise evaluation off (see there).
_BATCHED: list[bool] = [False]


@contextlib.contextmanager
def batched_rows() -> Iterator[None]:
    """Inside: :func:`row_invariant` functions and :func:`matmul_rows` evaluate all rows at once, as on a GPU.

    For tracing the step into one graph (``ds4c.export``): a per-row loop would unroll into one op per row.
    The values are the same up to the CPU's vector-tail rounding that the row-wise path exists to avoid."""
    _BATCHED.append(True)
    try:
        yield
    finally:
        _BATCHED.pop()


def row_invariant(n_row_args: int) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Decorator: on the CPU, evaluate the function one leading row at a time (its first ``n_row_args``
    arguments are row-indexed; outputs are concatenated along dim 0).

    Why: CPU torch computes transcendental functions (exp, sigmoid, softplus, silu, sin, cos) with vector code
    on whole vectors and scalar code on the tail, and the two can differ in the last bit; so an element's
    result depends on its place in the whole tensor, i.e. on how many rows the step has. Per row, a row's
    values are the same in a decode (1 row), a verify (2..5) and a prefill chunk (any C): the reference stays
    batch-invariant bit for bit, as :func:`matmul_rows` keeps its projections. CUDA evaluates every element
    with the same instructions, so device tensors take the batched path."""

    def deco(fn: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(fn)
        def wrapper(*args: object, **kw: object) -> object:
            lead = args[0]
            assert isinstance(lead, torch.Tensor)
            if _BATCHED[-1] or lead.device.type != "cpu" or lead.dim() == 0 or lead.shape[0] <= 1:
                return fn(*args, **kw)
            rows = [fn(*(a[i:i + 1] for a in args[:n_row_args]), *args[n_row_args:], **kw)  # type: ignore[index]
                    for i in range(lead.shape[0])]
            if isinstance(rows[0], tuple):
                return tuple(torch.cat(parts) for parts in zip(*rows))
            return torch.cat(rows)  # type: ignore[arg-type]

        return wrapper

    return deco


def act_dtype() -> torch.dtype:
    """The activation dtype of the running step (``torch.bfloat16`` unless inside ``dataflow("fp32")``)."""
    return _ACT[-1]


@contextlib.contextmanager
def dataflow(name: str) -> Iterator[None]:
    """Run the enclosed reference code with activations rounded to ``DATAFLOWS[name]`` (``"bf16"``, the
    spec's dataflow, or ``"fp32"``: no rounding between operations). Nested uses restore the outer one."""
    _ACT.append(DATAFLOWS[name])
    try:
        yield
    finally:
        _ACT.pop()


def matmul_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32, one row at a time (batch-invariant).

    Args:
        x: fp32 [..., K]; w: fp32 [N, K].
    Returns:
        fp32 [..., N].
    """
    lead = x.shape[:-1]
    if _BATCHED[-1]:
        return x @ w.T
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.cat([x2[i:i + 1] @ w.T for i in range(x2.shape[0])]) if x2.shape[0] else x2.new_zeros(0, w.shape[0])
    return out.reshape(*lead, w.shape[0])


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x fp32 -> fp32 projection (compressor, router, HC mixing, head). x: any float [..., K]."""
    return matmul_rows(x.to(F32), w)


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> bf16 projection with fp32 accumulation (``wo_a``, indexer ``weights_proj``).

    ``w`` is given in fp32 holding bf16-exact values. Returns bf16 [..., N].
    """
    return matmul_rows(x.to(F32), w).to(act_dtype())


def linear_q(x: torch.Tensor, w: torch.Tensor, emulate: bool = True) -> torch.Tensor:
    """Projection whose official weight is FP8 or FP4 (spec 2.3): the bf16 input is quantized to FP8 e4m3
    in blocks of 128 with power-of-two scales, multiplied with the dequantized weight in fp32, rounded to
    bf16. With ``emulate=False`` the activation quantization is skipped.

    Args:
        x: bf16 [..., K] (K a multiple of 128); w: fp32 [N, K] dequantized weight.
    Returns:
        bf16 [..., N].
    """
    xa = act_quant_dequant(x, 128) if emulate else x.to(F32)
    return matmul_rows(xa, w).to(act_dtype())


# -------------------------------------------------------------------------------------------------- P1, P2

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """P1: ``bf16(w * (x * rsqrt(mean(x^2) + eps)))`` in fp32. x: bf16 [..., D]; w: fp32 [D]. -> bf16."""
    xf = x.to(F32)
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w * xf).to(x.dtype)


def head_rms(q: torch.Tensor, eps: float) -> torch.Tensor:
    """P2: unweighted per-head RMS over the whole head in bf16 arithmetic (square bf16, mean with fp32
    accumulation to bf16, + eps bf16, rsqrt bf16, multiply bf16). q: bf16 [..., H, hd] -> bf16."""
    sq = q.square()  # bf16
    ms = sq.to(F32).mean(-1, keepdim=True).to(act_dtype())
    r = torch.rsqrt((ms.to(F32) + eps).to(act_dtype()).to(F32)).to(act_dtype())
    return (q.to(F32) * r.to(F32)).to(act_dtype())


# -------------------------------------------------------------------------------------------------- P5

def hadamard(x: torch.Tensor) -> torch.Tensor:
    """P5: ``bf16(H_n x n^-1/2)``, natural-order (Sylvester) Walsh-Hadamard on the last dim (a power of
    two), fp32 butterflies as in ``fast_hadamard_transform``. x: bf16 [..., n] -> bf16."""
    n = x.shape[-1]
    y = x.to(F32).reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (n ** -0.5)).to(act_dtype())


# -------------------------------------------------------------------------------------------------- P6, P7

def rope_freqs(rope_dim: int, base: float, yarn: bool, factor: float, orig_len: int, beta_fast: float,
               beta_slow: float) -> torch.Tensor:
    """P6: the rope_dim/2 inverse frequencies (fp32), with YaRN NTK-by-parts when ``yarn``.

    ``f_i = 1 / base^(2i/d)``; YaRN: ``f_i <- f_i*ramp_i/factor + f_i*(1-ramp_i)`` with
    ``ramp_i = clamp((i-low)/(high-low), 0, 1)`` (no attention-scale change anywhere). ``factor`` 1 is no
    scaling (a file without ``rope.scaling.*`` keys, :attr:`ds4c.config.Ds4Config.yarn`): the plain frequencies,
    bit for bit as llama.cpp computes them then (the identity ramp would round them in fp32).
    """
    d = rope_dim
    freqs = 1.0 / (base ** (torch.arange(0, d, 2, dtype=F32) / d))
    if yarn and factor != 1.0:
        def corr(r: float) -> float:
            return d * math.log(orig_len / (r * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=F32) - low) / (high - low), 0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


@row_invariant(2)
def apply_rope(x: torch.Tensor, pos: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """P7: interleaved (GPT-J) RoPE on the **last** ``2*len(freqs)`` dims of ``x``, fp32 math, bf16 out.

    Args:
        x: bf16 [R, ..., hd]; pos: int64 [R] (one position per leading row); freqs: fp32 [rd/2].
        inverse: rotate by -theta (used on the attention output, spec 5.2(j)).
    Returns:
        bf16, same shape; the non-rope dims are unchanged.
    """
    rd = 2 * freqs.numel()
    ang = pos.to(F32).reshape(-1, *([1] * (x.dim() - 2)), 1) * freqs  # [R, 1.., rd/2] fp32
    cos, sin = torch.cos(ang), torch.sin(ang)
    if inverse:
        sin = -sin
    r = x[..., -rd:].to(F32)
    a, b = r[..., 0::2], r[..., 1::2]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], out), dim=-1)


# -------------------------------------------------------------------------------------------------- P8

@row_invariant(1)
def sinkhorn_split(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P8: split the 24 HC mixing logits into pre [..., hc], post [..., hc] and the doubly-stochastic
    comb [..., hc(src), hc(dst)] (fp32): 1 softmax, then ``iters-1`` row + column normalisations,
    ending on a column normalisation."""
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return pre, post, c


def hc_mix_logits(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HC mixing logits (spec 5.2(a)): ``m = (fn . xf) * rsqrt(mean(xf^2) + eps)``.

    x: bf16 [R, hc, D]; fn: fp32 [n_mix, hc*D]. Returns (m fp32 [R, n_mix], xf fp32 [R, hc, D])."""
    xf = x.to(F32)
    flat = xf.flatten(-2)
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return linear_f32(flat, fn) * r, xf


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HC pre (spec 5.2(a)): mixing logits, Sinkhorn split, pre-mix.

    x: bf16 [R, hc, D]. Returns y bf16 [R, D], post fp32 [R, hc], comb fp32 [R, hc, hc]."""
    hc = x.shape[-2]
    m, xf = hc_mix_logits(x, fn, norm_eps)
    pre, post, comb = sinkhorn_split(m, scale, base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * xf).sum(dim=-2)
    return y.to(x.dtype), post, comb


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """HC post (spec 5.2(l)): ``X'_k = bf16(post_k out + sum_j C[j,k] residual_j)`` in fp32.

    out: bf16 [R, D]; residual: bf16 [R, hc, D]; post [R, hc]; comb [R, hc, hc]. -> bf16 [R, hc, D]."""
    mixed = (comb.unsqueeze(-1) * residual.to(F32).unsqueeze(-2)).sum(dim=-3)
    y = post.unsqueeze(-1) * out.to(F32).unsqueeze(-2) + mixed
    return y.to(residual.dtype)


@row_invariant(1)
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final HC head (spec 5.4.1): sigmoid-gated sum of the streams. x: bf16 [R, hc, D] -> bf16 [R, D]."""
    m, xf = hc_mix_logits(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale[0] + base) + hc_eps
    return (pre.unsqueeze(-1) * xf).sum(dim=-2).to(x.dtype)


# -------------------------------------------------------------------------------------------------- P9

ATTN_CHUNK = 64


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """P9: attention of one query row over an index list, with sink, in chunks of 64 list entries.

    Args:
        q: bf16 [H, hd] (all heads of one row); kv: bf16 [L, hd] the gathered list rows (K = V; masked
            entries may hold anything); valid: bool [L] (False = a -1 list entry); sink: fp32 [H];
        scale: softmax scale (hd^-1/2).
    Returns:
        bf16 [H, hd]. The list is padded with masked entries to a multiple of 64, so the result for a
        given list prefix does not depend on how many masked entries follow. Per chunk: fp32 scores, running max, fp32 exp for the denominator, exp rounded to
        bf16 for the PV product; finally the sink joins the denominator only (not the running max).
    """
    H = q.shape[0]
    pad = -kv.shape[0] % ATTN_CHUNK  # every chunk is a full 64 entries (masked tail): shape-invariant sums
    if pad:
        kv = torch.cat((kv, kv.new_zeros(pad, kv.shape[1])))
        valid = torch.cat((valid, valid.new_zeros(pad)))
    qf = q.to(F32)
    kvf = torch.where(valid.unsqueeze(-1), kv.to(F32), torch.zeros((), dtype=F32, device=kv.device))
    m = torch.full((H,), float("-inf"), dtype=F32, device=q.device)
    l = torch.zeros(H, dtype=F32, device=q.device)
    acc = torch.zeros(H, q.shape[1], dtype=F32, device=q.device)
    for c0 in range(0, kv.shape[0], ATTN_CHUNK):
        k = kvf[c0:c0 + ATTN_CHUNK]
        ok = valid[c0:c0 + ATTN_CHUNK]
        if not bool(ok.any()):
            continue
        s = (qf @ k.T) * scale
        s = s.masked_fill(~ok, float("-inf"))
        m_new = torch.maximum(m, s.max(dim=-1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        l = l * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + p.to(act_dtype()).to(F32) @ k
        m = m_new
    l = l + torch.exp(sink - m)
    return (acc / l.unsqueeze(-1)).to(act_dtype())


# -------------------------------------------------------------------------------------------------- P10-P12

@row_invariant(1)
def sqrtsoftplus(z: torch.Tensor) -> torch.Tensor:
    """P10: ``sqrt(softplus(z))`` (beta 1, threshold 20), fp32."""
    return torch.sqrt(F.softplus(z))


@row_invariant(2)
def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """P11: ``silu(min(g, limit)) * clamp(u, -limit, limit)`` in fp32 (gate clamped above only)."""
    u = torch.clamp(u, min=-limit, max=limit)
    g = torch.clamp(g, max=limit)
    return F.silu(g) * u


def topk_lower_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest scores along the last dim, sorted by descending score, ties broken by
    the lower index (a stable descending sort). Returns int64 [..., k]."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """P12: greedy argmax when ``temperature == 0``; else ``argmax(softmax(logits/T) / Exp(1) noise)``.

    logits: fp32 [R, V]; generator: a CPU generator. Returns int64 [R]. Ties in argmax go to the lower token id."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits.to(F32) / temperature, dim=-1)
    # noise drawn on the CPU so a seed gives the same tokens on every device
    noise = torch.empty(probs.shape, dtype=F32).exponential_(1.0, generator=generator).to(probs.device)
    return torch.argmax(probs / noise, dim=-1)


INDEX_TILE = 64


def index_scores(qi: torch.Tensor, keys: torch.Tensor, hw: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Spec 5.2(f.6): ``score_t = sum_h w_h * ReLU(qi_h . K_t)`` for one query row.

    The dot products are a bf16 einsum (fp32 accumulate, bf16 result) computed over fixed tiles of 64 keys,
    ReLU and the head weight in bf16, the head sum accumulated in fp32 head by head, rounded to bf16; so a
    key's score does not depend on how many keys are scanned.

    Args:
        qi: bf16 [heads, d]; keys: bf16 [T, d]; hw: bf16 [heads]; valid: bool [T].
    Returns:
        bf16 [T]; invalid keys score -inf.
    """
    T = keys.shape[0]
    if T == 0:
        return torch.zeros(0, dtype=act_dtype(), device=keys.device)
    pad = -T % INDEX_TILE
    kf = torch.cat((keys, keys.new_zeros(pad, keys.shape[1]))).to(F32) if pad else keys.to(F32)
    qf = qi.to(F32)
    dots = torch.cat([qf @ kf[t:t + INDEX_TILE].T for t in range(0, kf.shape[0], INDEX_TILE)], dim=1)
    dots = dots[:, :T].to(act_dtype())
    weighted = (torch.relu(dots).to(F32) * hw.to(F32).unsqueeze(-1)).to(act_dtype()).to(F32)
    acc = weighted[0].clone()
    for h in range(1, weighted.shape[0]):
        acc = acc + weighted[h]
    return acc.to(act_dtype()).masked_fill(~valid, float("-inf"))
