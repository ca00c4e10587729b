"""The shared comparison bounds (tests/numerics.py) accept what they say they accept and nothing more: one-ulp
flips of a reordered sum pass; a two-ulp error, too many flips, or an unwritten NaN fail."""

from __future__ import annotations

import pytest
import torch

from numerics import BF16_ULP, ULP, assert_same_roundings, flip_fraction_bound, fp32_order_bound, rel_l2


def _reordered(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two bf16 roundings of the same [64, 256] fp32 products summed over k in two orders."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(64, k, generator=g), torch.randn(k, 256, generator=g)
    fwd = a @ b
    rev = (a.flip(1).unsqueeze(-1) * b.flip(0).unsqueeze(0)).cumsum(1)[:, -1]  # another order, term by term
    return fwd.to(torch.bfloat16), rev.to(torch.bfloat16)


def test_a_reordered_sum_passes_and_flips_some_roundings() -> None:
    got, want = _reordered(512, 0)
    flips = float((got != want).float().mean())
    assert 0 < flips <= flip_fraction_bound(512)  # the case the helper exists for: some roundings do flip
    assert_same_roundings(got, want, k=512)
    assert rel_l2(got, want) <= BF16_ULP


def test_a_two_ulp_error_fails() -> None:
    got, want = _reordered(512, 1)
    bad = got.clone()
    bad[3, 7] = (want[3, 7].float() * (1 + 2.5 * ULP[torch.bfloat16])).to(torch.bfloat16)
    with pytest.raises(AssertionError, match="more than 1 ulp"):
        assert_same_roundings(bad, want, k=512)
    assert_same_roundings(bad, want, k=512, ulps=3)


def test_too_many_one_ulp_flips_fail() -> None:
    got, want = _reordered(64, 2)
    bumped = want.view(torch.int16).clone()
    bumped[:, ::4] += 1  # a quarter of the elements one ulp up: far more than a reordering flips
    with pytest.raises(AssertionError, match="differ"):
        assert_same_roundings(bumped.view(torch.bfloat16), want, k=64)


def test_an_unwritten_poison_fails() -> None:
    got, want = _reordered(64, 3)
    got = got.clone()
    got[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_same_roundings(got, want, k=64)
    assert rel_l2(got, want) == float("inf")


def test_fp32_order_bound_covers_a_reordered_fp32_sum() -> None:
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(32, 4096, generator=g), torch.randn(4096, 64, generator=g)
    fwd = a @ b
    rev = (a.flip(1).unsqueeze(-1) * b.flip(0).unsqueeze(0)).cumsum(1)[:, -1]
    assert 0 < rel_l2(rev, fwd, dim=1) <= fp32_order_bound(4096)
    exact = a.double() @ b.double()
    assert rel_l2(fwd, exact) <= fp32_order_bound(4096)
