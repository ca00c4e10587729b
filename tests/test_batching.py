"""Many sequences on the reference (issue 30, docs/batching.md): the lanes step, the paged pool and its prefix
cache, the continuous-batching engine and ``Model(lanes=N)``.

Every equality here is bit for bit: the reference's primitives are row-invariant, so a lane's logits and tokens
must equal the same sequence run alone (the one-sequence loop, ``ds4c.generate``). The pools poison freed pages
with NaN, so a read of a page a sequence no longer holds shows as non-finite logits or a changed token.

The tiny preset (window 16, ratios 4 and 16) pages every 16 positions: 128 tokens cross 8 window wraps, 8 HCA
and 32 CSA flushes and 8 page boundaries.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from ds4c import Model
from ds4c.batching import BatchConfig, BatchEngine
from ds4c.errors import Ds4cError, StepError
from ds4c.generate import generate
from ds4c.pages import PageAllocator, PrefixCache
from ds4c.reference import Reference
from ds4c.pages import check_page_tokens, default_page_tokens, lane_state_bytes, page_bytes
from ds4c.reference.paged import StatePool
from ds4c.reference.state import SequenceState

MAX_CTX = 320


@pytest.fixture(scope="module")
def ref(tiny_weights):
    return Reference(tiny_weights, max_ctx=MAX_CTX)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------------ pages
def test_page_allocator_and_prefix_cache_bookkeeping():
    freed = []
    a = PageAllocator(4, freed.append)
    p = a.alloc(3)
    assert a.free == 1 and sorted(p) == [0, 1, 2]
    with pytest.raises(StepError, match="1 free pages, 2 were asked for"):
        a.alloc(2)
    a.incref(p[0])
    a.decref(p[0])
    assert freed == [] and a.refs[p[0]] == 1
    a.release(p)
    assert sorted(freed) == [0, 1, 2] and a.free == 4
    with pytest.raises(StepError, match="already free"):
        a.decref(0)
    with pytest.raises(StepError, match="cannot be shared"):
        a.incref(0)
    # the cache: a chain of pages keyed by every token before them; a node holds its page
    c = PrefixCache(a, 2, max_states=1)
    pa, pb = a.alloc(2)
    n0 = c.insert(None, [1, 2], pa, "s0")
    n1 = c.insert(n0, [3, 4], pb, "s1")
    assert a.refs[pa] == a.refs[pb] == 2 and c.states == 1 and n0.state is None  # one state kept: the newest
    assert c.match([1, 2, 3, 4]) == []  # n1 would leave no token to compute, n0 lost its state
    assert c.match([1, 2, 3, 4, 5]) == [n0, n1]
    assert c.match([1, 2, 9, 9, 5]) == []  # n0 has no state left
    assert c.match([9, 2, 3, 4, 5]) == []
    a.release([pa, pb])  # the sequences end: the cache keeps the pages
    assert a.free == 2 and c.evictable() == 2
    assert c.evict(1) == 1 and list(c.nodes.values()) == [n0]  # leaves first
    c.clear()
    assert a.free == 4 and not c.nodes


def test_page_size_rules(ref):
    assert default_page_tokens(ref.cfg) == 16
    from ds4c.config import preset
    assert default_page_tokens(preset("flash")) == 128
    for bad in (0, 8, 24, "16", True):
        with pytest.raises(StepError, match="page_tokens must be a positive multiple of 16"):
            check_page_tokens(ref.cfg, bad)
    assert check_page_tokens(ref.cfg, 32) == 32


def test_pool_sizes_are_the_flat_states(ref):
    """A sequence's pages plus its lane state hold exactly what the one-sequence step's state buffers hold (the IR's
    state inputs) at a context that is a whole number of pages; ``ds4c info --plan`` prints the pool line and the
    compiled batch's slot line (a slot is the flat state)."""
    from click.testing import CliRunner

    from ds4c.cli import main
    from ds4c.config import preset
    from ds4c.ir.builder import state_inputs

    size = {"bf16": 2, "f32": 4}
    for cfg in (ref.cfg, preset("flash")):
        pt = default_page_tokens(cfg)
        flat = sum(size[t.dtype] * math.prod(t.shape) for t in state_inputs(cfg, 64 * pt).values())
        assert flat == 64 * page_bytes(cfg, pt) + lane_state_bytes(cfg), cfg.name
    r = CliRunner().invoke(main, ["info", "synthetic:flash:q2_k", "--plan", "--max-ctx", "65536", "--free-gib", "139"])
    assert r.exit_code == 0, r.output
    assert ("paged pool (lanes): pages of 128 tokens, 0.8 MiB each, + 17.0 MiB per sequence: a 65536-token sequence "
            "447.0 MiB; 84 such sequences fit") in r.output
    assert ("compiled lanes (--lanes on cuda): a slot of 447.0 MiB per sequence (its whole 65536 positions); 16 fit "
            "(a lanes step holds at most 16)") in r.output


def test_a_write_into_a_shared_page_copies_it_first(ref):
    pool = StatePool(ref.cfg, 8, poison=True)
    a = pool.new_sequence(32)
    rows = a.layers[3].comp  # ratio 16: one row per page
    rows[0] = torch.full((ref.cfg.head_dim,), 1.5, dtype=torch.bfloat16)
    b = pool.new_sequence(32)
    pool.alloc.decref(b.table[0])
    b.table[0] = a.table[0]  # share a's first page (as a reused prefix does)
    pool.alloc.incref(a.table[0])
    b.layers[3].comp[0] = torch.full((ref.cfg.head_dim,), -2.0, dtype=torch.bfloat16)
    assert b.table[0] != a.table[0]
    assert bool((rows[0] == 1.5).all()) and bool((b.layers[3].comp[0] == -2.0).all())
    assert bool((b.layers[3].comp[torch.tensor([-1, 0])][0] == 0).all())  # a masked -1 entry reads zeros


# ------------------------------------------------------------------------------------------------ the lanes step
def test_lanes_step_equals_each_sequence_alone(ref):
    """Three sequences stepped together with different row counts per step (decode, verify widths, prompt chunks
    longer than the window), on paged states of a poisoning pool and on a flat state: each lane's logits equal the
    same sequence's one-sequence steps bit for bit, also after a lane's rollback."""
    seqs = [ids(70, 1), ids(61, 2), ids(45, 3)]
    alone = []
    for toks in seqs:
        ref.reset()
        alone.append(torch.cat([ref.verify(toks[s:s + 5], s) for s in range(0, len(toks), 5)]))
    pool = StatePool(ref.cfg, 16, poison=True)
    states = [pool.new_sequence(80), pool.new_sequence(80), SequenceState.new(ref.cfg, 80)]
    widths = [(1, 3, 20, 1, 5), (2, 1, 1, 17, 4), (5, 1, 2, 3, 1)]
    got: list[list[torch.Tensor]] = [[], [], []]
    k = 0
    while any(st.pos < len(t) for st, t in zip(states, seqs)):
        lanes, who = [], []
        for j, (st, toks) in enumerate(zip(states, seqs)):
            if st.pos < len(toks):
                n = min(widths[j][k % 5], len(toks) - st.pos)
                lanes.append((st, toks[st.pos:st.pos + n], st.pos))
                who.append(j)
        out = ref.step_lanes(lanes)
        if k == 2:  # lane 0 keeps 4 of its 20 rows: rolled back to what 4 rows alone would leave
            lanes[0][0].rollback(4)
            out[0] = out[0][:4]
        for j, lg in zip(who, out):
            got[j].append(lg)
        k += 1
    for j in range(3):
        assert torch.equal(torch.cat(got[j]), alone[j]), j
    assert ref.pos == len(seqs[2])  # the reference's own sequence is not touched by lanes
    with pytest.raises(StepError, match="the same sequence state is in two lanes"):
        ref.step_lanes([(states[2], [1], states[2].pos), (states[2], [1], states[2].pos)])
    with pytest.raises(StepError, match="next position is"):
        ref.step_lanes([(states[2], [1], 0)])
    with pytest.raises(StepError, match="at least one lane"):
        ref.step_lanes([])
    with pytest.raises(StepError, match="expected \\(state, tokens, pos\\)"):
        ref.step_lanes([(states[2], [1])])


# ------------------------------------------------------------------------------------------------ the engine
def _alone(ref, prompt, n, **kw):
    return generate(ref, prompt, n, stop_ids=kw.pop("stop_ids", ()), **kw).tokens


def test_continuous_batching_equals_each_request_alone(ref):
    """Requests join and leave the running batch at different positions (128 new tokens for the longest, greedy
    and seeded sampling, a stop id, one cancelled in its prompt, one prompt that starts from the prefix cache):
    each request's tokens equal the same request alone; the pool's pages are all back (but the cache's) at the
    end, and a freed page is poisoned."""
    long_a, long_b = ids(21, 10), ids(40, 11)
    late = [(ids(7, 12), dict(temperature=0.9, top_k=40, seed=3)),
            (ids(33, 13), dict(temperature=1.0, top_p=0.8, seed=4))]
    eng = BatchEngine(ref, MAX_CTX, BatchConfig(max_lanes=3, max_rows=8, poison=True))
    want_a = _alone(ref, long_a, 128)
    want_b = _alone(ref, long_b, 90, temperature=0.7, seed=1)
    eos = want_b[50]  # a stop id the sampled request meets at its 51st token (or earlier, where it also occurs)
    want_b_eos = want_b[:want_b.index(eos) + 1]  # generate's stop: the same draws, up to and with the stop id
    want_late = [_alone(ref, p, 40, **kw) for p, kw in late]
    a = eng.submit(long_a, 128)
    b = eng.submit(long_b, 90, temperature=0.7, seed=1, stop_ids=(eos,))
    doomed = eng.submit(ids(200, 14), 10)  # the third lane; cancelled in its prompt
    for _ in range(12):
        next(a)
    c = eng.submit(late[0][0], 40, **late[0][1])  # waits for a lane
    while doomed.seq is None or doomed.seq.pos == 0:
        time.sleep(0.01)
    doomed.cancel()
    d = eng.submit(late[1][0], 40, **late[1][1])
    # a second turn: b's prompt and its first 30 tokens, then more; starts from b's cached pages
    for _ in range(30):
        next(b)
    turn2 = long_b + b.tokens[:30] + ids(5, 15)
    want_t2 = _alone(ref, turn2, 20)
    t2 = eng.submit(turn2, 20)
    res = {k: r.run() for k, r in dict(a=a, b=b, c=c, d=d, t2=t2).items()}
    assert res["a"].tokens == want_a and len(want_a) == 128
    assert res["b"].tokens == want_b_eos and res["b"].stop_reason == "eos"
    assert res["c"].tokens == want_late[0] and res["d"].tokens == want_late[1]
    assert res["t2"].tokens == want_t2 and t2.prefix_reused == 64  # 70 positions were cached: 4 full pages
    assert doomed.stop().stop_reason == "stop" and doomed.run().tokens == []
    st = eng.stats()
    assert st["running"] == 0 and st["pages_running"] == 0 and st["pages_in_use"] == st["prefix_pages"]
    eng.pool.prefix.clear()
    assert eng.pool.alloc.free == eng.pool.alloc.n_pages
    assert bool(torch.isnan(next(iter(eng.pool.comp.values()))).all())  # every page freed is poisoned
    eng.close()


def test_a_short_pool_is_a_wait_not_a_failure(ref):
    """A pool with room for two requests at a time and five submitted: they wait (first come, first served) and
    every one ends with its alone tokens; pages in use never pass the pool; the cache's pages are evicted for
    admission."""
    prompts = [ids(9 + 3 * k, 20 + k) for k in range(5)]
    want = [_alone(ref, p, 24) for p in prompts]
    eng = BatchEngine(ref, MAX_CTX, BatchConfig(max_lanes=4, max_rows=8, pages=6, poison=True))
    reqs = [eng.submit(p, 24) for p in prompts]
    peak = 0
    while any(r.result is None for r in reqs):
        st = eng.stats()
        peak = max(peak, st["running"])
        assert st["pages_in_use"] <= 6
        for r in reqs:
            while r._read < len(r.tokens):
                next(r)
        time.sleep(0.005)
    assert [r.result.tokens for r in reqs] == want
    assert peak <= 2
    with pytest.raises(StepError, match="need 20 pages; the pool has 6"):
        eng.submit(ids(300, 1), 20)
    eng.close()
    with pytest.raises(StepError, match="closed"):
        eng.submit([1], 1)


def test_cancelling_one_running_request_leaves_the_others_running(ref):
    """The first of four running requests is cancelled mid-decode: it ends ``stop``; the three after it (which a
    scheduler that edits its running list while walking it would drop) finish with their alone tokens."""
    prompts = [ids(5 + k, 30 + k) for k in range(4)]
    want = [_alone(ref, p, 12) for p in prompts[1:]]
    eng = BatchEngine(ref, 64, BatchConfig(max_lanes=4, max_rows=8))
    reqs = [eng.submit(p, 12 if k else 40) for k, p in enumerate(prompts)]
    for _ in range(3):
        next(reqs[0])
    assert reqs[0].stop().stop_reason == "stop"
    assert all(r._done.wait(120) for r in reqs[1:]), "a running request was dropped"
    assert [r.run().tokens for r in reqs[1:]] == want
    eng.close()


def test_a_matched_prefix_survives_the_eviction_that_makes_room_for_it(ref):
    """A short pool: a request that starts from a cached prefix while the pool is full of other cached pages and a
    running sequence: making room evicts other pages, never the prefix it is about to share; both requests give
    their alone tokens and the hit is counted once."""
    pa = list(range(10, 43))  # 33 tokens: two full pages cached
    r_prompt, b_prompt = list(range(100, 117)), pa + list(range(200, 207))
    want_r, want_b = _alone(ref, r_prompt, 47), _alone(ref, b_prompt, 24)
    eng = BatchEngine(ref, 64, BatchConfig(max_lanes=2, max_rows=16, pages=6))
    eng.submit(pa, 1).run()
    assert eng.stats()["prefix_pages"] == 2
    r = eng.submit(r_prompt, 47)
    next(r)
    b = eng.submit(b_prompt, 24)
    assert r._done.wait(120) and b._done.wait(120), "a request hung"
    assert (r.run().tokens, b.run().tokens) == (want_r, want_b)
    assert b.prefix_reused == 32 and eng.stats()["prefix_hits"] == 1
    eng.close()


def test_a_failing_callback_fails_its_own_request_only(ref):
    want = _alone(ref, ids(9, 40), 16)
    eng = BatchEngine(ref, 64, BatchConfig(max_lanes=2, max_rows=4))

    def broken(done: int, total: int) -> None:
        raise ValueError("my callback broke")

    good = eng.submit(ids(9, 40), 16)
    bad = eng.submit(ids(20, 41), 16, on_prefill=broken)
    with pytest.raises(StepError, match="on_prefill raised ValueError: my callback broke"):
        bad.run()
    assert good.run().tokens == want
    assert eng.stats()["pages_running"] == 0
    eng.close()


def test_batch_engine_refusals(ref):
    eng = BatchEngine(ref, 64, BatchConfig(max_lanes=2, max_rows=2))
    for args, want in ((([], 4), "at least one token"), (([600], 4), "token ids must be in 0..511"),
                       (([1], -1), "max_new_tokens must be an int >= 0"), (([1] * 60, 10), "exceeds max_ctx=64")):
        with pytest.raises(StepError, match=want):
            eng.submit(*args)
    with pytest.raises(StepError, match="temperature"):
        eng.submit([1], 2, temperature=-1)
    for kw, want in ((dict(prompt="abc"), "prompt: expected a list of int token ids, found str"),
                     (dict(prompt=None), "found NoneType"), (dict(prompt=[1.7]), "found float 1.7"),
                     (dict(prompt=[True]), "found a bool"), (dict(stop_ids=["x"]), "stop_ids: expected int"),
                     (dict(cancel="yes"), "cancel: expected a threading.Event, found str"),
                     (dict(on_prefill=3), "on_prefill: expected a callable")):
        args = {"prompt": [1, 2], "max_new_tokens": 2, **kw}
        with pytest.raises(StepError, match=want):
            eng.submit(**args)
    for args, want in (((ref, "64"), "max_ctx must be an int"), ((ref, 0), "max_ctx must be an int"),
                       ((ref, 64, 4), "config: expected a BatchConfig, found int"),
                       ((ref, 320, BatchConfig(max_lanes=10**6, max_rows=10**6)), "need .* GiB, more than the")):
        with pytest.raises(StepError, match=want):
            BatchEngine(*args)
    assert BatchConfig(max_lanes=20).max_rows == 20 and BatchConfig(max_lanes=3).max_rows == 16
    with pytest.raises(StepError, match="expected a list of int token ids, found dict"):
        eng.submit({1: 2}, 2)
    for bad, want in ((BatchConfig(warm="False"), "warm must be True or False, found 'False'"),
                      (BatchConfig(poison=1), "poison must be True or False, found 1"),
                      (BatchConfig(max_lanes=0), "max_lanes"), (BatchConfig(max_lanes=4, max_rows=2), "max_rows"),
                      (BatchConfig(pages=0), "pages"), (BatchConfig(page_tokens=24), "page_tokens")):
        with pytest.raises(StepError, match=want):
            BatchEngine(ref, 64, bad)
    assert eng.submit([1, 2], 0).run().tokens == []
    eng.close()


# ------------------------------------------------------------------------------------------------ the API
def test_model_lanes_runs_threads_together(tiny_path):
    """``Model(lanes=3)``: generations from four threads at once give each the text it gives on a Model without
    lanes; a cancel event ends one; lanes refuse what they cannot run, in one line."""
    one = Model(tiny_path, max_ctx=256, threads=1)
    m = Model(tiny_path, max_ctx=256, threads=1, lanes=3)
    prompts = ["The quick brown fox", "def main():", "Hello there", "Once upon a time, in"]
    want = [one.generate(p, 24, temperature=0.8, seed=k).text for k, p in enumerate(prompts)]
    got: list = [None] * 4

    def go(k: int) -> None:
        got[k] = m.generate(prompts[k], 24, temperature=0.8, seed=k).text

    threads = [threading.Thread(target=go, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert m.batch.stats()["steps"] < 4 * 24  # they ran together
    stop = threading.Event()
    s = m.generate(prompts[0], 200, stream=True, cancel=stop)
    next(s)
    stop.set()
    c = s.completion
    assert c.stop_reason == "stop" and len(c.ids) < 200
    with pytest.raises(Ds4cError, match="cancel: a threading.Event, with a Model opened with lanes"):
        one.generate("x", 2, cancel=stop)
    with pytest.raises(Ds4cError, match="lanes: expected an int >= 1"):
        Model(tiny_path, max_ctx=64, lanes=True)
    m.close()


def test_bench_lanes_reports_the_three_targets(tiny_path, tmp_path):
    """``ds4c bench --lanes`` on the CPU: a line per lane count with its ratios to one sequence, the prefill beside
    decode and the prefix reuse lines, the JSON record; its options alone are refused in one line."""
    import json

    from click.testing import CliRunner

    from ds4c.cli import main

    out = tmp_path / "lanes.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--lanes", "1,2", "--new-tokens", "4",
                                  "--prompt-len", "4", "--long-prompt", "40", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert [lv["lanes"] for lv in rec["levels"]] == [1, 2] and rec["levels"][0]["aggregate_x"] == 1.0
    assert rec["engine"] == "reference" and rec["prefix_reuse"]["reused"] == 16
    assert rec["prefill_beside_decode"]["decoding"] == 1
    assert "prefill beside decode: 1 decoding, a 40-token prompt" in r.output and "prefix reuse:" in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--new-tokens", "4"])
    assert r.exit_code == 2 and "--new-tokens: applies only with --lanes" in r.output
    for extra, want in ((["--long-prompt", "10"], "10 is not in the range x>=32"),
                        (["--lanes-prefill-every", "2"], "the compiled engine's policy"),
                        (["--long-prompt", "100000"], "the runs need 100008 positions, the model holds")):
        r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--lanes", "1", *extra])
        assert r.exit_code != 0 and want in r.output and "Traceback" not in r.output, r.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the reference's lanes on cuda)")
def test_lanes_on_cuda_equal_each_request_alone_on_cuda(tiny_path):
    """The reference on cuda: continuous batching (four requests joining at different times, one from the prefix
    cache) gives each request the tokens the same request gives alone on cuda, bit for bit (every product is row
    by row there too, so no other lane's rows can change a row's result)."""
    from ds4c.reference import ReferenceWeights
    from ds4c.sources import open_model

    cref = Reference(ReferenceWeights.load(open_model(tiny_path), "cuda"), max_ctx=MAX_CTX)
    prompts = [ids(21, 50), ids(40, 51), ids(7, 52)]
    prompts.append(prompts[1] + ids(9, 53))
    kws = [dict(), dict(temperature=0.8, seed=2), dict(temperature=1.0, top_k=30, seed=3), dict()]
    want = [_alone(cref, p, 96, **kw) for p, kw in zip(prompts, kws)]
    eng = BatchEngine(cref, MAX_CTX, BatchConfig(max_lanes=3, max_rows=8, poison=True))
    reqs = [eng.submit(p, 96, **kw) for p, kw in zip(prompts[:3], kws[:3])]
    for _ in range(40):
        next(reqs[1])
    reqs.append(eng.submit(prompts[3], 96, **kws[3]))
    assert [r.run().tokens for r in reqs] == want
    assert reqs[3].prefix_reused == 32
    eng.close()


def test_the_last_token_comes_with_its_result(ref, monkeypatch):
    """A reader that takes a request's last token sees its result at once (the Model's text drops an eos token by
    it): the engine's clean-up after that token is slowed here, so a result set only then would be missed."""
    slow = BatchEngine._finish

    def late_finish(self, req, reason, error=None):
        time.sleep(0.2)
        slow(self, req, reason, error)

    monkeypatch.setattr(BatchEngine, "_finish", late_finish)
    eng = BatchEngine(ref, 64, BatchConfig(max_lanes=1, max_rows=4))
    want = _alone(ref, ids(5, 60), 3)
    for stop_ids, reason in (((), "length"), ((want[1],), "eos")):
        req = eng.submit(ids(5, 60), 3, stop_ids=stop_ids)
        seen = [(t, req.result) for t in req]
        assert seen[-1][1] is not None and seen[-1][1].stop_reason == reason
        assert all(r is None for _, r in seen[:-1])
    eng.close()


def test_speculative_lanes_equal_each_request_alone(ref):
    """Speculative rows inside the batch: two requests with oracle drafters (greedy at width 5, seeded sampling at
    width 3, one ending at a stop id among accepted drafts) beside a plain request and a prompt being prefilled:
    each request's tokens equal the same request alone with the same drafter (``ds4c.generate``), bit for bit;
    drafts were verified and accepted in the batch; a drafter or width the batch cannot take is refused in one line."""
    from ds4c.drafters.oracle import OracleDrafter

    def oracle(seed):
        return OracleDrafter(0.8, ref.cfg.vocab_size, seed=seed)

    pa, pb, pc, pd = ids(21, 70), ids(30, 71), ids(9, 72), ids(90, 73)
    kb = dict(temperature=0.8, top_p=0.9, seed=2)
    want_a = generate(ref, pa, 30, draft=oracle(5), spec_width=5).tokens
    eos = want_a[25]  # generate's stop: the same steps, the tokens up to and with the stop id's first occurrence
    want_a = want_a[:want_a.index(eos) + 1]
    want_b = generate(ref, pb, 30, draft=oracle(6), spec_width=3, **kb).tokens
    want_c, want_d = _alone(ref, pc, 24), _alone(ref, pd, 8)
    eng = BatchEngine(ref, MAX_CTX, BatchConfig(max_lanes=4, max_rows=12, poison=True))
    a = eng.submit(pa, 30, draft=oracle(5), spec_width=5, stop_ids=(eos,))
    b = eng.submit(pb, 30, draft=oracle(6), spec_width=3, **kb)
    c = eng.submit(pc, 24)
    next(c)
    d = eng.submit(pd, 8)  # prefilled beside the speculative lanes (at least one row a step)
    assert a.run().tokens == want_a and a.result.stop_reason == "eos"
    assert b.run().tokens == want_b and c.run().tokens == want_c and d.run().tokens == want_d
    st = eng.stats()
    assert st["spec_steps"] > 0 and 0 < st["accepted"] <= st["drafts"]
    for kw, want in ((dict(draft=3), "expected a drafter"), (dict(draft=oracle(1), spec_width="auto"),
                                                             "spec_width: expected an int in 1..5")):
        with pytest.raises(StepError, match=want):
            eng.submit(pa, 4, **kw)
    eng.close()


def test_mtp_and_dspark_lanes_equal_each_request_alone(ref, tiny_path, tmp_path):
    """The MTP drafter (it reads the target's final HC state) and the DSpark drafter (its taps) inside the batch:
    each request's drafter is prepared on its own sequence, whose final HC rows and tap rows the batch step records;
    two MTP requests (greedy at width 4, seeded sampling at width 3, a prompt longer than the window) and a DSpark
    one beside a plain one and a prompt being prefilled: each request's tokens equal the same request alone on the
    reference with the same drafter, bit for bit, and drafts were accepted in the batch. A repeated prompt with an
    MTP drafter starts from no cached prefix (the cache keeps no final HC rows) and still equals alone."""
    from ds4c.drafters.dspark import DSparkDrafter
    from ds4c.drafters.dspark_synth import make_dspark
    from ds4c.drafters.mtp import MTPDrafter
    from ds4c.drafters.mtp_synth import make_mtp

    mtp = make_mtp(ref.cfg, tmp_path / "tiny-mtp.gguf", seed=0)
    dsp = make_dspark(tiny_path, tmp_path / "tiny-dspark.gguf", seed=3, block_size=4)
    pa, pb, pc, pd = ids(26, 80), ids(11, 81), ids(9, 82), ids(20, 83)
    kb = dict(temperature=0.7, top_k=50, seed=4)

    def alone(prompt, n, width, **kw):
        solo = Reference(ref.w, max_ctx=MAX_CTX)
        return generate(solo, prompt, n, draft=MTPDrafter(mtp, seed=1), spec_width=width, **kw).tokens

    want_a, want_b = alone(pa, 20, 4), alone(pb, 16, 3, **kb)
    solo = Reference(ref.w, max_ctx=MAX_CTX)
    want_e = generate(solo, pc, 14, draft=DSparkDrafter(dsp), spec_width=4).tokens
    eng = BatchEngine(ref, MAX_CTX, BatchConfig(max_lanes=5, max_rows=16, poison=True))
    a = eng.submit(pa, 20, draft=MTPDrafter(mtp, seed=1), spec_width=4)
    b = eng.submit(pb, 16, draft=MTPDrafter(mtp, seed=1), spec_width=3, **kb)
    e = eng.submit(pc, 14, draft=DSparkDrafter(dsp), spec_width=4)
    c = eng.submit(pc, 12)
    next(c)
    d = eng.submit(pd, 6)
    assert a.run().tokens == want_a and b.run().tokens == want_b and e.run().tokens == want_e
    assert c.run().tokens == _alone(ref, pc, 12) and d.run().tokens == _alone(ref, pd, 6)
    st = eng.stats()
    assert st["spec_steps"] > 0 and 0 < st["accepted"] <= st["drafts"]
    again = eng.submit(pa, 8, draft=MTPDrafter(mtp, seed=1), spec_width=4)
    assert again.run().tokens == want_a[:8] and again.prefix_reused == 0
    eng.close()


def test_model_lanes_with_a_drafter(tiny_path):
    """``Model(lanes=2, draft="oracle:0.8")``: threads' generations equal a Model without lanes with the same
    drafter."""
    from concurrent.futures import ThreadPoolExecutor

    one = Model(tiny_path, max_ctx=128, threads=1, draft="oracle:0.8")
    m = Model(tiny_path, max_ctx=128, threads=1, lanes=2, draft="oracle:0.8")
    prompts = ["The quick brown fox", "def main():", "Hello there"]
    want = [one.generate(p, 8, temperature=0.7, seed=k).text for k, p in enumerate(prompts)]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda k: m.generate(prompts[k], 8, temperature=0.7, seed=k).text, range(3)))
    assert got == want and m.batch.stats()["spec_steps"] > 0
    m.close()
