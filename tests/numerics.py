"""Comparison bounds derived from the dtype and the reduction, shared by the numerical tests.

Why a module: a fixed bound such as ``rel < 1e-3`` on a bf16 output sits below bf16's own noise floor and so
passes or fails with the CPU's summation order (torch and MKL pick their SIMD kernels by CPU: an AVX2-only
machine and an AVX-512 one order fp32 sums differently). The bounds here say where they come from.

Floating-point facts used (round to nearest even, normal numbers):

* unit roundoff ``u``: ``|fl(x) - x| <= u |x|``; FP8 e4m3 ``2^-4``, bf16 ``2^-8``, fp16 ``2^-11``, fp32 ``2^-24``;
* one ulp of ``x`` is at most ``2u |x|`` (``ULP``), so two roundings of the same dtype of nearby values are
  either equal or an ulp apart: ``|a - b| <= ULP |b|`` per element, hence also ``<= ULP`` in relative L2 norm;
* an fp32 sum of ``k`` terms computed in another order differs by at most ``gamma_k = k u / (1 - k u)`` times
  the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms, 3.1); for random
  zero-mean data the typical difference relative to the result is about ``k * 2^-24``.

Two results that hold the same products and differ only in fp32 summation order therefore round to the same
bf16 value except where the exact value lies within that difference of a rounding boundary: the expected
fraction of such "flips" is about ``k * 2^-24 / 2^-8 = k * 2^-16`` (0.8% at k = 512), and each flip is one ulp.
"""

from __future__ import annotations

import torch

#: unit roundoff per dtype (half the relative spacing at the bottom of a binade)
UNIT = {torch.float8_e4m3fn: 2.0 ** -4, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
        torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
#: one ulp relative to the value, the most two roundings of nearby values can differ by
ULP = {dt: 2 * u for dt, u in UNIT.items()}
BF16_ULP = ULP[torch.bfloat16]  # 2^-7 = 7.8e-3


def rel_l2(got: torch.Tensor, want: torch.Tensor, dim: int | None = None) -> float:
    """``||got - want|| / ||want||`` in fp64 (over the whole tensor, or the worst over ``dim``'s slices); inf
    when ``got`` has a non-finite element (a NaN poison left unwritten counts as an error)."""
    g, w = got.double(), want.double()
    d = (g - w).nan_to_num(float("inf"))
    if dim is None:
        return float(d.norm() / w.norm().clamp(min=1e-300))
    return float((d.norm(dim=dim) / w.norm(dim=dim).clamp(min=1e-300)).max())


def flip_fraction_bound(k: int, dtype: torch.dtype = torch.bfloat16, margin: float = 4.0) -> float:
    """The fraction of ``dtype`` roundings that a different fp32 summation order of ``k`` terms may flip:
    ``margin * k * 2^-24 / (2 u_dtype)`` (see the module docstring), at least one element in a hundred so that
    small cases are not held to a count of zero or one."""
    return max(0.01, margin * k * UNIT[torch.float32] / ULP[dtype])


def assert_same_roundings(got: torch.Tensor, want: torch.Tensor, *, k: int, ulps: int = 1,
                          max_flip_frac: float | None = None, what: str = "") -> None:
    """Assert that ``got`` and ``want`` (same low-precision dtype) are roundings of values that differ only by
    fp32 summation order over ``k`` terms: every element equal or within ``ulps`` ulps of ``want`` (relative),
    plus the reordering error of a k-term fp32 sum, which is relative to the terms' magnitudes rather than to the
    result (``k 2^-24 max|want|``: the tests' sums have terms no larger than the output's largest element, so a
    result that cancels to near zero may move by that much), and at most :func:`flip_fraction_bound` of the
    elements differing.

    ``ulps`` > 1 is for results that pass through several such roundings in a chain (say so at the call site).
    Non-finite elements in ``got`` (an unwritten NaN poison) fail.
    """
    assert got.shape == want.shape, (got.shape, want.shape)
    dt = want.dtype if want.dtype in ULP and want.dtype != torch.float32 else got.dtype
    g, w = got.double(), want.double()
    assert bool(torch.isfinite(g).all()), f"{what}: non-finite (unwritten?) elements"
    tol = ulps * ULP[dt] * w.abs() + (1 + ULP[dt]) * fp32_order_bound(k) * float(w.abs().max())
    bad = (g - w).abs() > tol
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements more than {ulps} ulp(s) of {dt} apart; worst "
                                 f"{float(((g - w).abs() / w.abs().clamp(min=1e-300)).max()):.3g} relative")
    frac = float((g != w).double().mean())
    bound = flip_fraction_bound(k, dt) if max_flip_frac is None else max_flip_frac
    assert frac <= bound, f"{what}: {frac:.3%} of the elements differ (bound {bound:.3%} for k = {k})"


def fp32_order_bound(k: int) -> float:
    """Relative L2 bound between two fp32 reductions of the same ``k`` products in different orders, for the
    tests' random zero-mean data: ``k * 2^-24``. Each order's rounding error is a random walk of ``k`` roundings of
    partial sums, about ``2^-24 sqrt(k / 2)`` of the result; the bound leaves a factor ``sqrt(2 k)`` above that
    (and stays below Higham's worst case ``gamma_k``, which is relative to the sum of magnitudes)."""
    return k * UNIT[torch.float32]
