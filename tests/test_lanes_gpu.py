"""Decode lanes on the compiled step (issue 30) on a CUDA GPU: each lane's logits equal the same sequence run alone on
the one-sequence compiled step, teacher-forced, with lanes at different positions crossing window wraps, flushes
of both ratios and context buckets (skipped without a GPU; run on the device and recorded in
docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch
from lanes_compare import lanes_vs_alone

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled lanes step)")]


def test_lanes_equal_each_sequence_alone(tiny_path, tmp_path):
    """Five lanes (prompts of 3..60 tokens; tiny: window 16, ratios 4 and 16, buckets 32..128), 40 decode steps:
    every row within the one-sequence step's noise floor of its alone run and the same argmax (measured: bit-equal,
    docs/gpu-validation.md)."""
    from ds4c.buckets import BucketSpec
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.step.lanes import LanesStep
    from ds4c.sources import open_model

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1,), 128, contexts=(32, 64, 128))
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(tmp_path / "kc"))
    lanes = LanesStep(ex, slots=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 15, 31, 47, 60)]
    feeds = [torch.randint(0, 512, (40,), generator=g).tolist() for _ in prompts]
    r = lanes_vs_alone(ex, lanes, prompts, feeds)
    e = r["errors"]
    assert torch.isfinite(e).all() and e.median() < 1e-3 and e.max() < 2e-2, e
    assert r["argmax"] == 1.0, r
