"""The compiled step records the DSpark taps (spec ds4-flash.md 5.2(q); issue 13, speculative decoding part 2) on a
CUDA GPU: ``CompiledStep(..., taps=...)`` on the synthetic tiny model against the reference's ``main_hidden``, with
the tap ring poisoned (NaN) before the steps so that an unwritten row shows; through verify + rollback and the
host-free decode loop; a virtual layer split (``ShardedStep.main_hidden``) against the unsplit step bit for bit; an
artifact compiled with taps, and one without refusing them. Skipped without a GPU; the lead runs them on the H200:

    pytest -q -m gpu tests/test_compiled_taps.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]

TAPS = (3, 4, 5)  # tiny's default_taps (its last three layers; 5 is the last: the head writes its streams)


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1717)
    return torch.randint(0, 512, (96,), generator=g).tolist()


@pytest.fixture(scope="module")
def env(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    cache = KernelCache(tmp_path_factory.mktemp("kcache"))
    ex = CompiledStep(mf, buckets, device_arch(), cache, taps=TAPS)
    ex.prepare_all(progress=False)
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=128, taps=TAPS)
    return mf, buckets, cache, ex, ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per row (fp32)."""
    got, want = got.float(), want.float()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def _poison(ex) -> None:
    ex.tap_ring.fill_(float("nan"))


def _copy_state(ex, ref, p: int) -> None:
    """The reference's sequence state into the compiled step (teacher forcing) at position ``p``; the tap ring is
    the step's own (a test resets the step before its first copy: the ring's held range starts there)."""
    from ds4c.ir.interpreter import state_to_inputs

    for name, buf in state_to_inputs(ref.state).items():
        ex.state[name].copy_(buf)
    ex.pos = p


def test_teacher_forced_taps_match_the_reference(env, tokens):
    """Steps of widths 5, 1, 3, 2, 4 from position 0 to 80 (the 16-slot window wraps five times, across the 32 / 64 /
    128 buckets), each from the reference's state: every written ring row (position t at row t % 16) is the
    reference's main_hidden(t) within bf16 tolerance, no written row is NaN, and rows of positions not reached
    yet keep the poison."""
    _, _, _, ex, ref = env
    W = ex.cfg.window
    ex.reset()
    ref.reset()
    _poison(ex)
    assert ex.tap_ring.shape == (W, 3 * ex.cfg.hidden_size) and ex.tap_ring.dtype == torch.bfloat16
    errs, p, k, widths = [], 0, 0, (5, 1, 3, 2, 4)
    while p < 80:
        q = widths[k % len(widths)]
        k += 1
        _copy_state(ex, ref, p)
        ex.step(tokens[p:p + q], p)
        ref.verify(tokens[p:p + q], p)
        rows = ex.tap_ring[torch.arange(p, p + q, device=ex.dev) % W]
        assert not torch.isnan(rows.float()).any(), f"step at {p} (q={q}) left a ring row unwritten"
        if p + q < W:
            assert torch.isnan(ex.tap_ring[p + q:].float()).all(), "a row of a later position was written"
        errs.append(_rel(rows, ref.main_hidden(p, p + q)).cpu())
        got = ex.main_hidden(max(0, p + q - W), p + q)
        assert torch.equal(got, ex.tap_ring[torch.arange(max(0, p + q - W), p + q, device=ex.dev) % W])
        p += q
    e = torch.cat(errs)
    assert e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2 and e.max() < 0.25, e


def test_main_hidden_refuses_positions_it_does_not_hold(env, tokens):
    from ds4c.errors import StepError

    _, _, _, ex, _ = env
    ex.reset()
    for p in range(0, 20, 5):
        ex.step(tokens[p:p + 5], p)
    assert ex.main_hidden(4, 20).shape == (16, 3 * ex.cfg.hidden_size)
    for start, stop in ((3, 20), (10, 21), (12, 11)):
        with pytest.raises(StepError, match="not committed positions held by the tap ring"):
            ex.main_hidden(start, stop)
    ex.verify(tokens[20:25], 20)
    ex.rollback(1)  # rows of 22..24 overwrote the slots of 6..8: the ring holds 9..20 only
    assert ex.pos == 21
    ex.main_hidden(9, 21)
    with pytest.raises(StepError, match=r"inside 9\.\.20"):
        ex.main_hidden(8, 21)


@pytest.mark.parametrize("start,q,keep", [(14, 5, 2), (30, 4, 0), (45, 5, 5)])
def test_taps_through_verify_rollback_and_the_next_step(env, tokens, start, q, keep):
    """A verify of q rows then a rollback keeping ``keep`` (the rollback kernel; q = 1 would restore a snapshot): the
    committed rows are the reference's; the next decode rewrites the first rejected position's row."""
    _, _, _, ex, ref = env
    ref.reset()
    for s in range(0, start, 5):
        ref.verify(tokens[s:min(s + 5, start)], s)
    ex.reset()
    _copy_state(ex, ref, start)
    _poison(ex)
    ex.verify(tokens[start:start + q], start)
    ex.rollback(keep)
    ref.verify(tokens[start:start + q], start)
    ref.rollback(keep)
    end = start + keep
    # the compiled step's noise floor against the reference (test_compiled_step's teacher-forced bounds: max
    # 0.25 per row; measured on the H200 up to 0.072 here); a wrong or unwritten row is >= 1 or NaN
    if keep:
        assert _rel(ex.main_hidden(start, end), ref.main_hidden(start, end)).max() < 0.25
    ex.step([tokens[95]], end)
    ref.decode(tokens[95], end)
    assert _rel(ex.main_hidden(end, end + 1), ref.main_hidden(end, end + 1)).max() < 0.25


def test_decode_loop_graphs_record_the_taps(env, tokens):
    """decode_tokens (the captured decode-loop graphs: step + device sampler) writes a ring row per token: from
    the reference's state at 37, 12 greedy tokens; the reference run on the same tokens gives the same taps
    within bf16 tolerance (12 steps of drift from one state)."""
    _, _, _, ex, ref = env
    ref.reset()
    for s in range(0, 37, 5):
        ref.verify(tokens[s:min(s + 5, 37)], s)
    ex.reset()
    _copy_state(ex, ref, 37)
    _poison(ex)
    captures = ex.captures
    out = list(ex.decode_tokens(tokens[37], 37, 12))
    assert ex.captures == captures and ex.pos == 49
    for i, t in enumerate([tokens[37]] + out[:-1]):
        ref.decode(t, 37 + i)
    e = _rel(ex.main_hidden(37, 49), ref.main_hidden(37, 49))
    assert e.median() < 2e-2 and e.max() < 0.25, e
    assert torch.isnan(ex.tap_ring[torch.arange(49, 53, device=ex.dev) % ex.cfg.window].float()).all()


@pytest.mark.parametrize("split", [(4, 2), (2, 2, 2), (5, 1)])
def test_virtual_split_taps_equal_the_unsplit_step(env, tokens, split):
    """A virtual split (every shard on this GPU; taps 3, 4, 5 on one or two shards): ShardedStep.main_hidden equals
    the unsplit compiled step's bit for bit (the same kernels on the same inputs) over verify and decode steps; a
    shard refuses main_hidden on its own when it lacks a tap."""
    from ds4c.errors import StepError
    from ds4c.runtime.step import device_arch
    from ds4c.runtime.sharded import ShardedStep
    from ds4c.shard_plan import ShardPlan

    mf, buckets, cache, ex, _ = env
    s = ShardedStep(mf, buckets, ShardPlan(("cuda:0",) * len(split), split), device_arch(), cache, taps=TAPS)
    s.prepare_all(widths=(1, 5), max_ctx=64, progress=False)
    assert s.taps == TAPS and [sh.local_taps for sh in s.shards][-1] != ()
    ex.reset()
    s.reset()
    for sh in s.shards:
        if sh.tap_ring is not None:
            sh.tap_ring.fill_(float("nan"))
    p = 0
    for q in (5, 5, 1, 5, 1, 1, 5):
        ex.step(tokens[p:p + q], p)
        s.step(tokens[p:p + q], p)
        p += q
    lo = p - ex.cfg.window
    assert torch.equal(s.main_hidden(lo, p), ex.main_hidden(lo, p))
    partial = next(sh for sh in s.shards if sh.local_taps and sh.local_taps != TAPS)
    with pytest.raises(StepError, match="read the split's taps with ShardedStep.main_hidden"):
        partial.main_hidden(lo, p)


def test_artifact_with_taps_serves_and_one_without_refuses(env, tokens, tmp_path):
    """``ds4c compile --taps 3,4,5`` for this GPU's arch: a CompiledStep with those taps runs from it (nothing
    compiled) and records the same taps as the cache-built step bit for bit; the same artifact refuses a step
    without taps, and one compiled without taps refuses a step with taps, in one line, before any GPU work."""
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import ArtifactError
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.targets import target

    mf, buckets, cache, ex, _ = env
    types = {n: mf.ggml_type(n) for n in mf.specs}
    arch = device_arch()
    art = build_artifact(mf.config, [target(arch)], buckets, tmp_path / "taps", cache, progress=False,
                         weight_types=types, taps=TAPS)
    a = CompiledStep(mf, buckets, arch, cache, artifact=str(art), taps=TAPS)
    ex.reset()
    for p in range(0, 20, 5):
        a.step(tokens[p:p + 5], p)
        ex.step(tokens[p:p + 5], p)
    assert torch.equal(a.main_hidden(4, 20), ex.main_hidden(4, 20))
    with pytest.raises(ArtifactError, match="compiled with the DSpark taps 3,4,5, asked to serve a step with no "
                                            "DSpark taps"):
        CompiledStep(mf, buckets, arch, cache, artifact=str(art))
    plain = build_artifact(mf.config, [target(arch)], buckets, tmp_path / "plain", cache, progress=False,
                           weight_types=types)
    with pytest.raises(ArtifactError, match="compiled with no DSpark taps, asked to serve a step with the DSpark "
                                            "taps 3,4,5; compile one with --taps 3,4,5"):
        CompiledStep(mf, buckets, arch, cache, artifact=str(plain), taps=TAPS)
