"""Confidence-adaptive verify width (ds4c/width_policy.py; issue 13, deliverable 4).

The calibration recovers a known logistic relation from synthetic outcomes; the policy verifies fewer drafts
after low-confidence proposals and more after high ones, and on a scripted cost model (the H200's measured
verify times) its modelled tokens/s beats every fixed width and the acceptance-and-cost policy; a useless
confidence (SEP 0) ends up choosing what the acceptance-and-cost policy chooses; greedy output equals
autoregressive output on a scripted target, on the reference (tiny) with the oracle's emulated head and with the
DSpark drafter's own head; sampling requests keep the acceptance-and-cost policy; the CLI reports it all.
Most loop tests run a scripted stepper (the target's greedy continuation is a fixed sequence), so hundreds of
steps take milliseconds."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from ds4c.drafters.factory import make_drafter
from ds4c.drafters.oracle import OracleDrafter
from ds4c.errors import StepError
from ds4c.generate import generate
from ds4c.reference import Reference
from ds4c.speculative import WidthPolicy
from ds4c.width_policy import (ConfidenceCalibration, ConfidencePolicy, OnlineLogistic, best_draft_count,
                               confidence_logit)

H200 = {1: 1.23, 2: 1.625, 3: 2.061, 4: 2.286, 5: 2.624}
"""ms per verify step by width, flash-l4 on the H200 (docs/perf.md: decode 813 tokens/s; verify graphs)."""
CHEAP = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------------------------------ the calibration

@pytest.mark.parametrize("slope,bias,par_tol", [(1.7, -0.4, 0.15), (0.0, 1.2, 0.15), (3.0, 0.5, 0.3),
                                                (0.5, -1.0, 0.15)])
def test_calibration_recovers_a_known_logistic_relation(slope, bias, par_tol):
    """3000 outcomes drawn from sigmoid(slope * z + bias), z ~ N(0, 1.5): the online fit's predicted probability
    is within 0.05 of the true one for every z in [-3, 3], its parameters within ``par_tol`` (the online Laplace
    update shrinks steep slopes a little: 0.3 at slope 3) in every one of 5 seeds."""
    for seed in range(5):
        r = random.Random(seed)
        m = OnlineLogistic()
        for _ in range(3000):
            z = r.gauss(0.0, 1.5)
            m.update(z, r.random() < _sig(slope * z + bias))
        assert m.n == 3000
        err = max(abs(m.predict(z / 4) - _sig(slope * z / 4 + bias)) for z in range(-12, 13))
        assert err < 0.05, (seed, err, m.as_dict())
        assert abs(m.mean[0] - slope) < par_tol and abs(m.mean[1] - bias) < par_tol, (seed, m.as_dict())
        assert m.as_dict()["slope_sd"] < 0.15


def test_calibration_prior_pooling_and_errors():
    m = OnlineLogistic()
    assert m.predict(0.0) == 0.5 and m.predict(2.0) > 0.75  # prior: the head taken as calibrated (moderated)
    assert m.predict(2.0) < _sig(2.0)
    cal = ConfidenceCalibration(4)
    for _ in range(200):  # only depth 0 sees outcomes: all rejected
        cal.update(0, 1.0, False)
    assert cal.predict(0, 1.0) < 0.05
    assert cal.predict(3, 1.0) < 0.05  # an unseen depth borrows the pooled evidence entirely
    assert cal.depth[3].n == 0 and cal.pooled.n == 200
    assert confidence_logit(0.5) == 0.0 and confidence_logit(1.0) == 16.0 and confidence_logit(0.0) == -16.0
    assert abs(confidence_logit(_sig(2.5)) - 2.5) < 1e-9
    for bad in (1.5, -0.1, "x", True, float("nan")):
        with pytest.raises(StepError, match="confidence must be a probability in \\[0, 1\\]") as ei:
            confidence_logit(bad)
        assert "\n" not in str(ei.value)
    with pytest.raises(StepError, match="expected depths an int >= 1"):
        ConfidenceCalibration(0)
    with pytest.raises(StepError, match="the policy needs 1..5"):
        ConfidencePolicy({1: 1.0, 2: 1.0}, 4)


def test_best_draft_count_by_hand():
    # a = 0.9 everywhere, costs CHEAP: rates 1.0, 1.81, 2.45, 2.95, 3.37 / costs -> k = 4
    assert best_draft_count([0.9] * 4, CHEAP) == 4
    assert best_draft_count([0.9, 0.9, 0.05, 0.9], CHEAP) == 2  # a likely rejection at depth 2 ends the step
    assert best_draft_count([0.01] * 4, H200) == 0
    assert best_draft_count([], H200) == 0
    # H200 costs at a = 0.5 everywhere: E(1) / c(2) = 1.5 / 1.625 beats 1 / 1.23 and 1.75 / 2.061
    assert best_draft_count([0.5] * 4, H200) == 1


def test_policy_picks_k_from_confidence():
    """After calibration on outcomes where confidence is informative, high-confidence drafts are all verified,
    low ones none, and a step whose confidence drops at depth 2 verifies 2."""
    pol = ConfidencePolicy(H200, 4)
    r = random.Random(0)
    for _ in range(300):  # right drafts ~N(+1.5, 1), wrong ~N(-1.5, 1), alpha 0.6: slope 3, bias logit(0.6)
        conf = []
        rights = [r.random() < 0.6 for _ in range(4)]
        for ok in rights:
            conf.append(_sig(r.gauss(1.5 if ok else -1.5, 1.0)))
        k = pol.choose(conf, 4)
        n_acc = next((i for i, ok in enumerate(rights[:k]) if not ok), k)
        pol.update(k, n_acc)
    hi, lo = _sig(3.0), _sig(-3.0)
    assert pol.choose([hi] * 4, 4) == 4
    assert pol.choose([lo] * 4, 4) == 0
    assert pol.choose([hi, hi, lo, lo], 4) == 2
    assert pol.choose([hi] * 4, 2) == 2  # never more than drafted
    d = pol.as_dict()
    cal = d["calibration"]["pooled"]
    assert abs(cal["slope"] - 3.0) < 0.6 and abs(cal["bias"] - math.log(0.6 / 0.4)) < 0.4, cal
    assert d["discarded_drafts"] == pol.discarded > 0
    assert sum(m["n"] for m in d["calibration"]["by_depth"]) == cal["n"]
    with pytest.raises(StepError, match="confidence holds 2 values for 3 drafts"):
        pol.choose([0.5, 0.5], 3)
    with pytest.raises(StepError, match="calibrates 4 draft depths, 5 were drafted"):
        pol.choose([0.5] * 5, 5)


# ------------------------------------------------------------------------------------------ the loop

class Scripted:
    """A target whose greedy continuation is ``seq``: row ``i`` of ``verify(tokens, pos)`` has its argmax at
    ``seq[pos + i + 1]``. Checks the loop's positions (every call at the sequence's next position, rollbacks
    keeping 1..q rows) and records the width of every step after the prompt (``steps``; a decode is 1). An
    :class:`ds4c.engine_protocol.Engine` (its ``cfg`` holds only the vocabulary size)."""

    def __init__(self, seq: list[int], vocab: int, prompt_len: int):
        self.seq, self.V, self.prompt_len = seq, vocab, prompt_len
        self.cfg = SimpleNamespace(vocab_size=vocab)
        self.max_ctx = len(seq) + 8
        self.reset()

    def reset(self) -> None:
        self.pos, self._last, self.steps = 0, None, []

    def _rows(self, tokens, pos):
        assert pos == self.pos, (pos, self.pos)
        out = torch.full((len(tokens), self.V), -1.0)
        for i in range(len(tokens)):
            out[i, self.seq[pos + i + 1]] = 1.0
        return out

    def verify(self, tokens, pos):
        assert 1 <= len(tokens) <= 5
        logits = self._rows(tokens, pos)
        if pos >= self.prompt_len:
            self.steps.append(len(tokens))
        self._last = (pos, len(tokens))
        self.pos = pos + len(tokens)
        return logits

    def decode(self, token, pos):
        logits = self._rows([token], pos)
        self.steps.append(1)
        self.pos = pos + 1
        return logits

    def rollback(self, accepted: int) -> None:
        pos, q = self._last
        assert 1 <= accepted <= q
        self.pos = pos + accepted


class Recorded(OracleDrafter):
    """The oracle, keeping each proposal's size and confidence."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[int, list[float] | None]] = []

    def propose(self, context, k):
        out = super().propose(context, k)
        self.log.append((k, self.confidence))
        return out


V = 64
PROMPT = [3, 1, 4, 1, 5]


def _run(alpha: float, n: int, width, sep: float | None = None, seed: int = 0, **kw):
    r = random.Random(99)
    seq = PROMPT + [r.randrange(V) for _ in range(n + 8)]
    st = Scripted(seq, V, len(PROMPT))
    d = Recorded(alpha, V, seed=seed, continuation=seq[len(PROMPT):], sep=sep)
    res = generate(st, PROMPT, n, draft=d, spec_width=width, **kw)
    return res, st, d, seq[len(PROMPT):len(PROMPT) + n]


def _model_rate(sp: dict, costs: dict[int, float]) -> float:
    """Tokens per modelled ms of a request's verify steps (its width histogram against ``costs``)."""
    return sp["tokens"] / sum(n * costs[int(w)] for w, n in sp["widths"].items())


def test_confidence_policy_follows_the_confidence_and_beats_fixed_widths():
    n = 600
    res, st, d, want = _run(0.6, n, WidthPolicy(costs=H200), sep=3.0)
    assert res.tokens == want  # greedy: the target's continuation whatever was verified
    sp = res.speculative
    assert sp["policy"] == "confidence" and sp["width"] == "auto"
    # every step drafts (no gating at ALPHA 0.6) and verifies 0..k of the k drafts proposed: pair them
    verified = [w - 1 for w in st.steps]
    assert len(d.log) == len(verified) == sp["steps"] and all(v <= k for (k, _), v in zip(d.log, verified))
    pairs = [(conf, v) for (_, conf), v in zip(d.log, verified)]
    hi = [v for c, v in pairs[ConfidencePolicy.EXPLORE_STEPS:] if c[0] > 0.85]
    lo = [v for c, v in pairs[ConfidencePolicy.EXPLORE_STEPS:] if c[0] < 0.15]
    assert len(hi) > 20 and len(lo) > 20
    assert sum(lo) / len(lo) < 0.3 and sum(hi) / len(hi) > 1.5, (sum(lo) / len(lo), sum(hi) / len(hi))
    assert sp["discarded_drafts"] == sum(k for k, _ in d.log) - sum(verified) > 0
    assert sum(int(k) * m for k, m in sp["verified_drafts"].items()) == sum(verified)
    cal = sp["calibration"]
    assert len(cal["by_depth"]) == 4 and cal["by_depth"][0]["n"] > 100
    assert abs(cal["pooled"]["slope"] - 3.0) < 0.6 and abs(cal["pooled"]["bias"] - math.log(0.6 / 0.4)) < 0.4
    rate = _model_rate(sp, H200)
    fixed = {w: _model_rate(_run(0.6, n, w, sep=3.0)[0].speculative, H200) for w in (2, 3, 4, 5)}
    plain = 1 / H200[1]
    ac = _model_rate(_run(0.6, n, WidthPolicy(costs=H200))[0].speculative, H200)  # no head: acceptance-and-cost
    assert rate > 1.08 * max(max(fixed.values()), plain, ac), (rate, fixed, plain, ac)


@pytest.mark.parametrize("alpha,costs,want", [(0.5, H200, 1), (0.9, CHEAP, 4), (0.1, H200, 0)])
def test_useless_confidence_converges_to_the_acceptance_and_cost_choice(alpha, costs, want):
    """SEP 0: the confidence carries nothing, the calibration's slope goes to 0 and its bias to logit(ALPHA), and
    the steps of the second half choose what the acceptance-and-cost policy (no head) chooses there."""
    n = 500
    res0, st0, _, w0 = _run(alpha, n, WidthPolicy(costs=costs), sep=0.0)
    res1, st1, _, w1 = _run(alpha, n, WidthPolicy(costs=costs))
    assert res0.tokens == w0 and res1.tokens == w1
    assert res0.speculative["policy"] == "confidence" and res1.speculative["policy"] == "acceptance-cost"
    late0, late1 = st0.steps[len(st0.steps) // 2:], st1.steps[len(st1.steps) // 2:]
    for late in (late0, late1):
        share = late.count(want + 1) / len(late)
        assert share > 0.9, (share, late)
    pooled = res0.speculative["calibration"]["pooled"]
    assert abs(pooled["slope"]) < 0.25
    if alpha != 0.1:  # at 0.1 the policy soon stops drafting (gated): few outcomes
        assert abs(_sig(pooled["bias"]) - alpha) < 0.08, pooled


def test_useless_drafter_is_gated_to_plain_steps():
    res, st, d, want = _run(0.0, 400, WidthPolicy(costs=H200), sep=2.0)
    assert res.tokens == want
    gate = ConfidencePolicy.GATE  # drafted steps with no accepted draft, then plain steps ...
    assert len(d.log) == gate + (len(st.steps) - gate) // ConfidencePolicy.PROBE_EVERY  # ... and a probe in 32
    assert st.steps[:ConfidencePolicy.EXPLORE_STEPS] == [5] * ConfidencePolicy.EXPLORE_STEPS
    probes = st.steps[gate:]
    assert probes.count(2) == len(d.log) - gate and set(probes) == {1, 2}  # each probe verifies one draft
    assert res.speculative["discarded_drafts"] == sum(k for k, _ in d.log) - sum(w - 1 for w in st.steps)


def test_sampling_keeps_the_acceptance_and_cost_policy():
    """Choosing drafts by their confidence would bias the exact sampling rule: sampling requests ignore it."""
    res, st, d, _ = _run(0.8, 60, WidthPolicy(costs=H200), sep=3.0, temperature=0.7, seed=1)
    sp = res.speculative
    assert sp["policy"] == "acceptance-cost" and "calibration" not in sp and len(res.tokens) == 60
    fixed, _, _, _ = _run(0.8, 30, 3, sep=3.0)
    assert fixed.speculative["policy"] == "fixed"


def test_oracle_confidence_head():
    d = OracleDrafter(0.5, V, seed=4, continuation=list(range(40)), sep=4.0)
    d.prepare(None, [1, 2], 40)
    right, wrong = [], []
    for at in range(0, 36, 4):
        drafts, q = d.propose([1, 2] + list(range(at)), 4)
        assert q is None and len(d.confidence) == 4
        for i, (t, c) in enumerate(zip(drafts, d.confidence)):
            (right if t == at + i else wrong).append(confidence_logit(c))
    assert len(right) > 5 and len(wrong) > 5
    assert sum(right) / len(right) > 1.0 > -1.0 > sum(wrong) / len(wrong)  # N(+2, 1) against N(-2, 1)
    # the same seed drafts the same tokens with and without a head (its own random stream)
    a = OracleDrafter(0.5, V, seed=4, continuation=list(range(40)))
    a.prepare(None, [1, 2], 40)
    d.prepare(None, [1, 2], 40)
    assert a.propose([1, 2], 4)[0] == d.propose([1, 2], 4)[0] and a.confidence is None
    assert make_drafter("oracle:0.7:2.5", V).name == "oracle:0.7:2.5" and make_drafter("oracle:0.7", V).sep is None
    for bad, msg in (("oracle:0.7:x", "with SEP a finite number >= 0, found 'x'"),
                     ("oracle:0.7:-1", "SEP a finite number >= 0, found '-1'"),
                     ("oracle:0.7:inf", "SEP a finite number >= 0, found .inf."),
                     ("oracle:0.7:1:2", "expected at most two numbers after 'oracle:'"),
                     ("oracle:y:1", "ALPHA a number in \\[0, 1\\], found 'y'")):
        with pytest.raises(StepError, match=msg) as ei:
            make_drafter(bad, V)
        assert "\n" not in str(ei.value)


# ------------------------------------------------------------------------------------------ real steppers

def test_greedy_confidence_policy_on_the_reference_equals_autoregressive(tiny_weights):
    ref = Reference(tiny_weights, max_ctx=256)
    prompt = [5, 17, 301, 42, 7, 99]
    ar = generate(ref, prompt, 64).tokens
    d = OracleDrafter(0.7, 512, seed=2, continuation=ar, sep=3.0)
    res = generate(ref, prompt, 64, draft=d, spec_width=WidthPolicy(costs=H200))
    assert res.tokens == ar
    sp = res.speculative
    assert sp["policy"] == "confidence" and sp["discarded_drafts"] > 0 and len(sp["widths"]) >= 3, sp


def test_dspark_drafter_confidence_drives_auto(tiny_path, tiny_weights, tmp_path):
    """The DSpark drafter's own head (7.3.4): a greedy ``auto`` request uses it and still equals AR."""
    from ds4c.drafters.dspark import DSparkDrafter
    from ds4c.drafters.dspark_synth import make_dspark

    path = make_dspark(tiny_path, tmp_path / "d4.gguf", seed=3, block_size=4, conf_bias=True)
    ref = Reference(tiny_weights, max_ctx=128)
    prompt = [5, 17, 301, 42, 7, 99]
    ar = generate(ref, prompt, 24).tokens
    res = generate(ref, prompt, 24, draft=DSparkDrafter(path), spec_width=WidthPolicy(costs=CHEAP))
    assert res.tokens == ar
    sp = res.speculative
    assert sp["policy"] == "confidence" and sp["calibration"]["pooled"]["n"] > 0


def test_cli_auto_with_a_confidence_head(tmp_path, tiny_path):
    from ds4c.cli import main

    base = ["generate", str(tiny_path), "--prompt-ids", "5,17,301", "--max-new-tokens", "16", "--ignore-eos",
            "--json"]
    env = {"DS4C_HOME": str(tmp_path)}
    plain = json.loads(CliRunner().invoke(main, base, env=env).output.strip().splitlines()[-1])
    r = CliRunner().invoke(main, base + ["--draft", "oracle:0.8:3", "--spec-width", "auto"], env=env)
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output.strip().splitlines()[-1])
    sp = rec["speculative"]
    assert rec["tokens"] == plain["tokens"] and sp["policy"] == "confidence" and sp["drafter"] == "oracle:0.8:3"
    assert {"discarded_drafts", "verified_drafts", "calibration", "widths"} <= set(sp)
    bad = CliRunner().invoke(main, base + ["--draft", "oracle:0.8:z"], env=env)
    assert bad.exit_code == 2 and "with SEP a finite number >= 0, found 'z'" in bad.output
