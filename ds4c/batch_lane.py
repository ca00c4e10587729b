"""What a batch step hands back for each sequence it ran (shared by :mod:`ds4c.batching` and the two ways a step
runs: :mod:`ds4c.batch_paged` on the reference, :mod:`ds4c.batch_slots` on the compiled step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds4c.errors import StepError


@dataclass
class LaneOut:
    """One request's part of a step.

    Attributes:
        req: the :class:`~ds4c.batching.BatchRequest`.
        rows: rows it ran.
        prompt_done: prompt positions ingested so far when this step fed prompt rows (None: a decode row).
        logits: fp32 ``[1, vocab]`` on the CPU, the last row's, when the host samples the next token (the end of
            the prompt; every step on the reference); None when the device sampled it (``token``).
        token: the token the device sampled (None: sample ``logits`` on the host).
        error: this request failed (non-finite logits...): it ends with this error, the others go on.
        tokens: the tokens a speculative lane's verify rows settled (its accepted drafts and the target's next
            token), in order; None otherwise.
    """

    req: Any
    rows: int
    prompt_done: int | None = None
    logits: torch.Tensor | None = None
    token: int | None = None
    error: StepError | None = None
    tokens: list[int] | None = None


def nonfinite(logits: torch.Tensor, start: int, stop: int) -> StepError | None:
    """The error of a request whose logits at positions ``start..stop-1`` hold NaN/inf, else None."""
    if bool(torch.isfinite(logits).all()):
        return None
    return StepError(f"non-finite logits at positions {start}..{stop - 1}: the weights or the config hold NaN/inf "
                     f"values")
