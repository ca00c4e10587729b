"""The MTP (nextn) drafter of DeepSeek-V4-Flash driving the speculative loop (:mod:`ds4c.speculative`; docs/model.md
7.5, the math in :mod:`ds4c.drafters.mtp_model`), on the reference engine and on the compiled step.

:class:`MTPDrafter` implements the loop's ``Drafter`` protocol. On ``prepare`` it attaches to the target stepper, makes
sure it records its final HC state per step row (``record_final_hc``: the 4 streams before ``hc_head``, ``X_main``)
and resets its ring. Each ``propose(context, k)`` with ``n = len(context) - 1`` (the target has committed positions
``0 .. n - 1``; ``context[-1]``, the anchor, sits at ``n``):

1. commits the MTP rows of every position ``t`` in ``ring_pos .. n``: the pair ``(context[t], X_main(t - 1))`` is
   final for all of them (the anchor is the target's own token), so their KV rows go to the MTP ring as sequential
   processing of the accepted tokens would put them (at the first call the prompt's, the drafter's prefill;
   afterwards the positions the last verify step accepted, however many, and the anchor);
2. drafts by chaining the block: row 0 is the anchor's (committed in step 1, its output gives draft 1); row j at
   ``n + j`` pairs draft j with row j - 1's output HC state and gives draft j + 1.

**Rollback rule.** The speculative rows (``n + 1 ..``, built from drafted tokens and the block's own states, not the
target's) are never written to the drafter's state: they live in a side buffer dropped when ``propose`` returns. The
state is the ring and ``ring_pos``, holding committed positions only, so a rejected draft leaves it exactly as if the
drafter had never drafted, and the next ``propose`` commits the accepted positions from the target's own final HC
states. Nothing needs undoing after a verify.

Greedy requests draft the argmax chain (ties to the lower id) and return ``q = None``. Sampling requests (the loop
calls :meth:`MTPDrafter.configure_sampling`) sample each draft from the block's distribution at the request's
temperature / top-k / top-p, the chain continuing from the sampled token, and return those distributions as ``q``
(the exact acceptance rule needs drafts drawn from ``q``).

Engines: the block always runs on the reference's arithmetic (torch) on the target's device; only ``X_main`` comes
from the target stepper (a :class:`~ds4c.engine_protocol.FinalHCReader`). The unsplit
:class:`~ds4c.reference.Reference` records it on request (``record_final_hc(True)``). The compiled step
(:class:`~ds4c.runtime.step.CompiledStep`, and the last shard of a :class:`~ds4c.runtime.sharded.ShardedStep`)
records it when built with ``record_hc=True`` (its graphs copy the last layer's streams into a ring, the tap
family's copy mode): the drafter declares it in :attr:`MTPDrafter.needs`, which :func:`ds4c.engine.open_engine`
resolves when the model opens. On the compiled step the block reads the target's embedding and head from the model file (:class:`FileTarget`:
bf16 / fp32 copies on the target's device, made only when the block has none of its own). ``prepare`` refuses, in
one line naming how to enable it, a stepper that records no final HC state (a compiled step built without
``record_hc``, a reference layer split, ``CompiledReference``).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.drafters.mtp_file import MTPSource, mtp_of_target, open_mtp
from ds4c.drafters.mtp_model import MTPModel
from ds4c.engine_protocol import BuiltRecording, Engine, EngineNeeds, FinalHCReader
from ds4c.errors import StepError
from ds4c.sampling import filter_logits


class FileTarget:
    """The part of the target's weights the MTP block reads, for a stepper that holds no
    :class:`~ds4c.reference.ReferenceWeights` (the compiled step): what :class:`~ds4c.drafters.mtp_model.MTPModel`
    reads of its ``target`` argument.

    Args:
        mf: the target's model file (its ``config``: the compiled step's, quantization emulation included).
        device: the target's device (where the final HC states are).

    Attributes: ``config``, ``device``, ``dataflow`` (``"bf16"``: the compiled step's), ``layer_range`` (the whole
    model), ``is_whole`` (True); ``embed`` (bf16 ``[vocab, hidden]``) and ``head`` (fp32 ``[vocab, hidden]``, the
    forms ``ReferenceWeights.load`` gives them) read from the file on first use, once.
    """

    dataflow = "bf16"
    is_whole = True

    def __init__(self, mf: Any, device: torch.device | str):
        self.mf, self.config, self.device = mf, mf.config, torch.device(device)
        self.layer_range = (0, self.config.n_layers)
        self._embed: torch.Tensor | None = None
        self._head: torch.Tensor | None = None

    @property
    def embed(self) -> torch.Tensor:
        if self._embed is None:
            self._embed = self.mf.tensor("token_embd.weight", torch.bfloat16, device=self.device)
        return self._embed

    @property
    def head(self) -> torch.Tensor:
        if self._head is None:
            self._head = self.mf.tensor("output.weight", torch.float32, device=self.device)
        return self._head


_FILE_TARGETS: "weakref.WeakKeyDictionary[Any, FileTarget]" = weakref.WeakKeyDictionary()
"""Per compiled stepper, the :class:`FileTarget` its MTP drafters read (one per stepper: the embedding and head
copies are large)."""


def _target_weights(stepper: FinalHCReader) -> Any:
    """The target's weights the block reads: the reference's ``w`` (an engine that records on request), else a
    :class:`FileTarget` of the compiled step's model file ``mf`` on the device of its final HC ring (one per
    stepper)."""
    if not isinstance(stepper, BuiltRecording):
        return stepper.w
    ft = _FILE_TARGETS.get(stepper)
    if ft is None:
        ft = _FILE_TARGETS[stepper] = FileTarget(stepper.mf, stepper.final_hc_rows.device)
    return ft


class MTPDrafter:
    """An MTP block driving speculative decoding on the reference or the compiled step (module docstring).

    Args:
        source: an :class:`MTPSource`, or the path of a file holding an MTP block (``--draft mtp:PATH``; checked
            against ``target`` / ``target_file`` when given, else at :meth:`prepare`).
        seed: seeds the drafter's sampling when the loop gives no generator.
        target, target_file: the target's config and model file (the file's embedding / head rows are compared
            with the source's).
        max_drafts: the most drafts one :meth:`propose` gives (the loop asks for at most ``MAX_WIDTH - 1``).
        cache_experts: the block's routed experts kept dequantized (default as the reference).

    Raises:
        ModelFileError: an unreadable file, one without an MTP block, or one that does not fit the target (one line).

    Attributes:
        name: ``mtp`` (the target's own block) or ``mtp:<file name>``. source: the :class:`MTPSource`. model: the
            :class:`MTPModel` (built at the first :meth:`prepare`). last_logits: fp32 [k, V] of the last proposal.
            last_committed: the positions whose ring rows the last :meth:`propose` committed.
    """

    def __init__(self, source: MTPSource | str | os.PathLike[str], seed: int = 0, target: Ds4Config | None = None,
                 target_file: Any = None, max_drafts: int = 4, cache_experts: int | None = None):
        self.source = source if isinstance(source, MTPSource) else open_mtp(source, target, target_file)
        self.name = self.source.label
        self.seed, self._cache, self.max_drafts = int(seed), cache_experts, int(max_drafts)
        self.model: MTPModel | None = None
        self._weights: Any = None
        self._stepper: Any = None
        self.needs = EngineNeeds(final_hc=True)
        """What it needs of the target engine: the final HC state (spec 7.5's ``X_main``), recorded by the compiled
        step's graphs when it is built with ``record_hc`` (:func:`ds4c.engine.open_engine` resolves this)."""
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator: torch.Generator | None = None
        self.last_logits: torch.Tensor | None = None
        self.last_committed: list[int] = []

    @classmethod
    def of_target(cls, target_file: Any, seed: int = 0, **kw: Any) -> "MTPDrafter":
        """The drafter of the target file's own nextn block (``--draft mtp``). Raises ModelFileError (one line)
        when the target has none."""
        return cls(mtp_of_target(target_file), seed=seed, **kw)

    def configure_sampling(self, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           generator: torch.Generator | None = None) -> None:
        """The request's sampling (the loop calls this before the first proposal): ``temperature == 0`` drafts the
        argmax chain; else drafts are sampled (with ``generator``, default one seeded by ``seed``) and ``q``
        returned."""
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        if generator is not None:
            self.generator = generator

    def prepare(self, stepper: Engine, prompt: list[int], max_new_tokens: int) -> None:
        """Attach to ``stepper`` for a request, before its prefill: build the block on the target's weights (once
        per weights; checks the block fits the target), make the stepper record its final HC state, reset the ring
        and the sampling (greedy until :meth:`configure_sampling`).

        Raises:
            StepError: a stepper that records no final HC state (a compiled step built without ``record_hc``, a
                reference layer split, ``CompiledReference``), naming how to get one that does.
            ModelFileError: the block does not fit the target.
        """
        if not (isinstance(stepper, FinalHCReader) and stepper.records_final_hc):
            compiled = isinstance(stepper, BuiltRecording)
            how = ("open the compiled step with record_hc=True (ds4c generate --draft mtp does; open_engine / Model "
                   "record_hc=True or draft=...; ds4c compile --draft mtp for an artifact)") if compiled else \
                "run the unsplit reference engine (--engine reference, no layer split) or the compiled engine"
            raise StepError(f"the MTP drafter needs the target's final HC state (spec 7.5's X_main), which this "
                            f"{type(stepper).__name__} does not record: {how}")
        w = _target_weights(stepper)
        if self.model is None or self._weights is not w:
            self.model = MTPModel(self.source, w, self._cache)
            self._weights = w
        if stepper.final_hc_rows is None:
            stepper.record_final_hc(True)
        self.model.reset()
        self._stepper = stepper
        self.temperature, self.top_k, self.top_p = 0.0, 0, 1.0
        self.generator = torch.Generator().manual_seed(self.seed)
        self.last_logits, self.last_committed = None, []

    def _x_main(self, start: int, stop: int) -> torch.Tensor:
        """``X_main(t - 1)`` for t in ``start .. stop - 1`` (zeros for t = 0): act dtype [stop - start, hc, D]."""
        h = self._stepper.final_hc(max(0, start - 1), stop - 1)
        if start == 0:
            h = torch.cat((h.new_zeros(1, *h.shape[1:]), h))
        return h.to(self.model.device)

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` drafts after ``context`` (prompt + tokens so far; the target's sequence must be at position
        ``len(context) - 1``), and their distributions: fp32 ``[k, V]`` (CPU) when sampling, None when greedy.
        Commits the positions up to the anchor first (module docstring).

        Raises:
            StepError: before :meth:`prepare`; ``k`` outside 0..max_drafts; the target not at ``len(context) - 1`` or
                behind the ring (a context that went back).
        """
        st, m = self._stepper, self.model
        if st is None or m is None:
            raise StepError("MTPDrafter.propose before prepare(stepper, prompt, max_new_tokens)")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.max_drafts:
            raise StepError(f"the MTP drafter drafts 0..{self.max_drafts} tokens per step, asked for {k!r}")
        n = len(context) - 1
        at = st.pos
        if at != n:
            raise StepError(f"MTP drafter: the target is at position {at}, the context asks for {n} (the "
                            f"anchor context[-1] is the next token the target runs)")
        if n + 1 < m.ring_pos:
            raise StepError(f"MTP drafter: the context ({n + 1} positions with the anchor) is behind the ring "
                            f"({m.ring_pos}); prepare() starts a new request")
        lo = max(m.ring_pos, n + 1 - m.window)  # older rows would be overwritten: not computed
        self.last_committed = list(range(lo, n + 1))
        if n + 1 > lo:
            toks = torch.tensor([int(t) for t in context[lo:]], dtype=torch.int64, device=m.device)
            m.commit(lo, toks, self._x_main(lo, n + 1))
        if k == 0:
            self.last_logits = None
            return [], None
        qs: list[torch.Tensor] = []

        def pick(lg: torch.Tensor) -> int:
            if self.temperature == 0:
                return int(torch.argmax(lg))
            lf = filter_logits(lg.float().cpu().unsqueeze(0), self.temperature, self.top_k, self.top_p)
            qi = torch.softmax(lf / self.temperature, dim=-1)[0]
            qs.append(qi)
            return int(torch.multinomial(qi, 1, generator=self.generator))

        drafts, logits = m.chain(int(context[n]), self._x_main(n, n + 1)[0], k, pick)
        self.last_logits = logits
        return drafts, torch.stack(qs) if qs else None
