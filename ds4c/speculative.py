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
(only ``q`` ids cross to the host); on a stepper with ``verify_greedy`` (the compiled step) the comparison, the
accepted count and the rollback run on the device too, enqueued behind the verify graph with one wait per step
(:meth:`ds4c.runtime.executor.CompiledStep.verify_greedy`). With a host-only drafter (``Drafter.host_only``,
the oracle) the compiled step also queues each verify step, graph launch included, before the previous step's
ids are back, and starts it with one store to a host flag once its drafts are made
(:mod:`ds4c.runtime.spec_pipeline`). Sampling brings the rows' logits to the CPU for the exact rule.

Drafters (:func:`make_drafter`): ``oracle:ALPHA`` drafts the target's own greedy continuation, computed by an
autoregressive pass before the request, with each draft token replaced by a wrong one with probability
``1 - ALPHA`` (seeded): a benchmark of the loop at a chosen acceptance rate, since synthetic weights make any
trained-style drafter's acceptance near zero. ``dspark:PATH`` (or a ``PATH.gguf``) is the DeepSeek-V4-Flash-0731
DSpark drafter of that file on the reference engine (:class:`ds4c.drafters.dspark.DSparkDrafter`; spec section 7).
``mtp`` / ``mtp:PATH`` is the MTP (nextn) block of the target file or of a separate file, on the reference engine
(:class:`ds4c.drafters.mtp.MTPDrafter`; spec 7.5).
A drafter with a ``configure_sampling(temperature, top_k, top_p, generator)`` method is told the request's sampling
before its first proposal (the DSpark drafter then samples its drafts from the ``q`` it returns, as the exact rule
needs).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ds4c.errors import StepError
from ds4c.width_policy import ConfidenceCalibration, ConfidencePolicy, best_draft_count  # noqa: F401 (re-exported)


class Drafter(Protocol):
    """What the loop needs of a drafter.

    Optional attribute ``host_only`` (default False): True when :meth:`propose` does no GPU work. A greedy
    request on the compiled step then queues each verify step before the previous one's result is back
    (:mod:`ds4c.runtime.spec_pipeline`). GPU work in ``propose`` would wait behind the queued step, so it is
    only allowed for drafters that say so. Optional ``has_confidence``: it sets ``confidence`` per proposal; an
    adaptive request then trims each step's drafts by it, which the pipelined loop (widths fixed ahead) cannot
    do, so such a request runs its steps one by one."""

    name: str

    def prepare(self, stepper: Any, prompt: list[int], max_new_tokens: int) -> None:
        """Called once per request, before the target's prefill (it may use the stepper, then must leave it
        to be reset)."""

    def propose(self, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """``k`` draft tokens continuing ``context`` (prompt + tokens so far), and their distributions
        ``q`` (fp32 ``[k, V]``, the drafts drawn from them) or None for a deterministic drafter.

        Optional: ``configure_sampling(temperature, top_k, top_p, generator)``, called by the loop once per request
        before the first proposal; a ``confidence`` attribute, set by each proposal to one probability per draft
        (that the draft is accepted given the ones before it are), read by the ``auto`` width in greedy requests
        (:mod:`ds4c.width_policy`)."""


class OracleDrafter:
    """Drafts the target's greedy continuation of the prompt, each token kept with probability ``alpha`` and
    otherwise replaced by another id (uniform over the rest of the vocabulary), from ``random.Random(seed)``.

    With greedy decoding the target follows that continuation, so ``alpha`` is the per-token acceptance; with
    sampling the output leaves it after the first sampled difference and the drafts are then mostly rejected.

    ``sep`` (>= 0, optional) emulates a confidence head of known informativeness: after each proposal
    :attr:`confidence` holds, per draft, ``sigmoid(z)`` with ``z`` drawn from ``N(+sep/2, 1)`` when the draft is the
    continuation's token and from ``N(-sep/2, 1)`` when it is not (its own ``random.Random``, seeded from
    ``seed``), so ``logit(alpha) + sep * z`` is the exact log-odds of a right draft (``sep = 0``: a useless head).
    Without ``sep``, :attr:`confidence` stays None (a drafter without a head).

    Raises:
        StepError: ``alpha`` not in [0, 1], ``sep`` not a finite number >= 0 (one line).
    """

    host_only = True
    """Its proposals are list lookups on the host (the pipelined loop may run it while a step is queued)."""

    def __init__(self, alpha: float, vocab_size: int, seed: int = 0, continuation: list[int] | None = None,
                 sep: float | None = None):
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0.0 <= float(alpha) <= 1.0):
            raise StepError(f"oracle drafter: ALPHA must be a number in [0, 1], found {alpha!r}")
        if sep is not None and (isinstance(sep, bool) or not isinstance(sep, (int, float))
                                or not 0.0 <= float(sep) < float("inf")):
            raise StepError(f"oracle drafter: SEP (confidence separation) must be a finite number >= 0, found {sep!r}")
        self.alpha, self.vocab_size, self.seed = float(alpha), int(vocab_size), int(seed)
        self.sep = None if sep is None else float(sep)
        self.name = f"oracle:{self.alpha:g}" + ("" if self.sep is None else f":{self.sep:g}")
        self._given = None if continuation is None else [int(t) for t in continuation]
        self._continuation: list[int] = []
        self._prompt_len = 0
        self._rng = random.Random(seed)
        self._conf_rng = random.Random(f"{seed}:confidence")
        self.confidence: list[float] | None = None

    @property
    def has_confidence(self) -> bool:
        """It reports a confidence per draft (made with ``sep``)."""
        return self.sep is not None

    def prepare(self, stepper: Any, prompt: list[int], max_new_tokens: int) -> None:
        """The target's greedy continuation of ``prompt`` (an autoregressive pass on ``stepper``), unless the
        drafter was made with a ``continuation`` (for benchmarks that already ran it)."""
        from ds4c.generate import generate

        if self._given is not None:
            self._continuation = self._given
        else:
            self._continuation = generate(stepper, prompt, max_new_tokens).tokens if max_new_tokens else []
        self._prompt_len = len(prompt)
        self._rng = random.Random(self.seed)
        self._conf_rng = random.Random(f"{self.seed}:confidence")
        self.confidence = None

    def propose(self, context: list[int], k: int) -> tuple[list[int], None]:
        at = len(context) - self._prompt_len
        out, conf = [], []
        for i in range(k):
            j = at + i
            t = self._continuation[j] if j < len(self._continuation) else 0
            right = self._rng.random() < self.alpha
            if not right:
                t = (t + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
            out.append(t)
            if self.sep is not None:
                z = self._conf_rng.gauss(self.sep / 2 if right else -self.sep / 2, 1.0)
                conf.append(1.0 / (1.0 + math.exp(-z)))
        self.confidence = conf if self.sep is not None else None
        return out, None


def make_drafter(spec: str, vocab_size: int, seed: int = 0, config: Any = None, target_file: Any = None) -> Drafter:
    """The drafter a ``--draft`` value names: ``oracle:ALPHA`` (``oracle:ALPHA:SEP``: with an emulated confidence
    head of separation SEP, :class:`OracleDrafter`); ``dspark:PATH`` / ``PATH.gguf`` (a DSpark drafter
    file, :class:`ds4c.drafters.dspark.DSparkDrafter`, checked against ``config``, the target's
    :class:`~ds4c.config.Ds4Config`, when given, else at its ``prepare``); ``dspark:synthetic:PRESET[:FORMATS[:SEED]]``
    (the same drafter with no file, :class:`ds4c.drafters.dspark_source.SyntheticDSpark`, checked likewise); ``mtp`` (the MTP block of the target file
    ``target_file`` itself) or ``mtp:PATH`` (a separate file holding one, llama.cpp's ``convert --mtp`` export or
    ``ds4c make-model --drafter mtp``; checked against ``config`` and the target file's embedding and head):
    :class:`ds4c.drafters.mtp.MTPDrafter`, spec 7.5.

    Raises:
        StepError: an unknown drafter, a bad ALPHA or SEP, ``mtp`` without ``target_file`` (one line, naming what
            was expected).
        ModelFileError: a DSpark or MTP file that is missing, invalid, or does not fit the target (its vocabulary not
            ``vocab_size``); ``mtp`` with a target that holds no MTP block.
    """
    text = str(spec)
    kind, _, arg = text.partition(":")
    if kind == "oracle":
        fields = arg.split(":")
        if len(fields) > 2:
            raise StepError(f"--draft oracle:ALPHA[:SEP]: expected at most two numbers after 'oracle:', found {arg!r}")
        bad_alpha = f"--draft {text!r}: expected oracle:ALPHA[:SEP] with ALPHA a number in [0, 1], found " \
            f"{'no ALPHA' if not fields[0] else repr(fields[0])}"
        try:
            alpha = float(fields[0])
        except ValueError:
            raise StepError(bad_alpha) from None
        if not 0.0 <= alpha <= 1.0:  # (nan fails too) named as typed, not as parsed
            raise StepError(bad_alpha)
        sep = None
        if len(fields) == 2:
            bad_sep = f"--draft {text!r}: expected oracle:ALPHA:SEP with SEP a finite number >= 0, found {fields[1]!r}"
            try:
                sep = float(fields[1])
            except ValueError:
                raise StepError(bad_sep) from None
            if not 0.0 <= sep < float("inf"):
                raise StepError(bad_sep)
        return OracleDrafter(alpha, vocab_size, seed, sep=sep)
    if kind == "mtp":
        from ds4c.drafters.mtp import MTPDrafter

        if arg:
            return MTPDrafter(arg, seed=seed, target=config, target_file=target_file)
        if text != "mtp":
            raise StepError(f"--draft {text!r}: expected mtp (the target's own MTP block) or mtp:PATH, found "
                            f"{'an empty path' if text == 'mtp:' else repr(text)}")
        if target_file is None:
            raise StepError("--draft mtp uses the target file's own MTP block: expected the target's model file "
                            "(make_drafter(..., target_file=...)), found none")
        return MTPDrafter.of_target(target_file, seed=seed)
    if kind == "dspark" and not arg:
        raise StepError(f"--draft {text!r}: expected dspark:PATH (a DSpark drafter file) or "
                        f"dspark:synthetic:PRESET, found an empty path")
    path = arg if kind == "dspark" else text if text.endswith(".gguf") else None
    if path is not None:
        from ds4c.drafters.dspark import DSparkDrafter
        from ds4c.errors import ModelFileError

        d = DSparkDrafter(path, seed=seed, target=config)
        if d.file.config.vocab_size != vocab_size:
            raise ModelFileError(f"{path}: the drafter's vocabulary has {d.file.config.vocab_size} tokens, the "
                                 f"target's {vocab_size}")
        return d
    raise StepError(f"unknown drafter {spec!r}: expected oracle:ALPHA[:SEP], dspark:PATH or PATH.gguf (a DSpark drafter "
                    f"file), dspark:synthetic:PRESET[:FORMATS[:SEED]] (the synthetic DSpark drafter, no file), mtp (the target's own MTP block) or mtp:PATH (an MTP file)")


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


def measure_width_costs(stepper: Any, widths: tuple[int, ...] = (1, 2, 3, 4, 5), repeats: int = 3) -> dict[int, float]:
    """Seconds of one verify step (and its rollback) per width on ``stepper``, median of ``repeats``, from a
    reset sequence (left reset). On a CUDA stepper each is synchronised; graphs are warm after one run."""
    import time

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
    from ds4c.generate import filter_logits

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


def drafter_name(drafter: Any) -> str:
    """The drafter's ``name`` (its class name when it has none: a custom drafter may omit it)."""
    name = getattr(drafter, "name", None)
    return name if isinstance(name, str) and name else type(drafter).__name__


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


def accept_greedy(top: list[int], drafts: list[int]) -> list[int]:
    """Greedy acceptance from each verify row's argmax ``top`` (``k + 1`` ids): the drafts up to the first that
    differs from its row's argmax, then that row's argmax (or, all kept, the last row's)."""
    out = []
    for i, d in enumerate(drafts):
        if top[i] != d:
            return out + [top[i]]
        out.append(d)
    return out + [top[len(drafts)]]


def speculative_tokens(stepper: Any, drafter: Drafter, prompt: list[int], first: int, n: int,
                       width: int | WidthPolicy, temperature: float, top_k: int, top_p: float,
                       generator: torch.Generator, stats: SpecStats, sample_one: Any) -> Iterator[int]:
    """The ``n`` tokens after ``first`` (sampled from the prefill, at position ``len(prompt)``), produced by
    verify steps of up to ``width`` rows (or as a :class:`WidthPolicy` chooses). ``sample_one(logits [1, V]) ->
    id`` samples a plain decode step (used when no draft fits or the policy drafts none). Yields ids in order;
    closing the generator stops it (the state then holds the last step's accepted rows)."""
    policy = width if isinstance(width, WidthPolicy) else WidthPolicy(width)
    stats.policy = policy
    vocab = getattr(getattr(stepper, "cfg", None), "vocab_size", None)
    # the pipelined loop fixes each step's width before its drafts exist, so it cannot trim them by confidence
    by_confidence = policy.adaptive and getattr(drafter, "has_confidence", False)
    if temperature == 0 and getattr(drafter, "host_only", False) and not by_confidence:
        make = getattr(stepper, "greedy_pipeline", None)
        pipe = make() if callable(make) else None
        if pipe is not None:  # the compiled step: the next verify queued while this one runs
            yield from _pipelined_tokens(pipe, drafter, prompt, first, n, policy, stats)
            return
    # greedy on a stepper that accepts and rolls back on its device (the compiled step): one call per step
    fused = getattr(stepper, "verify_greedy", None) if temperature == 0 else None
    configure = getattr(drafter, "configure_sampling", None)
    if callable(configure):  # e.g. the DSpark drafter: sample the drafts from the q it returns
        configure(temperature, top_k, top_p, generator)
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
            k = policy.trim(len(drafts), getattr(drafter, "confidence", None) if temperature == 0 else None)
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


def _pipelined_tokens(pipe: Any, drafter: Drafter, prompt: list[int], first: int, n: int, policy: WidthPolicy,
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
    vocab = getattr(getattr(pipe.step, "cfg", None), "vocab_size", None)

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
