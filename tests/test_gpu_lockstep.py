"""The compiled step served from an AOT artifact, in lockstep with the reference on the same GPU over hundreds of
decode steps that cross every context bucket (skipped without a GPU). The long form of this check, with
repeated requests through the API and the CLI, any model and a resumable checkpoint, is ``tests/gpu_soak.py``
(docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch
from step_compare import lockstep_errors, lockstep_ok, summary

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]

STEPS = 300  # > the last bucket's start: crosses 32, 64, 128 and 256 (~10-20 s of reference decode steps)


def test_lockstep_from_an_artifact_does_not_drift(tiny_path, tmp_path):
    """Both from an empty sequence with their own state, fed the same tokens: every step's logits finite, the
    error not growing faster than rounding does (``lockstep_ok``: last tenth's median <= the first tenth's x sqrt of
    the step ratio + 0.01, every step < 0.25: a random walk of rounding, not a state defect).
    The step opens from the artifact built first (artifact mode compiles nothing)."""
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.targets import target

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 5), STEPS + 4, contexts=(32, 64, 128, 256, STEPS + 4))
    arch = device_arch()
    art = build_artifact(mf.config, [target(arch)], buckets, tmp_path / "art", cache=KernelCache(tmp_path / "kc"),
                         progress=False, weight_types={name: mf.ggml_type(name) for name in mf.specs})
    ex = CompiledStep(mf, buckets, arch, KernelCache(tmp_path / "kc"), artifact=str(art))
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=ex.capacity)
    toks = torch.randint(0, mf.config.vocab_size, (STEPS,), generator=torch.Generator().manual_seed(7)).tolist()
    errs, _ = lockstep_errors(ex, ref, toks, STEPS)
    e = torch.tensor(errs)
    assert torch.isfinite(e).all(), summary(e)
    assert lockstep_ok(e), summary(e)
