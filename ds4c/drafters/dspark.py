"""The DSpark drafter of DeepSeek-V4-Flash-0731 driving the speculative loop on the reference engine
(:mod:`ds4c.speculative`; docs/model.md section 7, taps 5.2(q)).

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

On a compiled target (a :class:`~ds4c.runtime.step.CompiledStep`: an engine with the
:class:`~ds4c.engine_protocol.GraphHost` capability) the same drafter runs compiled
(:class:`~ds4c.runtime.dspark_exec.CompiledDSpark`, docs/drafter.md): the choice is made here, at
:meth:`DSparkDrafter.prepare`, from the stepper the loop gives, so ``make_drafter`` and the engine need no second
drafter kind. The compiled step records the taps when built with them: the drafter declares them in :attr:`needs`,
which :func:`ds4c.engine.open_engine` resolves when the model opens.

"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.drafters.dspark_file import DSparkFile
from ds4c.drafters.dspark_sources import open_dspark
from ds4c.drafters.dspark_model import Draft, DSparkModel
from ds4c.engine_protocol import EngineNeeds, GraphHost, TapsOnRequest
from ds4c.errors import StepError


class DSparkDrafter:
    """A DSpark drafter file driving speculative decoding on the reference (module docstring).

    Args:
        path: the drafter GGUF (arch ``dflash``; :mod:`ds4c.drafters.dspark_file`), or
            ``synthetic:PRESET[:FORMATS[:SEED]]``, the synthetic drafter with no file
            (:mod:`ds4c.drafters.dspark_source`).
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
        self.name = f"dspark:{getattr(self.file, 'identity', None) or Path(path).name}"
        self.seed, self._cache = int(seed), cache_experts
        self.model: DSparkModel | None = None
        self._weights: Any = None
        self._stepper: Any = None
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator: torch.Generator | None = None
        self.confidence: list[float] | None = None
        self.last_draft: Draft | None = None
        self.last_written: list[int] = []
        self.compiled: Any = None
        """The :class:`~ds4c.runtime.dspark_exec.CompiledDSpark` when the stepper is a compiled step."""
        self._device_sampling = False

    @property
    def needs(self) -> EngineNeeds:
        """What it needs of the target engine: the taps of the file's target layers (spec 5.2(q)), recorded by the
        compiled step's graphs when it is built with them (:func:`ds4c.engine.open_engine` resolves this)."""
        return EngineNeeds(taps=tuple(self.file.taps))

    @property
    def block_size(self) -> int:
        """Draft rows per block: the most tokens one :meth:`propose` drafts."""
        return self.file.block_size

    def configure_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           generator: torch.Generator | None = None) -> None:
        """The request's sampling (the loop calls this before the first proposal): ``temperature == 0`` drafts the
        argmax chain; else drafts are sampled (with ``generator``, default one seeded by ``seed``; on the compiled
        drafter on the device, the noise seeded by one draw from ``generator``) and ``q`` returned."""
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        if generator is not None:
            self.generator = generator
        self._device_sampling = False
        if self.compiled is not None and self.temperature > 0:
            self._configure_device()

    def _configure_device(self) -> None:
        """The compiled drafter's device sampler for this request: its noise seeded from the request's generator."""
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=self.generator))
        self.compiled.configure_sampling(self.temperature, self.top_k, self.top_p, seed)
        self._device_sampling = True

    def prepare(self, stepper: Any, prompt: list[int], max_new_tokens: int) -> None:
        """Attach to ``stepper`` for a request, before its prefill: check the file fits the target, build the
        drafter's model on the target's weights (once per weights), make the stepper record the drafter's taps,
        reset the rings and the sampling (greedy until :meth:`configure_sampling`).

        Raises:
            StepError: a stepper that records no taps (a layer split; a compiled step without the drafter's taps:
                its ``taps`` / ``tap_ring``, see :meth:`_prepare_compiled`).
            ModelFileError: the drafter does not fit the target.
        """
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator = torch.Generator().manual_seed(self.seed)
        self.confidence, self.last_draft, self.last_written = None, None, []
        self._device_sampling = False
        if isinstance(stepper, GraphHost):  # the compiled step: the compiled drafter
            self._prepare_compiled(stepper)
            return
        self.compiled = None
        if not (isinstance(stepper, TapsOnRequest) and stepper.records_taps):
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

    def _prepare_compiled(self, stepper: GraphHost) -> None:
        """:meth:`prepare` on a :class:`~ds4c.runtime.step.CompiledStep`: the compiled drafter
        (:class:`~ds4c.runtime.dspark_exec.CompiledDSpark`, built and captured once per step), its rings reset. The
        step must record the drafter's taps in its device ``tap_ring`` (bf16 [window, len(taps) * D], row
        ``t % window`` = ``main_hidden(t)``), with ``taps`` equal to the file's."""
        # the compiled drafter's module (kernel cache, launches) is imported only when a compiled target runs it:
        # start-up speed of the reference engine and the CLI
        from ds4c.runtime.dspark_exec import CompiledDSpark

        taps = tuple(stepper.taps or ())
        if taps != self.file.taps:  # (a drafter file has taps: with them, an unsplit step has its tap ring)
            raise StepError(f"the compiled DSpark drafter reads the target's taps of layers {list(self.file.taps)} "
                            f"(spec 5.2(q)) from the compiled step's tap_ring; found a {type(stepper).__name__} "
                            f"recording taps {list(taps)} (build the step with taps={tuple(self.file.taps)}: "
                            f"Model(draft=...) / open_engine(draft=...) does, or use --engine reference)")
        if self.compiled is None or self.compiled.step is not stepper:
            self.compiled = CompiledDSpark(self.file, stepper)
            self.compiled.prepare(progress=False)
        self.compiled.reset()
        self._stepper = stepper

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafts after ``context`` (prompt + tokens so far; ``context[-1]`` is the anchor, not yet run by the
        target, whose sequence must be at position ``len(context) - 1``), and their distributions: fp32 ``[k, V]``
        (CPU) when sampling, None when greedy.

        Raises:
            StepError: before :meth:`prepare`; ``k`` outside 0..block_size; the target not at ``len(context) - 1`` or
                behind the rings (a context that went back).
        """
        st, m = self._stepper, (self.compiled or self.model)
        if st is None or m is None:
            raise StepError("DSparkDrafter.propose before prepare(stepper, prompt, max_new_tokens)")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.block_size:
            raise StepError(f"the DSpark drafter drafts 0..{self.block_size} tokens per step (block_size), asked for "
                            f"{k!r}: use a speculative width of at most {self.block_size + 1}")
        n = len(context) - 1  # committed positions 0 .. n-1; context[-1] sits at n
        at = st.pos
        if at != n:
            raise StepError(f"DSpark drafter: the target is at position {at}, the context asks for {n} "
                            f"(the anchor context[-1] is the next token the target runs)")
        if self.compiled is not None:
            return self._propose_compiled(context, k)
        start = self._to_commit(n, m.ring_pos, m.window)
        if n > start:
            m.extend(start, st.main_hidden(start, n))
        d = m.draft(int(context[-1]), self.temperature, self.top_k, self.top_p, self.generator)
        self.last_draft = d
        self.confidence = None if d.confidence is None else torch.sigmoid(d.confidence).tolist()
        return d.tokens[:k], None if d.q is None else d.q[:k]

    def _to_commit(self, n: int, start: int, window: int) -> int:
        """The rings hold positions ``0 .. start - 1`` and the context ``n`` committed positions: record in
        :attr:`last_written` the ring rows the coming commit writes (the newest ``window`` of ``start .. n - 1``)
        and return ``start``. Raises StepError when the context is behind the rings (a new request without
        :meth:`prepare`)."""
        if n < start:
            raise StepError(f"DSpark drafter: the context ({n} committed positions) is behind the rings ({start}); "
                            f"prepare() starts a new request")
        self.last_written = list(range(max(start, n - window), n))
        return start

    def _propose_compiled(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """:meth:`propose` on the compiled drafter: commit the positions accepted since the last call (from the
        step's tap ring, on the device), then one draft graph replay. Greedy: the graph's Markov argmax chain.
        Sampling: the sampling draft graph (:meth:`CompiledDSpark.draft_sampled`: the chain drawn on the device with
        the request's parameters, its noise seeded from the request's generator at :meth:`configure_sampling`), ``q``
        copied to the CPU for the loop's acceptance rule."""
        cd, st = self.compiled, self._stepper
        assert cd is not None
        n = len(context) - 1
        start = self._to_commit(n, cd.ring_pos, cd.window)
        if n > start:
            cd.commit_taps(start, n, st.tap_ring)
        if self.temperature == 0:
            d = cd.draft(int(context[-1]))
            self.last_draft = Draft(d.tokens, d.logits, None, d.confidence)  # device tensors, valid until the next
        else:
            if not self._device_sampling:
                self._configure_device()
            d = cd.draft_sampled(int(context[-1]))
            assert d.q is not None
            self.last_draft = Draft(d.tokens, d.logits, d.q.float().cpu(), d.confidence)  # the loop's rule: q on CPU
        dr = self.last_draft
        self.confidence = None if dr.confidence is None else torch.sigmoid(dr.confidence).tolist()
        return dr.tokens[:k], None if dr.q is None else dr.q[:k]

