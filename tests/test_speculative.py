"""Speculative decoding (ds4c/speculative.py): the acceptance rule is exact (chi-square against the target's
distribution, for a deterministic drafter and for one with its own distributions), and on the reference greedy
speculative output equals greedy autoregressive output token for token over 300 tokens (crossing every
ratio-4 / ratio-16 flush and window wrap of the tiny preset) at every width; errors are one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ds4c.errors import StepError
from ds4c.generate import filter_logits, generate
from ds4c.reference import Reference
from ds4c.speculative import OracleDrafter, SpecStats, accept, make_drafter
from test_sampler import CHI2_1E4, _chi2

V = 9


def _target(seed: int) -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 6, 0.9)])
@pytest.mark.parametrize("with_q", [False, True])
def test_acceptance_is_exact_in_distribution(temperature, top_k, top_p, with_q):
    """First output token ~ p0; given the first draft accepted, the second ~ p1 (drafts drawn from q)."""
    logits = _target(1)
    p = torch.softmax(filter_logits(logits, temperature, top_k, top_p) / temperature, dim=-1).double()
    q = torch.softmax(torch.randn(2, V, generator=torch.Generator().manual_seed(2)), dim=-1) if with_q else None
    g = torch.Generator().manual_seed(3)
    n = 8000
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        if q is None:
            drafts = [int(torch.argmax(logits[0])), 4]
        else:
            drafts = [int(torch.multinomial(q[0], 1, generator=g)), int(torch.multinomial(q[1], 1, generator=g))]
        out = accept(logits, drafts, q, temperature, top_k, top_p, g)
        assert 1 <= len(out) <= 3
        first[out[0]] += 1
        if len(out) >= 2 and out[0] == drafts[0]:
            second[out[1]] += 1
    for counts, want in ((first, p[0]), (second, p[1])):
        m = int(counts.sum())
        assert m > 500 and counts[want == 0].sum() == 0
        stat, df = _chi2(counts, want, m)
        assert df == 0 or stat < CHI2_1E4[df], (counts.tolist(), (want * m).tolist())  # df 0: one token kept


def test_greedy_acceptance_keeps_the_agreeing_prefix():
    logits = torch.zeros(4, V)
    for i, t in enumerate((3, 5, 7, 1)):
        logits[i, t] = 1.0
    assert accept(logits, [3, 5, 7], None, 0.0) == [3, 5, 7, 1]       # all kept + the bonus
    assert accept(logits, [3, 2, 7], None, 0.0) == [3, 5]              # the target's token replaces draft 1
    assert accept(logits, [0, 5, 7], None, 0.0) == [3]
    assert accept(logits[:1], [], None, 0.0) == [3]


@pytest.fixture(scope="module")
def ref(tiny_weights):
    return Reference(tiny_weights, max_ctx=512)


PROMPTS = [[5, 17, 301, 42, 7, 99], list(range(30, 61))]


@pytest.fixture(scope="module")
def ar(ref):
    return {i: generate(ref, p, 300).tokens for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("which,width", [(0, 2), (0, 3), (0, 4), (0, 5), (1, 2), (1, 5)])
def test_greedy_speculative_equals_autoregressive(ref, ar, width, which):
    drafter = OracleDrafter(0.7, 512, seed=width, continuation=ar[which])
    res = generate(ref, PROMPTS[which], 300, draft=drafter, spec_width=width)
    assert res.tokens == ar[which]
    sp = res.speculative
    assert sp["tokens"] == 299 and sp["width"] == width
    assert 1 < sp["tokens_per_step"] <= width
    assert len(sp["acceptance_by_depth"]) == width - 1
    acc = sp["acceptance_by_depth"]
    assert 0.5 < acc[0] < 0.9 and all(a >= b for a, b in zip(acc, acc[1:]))  # alpha 0.7, cumulative by depth


def test_oracle_alpha_bounds_acceptance(ref, ar):
    perfect = generate(ref, PROMPTS[0], 120, draft=OracleDrafter(1.0, 512, continuation=ar[0]), spec_width=5)
    assert perfect.tokens == ar[0][:120] and perfect.speculative["acceptance_by_depth"] == [1.0] * 4
    assert perfect.speculative["tokens_per_step"] > 4.5
    wrong = generate(ref, PROMPTS[0], 60, draft=OracleDrafter(0.0, 512, continuation=ar[0]), spec_width=3)
    assert wrong.tokens == ar[0][:60] and wrong.speculative["acceptance_by_depth"] == [0.0, 0.0]


def test_oracle_drafter_runs_its_own_autoregressive_pass(ref, ar):
    res = generate(ref, PROMPTS[0], 40, draft=make_drafter("oracle:0.9", 512), spec_width=4)
    assert res.tokens == ar[0][:40]


def test_speculative_sampling_runs_and_is_seeded(ref, ar):
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, spec_width=4)

    def run(seed: int):
        return generate(ref, PROMPTS[0], 30, seed=seed, draft=OracleDrafter(0.8, 512, continuation=ar[0]), **kw)

    a, b, c = run(1), run(1), run(2)
    assert a.tokens == b.tokens and a.tokens != c.tokens and len(a.tokens) == 30
    assert all(0 <= t < 512 for t in a.tokens) and a.speculative["steps"] > 0


def test_stats_and_errors():
    st = SpecStats("oracle:0.5", 3)
    st.record(2, 1)
    st.record(2, 2)
    st.record(0, 0)
    d = st.as_dict()
    assert d["steps"] == 3 and d["tokens"] == 6 and d["acceptance_by_depth"] == [1.0, 0.5]
    assert d["widths"] == {"1": 1, "3": 2}
    for bad, msg in (("oracle:1.5", "ALPHA must be a number in \\[0, 1\\]"), ("oracle:x", "expected ALPHA"),
                     ("dspark", "unknown drafter 'dspark'")):
        with pytest.raises(StepError, match=msg) as ei:
            make_drafter(bad, 512)
        assert "\n" not in str(ei.value)


def test_bad_width_is_one_line(ref):
    for w in (0, 6, True):
        with pytest.raises(StepError, match="speculative width must be an int in 1..5"):
            generate(ref, [1, 2], 4, draft=make_drafter("oracle:0.5", 512), spec_width=w)


def test_cli_draft(tmp_path, tiny_path):
    from ds4c.cli import main

    def run(*args):
        r = CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(tmp_path)})
        return r

    base = ["generate", tiny_path, "--prompt-ids", "5,17,301", "--max-new-tokens", "24", "--ignore-eos", "--json"]
    plain = json.loads(run(*base).output.strip().splitlines()[-1])
    r = run(*base, "--draft", "oracle:0.8", "--spec-width", "3")
    assert r.exit_code == 0, r.output
    spec = json.loads(r.output.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["width"] == 3
    bad = run(*base, "--draft", "oracle:2")
    assert bad.exit_code == 2 and "ALPHA must be a number in [0, 1]" in bad.output
