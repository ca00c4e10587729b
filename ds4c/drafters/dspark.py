"""The DSpark drafter of DeepSeek-V4-Flash-0731 driving the speculative loop on the reference engine
(:mod:`ds4c.speculative`; spec ds4-flash.md section 7, taps 5.2(q)).

:class:`DSparkDrafter` implements the loop's ``Drafter`` protocol. On ``prepare`` it attaches to the target stepper (a
:class:`~ds4c.reference.Reference`), makes it record the taps of the drafter's target layers (``set_taps``) and resets
its rings; the loop's prefill then records the prompt's taps. Each ``propose(context, k)``:

1. writes one ring row per target position committed since the last call (at the first call the prompt's, the
   drafter's prefill of 7.4; afterwards the positions the last verify step accepted, however many, not only the
   newest as the official code does), reading the target's ``main_hidden`` of those positions;
2. drafts one block from the anchor ``context[-1]`` and returns its first ``k`` tokens (``k <= block_size``).

Greedy requests draft the Markov chain's argmax and return ``q = None`` (a deterministic drafter: the exact rule's
``q`` is one-hot on each draft). Sampling requests (the loop calls :meth:`DSparkDrafter.configure_sampling`) sample
each draft from the drafter's own distribution at the request's temperature / top-k / top-p, the chain conditioned
on the sampled tokens, and return those distributions as ``q``: the exact acceptance rule needs the drafts drawn
from ``q``, so returning softmax ``q`` with argmax drafts would bias the output.

After each proposal, :attr:`DSparkDrafter.confidence` holds the sigmoid of the confidence logits per block depth
(7.3.4): a greedy ``--spec-width auto`` request picks how many drafts to verify from it
(:mod:`ds4c.width_policy`). ``confidence[i]`` is computed from ``emb_i`` of the token before draft ``i``, so it
depends on the drafts before ``i`` only.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.drafters.dspark_file import DSparkFile, open_dspark
from ds4c.drafters.dspark_model import Draft, DSparkModel
from ds4c.errors import StepError


class DSparkDrafter:
    """A DSpark drafter file driving speculative decoding on the reference (module docstring).

    Args:
        path: the drafter GGUF (arch ``dflash``; :mod:`ds4c.drafters.dspark_file`).
        seed: seeds the drafter's sampling when the loop gives no generator.
        target: the target's config, to check the file against at once (else at :meth:`prepare`).
        cache_experts: the stages' routed experts kept dequantized (default as the reference).

    Raises:
        ModelFileError: an unreadable or invalid drafter file, or one that does not fit ``target`` (one line).

    Attributes:
        name: ``dspark:<file name>`` (the loop's stats). file: the :class:`DSparkFile`. model: the
            :class:`DSparkModel` (built at the first :meth:`prepare`). confidence: per-depth sigmoid of the last
            proposal's confidence logits (``block_size`` floats; None before one or without ``conf_proj``).
            last_draft: the last :class:`~ds4c.drafters.dspark_model.Draft`. last_written: the positions whose ring
            rows the last :meth:`propose` wrote.
    """

    def __init__(self, path: str | os.PathLike[str], seed: int = 0, target: Ds4Config | None = None,
                 cache_experts: int | None = None):
        self.file: DSparkFile = open_dspark(path, target)
        self.name = f"dspark:{Path(path).name}"
        self.seed, self._cache = int(seed), cache_experts
        self.model: DSparkModel | None = None
        self._weights: Any = None
        self._stepper: Any = None
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator: torch.Generator | None = None
        self.confidence: list[float] | None = None
        self.last_draft: Draft | None = None
        self.last_written: list[int] = []

    @property
    def block_size(self) -> int:
        """Draft rows per block: the most tokens one :meth:`propose` drafts."""
        return self.file.block_size

    def configure_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           generator: torch.Generator | None = None) -> None:
        """The request's sampling (the loop calls this before the first proposal): ``temperature == 0`` drafts the
        argmax chain; else drafts are sampled (with ``generator``, default one seeded by ``seed``) and ``q``
        returned."""
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        if generator is not None:
            self.generator = generator

    def prepare(self, stepper: Any, prompt: list[int], max_new_tokens: int) -> None:
        """Attach to ``stepper`` for a request, before its prefill: check the file fits the target, build the
        drafter's model on the target's weights (once per weights), make the stepper record the drafter's taps,
        reset the rings and the sampling (greedy until :meth:`configure_sampling`).

        Raises:
            StepError: a stepper that records no taps (the compiled step, a layer split: use the reference engine).
            ModelFileError: the drafter does not fit the target.
        """
        if not getattr(stepper, "records_taps", False) or not callable(getattr(stepper, "main_hidden", None)):
            raise StepError(f"the DSpark drafter needs the target's taps (spec 5.2(q)), which only the unsplit "
                            f"reference engine records (--engine reference, no layer split); found a "
                            f"{type(stepper).__name__}")
        if self.model is None or self._weights is not stepper.w:
            self.model = DSparkModel(self.file, stepper.w, self._cache)
            self._weights = stepper.w
        if tuple(stepper.taps) != self.file.taps:
            stepper.set_taps(self.file.taps)
        self.model.reset()
        self._stepper = stepper
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator = torch.Generator().manual_seed(self.seed)
        self.confidence, self.last_draft, self.last_written = None, None, []

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafts after ``context`` (prompt + tokens so far; ``context[-1]`` is the anchor, not yet run by the
        target, whose sequence must be at position ``len(context) - 1``), and their distributions: fp32 ``[k, V]``
        (CPU) when sampling, None when greedy.

        Raises:
            StepError: before :meth:`prepare`; ``k`` outside 0..block_size; the target not at ``len(context) - 1`` or
                behind the rings (a context that went back).
        """
        st, m = self._stepper, self.model
        if st is None or m is None:
            raise StepError("DSparkDrafter.propose before prepare(stepper, prompt, max_new_tokens)")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.block_size:
            raise StepError(f"the DSpark drafter drafts 0..{self.block_size} tokens per step (block_size), asked for "
                            f"{k!r}: use a speculative width of at most {self.block_size + 1}")
        n = len(context) - 1  # committed positions 0 .. n-1; context[-1] sits at n
        if st.state.pos != n:
            raise StepError(f"DSpark drafter: the target is at position {st.state.pos}, the context asks for {n} "
                            f"(the anchor context[-1] is the next token the target runs)")
        start = m.ring_pos
        if n < start:
            raise StepError(f"DSpark drafter: the context ({n} committed positions) is behind the rings ({start}); "
                            f"prepare() starts a new request")
        self.last_written = list(range(max(start, n - m.window), n))
        if n > start:
            m.extend(start, st.main_hidden(start, n))
        d = m.draft(int(context[-1]), self.temperature, self.top_k, self.top_p, self.generator)
        self.last_draft = d
        self.confidence = None if d.confidence is None else torch.sigmoid(d.confidence).tolist()
        return d.tokens[:k], None if d.q is None else d.q[:k]
