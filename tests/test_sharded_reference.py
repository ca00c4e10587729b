"""The reference over a layer split (ds4c/reference/sharded.py, issue: layer split): at every split point of
the tiny model and a 3-shard split, decodes and verifies of widths 1..5 give the unsplit logits and states bit
for bit, across ratio-4 and ratio-16 flushes, the window wrap and the indexer's top-k; rollback and
snapshot/restore per shard; shards share no storage; bad boundaries, lone shards and bad plans are one-line
errors; generation (plain, sampled, speculative) gives the unsplit tokens.

The tiny preset: 6 layers, ratios (0, 0, 4, 16, 4, 16), window 16, indexer top-k 8: the schedule's 45
positions cross ratio-4 flushes (p = 3, 7, ...), ratio-16 flushes (15, 31), the window wrap (16) and the
indexer selecting 8 of up to 11 blocks (p >= 36).
"""

from __future__ import annotations

import pytest
import torch

from ds4c.errors import StepError
from ds4c.generate import generate
from ds4c.sources import open_model
from ds4c.reference import Reference, ReferenceWeights, SequenceState, ShardedReference
from ds4c.shard_plan import ShardPlan, ShardPlanError
from ds4c.drafters.oracle import OracleDrafter

MAX_CTX = 64
WIDTHS = [1, 2, 3, 4, 5] * 3  # 45 positions; width 1 runs as decode()
SPLITS = [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1), (2, 1, 3)]


def _plan(counts: tuple[int, ...], device: str = "cpu") -> ShardPlan:
    return ShardPlan((device,) * len(counts), tuple(counts))


@pytest.fixture(scope="module")
def mf(tiny_path):
    return open_model(tiny_path)


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(77)
    return torch.randint(0, 512, (sum(WIDTHS) + 8,), generator=g).tolist()


def _step(ref, toks: list[int], pos: int) -> torch.Tensor:
    return ref.decode(toks[0], pos) if len(toks) == 1 else ref.verify(toks, pos)


@pytest.fixture(scope="module")
def unsplit(tiny_weights, tokens):
    """The unsplit reference's logits of every step of the schedule and its state after each."""
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    logits, snaps, pos = [], [], 0
    for q in WIDTHS:
        logits.append(_step(ref, tokens[pos:pos + q], pos))
        pos += q
        snaps.append(ref.snapshot())
    return logits, snaps


def _assert_shard_states_equal(sharded: ShardedReference, full: SequenceState, where: str) -> None:
    for k, shard in enumerate(sharded.shards):
        a, b = shard.layer_range
        st = shard.state
        assert st.layer_range == (a, b) and len(st.layers) == b - a
        assert st.pos == full.pos, f"{where}: shard {k} at {st.pos}, unsplit at {full.pos}"
        for j in range(b - a):
            mine, theirs = st.layers[j].tensors(), full.layers[a + j].tensors()
            assert len(mine) == len(theirs)
            for x, y in zip(mine, theirs):
                assert torch.equal(x, y), f"{where}: shard {k} layer {a + j} state differs"


# ------------------------------------------------------------------------------------------------ equality
@pytest.mark.parametrize("counts", SPLITS, ids=lambda c: "-".join(map(str, c)))
def test_split_equals_unsplit_bit_for_bit(mf, tokens, unsplit, counts):
    logits, snaps = unsplit
    sh = ShardedReference.load(mf, _plan(counts), max_ctx=MAX_CTX)
    assert [s.layer_range for s in sh.shards] == _plan(counts).ranges
    pos = 0
    for step, q in enumerate(WIDTHS):
        out = _step(sh, tokens[pos:pos + q], pos)
        assert out.dtype == torch.float32 and out.shape == (q, 512)
        assert torch.equal(out, logits[step]), f"step {step} (positions {pos}..{pos + q - 1}) logits differ"
        pos += q
        _assert_shard_states_equal(sh, snaps[step], f"step {step}")
    assert sh.pos == pos and sh.state.equal(snaps[-1])
    # the schedule really reached the compressed rows, the ring wrap and the indexer's top-k
    last = snaps[-1]
    assert (last.layers[3].comp[: pos // 16] != 0).any(-1).all() and pos // 16 == 2
    assert (last.layers[2].idx_keys[: pos // 4] != 0).any(-1).all() and pos // 4 > 8


def test_run_on_the_whole_model_equals_verify(tiny_weights, tokens):
    a, b = Reference(tiny_weights, max_ctx=MAX_CTX), Reference(tiny_weights, max_ctx=MAX_CTX)
    for pos in (0, 5):
        assert torch.equal(a.run(tokens[pos:pos + 5], pos), b.verify(tokens[pos:pos + 5], pos))
    assert a.state.equal(b.state)


@pytest.mark.parametrize("counts", [(3, 3), (2, 1, 3)], ids=lambda c: "-".join(map(str, c)))
def test_boundary_is_the_act_dtype_hc_state_and_a_copy(mf, tokens, counts, monkeypatch):
    sh = ShardedReference.load(mf, _plan(counts), max_ctx=MAX_CTX)
    seen: list[tuple[str, int, torch.Tensor]] = []
    for k, shard in enumerate(sh.shards):
        orig = shard.run

        def spy(toks, pos, x=None, _orig=orig, _k=k):
            seen.append(("in", _k, x))
            out = _orig(toks, pos, x)
            seen.append(("out", _k, out))
            return out

        monkeypatch.setattr(shard, "run", spy)
    sh.verify(tokens[:3], 0)
    assert [(d, k) for d, k, _ in seen] == [(d, k) for k in range(len(counts)) for d in ("in", "out")]
    assert seen[0][2] is None
    for k in range(len(counts) - 1):
        out, nxt = seen[2 * k + 1][2], seen[2 * k + 2][2]
        assert out.dtype == torch.bfloat16 and out.shape == (3, 4, 256)
        assert torch.equal(out, nxt)
        assert out.untyped_storage().data_ptr() != nxt.untyped_storage().data_ptr()
    assert seen[-1][2].dtype == torch.float32 and seen[-1][2].shape == (3, 512)


# ------------------------------------------------------------------------------------------------ rollback
@pytest.mark.parametrize("counts", [(3, 3), (1, 5), (2, 1, 3)], ids=lambda c: "-".join(map(str, c)))
def test_rollback_equals_unsplit(tiny_weights, mf, tokens, counts):
    """From p0 = 13 a 5-row verify crosses the ratio-4 flush at 15, the ratio-16 flush at 15 and the window wrap
    at 16; every accepted count 0..5 and the two decodes after it equal the unsplit reference's."""
    full = Reference(tiny_weights, max_ctx=MAX_CTX)
    sh = ShardedReference.load(mf, _plan(counts), max_ctx=MAX_CTX)
    p0 = 13
    for p in range(0, p0, 5):
        q = min(5, p0 - p)
        assert torch.equal(full.verify(tokens[p:p + q], p), sh.verify(tokens[p:p + q], p))
    f_snap, s_snap = full.snapshot(), sh.snapshot()
    assert len(s_snap) == len(counts)
    for accepted in range(6):
        full.restore(f_snap)
        sh.restore(s_snap)
        _assert_shard_states_equal(sh, full.state, "restored")
        assert torch.equal(full.verify(tokens[p0:p0 + 5], p0), sh.verify(tokens[p0:p0 + 5], p0))
        full.rollback(accepted)
        sh.rollback(accepted)
        assert sh.pos == p0 + accepted
        _assert_shard_states_equal(sh, full.state, f"accepted={accepted}")
        nxt = p0 + accepted
        # a different continuation than the rolled-back rows: what a rejected draft leads to
        for t in (tokens[-1], tokens[-2]):
            assert torch.equal(full.decode(t, nxt), sh.decode(t, nxt)), f"accepted={accepted}, pos {nxt}"
            nxt += 1
        _assert_shard_states_equal(sh, full.state, f"after accepted={accepted}")
    with pytest.raises(StepError, match="rollback: accepted must be in 0..1"):
        sh.rollback(2)  # the last step was a decode (1 row); no shard is changed
    sh.rollback(1)
    with pytest.raises(StepError, match="no verify step"):
        sh.rollback(0)


def test_rollback_actually_undoes_state(mf, tokens):
    """Guard for the rollback test: the 5-row verify from 13 writes state that rollback(0) removes."""
    sh = ShardedReference.load(mf, _plan((3, 3)), max_ctx=MAX_CTX)
    for p in range(0, 13, 5):
        sh.verify(tokens[p:min(p + 5, 13)], p)
    before = sh.snapshot()
    sh.verify(tokens[13:18], 13)
    assert not sh.shards[1].state.equal(before[1]) and not sh.shards[0].state.equal(before[0])
    sh.rollback(0)
    assert all(s.state.equal(b) for s, b in zip(sh.shards, before))


# ------------------------------------------------------------------------------------------------ isolation
def _tensors_of(shard: Reference) -> list[torch.Tensor]:
    w = shard.w
    out = list(w.by_name.values())
    out += [t for ts in w.experts._cache.values() for t in ts]
    out += list(shard._freqs.values())
    out += [t for ls in shard.state.layers for t in ls.tensors()]
    return out


def _byte_ranges(ts: list[torch.Tensor]) -> list[tuple[int, int]]:
    rs = []
    for t in ts:
        s = t.untyped_storage()
        rs.append((s.data_ptr(), s.data_ptr() + max(s.nbytes(), 1)))
    return rs


def _assert_isolated(sh: ShardedReference) -> None:
    per = [_tensors_of(s) for s in sh.shards]
    for k, (shard, ts) in enumerate(zip(sh.shards, per)):
        assert len(ts) > 20
        want = torch.device(sh.plan.devices[k])
        assert all(t.device.type == want.type and (want.index is None or t.device.index == want.index)
                   for t in ts), f"shard {k}: a tensor off {want}"
    for k in range(len(per)):
        for m in range(k + 1, len(per)):
            ptrs_k = {s for s, _ in _byte_ranges(per[k])}
            ptrs_m = {s for s, _ in _byte_ranges(per[m])}
            assert not ptrs_k & ptrs_m, f"shards {k} and {m} share storage"
            for a0, a1 in _byte_ranges(per[k]):  # no overlapping bytes either (views of one buffer)
                for b0, b1 in _byte_ranges(per[m]):
                    assert a1 <= b0 or b1 <= a0, f"shards {k} and {m} overlap in memory"


def test_shards_share_no_storage_and_live_on_their_devices(mf, tokens):
    sh = ShardedReference.load(mf, _plan((2, 1, 3)), max_ctx=MAX_CTX)
    for p in range(0, 10, 5):
        sh.verify(tokens[p:p + 5], p)  # fills the expert caches
    w0, w1, w2 = (s.w for s in sh.shards)
    assert w0.embed is not None and w0.head is None and w0.hc_head is None and w0.out_norm is None
    assert w1.embed is None and w1.head is None
    assert w2.embed is None and w2.head is not None and w2.hc_head is not None and w2.out_norm is not None
    assert {n.split(".")[1] for n in w1.by_name if n.startswith("blk.")} == {"2"}
    assert all(s.w.experts._cache for s in sh.shards)
    _assert_isolated(sh)


def test_isolation_check_can_fail(mf):
    """The storage check of the isolation test sees two shards holding one tensor."""
    sh = ShardedReference.load(mf, _plan((3, 3)), max_ctx=MAX_CTX)
    sh.shards[1].w.by_name["shared"] = sh.shards[0].w.by_name["blk.0.attn_norm.weight"]
    with pytest.raises(AssertionError, match="share storage"):
        _assert_isolated(sh)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (reference on cuda)")
def test_split_on_cuda_equals_unsplit_on_cuda(tiny_path, tokens):
    """cuda:0,cuda:1 when there are two devices (else a virtual split on cuda:0) against the unsplit reference
    on cuda:0: equal logits and states; each shard on its device."""
    mf = open_model(tiny_path)
    devs = ("cuda:0", "cuda:1") if torch.cuda.device_count() >= 2 else ("cuda:0", "cuda:0")
    full = Reference(ReferenceWeights.load(mf, "cuda:0"), max_ctx=MAX_CTX)
    sh = ShardedReference.load(mf, ShardPlan(devs, (3, 3)), max_ctx=MAX_CTX)
    assert sh.device == torch.device(devs[1])
    pos = 0
    for q in WIDTHS:
        a, b = _step(full, tokens[pos:pos + q], pos), _step(sh, tokens[pos:pos + q], pos)
        assert b.device == torch.device(devs[1])
        assert torch.equal(a, b.to("cuda:0")), f"positions {pos}..{pos + q - 1}"
        pos += q
    assert sh.state.to("cuda:0").equal(full.state)
    _assert_isolated(sh)


# ------------------------------------------------------------------------------------------------ errors
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_bad_boundary_is_a_one_line_error(mf, tokens):
    sh = ShardedReference.load(mf, _plan((3, 3)), max_ctx=MAX_CTX)
    first, second = sh.shards
    x = first.run(tokens[:2], 0)
    assert x.dtype == torch.bfloat16 and x.shape == (2, 4, 256)
    for bad, found in ((x.float(), "torch.float32 [2, 4, 256]"), (x[:1], "torch.bfloat16 [1, 4, 256]"),
                       (x[:, :3], "torch.bfloat16 [2, 3, 256]"), (x[..., :255], "torch.bfloat16 [2, 4, 255]")):
        with pytest.raises(StepError) as e:
            second.run(tokens[:2], 0, bad)
        msg = _one_line(e)
        assert "expected torch.bfloat16 [2, 4, 256]" in msg and f"found {found}" in msg, msg
    with pytest.raises(StepError) as e:
        second.run(tokens[:2], 0, None)
    assert "expected a torch.bfloat16 tensor [2, 4, 256], found NoneType" in _one_line(e)
    with pytest.raises(StepError) as e:
        first.run(tokens[:2], 2, x)
    assert "expected x=None" in _one_line(e)
    assert second.state.pos == 0  # nothing ran
    out = second.run(tokens[:2], 0, x)
    assert out.shape == (2, 512) and out.dtype == torch.float32
    with pytest.raises(StepError, match="next position is 2"):
        second.run(tokens[:2], 0, x)  # per-shard position check


def test_fp32_dataflow_boundary_is_fp32(mf, tokens):
    sh = ShardedReference.load(mf, _plan((3, 3)), max_ctx=MAX_CTX, dataflow="fp32", quant_emulation=False)
    x = sh.shards[0].run(tokens[:2], 0)
    assert x.dtype == torch.float32
    with pytest.raises(StepError, match=r"expected torch.float32 \[2, 4, 256\], found torch.bfloat16"):
        sh.shards[1].run(tokens[:2], 0, x.bfloat16())
    w = ReferenceWeights.load(mf, dataflow="fp32")
    w.config = w.config.replace(quant_emulation=False)
    full = Reference(w, max_ctx=MAX_CTX, dataflow="fp32")
    sh.reset()
    assert torch.equal(sh.verify(tokens[:4], 0), full.verify(tokens[:4], 0))


def test_lone_shard_verify_and_decode_point_to_the_sharded_reference(mf):
    for rng in ((0, 3), (3, 6), (2, 4)):
        ref = Reference(ReferenceWeights.load(mf, layers=rng), max_ctx=MAX_CTX)
        with pytest.raises(StepError) as e:
            ref.verify([1, 2], 0)
        assert "ShardedReference" in _one_line(e) and f"[{rng[0]},{rng[1]})" in str(e.value)
        with pytest.raises(StepError, match="ShardedReference"):
            ref.decode(1, 0)
        assert ref.state.pos == 0
    from ds4c.reference.compiled import CompiledReference

    with pytest.raises(StepError, match=r"whole model; these weights hold layers \[0,3\)"):
        CompiledReference(ReferenceWeights.load(mf, layers=(0, 3)), max_ctx=MAX_CTX)


def test_bad_plans_and_ranges(mf, tiny_weights):
    for counts in ((3, 4), (2, 2), (6, 1)):
        with pytest.raises(ShardPlanError) as e:
            ShardedReference.load(mf, _plan(counts), max_ctx=MAX_CTX)
        assert "6 layers" in _one_line(e)
    with pytest.raises(ShardPlanError):
        ShardedReference.load(mf, ShardPlan(("cpu",), (3, 3)))
    for rng in ((3, 3), (-1, 2), (0, 7), (4, 2), (0,)):
        with pytest.raises(ShardPlanError):
            ReferenceWeights.load(mf, layers=rng)  # type: ignore[arg-type]
    a = Reference(ReferenceWeights.load(mf, layers=(0, 2)), max_ctx=MAX_CTX)
    b = Reference(ReferenceWeights.load(mf, layers=(3, 6)), max_ctx=MAX_CTX)
    with pytest.raises(ShardPlanError, match="expected it to start at layer 2"):
        ShardedReference([a, b])
    with pytest.raises(ShardPlanError, match="cover"):
        ShardedReference([a])
    c = Reference(ReferenceWeights.load(mf, layers=(2, 6)), max_ctx=MAX_CTX + 1)
    with pytest.raises(ShardPlanError, match="max_ctx"):
        ShardedReference([a, c])
    with pytest.raises(StepError, match=r"snapshot holds layers \[3,6\), this state \[0,2\)"):
        a.state.restore(b.state.snapshot())
    sh = ShardedReference([a, Reference(ReferenceWeights.load(mf, layers=(2, 6)), max_ctx=MAX_CTX)])
    assert sh.plan == _plan((2, 4))
    with pytest.raises(StepError, match="expected 2 shard snapshots"):
        sh.restore(sh.snapshot()[:1])


def test_layers_none_and_whole_range_load_the_same_weights(mf, tiny_weights):
    whole = ReferenceWeights.load(mf, layers=(0, 6))
    assert tiny_weights.layer_range == whole.layer_range == (0, 6) and tiny_weights.is_whole
    assert list(whole.by_name) == list(tiny_weights.by_name)
    assert all(torch.equal(whole.by_name[n], t) for n, t in tiny_weights.by_name.items())
    part = ReferenceWeights.load(mf, layers=(2, 5))
    assert part.layer_range == (2, 5) and not part.is_whole and len(part.layers) == 3
    assert torch.equal(part.layers[0].wq_a, tiny_weights.layers[2].wq_a)
    assert part.layers[0].idx_compressor is not None and part.layers[1].idx_compressor is None  # 4, then 16
    st = SequenceState.new(mf.config, MAX_CTX, layers=(2, 5))
    assert st.layer_range == (2, 5) and st.layer(3) is st.layers[1] and st.layer(2).idx_keys is not None
    with pytest.raises(StepError, match=r"holds layers \[2,5\)"):
        st.layer(5)


# ------------------------------------------------------------------------------------------------ generation
@pytest.fixture(scope="module")
def generated(tiny_weights):
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    prompt = [5, 17, 301, 42, 7, 99, 250]
    return ref, prompt, generate(ref, prompt, 30).tokens


def test_generate_through_the_split_equals_unsplit(mf, generated):
    ref, prompt, want = generated
    sh = ShardedReference.load(mf, _plan((2, 1, 3)), max_ctx=MAX_CTX)
    assert generate(sh, prompt, 30).tokens == want
    assert len(set(want)) > 3
    assert generate(sh, prompt, 12, temperature=0.9, seed=5, top_k=50).tokens == \
        generate(ref, prompt, 12, temperature=0.9, seed=5, top_k=50).tokens


def test_speculative_through_the_split_equals_unsplit(mf, generated):
    ref, prompt, want = generated
    sh = ShardedReference.load(mf, _plan((4, 2)), max_ctx=MAX_CTX)
    res = generate(sh, prompt, 30, draft=OracleDrafter(0.6, 512, seed=1, continuation=want), spec_width=4)
    assert res.tokens == want
    spec = res.speculative
    acc = spec["acceptance_by_depth"]
    assert spec["steps"] < 29 and acc[0] < 1.0  # drafts were accepted and rejected: rollbacks ran
    # the drafter's own autoregressive pass on the split stepper (no continuation given)
    res2 = generate(sh, prompt, 20, draft=OracleDrafter(0.8, 512, seed=2), spec_width=5)
    assert res2.tokens == want[:20]
