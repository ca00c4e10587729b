"""Confidence-adaptive verify width (docs/model.md 7.3.4 for the DSpark confidence head, section 6 for the
verify step; docs/drafter.md "The request's report" for what it reports).

When a drafter reports a confidence per draft depth after each proposal (``drafter.confidence``: one probability
per draft, the sigmoid of the head's logit; :class:`ds4c.drafters.dspark.DSparkDrafter`, or the oracle drafter's
emulated head ``oracle:ALPHA:SEP``), the ``auto`` width drafts the most it may and then verifies only the first
``k`` drafts, ``k`` chosen per step from those confidences (:class:`ConfidencePolicy`):

1. **Calibration** (:class:`ConfidenceCalibration`): the acceptance of draft depth ``i`` given that every draft
   before it was accepted is modelled as ``sigmoid(slope_i * z + bias_i)`` of the draft's confidence logit ``z``
   (per-depth Platt scaling), fitted online in the request against the target's actual accept/reject outcome of
   every verified depth, after each verify step. Each depth's prediction is shrunk toward one model pooled over
   all depths by :attr:`ConfidenceCalibration.POOL` pseudo-observations (as the acceptance-and-cost policy does
   with its rates), so rarely verified depths borrow the others' evidence.
2. **Choice**: the predicted conditional acceptances ``p_i`` of this step's drafts give ``E(k) = 1 + sum_{i<=k}
   prod_{j<i} p_j`` expected tokens, and ``k`` maximises ``E(k) / cost(k + 1)`` with the per-width verify costs
   measured at the start of the request (:func:`best_draft_count`, the objective of the acceptance-and-cost
   policy, :class:`ds4c.speculative.WidthPolicy`, which is what runs for drafters without confidence).

Why Platt scaling fitted by an online Laplace (assumed-density) update rather than binned isotonic regression:

* a trained confidence head is a logistic model of acceptance, and the emulated head is exactly one (a logit
  ``z ~ N(+-SEP/2, 1)`` for a right / wrong draft of prior probability ``ALPHA`` gives log-odds
  ``logit(ALPHA) + SEP * z``), so two parameters per depth fit it with no binning error, and extrapolate to
  confidences not seen yet; isotonic bins need tens of outcomes each before they are stable, more than a request
  of a few hundred verify steps gives four depths;
* which depths get verified depends on ``z`` only (a selection on the regressor), so a regression on ``z`` stays
  unbiased, while the plain acceptance rate of the verified drafts is biased upward by that selection;
* the update is O(1) per outcome (a 2 x 2 covariance, one scalar Newton solve: a few microseconds), so it costs
  nothing beside a verify step, where refitting on every stored outcome would cost O(steps) per step.

The prior is ``slope ~ N(1, 1)``, ``bias ~ N(0, 1)`` (the head taken as calibrated until evidence says otherwise);
predictions use the posterior-moderated probability ``sigmoid(mu / sqrt(1 + pi * s / 8))`` (MacKay), so a
confidence far from the ones seen so far is not trusted to the extreme.

Costs of drafting the maximum: the drafts beyond ``k`` are discarded (counted in the stats as
``discarded_drafts``). The DSpark drafter drafts its whole block in one pass whatever ``k`` is, so they cost it
nothing; an autoregressive drafter (MTP) pays one drafter step per discarded draft; the oracle pays nothing. A
step that verifies no draft runs the last token as a 1-row verify (a decode, ``cost(1)``) and still paid for the
proposal: after :attr:`ConfidencePolicy.GATE` drafted steps in a
row with no accepted draft (none verified, or all rejected) the policy stops drafting (plain decode steps) and
drafts again every :attr:`ConfidencePolicy.PROBE_EVERY` steps, verifying at least one draft then so the
calibration keeps learning; an accepted draft ends the gate.

Only greedy requests use the confidence: choosing which drafts to verify from their confidences would bias the
exact sampling rule (a draft's chance of being verified would depend on the draft), so sampling requests run the
acceptance-and-cost policy (:func:`ds4c.speculative.speculative_tokens` passes no confidence then).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ds4c.errors import StepError

LOGIT_CLAMP = 16.0
"""Confidence logits are clamped to +-this many (a probability within ~1e-7 of 0 or 1)."""


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def confidence_logit(p: float) -> float:
    """The logit of a confidence probability ``p`` (a float in [0, 1]), clamped to +-:data:`LOGIT_CLAMP`.

    Raises:
        StepError: ``p`` not a number in [0, 1].
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
        raise StepError(f"a drafter's confidence must be a probability in [0, 1] per draft, found {p!r}")
    p = float(p)
    if p <= 0.0 or p >= 1.0:
        return LOGIT_CLAMP if p >= 1.0 else -LOGIT_CLAMP
    return max(-LOGIT_CLAMP, min(LOGIT_CLAMP, math.log(p / (1.0 - p))))


def best_draft_count(acceptance: Sequence[float], costs: Mapping[int, float]) -> int:
    """The number of drafts ``k`` in ``0..len(acceptance)`` maximising expected tokens per second,
    ``E(k) / costs[k + 1]`` with ``E(k) = 1 + sum_{i=1..k} prod_{j<i} acceptance[j]`` (ties to the smaller ``k``).

    Args:
        acceptance: per draft depth, the probability that the draft is accepted given that every draft before it
            was (floats in [0, 1]).
        costs: seconds of one verify step per width (``k + 1`` rows), holding at least ``1..len(acceptance) + 1``.
    Raises:
        StepError: a width the costs lack (one line).
    """
    missing = [w for w in range(1, len(acceptance) + 2) if w not in costs]
    if missing:
        raise StepError(f"width costs hold widths {sorted(costs)}, the policy needs 1..{len(acceptance) + 1}")
    best, best_rate, e, run = 0, 1.0 / costs[1], 1.0, 1.0
    for k in range(1, len(acceptance) + 1):
        run *= acceptance[k - 1]
        e += run
        rate = e / costs[k + 1]
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class OnlineLogistic:
    """``P(accepted | z) = sigmoid(slope * z + bias)`` fitted online: a Gaussian posterior over ``(slope, bias)``
    updated by one Laplace step per outcome (assumed-density filtering for logistic regression; module docstring).

    Args:
        slope, bias: the prior mean; prior_var: the prior variance of each (independent).
    Attributes:
        mean: ``[slope, bias]``; cov: the 2 x 2 posterior covariance; n: outcomes seen.
    """

    def __init__(self, slope: float = 1.0, bias: float = 0.0, prior_var: float = 1.0):
        self.mean = [float(slope), float(bias)]
        self.cov = [[float(prior_var), 0.0], [0.0, float(prior_var)]]
        self.n = 0

    def update(self, z: float, accepted: bool) -> None:
        """Condition on one outcome: confidence logit ``z`` (clamped to +-:data:`LOGIT_CLAMP`), ``accepted``."""
        z = max(-LOGIT_CLAMP, min(LOGIT_CLAMP, float(z)))
        (a, b), ((c00, c01), (c10, c11)) = self.mean, self.cov
        sx0, sx1 = c00 * z + c01, c10 * z + c11  # cov @ x with x = (z, 1)
        s = max(z * sx0 + sx1, 1e-12)  # x^T cov x
        mu = a * z + b
        y = 1.0 if accepted else 0.0
        eta = mu  # the new linear predictor: eta = mu + s * (y - sigmoid(eta)), by Newton
        for _ in range(30):
            g = _sigmoid(eta)
            step = (eta - mu - s * (y - g)) / (1.0 + s * g * (1.0 - g))
            eta -= step
            if abs(step) < 1e-12:
                break
        g = _sigmoid(eta)
        lam = g * (1.0 - g)
        shift = (eta - mu) / s
        self.mean = [a + sx0 * shift, b + sx1 * shift]
        f = lam / (1.0 + lam * s)
        self.cov = [[c00 - f * sx0 * sx0, c01 - f * sx0 * sx1], [c10 - f * sx1 * sx0, c11 - f * sx1 * sx1]]
        self.n += 1

    def predict(self, z: float) -> float:
        """The posterior-moderated acceptance probability at confidence logit ``z``."""
        z = max(-LOGIT_CLAMP, min(LOGIT_CLAMP, float(z)))
        (a, b), ((c00, c01), (c10, c11)) = self.mean, self.cov
        s = max(z * (c00 * z + c01) + (c10 * z + c11), 0.0)
        return _sigmoid((a * z + b) / math.sqrt(1.0 + math.pi * s / 8.0))

    def as_dict(self) -> dict[str, Any]:
        """``slope``, ``bias`` (posterior means), their standard deviations, ``n``."""
        return {"slope": round(self.mean[0], 4), "bias": round(self.mean[1], 4),
                "slope_sd": round(math.sqrt(max(self.cov[0][0], 0.0)), 4),
                "bias_sd": round(math.sqrt(max(self.cov[1][1], 0.0)), 4), "n": self.n}


class ConfidenceCalibration:
    """Per-depth calibration of a drafter's confidence logits against the target's accept/reject outcomes, each
    depth shrunk toward a model pooled over all depths (module docstring).

    Args:
        depths: draft depths calibrated (the most drafts per step).
    """

    POOL = 8.0
    """Outcomes' worth of weight the pooled model has in a depth's prediction (the depth's own model weighs its
    outcome count)."""

    def __init__(self, depths: int):
        if isinstance(depths, bool) or not isinstance(depths, int) or depths < 1:
            raise StepError(f"confidence calibration: expected depths an int >= 1, found {depths!r}")
        self.depth = [OnlineLogistic() for _ in range(depths)]
        self.pooled = OnlineLogistic()

    def update(self, depth: int, z: float, accepted: bool) -> None:
        """One verified draft at ``depth`` (every draft before it accepted) with confidence logit ``z``."""
        self.depth[depth].update(z, accepted)
        self.pooled.update(z, accepted)

    def predict(self, depth: int, z: float) -> float:
        """Acceptance of a draft at ``depth`` with confidence logit ``z``, given the drafts before it accepted."""
        m = self.depth[depth]
        return (m.n * m.predict(z) + self.POOL * self.pooled.predict(z)) / (m.n + self.POOL)

    def as_dict(self) -> dict[str, Any]:
        return {"by_depth": [m.as_dict() for m in self.depth], "pooled": self.pooled.as_dict()}


class ConfidencePolicy:
    """Drafts to verify per step from the drafter's per-depth confidence (module docstring).

    Args:
        costs: ``{width: seconds}`` of one verify step, widths ``1..depths + 1``
            (:func:`ds4c.speculative.measure_width_costs`).
        depths: the most drafts per step.
    Attributes:
        calibration: the :class:`ConfidenceCalibration`; discarded: drafts proposed but not verified; chosen:
            steps per number of verified drafts (``{k: steps}``, decided steps only).
    """

    EXPLORE_STEPS = 4
    """The first drafted steps verify every draft, to give the calibration outcomes at every depth."""
    GATE = 32
    """After this many drafted steps in a row with no accepted draft, stop drafting (plain decode steps) ..."""
    PROBE_EVERY = 32
    """... except on one step in this many, which drafts and verifies at least one draft."""

    def __init__(self, costs: Mapping[int, float], depths: int):
        self.costs = dict(costs)
        self.calibration = ConfidenceCalibration(depths)
        best_draft_count([0.0] * depths, self.costs)  # every width's cost is there
        self.depths = depths
        self.discarded = 0
        self.chosen: dict[int, int] = {}
        self._decided = 0
        self._dry = 0  # drafted steps since the last accepted draft
        self._plain = 0
        self._probe = False
        self._pending: list[float] = []

    def wants_drafts(self) -> bool:
        """Whether the next step should draft (False while gated: see :attr:`GATE`)."""
        if self._dry < self.GATE:
            return True
        self._plain += 1
        if self._plain >= self.PROBE_EVERY:
            self._plain, self._probe = 0, True
            return True
        return False

    def choose(self, confidence: Sequence[float], drafted: int) -> int:
        """How many of the ``drafted`` drafts to verify, from their confidences (``confidence[i]`` for draft
        ``i``, a probability; only the first ``drafted`` are read).

        Raises:
            StepError: fewer than ``drafted`` confidences, more drafts than ``depths``, or a confidence outside
                [0, 1] (one line).
        """
        if len(confidence) < drafted:
            raise StepError(f"the drafter's confidence holds {len(confidence)} values for {drafted} drafts "
                            f"(expected one per draft)")
        if drafted > self.depths:
            raise StepError(f"the confidence policy calibrates {self.depths} draft depths, {drafted} were drafted")
        z = [confidence_logit(c) for c in confidence[:drafted]]
        best = best_draft_count([self.calibration.predict(i, zi) for i, zi in enumerate(z)], self.costs)
        self._dry += 1
        if self._decided < self.EXPLORE_STEPS:
            k = drafted
        elif self._probe:
            k = max(1, best) if drafted else 0
        else:
            k = best
        self._probe = False
        self._decided += 1
        self.discarded += drafted - k
        self.chosen[k] = self.chosen.get(k, 0) + 1
        self._pending = z[:k]
        return k

    def update(self, k: int, n_accepted: int) -> None:
        """The verify outcome of the last :meth:`choose` (``k`` drafts verified, the first ``n_accepted`` of them
        accepted): every depth judged (all before it accepted) is one outcome for the calibration."""
        z, self._pending = self._pending, []
        if n_accepted > 0:
            self._dry = self._plain = 0
        for i in range(min(k, n_accepted + 1, len(z))):
            self.calibration.update(i, z[i], i < n_accepted)

    def as_dict(self) -> dict[str, Any]:
        """``discarded_drafts``, ``verified_drafts`` (``{k: steps}``) and ``calibration`` (per depth and pooled:
        slope, bias, their posterior standard deviations, outcomes)."""
        return {"discarded_drafts": self.discarded,
                "verified_drafts": {str(k): n for k, n in sorted(self.chosen.items())},
                "calibration": self.calibration.as_dict()}
