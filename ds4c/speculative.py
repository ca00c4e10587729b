"""Speculative decoding on any stepper (docs/model.md section 6 for the verify step and its rollback;
docs/drafter.md for the drafters and the request's report).

Each step drafts ``k <= width - 1`` tokens, runs the last accepted token and the drafts as one verify step of
``k + 1`` rows, keeps the longest prefix the target agrees with plus one token of the target's own, and rolls
the rest of the step back (``stepper.rollback``). Works on the reference and on the compiled step; the
acceptance runs on the CPU from the verify step's logits.

Acceptance (:func:`accept`):

* greedy: draft ``i`` is kept while it equals the argmax of row ``i``; the first disagreeing row's argmax (or,
  when every draft was kept, the last row's) is appended. On the reference, whose verify rows equal sequential
  decodes bit for bit, the output equals greedy autoregressive decoding token for token.
* sampling (temperature > 0, with top-k / top-p): the standard exact rule (Leviathan et al., Chen et al.):
  keep draft ``d`` with probability ``min(1, p(d) / q(d))`` where ``p`` is the target's filtered distribution
  of that row and ``q`` the drafter's; on a rejection draw from the residual ``max(0, p - q)`` normalised, and
  stop; after all drafts draw the bonus token from the last row. The output is distributed exactly as
  autoregressive sampling (tests/test_speculative.py checks it). A drafter without probabilities is
  deterministic: ``q`` is one-hot on its draft.

Width (:class:`WidthPolicy`): fixed (2..5 rows per verify step), or ``"auto"``: per step the number of drafts
``k`` that maximises the expected tokens per second, ``E(k) / cost(k + 1)`` with ``E(k) = 1 + sum_{i<=k}
prod_{j<=i} a_j`` from the acceptance per draft depth ``a_j`` observed so far in the request (a Beta(1, 1)
prior: 1/2 before any evidence) and ``cost(w)`` the stepper's verify-step time at width ``w``, measured once
before the request (:func:`measure_width_costs`). This is the acceptance-and-cost policy, for drafters without a
confidence head and for sampling requests. When the drafter reports a confidence per draft depth after its
proposal (``drafter.confidence``: the DSpark head, 7.3.4, or the oracle's emulated head ``oracle:ALPHA:SEP``) a
greedy ``auto`` request drafts the most it may and verifies the first ``k`` drafts, ``k`` maximising the same
objective with each draft's acceptance predicted from its confidence by a per-depth calibration fitted online
against the target's accept/reject outcomes (:mod:`ds4c.width_policy`); the drafts beyond ``k`` are discarded.
The stats report the policy that ran, the widths chosen and, for the confidence policy, the discarded drafts and
the calibration's final parameters per depth.

Greedy acceptance compares draft ids with the argmax of each verify row, taken on the verify step's device
(only ``q`` ids cross to the host); on an engine with the :class:`~ds4c.engine_protocol.DeviceGreedyVerify`
capability (the compiled step) the comparison, the accepted count and the rollback run on the device too, enqueued
behind the verify graph with one wait per step (:meth:`ds4c.runtime.step.CompiledStep.verify_greedy`). With a
host-only drafter (:class:`~ds4c.engine_protocol.HostOnlyDrafter`, the oracle) an engine with the
:class:`~ds4c.engine_protocol.PipelinedVerify` capability (the compiled step) also queues each verify step, graph
launch included, before the previous step's ids are back, and starts it with one store to a host flag once its
drafts are made (:mod:`ds4c.runtime.spec_pipeline`). Sampling brings the rows' logits to the CPU for the exact rule.

Drafters (:func:`ds4c.drafters.factory.make_drafter` makes the one a ``--draft`` value names): ``oracle:ALPHA``
(:class:`ds4c.drafters.oracle.OracleDrafter`) drafts the target's own greedy continuation, computed by an
autoregressive pass before the request, with each draft token replaced by a wrong one with probability
``1 - ALPHA`` (seeded): a benchmark of the loop at a chosen acceptance rate, since synthetic weights make any
trained-style drafter's acceptance near zero. ``dspark:PATH`` (or a ``PATH.gguf``) is the DeepSeek-V4-Flash-0731
DSpark drafter of that file (:class:`ds4c.drafters.dspark.DSparkDrafter`; spec section 7). ``mtp`` / ``mtp:PATH``
is the MTP (nextn) block of the target file or of a separate file (:class:`ds4c.drafters.mtp.MTPDrafter`; spec 7.5).
A drafter is a :class:`~ds4c.engine_protocol.Drafter`; a :class:`~ds4c.engine_protocol.SamplingDrafter` is told the
request's sampling before its first proposal (the DSpark drafter then samples its drafts from the ``q`` it returns,
as the exact rule needs).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.engine_protocol import (ConfidenceHead, DeviceGreedyVerify, Drafter, Engine, HostOnlyDrafter,
                                  PipelinedVerify, ReportsConfidence, SamplingDrafter, VerifyPipeline, drafter_name)
from ds4c.errors import StepError
from ds4c.sampling import accept, accept_greedy  # noqa: F401 (re-exported)
from ds4c.width_policy import ConfidenceCalibration, ConfidencePolicy, best_draft_count  # noqa: F401 (re-exported)


class WidthPolicy:
    """How many drafts each verify step carries (module docstring: fixed or ``auto``).

    Args:
        width: verify rows per step (1..5) when fixed; ignored when ``costs`` is given.
        costs: ``{width: seconds}`` of one verify step per width (1..5, from :func:`measure_width_costs`):
            the adaptive policy (acceptance-and-cost; with a drafter's confidence, :meth:`trim` hands the choice to
            :class:`ds4c.width_policy.ConfidencePolicy`).

    Raises:
        StepError: ``costs`` lacking a width in ``1..max(costs)``.
    """

    EXPLORE_STEPS = 4
    """Adaptive: the first steps draft as many as allowed, to measure the acceptance."""
    PROBE_EVERY = 32
    """Adaptive: when the policy has settled on plain decode steps, every this many steps one draft is still
    tried, so a drafter that improves later in the request is noticed."""

    def __init__(self, width: int = 5, costs: dict[int, float] | None = None):
        self.costs = dict(costs) if costs else None
        self.width = max(self.costs) if self.costs else int(width)
        self.reached = [0] * self.width  # steps in which draft depth i was judged (all before it accepted)
        self.ok = [0] * self.width  # ... and accepted
        self._since_draft = 0
        self.by_confidence = ConfidencePolicy(self.costs, self.width - 1) if self.costs and self.width > 1 else None
        self.confident = False  # the last proposal came with a per-depth confidence (auto only)

    @property
    def adaptive(self) -> bool:
        return self.costs is not None

    @property
    def name(self) -> str:
        """``fixed``, ``acceptance-cost`` (auto, no confidence) or ``confidence`` (auto, from the drafter's)."""
        return "fixed" if not self.adaptive else "confidence" if self.confident else "acceptance-cost"

    def trim(self, k: int, confidence: Any) -> int:
        """Drafts to verify of the ``k`` just proposed: ``k`` unless the policy is adaptive and the drafter gave
        ``confidence`` (a probability per draft, e.g. ``drafter.confidence``; None: no head, or a sampling request),
        then :meth:`ds4c.width_policy.ConfidencePolicy.choose` (``0..k``; the rest are discarded)."""
        if self.by_confidence is None or k <= 0:
            return k
        self.confident = confidence is not None
        return self.by_confidence.choose(list(confidence), k) if self.confident else k

    def report(self) -> dict[str, Any]:
        """For the request's stats: ``policy`` (:attr:`name`) and, with the confidence policy,
        :meth:`ds4c.width_policy.ConfidencePolicy.as_dict` (discarded drafts, calibration per depth)."""
        return {"policy": self.name, **(self.by_confidence.as_dict() if self.confident else {})}

    POOL = 8.0
    """Pseudo-counts by which a depth's acceptance is shrunk toward the acceptance pooled over all depths:
    depths the policy rarely drafts to (it learns only from what it drafts) borrow the others' evidence."""

    def acceptance(self, i: int) -> float:
        """Acceptance of draft depth ``i`` given the ones before it: its own counts, shrunk toward the pooled
        rate over all depths (Beta(1, 1) prior on that)."""
        pooled = (sum(self.ok) + 1) / (sum(self.reached) + 2)
        return (self.ok[i] + self.POOL * pooled) / (self.reached[i] + self.POOL)

    def choose(self, limit: int) -> int:
        """Drafts for the next step, at most ``limit`` and ``width - 1``."""
        top = max(0, min(self.width - 1, limit))
        if not self.adaptive or top == 0:
            return top
        if self.by_confidence is not None and self.confident:  # draft the most; trim() picks k
            return top if self.by_confidence.wants_drafts() else 0
        if self.reached[0] < self.EXPLORE_STEPS:
            return top
        best = best_draft_count([self.acceptance(i) for i in range(top)], self.costs)
        self._since_draft = 0 if best else self._since_draft + 1
        if not best and self._since_draft >= self.PROBE_EVERY:
            self._since_draft = 0
            return 1
        return best

    def update(self, k: int, n_accepted: int) -> None:
        """Record a step of ``k`` drafts of which the first ``n_accepted`` were accepted."""
        for i in range(min(k, n_accepted + 1)):
            self.reached[i] += 1
            self.ok[i] += int(i < n_accepted)
        if self.confident:
            self.by_confidence.update(k, n_accepted)


def measure_width_costs(stepper: Engine, widths: tuple[int, ...] = (1, 2, 3, 4, 5), repeats: int = 3) -> dict[int, float]:
    """Seconds of one verify step (and its rollback) per width on ``stepper``, median of ``repeats``, from a
    reset sequence (left reset). On a CUDA stepper each is synchronised; graphs are warm after one run."""
    stepper.reset()
    out: dict[int, float] = {}
    toks = [1, 2, 3, 4, 5]
    for w in widths:
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            logits = stepper.verify(toks[:w], 0)
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            ts.append(time.perf_counter() - t0)
            stepper.rollback(0)
        ts = sorted(ts[1:])
        out[w] = ts[len(ts) // 2]
    stepper.reset()
    return out


def no_speculation(width: Any) -> str | None:
    """Why a request with a drafter will not speculate, in one line, or None: said once to the user (the seed's
    trap: a setting that silently turned speculation off). Sampling settings never do: every temperature /
    top-k / top-p speculates with the exact rule."""
    if width == 1:
        return ("--spec-width 1 (spec_width=1): one verify row per step leaves no room for a draft; every step is a "
                "plain decode (use 2..5 or auto)")
    return None


@dataclass
class SpecStats:
    """Per-request speculative decoding report: verify ``steps``, ``drafted`` / ``accepted`` per draft depth
    (index 0 = the first draft of a step; a draft counts as accepted when it and every draft before it in its
    step were), ``widths`` (verify rows per step, counted; 1 = a plain decode, or a verify of no draft), tokens
    produced (``tokens_verified`` in :meth:`as_dict`, which ``tokens_per_step`` divides; ``tokens`` there is what
    the request kept, :attr:`delivered`, once it ended); :meth:`as_dict` adds the width policy's report (``policy``: fixed / acceptance-cost / confidence;
    with the confidence policy ``discarded_drafts``, ``verified_drafts`` and ``calibration``,
    :meth:`ds4c.width_policy.ConfidencePolicy.as_dict`)."""

    drafter: str
    width: int | str
    steps: int = 0
    tokens: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    widths: dict[int, int] = field(default_factory=dict)

    def record(self, k: int, n_accepted: int) -> None:
        self.steps += 1
        self.tokens += n_accepted + 1
        self.widths[k + 1] = self.widths.get(k + 1, 0) + 1
        while len(self.drafted) < k:
            self.drafted.append(0)
            self.accepted.append(0)
        for i in range(k):
            self.drafted[i] += 1
            self.accepted[i] += int(i < n_accepted)

    costs_ms: dict[int, float] | None = None
    """With ``width="auto"``: the measured verify-step time per width the policy used."""
    host_s: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "verify+accept": 0.0, "rollback": 0.0})
    """Wall seconds per phase of the verify steps: drafting, the verify (submit, wait for its rows' argmax or
    logits, accept) and the rollback call."""

    policy: Any = None
    """The request's :class:`WidthPolicy` (set by :func:`speculative_tokens`): its ``report()`` is merged in."""
    delivered: int | None = None
    """Tokens the request kept of those the steps produced (set when it ends: an EOS, a stop string or the
    length limit can end it inside a step's accepted tokens); None while it runs."""
    prepare_s: float = 0.0
    """Wall seconds before the prefill: the drafter's ``prepare`` (the oracle's autoregressive pass) and, with
    ``auto``, the per-width cost measurement; not in the prefill or decode times."""

    def as_dict(self) -> dict[str, Any]:
        note = no_speculation(self.width)
        return {"drafter": self.drafter, "width": self.width, "steps": self.steps,
                "tokens": self.tokens if self.delivered is None else self.delivered, "tokens_verified": self.tokens,
                **({"note": note} if note else {}),
                **(self.policy.report() if self.policy is not None else  # no step ran: the policy asked for
                   {"policy": "acceptance-cost" if self.width == "auto" else "fixed"}),
                **({"verify_ms_by_width": {str(w): round(t, 4) for w, t in self.costs_ms.items()}}
                   if self.costs_ms else {}),
                "prepare_s": round(self.prepare_s, 4),
                "tokens_per_step": self.tokens / self.steps if self.steps else None,
                "acceptance_by_depth": [a / d if d else None for a, d in zip(self.accepted, self.drafted)],
                "ms_per_verify_step": {k: round(v * 1e3 / max(1, self.steps), 4) for k, v in self.host_s.items()},
                "widths": {str(w): n for w, n in sorted(self.widths.items())}}


def _integral(t: Any) -> bool:
    try:
        return not isinstance(t, bool) and float(t) == int(t)
    except (TypeError, ValueError, OverflowError):
        return False


def check_proposal(drafter: Any, drafts: Any, k: int, vocab: int | None) -> list[int]:
    """A drafter's proposal as a list of at most ``k`` token ids (integers in ``0..vocab-1`` when ``vocab`` is
    known). Raises a one-line StepError naming the drafter otherwise (a custom drafter's bug would else surface as
    the target step's error about its own arguments)."""
    name = drafter_name(drafter)
    try:
        seq = list(drafts)
    except TypeError:
        raise StepError(f"drafter {name}: expected a list of token ids from propose(), found {drafts!r:.80}") from None
    if not all(_integral(t) for t in seq):
        raise StepError(f"drafter {name}: expected integer token ids from propose(), found {drafts!r:.80}")
    ids = [int(t) for t in seq]
    if len(ids) > k:
        raise StepError(f"drafter {name}: asked for {k} drafts, proposed {len(ids)}")
    if vocab is not None and any(not 0 <= t < vocab for t in ids):
        raise StepError(f"drafter {name}: proposed token ids outside 0..{vocab - 1}: {ids}")
    return ids


def call_propose(drafter: Any, context: list[int], k: int, vocab: int | None) -> tuple[list[int], Any]:
    """``drafter.propose(context, k)`` checked: ``(ids, q)`` with ids as :func:`check_proposal` returns them and
    ``q`` None or a tensor ``[>= len(ids), vocab]`` (the drafts' distributions).

    Raises:
        StepError: anything else (one line naming the drafter and what it returned).
    """
    name = drafter_name(drafter)
    got = drafter.propose(context, k)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise StepError(f"drafter {name}: propose() must return (token ids, q or None), found {got!r:.80}")
    ids = check_proposal(drafter, got[0], k, vocab)
    q = got[1]
    if q is not None:
        shape = tuple(q.shape) if isinstance(q, torch.Tensor) else None
        if shape is None or len(shape) != 2 or shape[0] < len(ids) or (vocab is not None and shape[1] != vocab):
            raise StepError(f"drafter {name}: propose()'s q must be None or a tensor [>= {len(ids)} drafts, "
                            f"{vocab if vocab is not None else 'vocab'}], found "
                            f"{'a tensor ' + str(list(shape)) if shape is not None else type(q).__name__}")
    return ids, q


def speculative_tokens(stepper: Engine, drafter: Drafter, prompt: list[int], first: int, n: int,
                       width: int | WidthPolicy, temperature: float, top_k: int, top_p: float,
                       generator: torch.Generator, stats: SpecStats, sample_one: Any) -> Iterator[int]:
    """The ``n`` tokens after ``first`` (sampled from the prefill, at position ``len(prompt)``), produced by
    verify steps of up to ``width`` rows (or as a :class:`WidthPolicy` chooses). ``sample_one(logits [1, V]) ->
    id`` samples a plain decode step (used when no draft fits or the policy drafts none). Yields ids in order;
    closing the generator stops it (the state then holds the last step's accepted rows)."""
    policy = width if isinstance(width, WidthPolicy) else WidthPolicy(width)
    stats.policy = policy
    vocab = stepper.cfg.vocab_size
    # the pipelined loop fixes each step's width before its drafts exist, so it cannot trim them by confidence
    by_confidence = policy.adaptive and isinstance(drafter, ConfidenceHead) and drafter.has_confidence
    if temperature == 0 and isinstance(drafter, HostOnlyDrafter) and drafter.host_only and not by_confidence \
            and isinstance(stepper, PipelinedVerify):
        pipe = stepper.greedy_pipeline()
        if pipe is not None:  # the compiled step: the next verify queued while this one runs
            yield from _pipelined_tokens(pipe, drafter, prompt, first, n, policy, stats)
            return
    # greedy on a stepper that accepts and rolls back on its device (the compiled step): one call per step
    fused = stepper.verify_greedy if temperature == 0 and isinstance(stepper, DeviceGreedyVerify) else None
    if isinstance(drafter, SamplingDrafter):  # e.g. the DSpark drafter: sample the drafts from the q it returns
        drafter.configure_sampling(temperature, top_k, top_p, generator)
    out = [int(first)]
    pos = len(prompt)
    produced = 0
    while produced < n:
        k = policy.choose(n - produced - 1)
        if k <= 0:
            logits = stepper.decode(out[-1], pos)
            # greedy: the argmax on the step's device (ties to the lower id, as the CPU sampler); one id crosses
            tok = int(logits[0].argmax()) if temperature == 0 else sample_one(logits.float().cpu())
            stats.record(0, 0)
            pos += 1
            new = [tok]
        else:
            t0 = time.perf_counter()
            drafts, q = call_propose(drafter, prompt + out, k, vocab)
            k = policy.trim(len(drafts), drafter.confidence if temperature == 0 and isinstance(drafter, ReportsConfidence)
                            else None)
            drafts, q = drafts[:k], None if q is None else q[:k]  # greedy only trims; k == 0: a 1-row verify
            t1 = time.perf_counter()
            if fused is not None:  # verify, acceptance and rollback enqueued together, one wait
                new = fused([out[-1]] + list(drafts), pos)
                t2 = t3 = time.perf_counter()
            else:
                logits = stepper.verify([out[-1]] + list(drafts), pos)
                if temperature == 0:  # argmax on the step's device: k + 1 ids to the host
                    new = accept_greedy(logits.argmax(dim=-1).tolist(), list(drafts))
                else:
                    new = accept(logits.float().cpu(), list(drafts), q, temperature, top_k, top_p, generator)
                t2 = time.perf_counter()
                stepper.rollback(len(new))  # keep the step's first row and the accepted drafts
                t3 = time.perf_counter()
            stats.record(k, len(new) - 1)
            policy.update(k, len(new) - 1)
            stats.host_s["draft"] += t1 - t0
            stats.host_s["verify+accept"] += t2 - t1
            stats.host_s["rollback"] += t3 - t2
            pos += len(new)
        for t in new:
            out.append(t)
            produced += 1
            yield t


def _pipelined_tokens(pipe: VerifyPipeline, drafter: Drafter, prompt: list[int], first: int, n: int, policy: WidthPolicy,
                      stats: SpecStats) -> Iterator[int]:
    """:func:`speculative_tokens` for a greedy request with a host-only drafter on a
    :class:`~ds4c.runtime.spec_pipeline.GreedyPipeline`. Each step N+1 is queued (its width chosen by the policy
    from the steps before N, its bucket for the furthest position N can reach) before step N's ids are awaited;
    then the drafts of N+1 are made and released into it, before N's tokens are yielded (the consumer's time
    per token overlaps the GPU's next step). The output is the synchronous loop's: the same
    acceptance on the same rows. On closing, the released step completes and a held one runs as a plain
    decode (the state may then hold up to two steps more than were consumed; the stepper's ``pos`` says how
    far it went)."""
    out = [int(first)]
    pos, last, produced = len(prompt), int(first), 0
    vocab = pipe.step.cfg.vocab_size

    def drafts_for(k: int) -> list[int]:
        if not k:
            return []
        t0 = time.perf_counter()
        d = call_propose(drafter, prompt + out, k, vocab)[0]
        stats.host_s["draft"] += time.perf_counter() - t0
        return d + [0] * (k - len(d))  # a drafter with fewer: the rows still run, their drafts rejected

    me = pipe.owner = object()  # another call on the step ends this request (check_owner then raises)
    k = policy.choose(n - 1)
    try:
        pipe.enqueue(k + 1, pos)
        pipe.release([last] + drafts_for(k), pos)
        while True:
            k_next = policy.choose(max(0, n - produced - 2))
            pipe.check_owner(me)
            pipe.enqueue(k_next + 1, pos + k + 1)
            t1 = time.perf_counter()
            new = pipe.result()
            stats.host_s["verify+accept"] += time.perf_counter() - t1
            pos, last = pos + len(new), new[-1]
            take = new[:n - produced]
            out.extend(take)
            ending = produced + len(take) >= n
            if not ending:  # the next step starts before this one's tokens go to the consumer
                pipe.release([last] + drafts_for(k_next), pos)
            if k:
                stats.record(k, len(new) - 1)
                policy.update(k, len(new) - 1)
            else:
                stats.record(0, 0)
            for t in take:
                produced += 1
                yield t
                pipe.check_owner(me)
            if ending:
                return
            k = k_next
    finally:
        if pipe.owner is me:
            pipe.close(last, pos)
            pipe.owner = None
