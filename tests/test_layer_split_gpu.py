"""The compiled layer split on a CUDA GPU (issue: layer split): a virtual split (every shard on the same GPU)
against the unsplit compiled step, bit for bit (the same kernels on the same inputs, with the HC boundary cut
into hc_post_out + hc_pre), for decode, verify and rollback; isolation of the shards; the split through
generate and from a split artifact. Skipped without a GPU; run on the H200 and recorded in
docs/gpu-validation.md."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]

SPLITS = [(1, 5), (3, 3), (5, 1), (2, 2, 2)]


@pytest.fixture(scope="module")
def env(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    cache = KernelCache(tmp_path_factory.mktemp("kcache"))
    whole = CompiledStep(mf, buckets, device_arch(), cache)
    whole.prepare_all(progress=False)
    return mf, buckets, cache, whole


def _split(env, split):
    from ds4c.runtime.step import device_arch
    from ds4c.runtime.sharded import ShardedStep
    from ds4c.shard_plan import ShardPlan

    mf, buckets, cache, _ = env
    s = ShardedStep(mf, buckets, ShardPlan(("cuda:0",) * len(split), split), device_arch(), cache)
    s.prepare_all(progress=False)
    return s


def _states_equal(whole, split) -> list[str]:
    bad = []
    for sh in split.shards:
        for name, buf in sh.state.items():
            if not torch.equal(buf, whole.state[name]):
                bad.append(name)
    return bad


@pytest.mark.parametrize("split", SPLITS)
def test_virtual_split_equals_the_unsplit_step_bit_for_bit(env, split):
    """Decode and verify steps of widths 1..5 over 100 positions (crossing the 16-slot window, ratio-4 and
    ratio-16 flushes and the 32 / 64 / 128 buckets), each followed by a rollback of a rejected suffix on some
    steps: logits and every state buffer equal the unsplit step's bit for bit."""
    _, _, _, whole = env
    s = _split(env, split)
    g = torch.Generator().manual_seed(len(split) * 10 + split[0])
    toks = torch.randint(0, 512, (120,), generator=g).tolist()
    whole.reset()
    s.reset()
    pos, k = 0, 0
    widths = (5, 1, 3, 2, 4, 5, 1)
    while pos < 100:
        q = widths[k % len(widths)]
        k += 1
        want = whole.verify(toks[pos:pos + q], pos).clone()
        got = s.verify(toks[pos:pos + q], pos)
        assert torch.equal(got, want), f"split {split} pos {pos} q {q}: logits differ by {(got - want).abs().max()}"
        keep = q if k % 3 else max(1, q - 2)  # every third step rejects up to two rows
        whole.rollback(keep)
        s.rollback(keep)
        assert s.pos == whole.pos == pos + keep
        bad = _states_equal(whole, s)
        assert not bad, f"split {split} pos {pos}: state buffers differ: {bad[:4]}"
        pos += keep


def test_shards_share_no_memory_and_stay_on_their_device(env):
    s = _split(env, (2, 2, 2))
    ptrs = []
    for k, (sh, ts) in enumerate(zip(s.shards, s.bound_tensors())):
        assert ts, f"shard {k}: no bound tensors"
        assert all(t.device == sh.dev for t in ts), f"shard {k}: a tensor on another device"
        ptrs.append({t.untyped_storage().data_ptr() for t in ts})
    for a in range(len(ptrs)):
        for b in range(a + 1, len(ptrs)):
            assert not ptrs[a] & ptrs[b], f"shards {a} and {b} share {len(ptrs[a] & ptrs[b])} storages"
    # the layers each shard holds: its own state names only
    assert {n.split(".")[0] for n in s.shards[1].state} == {"l2", "l3"}
    assert s.shards[0].graphs.logits is None and s.shards[-1].hc_out is None and s.shards[0].hc_in is None


def test_split_generates_the_unsplit_tokens(env):
    from ds4c.generate import generate

    _, _, _, whole = env
    s = _split(env, (3, 3))
    prompt = [5, 17, 301, 42, 7, 99, 3, 250]
    whole.reset()
    a = generate(whole, prompt, 40).tokens
    b = generate(s, prompt, 40).tokens
    assert a == b and len(set(a)) > 3
    # the host-free loop samples on the last shard's device with the same seeded noise: the same ids
    a = generate(whole, prompt, 40, temperature=0.8, top_k=50, seed=3).tokens
    b = generate(s, prompt, 40, temperature=0.8, top_k=50, seed=3).tokens
    assert a == b
    assert s.captures == sum(len(sh.graphs.by_key) + len(sh.loop.graphs) + len(sh.verifier.accept_graphs) for sh in s.shards)


def test_split_artifact_serves_its_split_only(env, tmp_path):
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import ArtifactError
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.sharded import ShardedStep
    from ds4c.runtime.targets import target
    from ds4c.shard_plan import ShardPlan

    mf, buckets, cache, whole = env
    types = {n: mf.ggml_type(n) for n in mf.specs}
    art = build_artifact(mf.config, [target(device_arch())], buckets, tmp_path / "a", cache, progress=False,
                         weight_types=types, layer_split=(4, 2))
    s = ShardedStep(mf, buckets, ShardPlan(("cuda:0", "cuda:0"), (4, 2)), device_arch(), artifact=str(art))
    s.prepare_all(progress=False)
    assert s.binary_batches == 0  # nothing compiled: every binary from the artifact
    toks = [9, 8, 7, 6, 5]
    whole.reset()
    want = whole.step(toks, 0).clone()
    assert torch.equal(s.step(toks, 0), want)
    with pytest.raises(ArtifactError, match="compiled for layer split 4,2, asked to serve layer split 3,3"):
        ShardedStep(mf, buckets, ShardPlan(("cuda:0", "cuda:0"), (3, 3)), device_arch(), artifact=str(art))
    with pytest.raises(ArtifactError, match="compiled for layer split 4,2, asked to serve the unsplit step"):
        CompiledStep(mf, buckets, device_arch(), artifact=str(art))


def test_an_open_loads_and_verifies_the_manifest_once(env, tiny_path, tmp_path, monkeypatch):
    """open_engine loads and verifies an artifact's manifest (every binary's sha256 included) once per open and
    hands the opened Artifact to the step, unsplit or split; a ShardedStep given a path opens it once for all its
    shards (before: once in open_engine, then again in every CompiledStep)."""
    from ds4c.engine import open_engine
    from ds4c.runtime import artifact_manifest
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.step import device_arch
    from ds4c.runtime.sharded import ShardedStep
    from ds4c.runtime.targets import target
    from ds4c.shard_plan import ShardPlan
    from ds4c.sources import open_model

    mf, buckets, cache, _ = env
    types = {n: mf.ggml_type(n) for n in mf.specs}
    whole = build_artifact(mf.config, [target(device_arch())], buckets, tmp_path / "w", cache, progress=False,
                           weight_types=types)
    split = build_artifact(mf.config, [target(device_arch())], buckets, tmp_path / "s", cache, progress=False,
                           weight_types=types, layer_split=(4, 2))
    loads: list = []
    real = artifact_manifest.load_manifest
    monkeypatch.setattr(artifact_manifest, "load_manifest", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    eng = open_engine(open_model(tiny_path), "cuda", artifact=whole, max_ctx=None, prepare=False, progress=False)
    assert loads == [whole] and eng.artifact == str(whole)
    loads.clear()
    open_engine(open_model(tiny_path), "cuda", artifact=split, max_ctx=None, prepare=False, progress=False,
                devices="cuda:0,cuda:0", layer_split="4,2")
    assert loads == [split]
    loads.clear()
    ShardedStep(mf, buckets, ShardPlan(("cuda:0", "cuda:0"), (4, 2)), device_arch(), artifact=str(split))
    assert loads == [str(split)]


def test_engine_opens_a_split_from_the_options(env):
    from ds4c.engine import open_engine
    from ds4c.runtime.sharded import ShardedStep

    mf = env[0]
    st = open_engine(mf, device="cuda", max_ctx=64, layer_split="2,4", progress=False)
    assert isinstance(st, ShardedStep) and st.plan.layers == (2, 4) and st.plan.devices == ("cuda", "cuda")
    auto = open_engine(mf, device="cuda", max_ctx=64, devices="cuda:0,cuda:0", progress=False)
    assert isinstance(auto, ShardedStep) and sum(auto.plan.layers) == 6


def test_speculative_decoding_through_the_split_equals_unsplit(env):
    """The speculative loop (verify steps of up to 4 rows, rejected suffixes rolled back on every shard): the
    split gives the unsplit compiled step's tokens and acceptance exactly (its verify rows are the unsplit
    step's, bit for bit). Both run the step-by-step loop (a drafter that is not host-only); the unsplit step's
    pipelined loop gives the same tokens (its widths are fixed a step ahead, so its last steps' widths and
    verified counts may differ)."""
    from ds4c.generate import generate
    from ds4c.drafters.oracle import OracleDrafter

    class StepByStep(OracleDrafter):
        host_only = False

    _, _, _, whole = env
    s = _split(env, (2, 4))
    prompt = [11, 23, 5, 8, 300, 2]
    whole.reset()
    cont = generate(whole, prompt, 60).tokens
    a = generate(whole, prompt, 60, draft=StepByStep(0.6, 512, seed=4, continuation=cont), spec_width=4)
    b = generate(s, prompt, 60, draft=StepByStep(0.6, 512, seed=4, continuation=cont), spec_width=4)
    piped = generate(whole, prompt, 60, draft=OracleDrafter(0.6, 512, seed=4, continuation=cont), spec_width=4)
    timing = "ms_per_verify_step"  # host wall times: the only part that may differ
    assert a.tokens == b.tokens == piped.tokens
    assert {k: v for k, v in a.speculative.items() if k != timing} == \
        {k: v for k, v in b.speculative.items() if k != timing}
    assert a.speculative["steps"] < 59 and min(a.speculative["acceptance_by_depth"]) < 1.0  # rollbacks happened
