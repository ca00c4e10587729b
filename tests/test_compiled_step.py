"""The compiled step on a CUDA GPU against the reference on the same GPU (skipped without a GPU; run on the
H200 and recorded in docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, 512, (80,), generator=g).tolist()


@pytest.fixture(scope="module")
def setup(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.gguf_file import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.executor import CompiledStep, device_arch

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(tmp_path_factory.mktemp("kcache")))
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=128)
    return ex, ref


def teacher_forced_errors(ex, ref, tokens: list[int], widths: tuple[int, ...], end: int) -> torch.Tensor:
    """Relative L2 error per logits row of the compiled step against the reference, each step started from the
    reference's state (copied in), widths cycling through ``widths`` until position ``end``."""
    from ds4c.ir.interpreter import state_to_inputs

    ref.reset()
    errs, p, k = [], 0, 0
    while p < end:
        q = widths[k % len(widths)]
        k += 1
        for name, buf in state_to_inputs(ref.state).items():
            ex.state[name].copy_(buf)
        ex.pos = p
        got = ex.step(tokens[p:p + q], p).float().cpu()
        want = ref.verify(tokens[p:p + q], p).cpu()
        errs.append((got - want).norm(dim=-1) / want.norm(dim=-1))
        p += q
    return torch.cat(errs)


def test_teacher_forced_steps_match_the_reference(setup, tokens):
    ex, ref = setup
    e = teacher_forced_errors(ex, ref, tokens, (5, 1, 3), 60)
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


def test_rollback_matches_the_reference_rollback(setup, tokens):
    """From the same state, verify 5 rows and keep 2 in both the compiled step and the reference (whose
    rollback is an exact undo journal): the states agree within bf16 tolerance (same -inf slots), and the
    next decode's logits too."""
    from ds4c.ir.interpreter import state_to_inputs

    ex, ref = setup
    ref.reset()
    for s in range(0, 10, 5):
        ref.verify(tokens[s:s + 5], s)
    for name, buf in state_to_inputs(ref.state).items():
        ex.state[name].copy_(buf)
    ex.pos = 10
    ex.verify(tokens[10:15], 10)
    ex.rollback(2)
    ref.verify(tokens[10:15], 10)
    ref.rollback(2)
    assert ex.pos == ref.state.pos == 12
    for name, want in state_to_inputs(ref.state).items():
        got = ex.state[name].float().cpu()
        want = want.float().cpu()
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got)), name
        den = want[fin].norm()
        assert den == 0 or (got[fin] - want[fin]).norm() / den < 3e-2, name
    a = ex.step([tokens[12]], 12).float().cpu()
    b = ref.decode(tokens[12], 12).cpu()
    assert ((a - b).norm() / b.norm()) < 3e-2
