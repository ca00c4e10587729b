"""Speculative decoding (ds4c/speculative.py): the acceptance rule is exact (chi-square against the target's
distribution, for a deterministic drafter and for one with its own distributions), and on the reference greedy
speculative output equals greedy autoregressive output token for token over 140 tokens (crossing ratio-4 /
ratio-16 flushes and window wraps of the tiny preset, and past the point where the indexer chooses among more
ratio-16 blocks than its top-k of 8 keeps) at every width; errors are one line."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ds4c.errors import StepError
from ds4c.generate import filter_logits, generate
from ds4c.reference import Reference
from ds4c.drafters.factory import make_drafter
from ds4c.drafters.oracle import OracleDrafter
from ds4c.speculative import SpecStats, WidthPolicy, accept, accept_greedy
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
    top = logits.argmax(-1).tolist()  # the device path: the rows' argmax only
    for drafts in ([3, 5, 7], [3, 2, 7], [0, 5, 7], [3, 5], []):
        assert accept_greedy(top[:len(drafts) + 1], drafts) == accept(logits[:len(drafts) + 1], drafts, None, 0.0)


def test_width_policy_maximises_expected_tokens_per_second():
    costs = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4}
    pol = WidthPolicy(costs=costs)
    assert pol.adaptive and pol.acceptance(0) == 0.5
    for _ in range(50):  # every draft accepted: the widest step pays
        pol.update(4, 4)
    assert pol.choose(10) == 4 and pol.choose(2) == 2 and pol.choose(0) == 0
    bad = WidthPolicy(costs=costs)
    for _ in range(50):  # nothing accepted: a verify row costs more than it brings, so plain decode steps
        bad.update(4, 0)
    assert bad.acceptance(0) < 0.05 and bad.reached[1] == 0 and bad.choose(10) == 0
    mid = WidthPolicy(costs={1: 1.0, 2: 1.9, 3: 2.8, 4: 3.7, 5: 4.6})  # cost linear in rows: no width pays at 0.5
    assert mid.choose(10) == 4  # no evidence yet: explore with every draft allowed
    mid.reached, mid.ok = [10] * 4, [4] * 4  # (4 + 1) / (10 + 2) = 0.42
    assert mid.choose(10) == 0
    probes = [mid.choose(10) for _ in range(2 * WidthPolicy.PROBE_EVERY)]
    assert probes.count(1) == 2 and set(probes) == {0, 1}  # one draft now and then, to notice a change
    # by hand: a = 0.9 at every depth, costs above: E(k) / cost(k + 1) is largest at k = 4
    nine = WidthPolicy(costs=costs)
    nine.reached, nine.ok = [98] * 4, [88] * 4  # (88 + 1) / (98 + 2) = 0.89
    rates = [(1 + sum(0.89 ** i for i in range(1, k + 1))) / costs[k + 1] for k in range(5)]
    assert nine.choose(10) == max(range(5), key=lambda k: rates[k])
    fixed = WidthPolicy(3)
    assert not fixed.adaptive and fixed.choose(10) == 2 and fixed.choose(1) == 1


@pytest.fixture(scope="module")
def ref(tiny_weights):
    return Reference(tiny_weights, max_ctx=512)


PROMPTS = [[5, 17, 301, 42, 7, 99], list(range(30, 61))]
N_PIPE = 60  # the pipelined loop against the synchronous one: 12+ verify steps at width 5
N_AR = 140  # 6 + 140 positions: 9 ratio-16 blocks, more than index_topk (8); 16-token windows wrap 9 times


@pytest.fixture(scope="module")
def ar(ref):
    return {i: generate(ref, p, N_AR).tokens for i, p in enumerate(PROMPTS)}


# widths 2, 3 and 5 and both prompts (width 4 runs in the oracle-drafter and sampling tests below)
@pytest.mark.parametrize("which,width", [(0, 2), (1, 3), (0, 5)])
def test_greedy_speculative_equals_autoregressive(ref, ar, width, which):
    drafter = OracleDrafter(0.7, 512, seed=width, continuation=ar[which])
    res = generate(ref, PROMPTS[which], N_AR, draft=drafter, spec_width=width)
    assert res.tokens == ar[which]
    sp = res.speculative
    assert sp["tokens"] == N_AR - 1 and sp["width"] == width
    assert 1 < sp["tokens_per_step"] <= width
    assert len(sp["acceptance_by_depth"]) == width - 1
    acc = sp["acceptance_by_depth"]
    assert 0.5 < acc[0] < 0.9 and all(a >= b for a, b in zip(acc, acc[1:]))  # alpha 0.7, cumulative by depth


def test_oracle_alpha_bounds_acceptance(ref, ar):
    perfect = generate(ref, PROMPTS[0], 60, draft=OracleDrafter(1.0, 512, continuation=ar[0]), spec_width=5)
    assert perfect.tokens == ar[0][:60] and perfect.speculative["acceptance_by_depth"] == [1.0] * 4
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
    for bad, msg in (("oracle:1.5", "--draft 'oracle:1.5': expected oracle:ALPHA\\[:SEP\\] with ALPHA a number in "
                                    "\\[0, 1\\], found '1.5'"),
                     ("oracle:x", "ALPHA a number in \\[0, 1\\], found 'x'"), ("oracle", "found no ALPHA"),
                     ("dspark", "expected dspark:PATH .* found an empty path"), ("foo", "unknown drafter 'foo'")):
        with pytest.raises(StepError, match=msg) as ei:
            make_drafter(bad, 512)
        assert "\n" not in str(ei.value)


def test_bad_width_is_one_line(ref):
    for w in (0, 6, True, "wide"):
        with pytest.raises(StepError, match="speculative width must be an int in 1..5 .* or 'auto'"):
            generate(ref, [1, 2], 4, draft=make_drafter("oracle:0.5", 512), spec_width=w)


def test_adaptive_width_on_the_reference(ref, ar):
    """``spec_width="auto"``: the output is still the autoregressive one; the widths follow the acceptance (a
    perfect drafter keeps wide steps, a useless one falls back to plain decode steps) and the measured costs
    are reported."""
    auto = generate(ref, PROMPTS[0], 40, draft=OracleDrafter(0.8, 512, continuation=ar[0]), spec_width="auto")
    assert auto.tokens == ar[0][:40]
    sp = auto.speculative
    assert sp["width"] == "auto" and set(sp["verify_ms_by_width"]) == {"1", "2", "3", "4", "5"}
    # a GPU-like cost table (a verify row costs far less than a step): the policy's choices follow acceptance
    costs = {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2}
    good = generate(ref, PROMPTS[0], 80, draft=OracleDrafter(1.0, 512, continuation=ar[0]),
                    spec_width=WidthPolicy(costs=costs))
    assert good.tokens == ar[0][:80] and good.speculative["tokens_per_step"] > 4.0
    bad = generate(ref, PROMPTS[0], 120, draft=OracleDrafter(0.0, 512, continuation=ar[0]),
                   spec_width=WidthPolicy(costs=costs))
    assert bad.tokens == ar[0][:120]
    w = bad.speculative["widths"]
    assert w.get("1", 0) > 3 * sum(n for k, n in w.items() if k != "1"), w  # a few steps to learn, then decode


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
    assert bad.exit_code == 2 and "ALPHA a number in [0, 1]" in bad.output
    r = run(*base, "--draft", "oracle:0.8", "--spec-width", "auto")
    assert r.exit_code == 0, r.output
    spec = json.loads(r.output.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["width"] == "auto"
    r = run(*base, "--draft", "oracle:0.8", "--spec-width", "1")
    assert r.exit_code == 0 and "note: --spec-width 1" in r.output and "plain decode" in r.output
    assert json.loads(r.output.strip().splitlines()[-1])["speculative"]["note"].startswith("--spec-width 1")
    for w in ("6", "two", ""):
        bad = run(*base, "--draft", "oracle:0.8", "--spec-width", w)
        assert bad.exit_code == 2 and "--spec-width: expected 1..5 (verify rows per step) or auto" in bad.output
    r = run(*base, "--spec-width", "3")  # no drafter: said once, the run is the plain one
    assert r.exit_code == 0 and "note: --spec-width" in r.output and "without --draft" in r.output
    assert json.loads(r.output.strip().splitlines()[-1])["tokens"] == plain["tokens"]
    assert "without --draft" not in run(*base).output


def test_the_device_loop_is_closed_when_generation_ends(tiny_weights):
    """A stepper's ``decode_tokens`` generator is closed as soon as generate / a stream has produced its tokens
    (its ``finally`` records how far the device went), not at garbage collection, where it would move the
    position of whatever request runs then. CPU: a reference stepper with a host ``decode_tokens``."""
    import gc

    from ds4c.generate import generate, stream
    from ds4c.reference import Reference

    class Stepper(Reference):
        closed = 0

        def decode_tokens(self, token, pos, n, temperature=0.0, top_k=0, top_p=1.0, seed=0, lag=4):
            try:
                for i in range(n):
                    token = int(self.decode(token, pos + i).argmax())
                    yield token
            finally:
                Stepper.closed += 1

    st = Stepper(tiny_weights, max_ctx=128)
    gc.disable()
    try:
        res = generate(st, [5, 17, 301], 12)
        assert Stepper.closed == 1 and len(res.tokens) == 12
        s = stream(st, [5, 17, 301], 6)
        assert len(list(s)) == 6 and Stepper.closed == 2
        assert generate(Reference(tiny_weights, max_ctx=128), [5, 17, 301], 12).tokens == res.tokens
    finally:
        gc.enable()


class _QueuedOnTheReference:
    """What the pipelined loop needs of ``ds4c.runtime.spec_pipeline.GreedyPipeline``, on the reference: steps
    are queued (width and bucket bound recorded), released with tokens, run at release (verify, greedy accept,
    rollback) and awaited in order; ``close`` runs a held step as a decode kept to one row. Checks the order
    the loop keeps: at most two queued, release before result, widths as queued."""

    def __init__(self, ref):
        self.ref, self.queue, self.log = ref, [], []
        self.step = ref  # the loop reads its vocabulary from here
        self.owner = None

    def check_owner(self, me):
        if self.owner is not me:
            raise StepError("ended by another call")

    def enqueue(self, width, pos_bound):
        assert len(self.queue) < 2
        self.queue.append({"width": width, "bound": pos_bound, "new": None})

    def release(self, tokens, pos, keep=None):
        q = next(x for x in self.queue if x["new"] is None)
        assert len(tokens) == q["width"] and pos <= q["bound"] and pos == self.ref.state.pos
        top = self.ref.verify(tokens, pos).argmax(dim=-1).tolist()
        new = accept_greedy(top, tokens[1:])[: keep or None]
        self.ref.rollback(len(new))
        q["new"] = new
        self.log.append((q["width"], pos))

    def result(self):
        assert self.queue and self.queue[0]["new"] is not None
        return self.queue.pop(0)["new"]

    def close(self, token, pos):
        while self.queue and self.queue[0]["new"] is not None:
            new = self.result()
            token, pos = new[-1], pos + len(new)
        for q in list(self.queue):
            self.release([token] * q["width"], pos, keep=1)
            pos += 1
        self.queue.clear()


@pytest.mark.parametrize("width", [3, 5])
def test_the_pipelined_loop_equals_the_synchronous_one(ref, ar, width):
    """ds4c.speculative's pipelined loop (each step queued before the previous one's result, as on the compiled
    step) gives the synchronous loop's tokens and steps on the reference, ends with nothing queued and a
    state at most two steps past the output (the step released before the consumer stopped), also when the
    consumer stops early."""
    from ds4c.speculative import _pipelined_tokens

    sync = generate(ref, PROMPTS[0], N_PIPE, draft=OracleDrafter(0.7, 512, seed=2, continuation=ar[0]),
                    spec_width=width)
    for n in (N_PIPE, 9):
        prompt = PROMPTS[0]
        ref.reset()
        logits = None
        for s in range(0, len(prompt), 5):
            logits = ref.verify(prompt[s:s + 5], s)
        first = int(logits[-1].argmax())
        pipe = _QueuedOnTheReference(ref)
        stats = SpecStats("oracle", width)
        d = OracleDrafter(0.7, 512, seed=2, continuation=ar[0])
        d.prepare(ref, prompt, N_PIPE)
        gen = _pipelined_tokens(pipe, d, prompt, first, n - 1 if n == N_PIPE else N_PIPE - 1, WidthPolicy(width), stats)
        got = [first] + [t for _, t in zip(range(n - 1), gen)]
        gen.close()
        assert got == sync.tokens[:n]
        assert not pipe.queue and 0 <= ref.state.pos - (len(prompt) + n - 1) <= 2 * width
        if n == N_PIPE:  # the same steps, but for the last one's width: chosen before the tokens left were known
            a, b = stats.as_dict()["widths"], sync.speculative["widths"]
            assert sum(a.values()) == sum(b.values())
            assert sum(abs(a.get(w, 0) - b.get(w, 0)) for w in set(a) | set(b)) <= 2, (a, b)
        # the state is valid where it stopped: the next decode there gives the AR run's token
        p = ref.state.pos
        seq = prompt + ar[0]
        assert int(ref.decode(seq[p], p)[0].argmax()) == seq[p + 1]


def test_a_new_generation_ends_an_unfinished_stream_on_the_same_stepper(ref, ar):
    """Two generations share a stepper's sequence state: one started while a stream is unfinished ends that
    stream (its next read is a one-line StepError) instead of both silently reading the mixed state; the new
    one's tokens are right."""
    from ds4c.generate import stream

    ts = stream(ref, PROMPTS[0], 12, draft=OracleDrafter(0.8, 512, continuation=ar[0]), spec_width=3)
    assert [next(ts) for _ in range(2)] == ar[0][:2]
    assert generate(ref, [9] * 5, 2).tokens == generate(ref, [9] * 5, 2).tokens
    with pytest.raises(StepError, match="ended by another generation on the same model") as ei:
        next(ts)
    assert "\n" not in str(ei.value)
    plain = stream(ref, PROMPTS[0], 6)  # also without a drafter
    next(plain)
    generate(ref, PROMPTS[0], 3)
    with pytest.raises(StepError, match="ended by another generation"):
        next(plain)
    assert generate(ref, PROMPTS[0], 12).tokens == ar[0][:12]


def test_speculative_report_counts_kept_tokens_and_bad_drafts_are_one_line(ref, ar):
    """The report's ``tokens`` are the tokens the request kept (a stop inside a step's accepted tokens ends it
    early), ``tokens_verified`` all the steps produced; with max_new_tokens <= 1 the report is there with no
    steps (and nothing is measured or prepared); a wrong ``draft`` type and a drafter's bad proposal are
    one-line errors naming what was expected."""
    from ds4c.generate import stream

    stop = ar[0][7]
    res = generate(ref, PROMPTS[0], 40, draft=OracleDrafter(1.0, 512, continuation=ar[0]), spec_width=5,
                   stop_ids={stop})
    sp = res.speculative
    assert res.tokens[-1] == stop and sp["tokens"] == len(res.tokens) - 1 <= sp["tokens_verified"]
    assert sp["tokens_per_step"] == sp["tokens_verified"] / sp["steps"]

    class Counting(OracleDrafter):
        prepared = 0

        def prepare(self, stepper, prompt, n):
            Counting.prepared += 1
            super().prepare(stepper, prompt, n)

    for n in (0, 1):
        r = generate(ref, PROMPTS[0], n, draft=Counting(0.5, 512), spec_width="auto")
        assert r.speculative is not None and r.speculative["steps"] == 0 and r.speculative["tokens"] == n - (n > 0)
    assert Counting.prepared == 0
    for bad in (0.7, True, b"oracle:0.5", object()):
        with pytest.raises(StepError, match="draft: expected a drafter spelling") as ei:
            stream(ref, PROMPTS[0], 4, draft=bad)
        assert "\n" not in str(ei.value)

    class Bad(OracleDrafter):
        def __init__(self, out):
            super().__init__(0.5, 512, continuation=ar[0])
            self.out = out

        def propose(self, context, k):
            return self.out(k)

    for out, msg in ((lambda k: ([999999] * k, None), "proposed token ids outside 0..511"),
                     (lambda k: ([1] * (k + 1), None), "asked for 2 drafts, proposed 3"),
                     (lambda k: (["x"] * k, None), "expected integer token ids"),
                     (lambda k: ([1.5] * k, None), "expected integer token ids from propose\\(\\), found \\[1.5"),
                     (lambda k: (7, None), "expected a list of token ids"),
                     (lambda k: [1] * (k + 1), "propose\\(\\) must return \\(token ids, q or None\\), found "
                                              "\\[1, 1, 1\\]"),
                     (lambda k: None, "must return \\(token ids, q or None\\), found None"),
                     (lambda k: ([1] * k, torch.zeros(1, 3)), "q must be None or a tensor \\[>= 2 drafts, 512\\], "
                                                            "found a tensor \\[1, 3\\]")):
        with pytest.raises(StepError, match=msg) as ei:
            generate(ref, PROMPTS[0], 6, draft=Bad(out), spec_width=3)
        assert str(ei.value).startswith("drafter oracle:0.5")

    class Nameless:  # a custom drafter with no name: named by its class
        def prepare(self, stepper, prompt, n):
            pass

        def propose(self, context, k):
            return [999999] * k, None

    with pytest.raises(StepError, match="^drafter Nameless: proposed token ids outside"):
        generate(ref, PROMPTS[0], 6, draft=Nameless(), spec_width=3)
    with pytest.raises(StepError, match="expected dspark:PATH .* found an empty path"):
        make_drafter("dspark:", 512)
    with pytest.raises(StepError, match=r"ALPHA a number in \[0, 1\], found 'abc'"):
        make_drafter("oracle:abc", 512)
