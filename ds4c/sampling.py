"""Sampling rules shared by the generation loop, speculative decoding, the drafters and the compiled step (spec
ds4-flash.md P12): top-k / top-p filtering, the sampling arguments' checks, and the acceptance of a verify step's
rows (greedy, and the exact rule for sampling).

Pure functions of tensors and ids, below everything that samples: :mod:`ds4c.generate`, :mod:`ds4c.speculative`,
the drafters and the runtime import them from here (the runtime's device-side acceptance counts with
:func:`accept_greedy` too), and nothing here imports any of them.
"""

from __future__ import annotations

from typing import Any

import torch

from ds4c.errors import StepError


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of fp32 ``[R, V]`` logits: removed tokens get ``-inf``.

    ``top_k`` keeps the tokens whose logit is at least the k-th largest (ties at the boundary are kept, as
    HuggingFace's ``TopKLogitsWarper``); 0 or >= V keeps all. ``top_p`` keeps the smallest set of most probable
    tokens (probabilities of ``softmax(logits / temperature)``, after top-k) whose mass reaches ``top_p``, at
    least one token; 1.0 keeps all. Greedy (``temperature == 0``) is returned unfiltered: both keep the argmax.
    """
    if temperature == 0:
        return logits
    v = logits.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(logits / temperature, dim=-1)
        sp, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp   # mass of the more probable tokens
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raises StepError unless ``temperature`` is finite >= 0, ``top_k`` an int >= 0, ``top_p`` in (0, 1]."""
    if not (isinstance(temperature, (int, float)) and temperature >= 0 and temperature != float("inf")):
        raise StepError(f"temperature (--temperature) must be a finite number >= 0, found {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise StepError(f"top_k (--top-k) must be an int >= 0 (0 = off), found {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise StepError(f"top_p (--top-p) must be in (0, 1] (1 = off), found {top_p!r}")


def check_seed(seed: Any) -> None:
    """Raises StepError unless ``seed`` is an int in 0..2^63-1."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise StepError(f"seed must be an int in 0..2^63-1, found {seed!r}")


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, temperature: float, top_k: int = 0,
           top_p: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
    """The tokens one verify step adds: the accepted prefix of ``drafts`` then one token of the target's.

    Args:
        logits: fp32 ``[k + 1, V]`` (CPU): row ``i`` is the target's next-token logits after draft ``i - 1``
            (row 0 after the step's first row, the last accepted token).
        drafts: the ``k`` draft ids; q: the drafter's distributions ``[k, V]`` or None (one-hot on the drafts).
        temperature, top_k, top_p: the request's sampling (greedy when ``temperature == 0``).
        generator: CPU generator for the accept/reject draws and the residual / bonus samples.
    Returns:
        1..k+1 token ids.
    """
    k = len(drafts)
    if temperature == 0:
        out = []
        for i, d in enumerate(drafts):
            y = int(torch.argmax(logits[i]))
            if y != d:
                return out + [y]
            out.append(d)
        return out + [int(torch.argmax(logits[k]))]
    p = torch.softmax(filter_logits(logits.float(), temperature, top_k, top_p) / temperature, dim=-1)
    out = []
    for i, d in enumerate(drafts):
        qi = q[i].float() if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[-1]).float()
        ratio = float(p[i, d]) / max(float(qi[d]), 1e-30)
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            out.append(d)
            continue
        resid = torch.clamp(p[i] - qi, min=0)
        if float(resid.sum()) <= 0:
            resid = p[i]
        return out + [int(torch.multinomial(resid / resid.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(p[k], 1, generator=generator))]


def accept_greedy(top: list[int], drafts: list[int]) -> list[int]:
    """Greedy acceptance from each verify row's argmax ``top`` (``k + 1`` ids): the drafts up to the first that
    differs from its row's argmax, then that row's argmax (or, all kept, the last row's)."""
    out = []
    for i, d in enumerate(drafts):
        if top[i] != d:
            return out + [top[i]]
        out.append(d)
    return out + [top[len(drafts)]]
