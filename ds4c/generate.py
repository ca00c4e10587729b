"""Token generation on the reference: prefill as verify steps of the widest width, then q = 1 decodes.

Spec ds4-flash.md sections 5-6 and P12 (sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.reference import MAX_WIDTH, Reference
from ds4c.reference.primitives import sample


@dataclass
class GenerationResult:
    """Output of :func:`generate`: the prompt, the new tokens, and wall-clock timings in seconds."""

    prompt: list[int]
    tokens: list[int]
    prefill_s: float
    decode_s: float
    step_s: list[float] = field(default_factory=list)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """New tokens after the first, per second of decode (the first comes from the prefill); None when
        fewer than two tokens were generated."""
        n = len(self.tokens) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    def as_dict(self) -> dict:
        return {"prompt": self.prompt, "tokens": self.tokens, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "step_ms": [round(s * 1e3, 3) for s in self.step_s]}


def generate(ref: Reference | Any, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, width: int = MAX_WIDTH) -> GenerationResult:
    """Generate ``max_new_tokens`` tokens after ``prompt`` on a fresh sequence.

    ``ref`` is a :class:`~ds4c.reference.Reference` or any stepper with ``reset()``, ``verify(tokens, pos)``,
    ``decode(token, pos)`` and ``max_ctx`` (the compiled step's :class:`~ds4c.runtime.executor.CompiledStep`).
    The prompt runs as verify steps of ``width`` rows (the last may be narrower); the last row's logits
    give the first new token; each further token is one decode step. Sampling: greedy when
    ``temperature == 0``, else P12 with a CPU generator seeded by ``seed``.

    Raises:
        StepError: empty prompt, negative ``max_new_tokens``, or prompt + new tokens past ``ref.max_ctx``.
    """
    if not prompt:
        raise StepError("the prompt must hold at least one token id")
    if not (temperature >= 0 and temperature != float("inf")):
        raise StepError(f"temperature must be a finite number >= 0, found {temperature}")
    if max_new_tokens < 0:
        raise StepError(f"max_new_tokens must be >= 0, found {max_new_tokens}")
    if len(prompt) + max_new_tokens > ref.max_ctx:
        raise StepError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds max_ctx={ref.max_ctx}")
    gen = torch.Generator().manual_seed(seed)
    ref.reset()
    t0 = time.perf_counter()
    logits = None
    for s in range(0, len(prompt), width):
        logits = ref.verify(prompt[s:s + width], s)
    out: list[int] = []
    steps: list[float] = []
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if max_new_tokens:
        out.append(int(sample(logits[-1:].float().cpu(), temperature, gen)[0]))
    while len(out) < max_new_tokens:
        ts = time.perf_counter()
        logits = ref.decode(out[-1], len(prompt) + len(out) - 1).float().cpu()
        out.append(int(sample(logits, temperature, gen)[0]))
        steps.append(time.perf_counter() - ts)
    return GenerationResult(list(prompt), out, prefill_s, time.perf_counter() - t1, steps)
