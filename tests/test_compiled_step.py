"""The compiled step on a CUDA GPU against the reference on the same GPU (skipped without a GPU; run on the
H200 and recorded in docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch
from step_compare import teacher_forced_errors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 512, (80,), generator=g).tolist()


@pytest.fixture(scope="module")
def setup(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(tmp_path_factory.mktemp("kcache")))
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=128)
    return ex, ref


def test_teacher_forced_steps_match_the_reference(setup, tokens):
    ex, ref = setup
    e, _ = teacher_forced_errors(ex, ref, tokens, (5, 1, 3), 60)
    assert e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2 and e.max() < 0.25, e


def test_two_requests_give_identical_output_and_a_missing_key_is_named(setup):
    from ds4c.errors import StepError
    from ds4c.generate import generate

    ex, _ = setup
    a = generate(ex, [5, 17, 301, 42, 7, 99], 30).tokens
    b = generate(ex, [5, 17, 301, 42, 7, 99], 30).tokens
    assert a == b
    ex.reset()
    ex.step([1], 0)
    with pytest.raises(StepError, match="next position is 1"):
        ex.step([1], 5)
    ex.pos = 126
    with pytest.raises(StepError, match="outside the context"):
        ex.step([1] * 5, 126)
    ex.reset()


def _readable(cfg, name: str, t: torch.Tensor, pos: int) -> torch.Tensor:
    """The part of state buffer ``name`` that a step at ``pos`` or later can read before writing it: the ring and
    every ratio-4 compressor state whole; of a ratio > 4 compressor state the slots of the current block written
    so far (every other slot is written again before its flush); compressed rows and indexer keys of the
    blocks flushed before ``pos``."""
    layer, what = int(name.split(".")[0][1:]), name.split(".")[1]
    r = cfg.ratio(layer)
    if what in ("comp_kv", "comp_score") and r != 4:
        return t[:pos % r]
    if what == "comp":
        return t[:pos // r]
    if what == "idx_keys":
        return t[:pos // 4]
    return t


@pytest.mark.parametrize("start,q,keep", [(10, 5, 2), (15, 5, 1), (15, 5, 4), (13, 5, 0), (29, 4, 2), (30, 3, 3),
                                          (46, 2, 1)])
def test_rollback_matches_the_reference_rollback(setup, tokens, start, q, keep):
    """From the same state, verify q rows and keep ``keep`` in both the compiled step (its rollback kernel: the
    ring rows and ratio-4 states the verify saved) and the reference (an exact undo journal): everything a later
    step can read agrees within bf16 tolerance (same -inf slots), and the next decodes' logits too. Cases
    cover a rejection across two ratio-4 flushes (15, q=5: flushes at rows 0 and 4), a rejection of every row,
    and a ratio-16 flush in the rejected rows (29..32)."""
    from ds4c.ir.interpreter import state_to_inputs

    ex, ref = setup
    ref.reset()
    for s in range(0, start, 5):
        ref.verify(tokens[s:min(s + 5, start)], s)
    for name, buf in state_to_inputs(ref.state).items():
        ex.state[name].copy_(buf)
    ex.pos = start
    ex.verify(tokens[start:start + q], start)
    ex.rollback(keep)
    ref.verify(tokens[start:start + q], start)
    ref.rollback(keep)
    end = start + keep
    assert ex.pos == ref.state.pos == end
    for name, want in state_to_inputs(ref.state).items():
        got = _readable(ex.cfg, name, ex.state[name].float().cpu(), end)
        want = _readable(ex.cfg, name, want.float().cpu(), end)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)), name
        den = want[fin].norm()
        assert den == 0 or (got[fin] - want[fin]).norm() / den < 3e-2, name
    for p in range(end, end + 3):
        a = ex.step([tokens[p]], p).float().cpu()
        b = ref.decode(tokens[p], p).cpu()
        assert ((a - b).norm() / b.norm()) < 3e-2, p


def test_rollback_kernel_restores_exactly_what_the_verify_saved(setup, tokens):
    """Kernel level, bit for bit: after verify(5) + rollback(a) the ring slots of rejected rows hold their
    values from before the verify and those of accepted rows the verify's; each compressor state equals the undo
    family's torch model from what the step saved (runtime/families/undo.py): ratio 4 rebuilt from the saved
    state (the state before the verify) and rows, ratio 16 with the rejected slots back to their old values.
    Every accepted count at a position with two ratio-4 flushes and a ratio-16 flush in the step."""
    from ds4c.runtime.families import undo as U

    ex, _ = setup
    start = 15  # rows at 15..19: flushes after rows 0 and 4
    for keep in range(0, 5):
        ex.reset()
        for s in range(0, start, 5):
            ex.step(tokens[s:s + 5], s)
        before = {k: v.clone() for k, v in ex.state.items()}
        ex.verify(tokens[start:start + 5], start)
        after = {k: v.clone() for k, v in ex.state.items()}
        ex.rollback(keep)
        cfg = ex.cfg
        for i in range(cfg.n_layers):
            ring = ex.state[f"l{i}.ring"]
            for row in range(5):
                slot = (start + row) % cfg.window
                want = before if row >= keep else after
                assert torch.equal(ring[slot], want[f"l{i}.ring"][slot]), (i, row, keep)
            r = cfg.ratio(i)
            if not r:
                continue
            for what, d in (("comp", cfg.head_dim), ("idx", cfg.index_head_dim))[:2 if r == 4 else 1]:
                w = 2 * d if r == 4 else d
                n = U.compressor_undo_floats(r, w)
                undo = ex.graphs.workspaces[U.workspace_name(i, what)].view(torch.float32)[:n].cpu()
                if r == 4:
                    assert torch.equal(undo[:8 * w].view(8, w), before[f"l{i}.{what}_kv"].cpu())
                spec = U.RollbackSpec(5, cfg.window, cfg.head_dim, 1, ((r, w),))
                post = (after[f"l{i}.{what}_kv"].cpu(), after[f"l{i}.{what}_score"].cpu(), undo)
                _, ((k, sc),) = U.reference(spec, start, keep, [], [post])
                if r != 4:  # the slots of the rejected rows are back to their values before the verify
                    rej = [(start + j) % r for j in range(keep, 5)]
                    assert torch.equal(k[rej], before[f"l{i}.{what}_kv"].cpu()[rej])
                assert torch.equal(ex.state[f"l{i}.{what}_kv"].cpu(), k), (i, what, keep)
                assert torch.equal(ex.state[f"l{i}.{what}_score"].cpu(), sc), (i, what, keep)
    ex.reset()

@pytest.mark.parametrize("agree", [0, 1, 2, 4])
def test_verify_greedy_equals_verify_then_rollback(setup, tokens, agree):
    """The device-side acceptance (``verify_greedy``: argmax, accepted count and rollback kernel enqueued behind
    the verify graph) returns the tokens and leaves bit for bit the state that ``verify`` + the host's
    ``accept_greedy`` + ``rollback`` give, for 4 drafts of which exactly the first ``agree`` equal the target's
    greedy tokens (4: all, the bonus row's token added). At 15..19: two ratio-4 flushes in the step."""
    from ds4c.speculative import accept_greedy

    ex, _ = setup
    start, first = 15, tokens[15]

    def prefix():
        ex.reset()
        for s in range(0, start, 5):
            ex.step(tokens[s:s + 5], s)

    prefix()
    drafts: list[int] = []
    for i in range(4):  # the target's greedy chain: the last row's argmax after the rows so far
        t = int(ex.verify([first] + drafts, start)[-1].argmax())
        ex.rollback(0)
        drafts.append(t if i < agree else (t + 1) % ex.cfg.vocab_size)
    want_new = accept_greedy(ex.verify([first] + drafts, start).argmax(dim=-1).tolist(), drafts)
    assert len(want_new) == agree + 1
    ex.rollback(len(want_new))
    want = {k: v.clone() for k, v in ex.state.items()}
    prefix()
    assert ex.verify_greedy([first] + drafts, start) == want_new
    assert ex.pos == start + len(want_new) and ex.sequence.undo is None
    for k, v in want.items():
        assert torch.equal(ex.state[k], v), k
    ex.reset()


@pytest.mark.parametrize("formats", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_kquant_experts_step_matches_the_reference(formats, tokens, tmp_path_factory):
    """The compiled step with K-quant / IQ4_XS expert banks (and the GEMVs of the K mix) on the synthetic tiny
    model against the reference dequantizing the same bytes (issue 14 part 2), teacher-forced at widths 5, 1, 3."""
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(f"synthetic:tiny:{formats}")
    assert formats.upper() in {mf.ggml_type(n).name for n in mf.specs}, "no tensor in the format under test"
    buckets = BucketSpec.build(mf.config, (1, 3, 5), 64, contexts=(64,))
    cache = KernelCache(tmp_path_factory.getbasetemp() / "kquant-kcache")  # shared: only the expert kernels differ
    ex = CompiledStep(mf, buckets, device_arch(), cache)
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=64)
    e, _ = teacher_forced_errors(ex, ref, tokens, (5, 1, 3), 40)
    assert e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2 and e.max() < 0.25, e


@pytest.mark.parametrize("reference", [True, False])
def test_bench_times_the_compiled_step(tiny_path, reference):
    """ds4c bench's compiled path end to end on tiny: graph replay, every launch timed alone (the rollback kernel
    is in the plan but not in the step's launches), the end-to-end generate row; --no-reference / --no-generate
    leave those columns out."""
    from ds4c.bench import run_bench
    from ds4c.sources import open_model

    rep = run_bench(open_model(tiny_path), "cuda", (1, 5), (40,), repeats=3, ref_repeats=1, compile_modes=(),
                    transformers=False, reference=reference, end_to_end=reference, say=lambda m: None)
    for row in rep.rows:
        assert row.ours_ms > 0 and row.launches > 0 and row.families, row
        assert (row.eager_ms is not None) == reference, row
    assert len(rep.e2e) == (1 if reference else 0)
