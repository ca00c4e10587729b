"""The device sampler (runtime/sampler.py) against the CPU sampler (spec P12 + top-k/top-p): the same filter, and
draws from the same distribution (chi-square goodness of fit of both samplers to the exact filtered softmax),
reproducible per seed. Runs on the CPU (the sampler is device-agnostic torch); tests/test_compiled_step.py
runs it inside the captured step on a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from ds4c.generate import filter_logits
from ds4c.reference.primitives import sample
from ds4c.runtime.sampler import DeviceSampler, exp_noise

# chi-square critical values at p = 1e-4 by degrees of freedom (a correct sampler fails 1 run in 10,000)
CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72, 10: 35.56,
            11: 37.37}


def _chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


LOGITS = torch.tensor([2.0, 1.5, 1.4, 1.4, 0.9, 0.3, 0.0, -0.2, -1.0, -3.0, 0.8, 1.1])
CASES = [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.8), (0.8, 5, 0.9), (2.0, 12, 0.999)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_device_and_cpu_samplers_draw_the_filtered_softmax(temperature, top_k, top_p):
    n = 6000
    want = torch.softmax(filter_logits(LOGITS[None], temperature, top_k, top_p)[0] / temperature, dim=0)
    ds = DeviceSampler(len(LOGITS), "cpu", ring=16)
    ds.configure(temperature, top_k, top_p, seed=11)
    dev = torch.bincount(torch.cat([ds.sample(LOGITS) for _ in range(n)]), minlength=len(LOGITS)).double()
    g = torch.Generator().manual_seed(11)
    cpu = torch.bincount(torch.cat([sample(filter_logits(LOGITS[None], temperature, top_k, top_p), temperature, g)
                                    for _ in range(n)]), minlength=len(LOGITS)).double()
    for counts in (dev, cpu):
        assert counts[want == 0].sum() == 0  # filtered tokens are never drawn
        stat, df = _chi2(counts, want.double(), n)
        assert stat < CHI2_1E4[df], (counts.tolist(), (want * n).tolist())
    assert int(ds.counter) == n


def test_filter_sets_agree_with_the_cpu_filter():
    """For many random rows: the tokens the device sampler can draw are exactly those filter_logits keeps."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        v = int(torch.randint(2, 64, (1,), generator=g))
        logits = torch.randn(v, generator=g) * 3
        if trial % 4 == 0:
            logits = torch.round(logits)  # ties at the top-k boundary
        t = float(torch.rand(1, generator=g)) * 2 + 0.05
        k = int(torch.randint(0, v + 2, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.01
        keep = torch.isfinite(filter_logits(logits[None], t, k, p)[0])
        ds = DeviceSampler(v, "cpu")
        ds.configure(t, k, p, seed=trial)
        drawn = {int(ds.sample(logits)) for _ in range(300)}
        assert drawn <= set(keep.nonzero().flatten().tolist()), (trial, drawn)
        if int(keep.sum()) == 1:
            assert drawn == set(keep.nonzero().flatten().tolist())


def test_seeded_reproducible_and_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    ds = DeviceSampler(1000, "cpu", ring=8)

    def run(seed: int) -> list[int]:
        ds.configure(0.9, 50, 0.95, seed)
        return [int(ds.sample(logits)) for _ in range(20)]

    a, b, c = run(5), run(5), run(6)
    assert a == b and a != c and len(set(a)) > 3
    assert ds.ring.tolist() == c[16:20] + c[12:16]  # draw n at n % 8
    ds.configure(0.0, 0, 1.0, 0)
    assert int(ds.greedy(logits)) == int(torch.argmax(logits))
    assert int(ds.greedy(torch.tensor([1.0, 3.0, 3.0]))) == 1  # ties to the lower id


def test_noise_is_exp1_and_independent_across_ids_and_draws():
    ids = torch.arange(200_000)
    e = exp_noise(torch.tensor([7]), torch.tensor([3]), ids)
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.03
    u = torch.exp(-e.double())  # back to uniform: 20 equal bins
    stat, df = _chi2(torch.histc(u, 20, 0, 1), torch.full((20,), 0.05, dtype=torch.float64), len(ids))
    assert stat < 45.3  # chi-square, 19 df, p = 1e-4
    e2 = exp_noise(torch.tensor([7]), torch.tensor([4]), ids)
    corr = float(torch.corrcoef(torch.stack([e, e2]))[0, 1])
    assert abs(corr) < 0.01 and not torch.equal(e, e2)
    assert math.isclose(float(exp_noise(torch.tensor([7]), torch.tensor([3]), ids[:5])[2]), float(e[2]))


def test_argmax_rows_equals_torch_argmax_with_ties():
    """The chunked two-level argmax the verify acceptance uses (runtime/sampler.py argmax_rows) returns
    torch.argmax's ids, ties to the lower id, for vocabularies with and without a usable chunk."""
    from ds4c.runtime.sampler import argmax_chunk, argmax_rows

    g = torch.Generator().manual_seed(5)
    assert argmax_chunk(129280) == 2020 and argmax_chunk(513) is None
    for v in (129280, 4096, 513):
        c = argmax_chunk(v)
        for _ in range(5):
            x = torch.randn(5, v, generator=g)
            x[1, 3] = x[1, v - 2] = 1e4  # a tie across chunks: the lower id
            x[2, :] = 0.5  # a whole row tied: id 0
            x[3, v // 2] = x[3, v // 2 + 1] = 1e4  # a tie inside one chunk
            want = x.argmax(dim=-1)
            assert want[1] == 3 and want[2] == 0
            assert torch.equal(argmax_rows(x, c), want), v
