"""Sub-blocks of the step shared by the reference and the IR interpreter's op implementations, so both
compute each sub-block with the same torch operations (docs/model.md sections 5.2-5.3).

Each function handles one row (one position); callers loop rows in position order.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ds4c.reference import primitives as P

BF16, F32 = torch.bfloat16, torch.float32

Write = Callable[[torch.Tensor, Any, torch.Tensor], None]


def plain_write(buf: torch.Tensor, index: Any, value: torch.Tensor) -> None:
    """``buf[index] = value`` (the non-journaled :data:`Write`)."""
    buf[index] = value


def compress_token(kv: torch.Tensor, score: torch.Tensor, v: torch.Tensor, g: torch.Tensor, p: int, r: int,
                   d: int, write: Write) -> torch.Tensor | None:
    """Compressor state update for the token at position ``p`` (spec 5.3).

    Args:
        kv, score: fp32 compressor state [8, 2d] (r = 4, overlap) or [r, d]; updated through ``write``.
        v: fp32 [c*d] kv projection; g: fp32 [c*d] gate projection plus ``ape[p % r]``.
    Returns:
        the pooled fp32 vector [d] when the token finishes a block (``(p+1) % r == 0``), else None.
    """
    slot = 4 + p % 4 if r == 4 else p % r
    write(kv, slot, v)
    write(score, slot, g)
    if (p + 1) % r:
        return None
    if r == 4:  # overlap: previous block's first half + current block's second half, then shift
        kvs = torch.cat((kv[:4, :d], kv[4:, d:]))
        sc = torch.cat((score[:4, :d], score[4:, d:]))
        write(kv, slice(0, 4), kv[4:].clone())
        write(score, slice(0, 4), score[4:].clone())
    else:
        kvs, sc = kv, score
    return (kvs * sc.softmax(dim=0)).sum(dim=0)


def finish_compressed_row(cvec: torch.Tensor, norm: torch.Tensor, p: int, r: int, freqs: torch.Tensor,
                          eps: float, indexer: bool, emulate: bool, nope: int) -> torch.Tensor:
    """Post-processing of a flushed vector (spec 5.3): RMSNorm (bf16), RoPE at the block's first position
    ``p + 1 - r``; then Hadamard + FP4 fake-quant (indexer) or FP8 fake-quant of the first ``nope`` dims.
    Returns bf16 [d]."""
    c = P.rms_norm(cvec.to(P.act_dtype()), norm, eps)
    c = P.apply_rope(c.unsqueeze(0), torch.tensor([p + 1 - r], device=c.device), freqs)[0]
    if indexer:
        c = P.hadamard(c)
        return P.fp4_fake_quant(c, 32) if emulate else c
    return kv_fake_quant(c, nope, emulate)


def kv_fake_quant(kv: torch.Tensor, nope: int, emulate: bool) -> torch.Tensor:
    """P3 on the first ``nope`` dims of KV rows (blocks of 64); the rope dims stay plain bf16."""
    if not emulate:
        return kv
    return torch.cat((P.fp8_fake_quant(kv[..., :nope], 64), kv[..., nope:]), dim=-1)


def window_rows(ring: torch.Tensor, kv_new: torch.Tensor, p: int, p0: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e) The window list of position ``p`` in position order, padded with masked entries to ``window``:
    positions before ``p0`` (the step's first row) come from the ring, the step's own from ``kv_new``.
    Returns KV rows bf16 [window, hd] and validity bool [window]."""
    first = max(0, p - window + 1)
    rows = [ring[t % window] if t < p0 else kv_new[t - p0] for t in range(first, p + 1)]
    n = len(rows)
    lst = ring.new_zeros(window, ring.shape[1])
    lst[:n] = torch.stack(rows)
    ok = torch.zeros(window, dtype=torch.bool, device=ring.device)
    ok[:n] = True
    return lst, ok


def attention_row(q: torch.Tensor, ring: torch.Tensor, kv_new: torch.Tensor, p: int, p0: int, window: int,
                  comp: torch.Tensor | None, comp_ok: torch.Tensor | None, sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """(i) Attention of one row over its window list followed by its compressed list (rows ``comp`` with
    validity ``comp_ok``, in list order). Returns bf16 [H, hd]."""
    kv, ok = window_rows(ring, kv_new, p, p0, window)
    if comp is not None and comp.shape[0]:
        kv, ok = torch.cat((kv, comp)), torch.cat((ok, comp_ok))
    return P.sparse_attention(q, kv, ok, sink, scale)


def indexer_select(keys: torch.Tensor, valid: torch.Tensor, qi: torch.Tensor, hw: torch.Tensor,
                   topk: int) -> torch.Tensor:
    """(f.6-7) Scores of the valid keys and the ids of the top ``min(topk, #valid)`` (descending score, ties
    to the lower id), followed by -1 up to ``min(topk, len(keys))`` entries. Returns int64."""
    score = P.index_scores(qi, keys, hw, valid)
    k = min(topk, keys.shape[0])
    sel = P.topk_lower_index(score, k)
    n_valid = min(topk, int(valid.sum()))
    sel[n_valid:] = -1
    return sel


def expert_ffn(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
               weight: torch.Tensor | None, limit: float, emulate: bool) -> torch.Tensor:
    """One clamped-SwiGLU expert (P11) on bf16 [1, D]: the routing weight scales the fp32 intermediate
    before the bf16 cast and ``w2``. Returns bf16 [1, D]."""
    g = P.linear_q(x, w1, emulate).to(F32)
    u = P.linear_q(x, w3, emulate).to(F32)
    h = P.clamped_swiglu(g, u, limit)
    if weight is not None:
        h = weight * h
    return P.linear_q(h.to(P.act_dtype()), w2, emulate)


def routed_sum(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
               expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], limit: float,
               emulate: bool) -> torch.Tensor:
    """(o.5) fp32 sum of the routed experts of one row in ascending expert id. x bf16 [1, D]; ids int64
    [k]; wts fp32 [k]; ``expert(e)`` gives (w1, w3, w2). Returns fp32 [1, D]."""
    acc = torch.zeros(1, x.shape[-1], dtype=F32, device=x.device)
    for k in torch.argsort(ids).tolist():
        w1, w3, w2 = expert(int(ids[k]))
        acc += expert_ffn(x, w1, w3, w2, wts[k], limit, emulate).to(F32)
    return acc


def route(s: torch.Tensor, bias: torch.Tensor | None, hash_ids: torch.Tensor | None, k: int,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(o.3-4) Expert ids (hash lookup, or top-k of ``s + bias`` with ties to the lower id) and weights
    ``s[ids] / sum * scale``. s fp32 [R, E]. Returns (int64 [R, k], fp32 [R, k])."""
    ids = hash_ids if hash_ids is not None else P.topk_lower_index(s + bias, k)
    wts = s.gather(-1, ids)
    return ids, wts / wts.sum(-1, keepdim=True) * scale
