"""The activation quant launch (docs/model.md 2.3.1 written once to global memory): ``templates/actq/
act_quant.cu.j2`` for ``rows`` rows of ``k`` values, in one of two layouts picked by the row count.

* ``block`` (fewer than :data:`WARP_LAYOUT_MIN_ROWS` rows: a decode / verify step's x and h): grid ``(k/128,
  rows)``, 128 threads, one value per thread, the amax over four warps through shared memory. The layout the
  decode kernels were validated with on the H200.
* ``warp`` (a prefill chunk's rows): grid ``(ceil(k/128 / (8 iters)), rows)``, 8 warps, one warp per 128-block,
  ``iters`` 128-blocks per warp (up to :data:`MAX_ITERS`), ``128 / wave`` values per lane, the amax by one warp
  reduction. Measured on the H200 (docs/perf.md, the GEMM prequant outcome): the ``block`` layout took 161.6 us
  for 4096 x 4096 values (131,072 blocks of one value per thread: bound by block scheduling, 0.4 TB/s); this
  one runs 4,096 blocks of 256 threads there (one block per row, 16 values per thread, loads issued together).

Both write the same values bit for bit (the amax is a max: its order does not matter); forms ``bf16`` (bf16
``e4m3 * 2^k``), ``f16s`` (f16 e4m3 values and fp32 per-128 scales), ``bf16p`` (the ``bf16`` values at the
positions of :func:`bf16p_positions`, and the scales) and ``e4m3s`` (the e4m3 codes, one byte a value, and the
scales), see the template's header. Arguments: ``x`` bf16 ``[rows, k]``, ``out`` ``[rows, k]`` (bf16 / f16 bits,
e4m3 bytes), with ``f16s`` / ``bf16p`` / ``e4m3s`` ``scales`` fp32 ``[rows, k/128]``.
"""

from __future__ import annotations

import math

from ds4c.runtime.families import Launch
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target

TEMPLATE = "actq/act_quant.cu.j2"
WARP_LAYOUT_MIN_ROWS = 64
WARPS = 8
MAX_ITERS = 4
FORMS = ("bf16", "f16s", "bf16p", "e4m3s")


def bf16p_positions(k: int) -> list[int]:
    """Where form ``bf16p`` stores value ``i`` of a row of ``k``: inside every 16 values, ``4t + j`` goes to ``2t +
    j`` (``j < 2``) or ``8 + 2t + j - 2`` (``j >= 2``) -- the k order of an m64nNk16 A fragment whose thread ``t``
    holds the bytes ``4t .. 4t + 3`` of a 32-value MXFP4 block (low nibbles: values ``4t + j``, high: ``16 + 4t + j``;
    runtime/families/moe_gemm.py, ``MoeGemmSpec.mma``)."""
    out = []
    for i in range(k):
        r = i & 15
        out.append((i & ~15) + (((r >> 2) << 1) | (r & 1)) + ((r & 2) << 2))
    return out


def layout_for(rows: int) -> str:
    """``warp`` from :data:`WARP_LAYOUT_MIN_ROWS` rows on, else ``block``."""
    return "warp" if rows >= WARP_LAYOUT_MIN_ROWS else "block"


def _iters(k: int) -> int:
    return max(1, min(MAX_ITERS, math.ceil(k // 128 / WARPS)))


def _check(k: int, rows: int, form: str) -> None:
    bad = []
    if not (isinstance(k, int) and k >= 128 and k % 128 == 0):
        bad.append(f"k {k!r} (expected a positive multiple of 128)")
    if not (isinstance(rows, int) and 1 <= rows <= 65535):
        bad.append(f"rows {rows!r} (expected 1..65535: the grid's y)")
    if form not in FORMS:
        bad.append(f"form {form!r} (expected one of {FORMS})")
    if bad:
        raise RenderError("actq: " + "; ".join(bad))


def render_actq(name: str, family: str, target: Target, k: int, rows: int, form: str = "f16s") -> KernelSource:
    """The actq kernel for ``rows`` rows of ``k`` values in :func:`layout_for`'s layout (the ``block`` render
    is the template's original text, byte for byte).

    Raises:
        RenderError: ``k`` not a positive multiple of 128, ``rows`` outside 1..65535, an unknown form.
    """
    _check(k, rows, form)
    params: dict = {"k": k} if form == "bf16" else {"k": k, "form": form}
    if layout_for(rows) == "warp":
        params.update(layout="warp", iters=_iters(k))
    return render(TEMPLATE, name, family, target, params)


def actq_launch(k: int, rows: int, target: Target, kernel: str = "actq") -> Launch:
    """The launch shape of :func:`render_actq`'s kernel (no dynamic shared memory)."""
    _check(k, rows, "f16s")
    if layout_for(rows) == "block":
        return Launch((k // 128, rows, 1), (128, 1, 1), 0, kernel=kernel)
    per_block = WARPS * _iters(k)
    return Launch((math.ceil(k // 128 / per_block), rows, 1), (WARPS * target.wave, 1, 1), 0, kernel=kernel)
