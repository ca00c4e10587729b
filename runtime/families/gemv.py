"""The multi-output GEMV family: the weight-streaming kernel of a decode / verify step (docs/model.md 2.3,
the IR op ``linear`` with modes ``fp8act`` / ``bf16`` / ``f32``), plus ``gemv_argmax`` (greedy head epilogue).
Template: ``templates/gemv/gemv.cu.j2``.

One launch computes, for ``q`` rows (1..5) of one activation ``x`` (bf16 ``[q, K]``), several outputs
``y_j = x @ W_j^T`` (``W_j`` logical ``[N_j, K]``). Per output (:class:`GemvOutput`):

* ``fmt``: how ``W_j`` is stored (row-major, rows of K values; docs/gguf-layout.md "Tensor types ds4c reads"):
  ``bf16`` raw u16 ``[N, K]``; ``f32`` ``[N, K]``; ``q8_0`` GGUF Q8_0 blocks, uint8 ``[N, K/32*34]`` (fp16 scale
  ``d`` then 32 int8 ``q``, value ``d*q``); ``mxfp4`` GGUF MXFP4 blocks, uint8 ``[N, K/32*17]`` (e8m0 byte ``e``,
  then 16 bytes: byte ``j`` = element ``j`` (low nibble) and ``j+16`` (high nibble); value
  ``e2m1[nibble] * 2^(e-127)``); ``q2_k`` .. ``q6_k``, ``iq4_xs``: llama.cpp's super-blocks of 256 values,
  uint8 ``[N, K/256*bytes]`` (84 / 110 / 144 / 176 / 210 / 136 bytes; layouts in :mod:`ds4c.quant`), K a multiple
  of 256.
* ``mode``: ``fp8act`` (spec 2.3: when ``GemvSpec.act_quant`` the activation is quantized to e4m3 in blocks of
  128 with power-of-two scales exactly as :func:`ds4c.quant.act_quant_dequant`, then an fp32-accumulated
  product, bf16 out); ``bf16`` (plain bf16 x, fp32 accumulate, bf16 out); ``f32`` (fp32 out; the head).
* ``out_dtype``: ``bf16`` or ``f32`` (default: ``f32`` for mode ``f32``, else ``bf16``): the fp32 accumulator
  rounded once (RNE) or stored as is.

Kernel design (the numbers are render-time constants computed here, see :func:`plan`):

* 256 threads per block; a persistent grid (:func:`launch_shape`) walks "tiles" = ``RB`` consecutive rows of
  one output; all outputs' tiles form one list, so every output's rows are spread over the whole grid.
* Prologue, once per block: ``x`` is read once; the fp8 activation quantization (amax over 16 lanes per
  128-block, ``s = 2^ceil(log2(max(amax,1e-4)/448))``, ``e4m3_rne(x/s)*s``) is done once and the dequantized
  values (exact in bf16) go to shared memory (rows padded by 16 bytes per 128 bytes so that the strided
  16-byte reads of the q8_0 / mxfp4 paths are bank-conflict free). Plain ``x`` for ``bf16`` / ``f32`` modes is
  copied to shared memory when it fits (HIP: 64 KiB LDS), else read from global memory (L1/L2 resident).
* Inside a tile, each thread owns one "unit" of columns (bf16: 8 values = 16 B, f32: 4 values = 16 B, q8_0:
  half a block = 16 values, mxfp4: one block = 32 values) for ``R`` rows (``R`` = 4 bf16 / q8_0 / mxfp4, 2 f32,
  halved for small launches; 1 for q = 1 launches without the FP8 prologue), so each x element read from
  shared memory is reused ``R`` times and every weight element is used by all ``q`` rows. ``TG`` threads (a power of two, <= 256) split a row's units; a block holds
  ``G = 256/TG`` row groups, so ``RB = G*R`` rows per tile.
* bf16 / f32 weights are loaded straight from global memory with 16-byte coalesced loads (up to 8 loads in
  flight per thread). q8_0 / mxfp4 rows are not 16-byte aligned per block (34 / 17 byte blocks), so a tile's
  bytes (one contiguous range) are staged into shared memory with 16-byte coalesced loads, the next tile's bytes
  are prefetched into registers while the current tile is computed, and threads read their blocks from shared
  memory with 4-byte reads.
* fp32 accumulation; q8_0 and mxfp4 sum each unit's products (``sum x*q``) before one multiply by the block
  scale. mxfp4 codes are decoded by bit placement (``code << 22`` is ``e2m1 * 2^-126`` as fp32, subnormal for
  ``|e2m1| < 1``) with x pre-scaled by ``2^64``; the unit sum is multiplied back by ``2^62 * 2^(e-127)``.
  This is exact for |x| < 2^64 (realistic activations) and e <= 254.
* K-quants / IQ4_XS (staged like q8_0): a unit is one 32-block ``ib`` of super-block ``unit // 8`` (the decoder
  ``templates/prelude/kquant.h.j2``, shared with the experts family). Per row the two 16-value halves' scales
  ``sc = d * sub_scale`` and mins ``mn = dmin * sub_min`` are decoded once; then per 8-column chunk the 8 codes
  as exact int8 (``ds4c_kq_codes``, magic-number conversion) times x, summed per half (per 32-block for Q4_K /
  Q5_K / IQ4_XS, one scale for both halves) and applied once: ``acc += sc * sum(x*code) - mn * sum(x)``, with
  ``sum(x)`` shared by the ``R`` rows. The products are those of gguf's dequantizer (``d*sc`` exact, times the
  code exact), so only the fp32 summation order differs from :func:`reference` (plus the subtraction of the
  min term after the sum instead of per element). Q3_K / Q6_K rows of an odd number of super-blocks are only
  2-byte aligned, as is every odd super-block inside a row: their 4-byte reads funnel two aligned words.
  Rows ``R`` = 4 at q <= 2, 2 at q >= 3 (HIP: 1 at q >= 6) and, on CUDA, ``__launch_bounds__(256, 2)``, so no
  build spills (sm_90: 40-120 registers).
* Reduction over the ``TG`` threads of a row group: a butterfly reduce-scatter of the ``R*q`` sums with the
  prelude's xor shuffle (about ``R*q + log2`` shuffles per warp instead of ``5*R*q``), then a shared-memory
  sum over the warps of a group; one thread per (row, q) writes the output.

Kernel arguments, in order (:func:`arg_order`): ``x``, ``w_0 .. w_{n-1}``, ``y_0 .. y_{n-1}``; no integers
(every size is a render-time constant). Pointers must be 16-byte aligned (torch allocations are) and tensors
contiguous. Outputs are ``[q, N_j]`` row-major.

``gemv_argmax`` (:class:`ArgmaxSpec`, :func:`render_argmax`): one block of 1024 threads per row of fp32 logits
``[q, N]`` -> int32 ``[q]``, the index of the maximum, ties to the lower index, NaN counted as the largest
(torch.argmax semantics).

Numerics vs :func:`reference`: identical products and operands; only the fp32 summation order differs
(per-thread unit sums, then the butterfly), so f32 outputs agree to ~1e-6 relative and bf16 outputs to one
bf16 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ds4c.runtime.families.experts import BLOCK_BYTES as _KQ_BYTES, FMT_ID as _FMT_ID, KQUANTS
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target, target as _target

TEMPLATE = "gemv/gemv.cu.j2"
FAMILY = "gemv"
THREADS = 256
ARGMAX_THREADS = 1024
FORMATS = ("bf16", "q8_0", "mxfp4", "f32") + KQUANTS
MODES = ("fp8act", "bf16", "f32")
OUT_DTYPES = ("bf16", "f32")
#: columns per thread unit (one 16-byte load for bf16 / f32, half a Q8_0 block, one MXFP4 block, one 32-block of
#: a K-quant / IQ4_XS super-block)
UNIT_COLS = {"bf16": 8, "f32": 4, "q8_0": 16, "mxfp4": 32, **{f: 32 for f in KQUANTS}}
#: rows per thread (x reuse) before the small-launch adjustment
DEFAULT_ROWS = {"bf16": 4, "f32": 2, "q8_0": 4, "mxfp4": 4, **{f: 4 for f in KQUANTS}}
STAGED = ("q8_0", "mxfp4") + KQUANTS
#: values per K-quant super-block (K of such an output must be a multiple)
QK_K = 256
#: shared memory a block may use (CUDA sm_90 opt-in maximum; HIP LDS per workgroup)
SMEM_LIMIT = {"cuda": 227 * 1024, "hip": 64 * 1024}
#: shared memory per multiprocessor, for the persistent grid's blocks per SM
SMEM_PER_SM = {"cuda": 228 * 1024, "hip": 64 * 1024}
#: multiprocessors the persistent grid is sized for (H200: 132); launch_shape takes another count
DEFAULT_SMS = 132
#: blocks per multiprocessor the grid aims at (register use ~100-128 per thread allows 2)
BLOCKS_PER_SM = 2
#: q = 1 launches without an FP8 activation prologue (plain bf16/f32 x, e.g. the head): one row per thread
#: (~32 registers) and 8 blocks per multiprocessor keep more weight bytes in flight. H200 sweep
#: (tests/gpu_checks/gemv_sweep.py, docs/perf.md): head 129280x4096 bf16 at q=1 from ~450 us (R=4, 2 blocks/SM)
#: to 241 us (R=1, 8 blocks/SM), 4.39 TB/s. Launches with the prologue pay it once per block, so they keep 2.
PLAIN_Q1_BLOCKS_PER_SM = 8
MAX_Q = 16  # a lanes step's rows (ds4c.ir.builder.MAX_LANE_ROWS); the lowering takes up to settings.gemv_rows()


@dataclass(frozen=True)
class GemvOutput:
    """One output ``y = x @ W^T`` of a GEMV launch.

    Attributes:
        n: N, the rows of ``W`` (output width).
        fmt: storage of ``W``: ``bf16`` | ``q8_0`` | ``mxfp4`` | ``f32`` | ``q2_k`` .. ``q6_k`` | ``iq4_xs``
            (layouts in the module docstring).
        mode: ``fp8act`` | ``bf16`` | ``f32`` (the IR ``linear`` modes).
        out_dtype: ``bf16`` | ``f32``; None = ``f32`` for mode ``f32``, else ``bf16``.
    """

    n: int
    fmt: str = "bf16"
    mode: str = "bf16"
    out_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.out_dtype is None:
            object.__setattr__(self, "out_dtype", "f32" if self.mode == "f32" else "bf16")
        bad = []
        if not isinstance(self.n, int) or self.n < 1:
            bad.append(f"n {self.n!r} (expected an int >= 1)")
        if self.fmt not in FORMATS:
            bad.append(f"fmt {self.fmt!r} (expected one of {FORMATS})")
        if self.mode not in MODES:
            bad.append(f"mode {self.mode!r} (expected one of {MODES})")
        if self.out_dtype not in OUT_DTYPES:
            bad.append(f"out_dtype {self.out_dtype!r} (expected one of {OUT_DTYPES})")
        if bad:
            raise RenderError("GemvOutput: bad " + "; ".join(bad))

    @property
    def torch_out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.out_dtype == "bf16" else torch.float32

    def short(self) -> str:
        return f"{self.n}:{self.fmt}/{self.mode}->{self.out_dtype}"


@dataclass(frozen=True)
class GemvSpec:
    """One GEMV launch: ``q`` activation rows of width ``k`` and several outputs sharing them.

    Attributes:
        k: K, the input width (a multiple of 128).
        q: rows of ``x`` (1..8; 1 = decode, 2..5 = verify).
        outputs: the outputs, in argument order (a list is converted to a tuple).
        act_quant: quantize the activation of ``fp8act`` outputs (spec 2.3 step 1); False = the reference's
            ``quant_emulation=False`` (plain bf16 x for every output).
        rows: rows per thread ``R`` for every output (1, 2, 4 or 8); 0 = automatic (:data:`DEFAULT_ROWS`,
            halved while the launch has fewer tiles than :data:`DEFAULT_SMS`).
    """

    k: int
    q: int
    outputs: tuple[GemvOutput, ...]
    act_quant: bool = True
    rows: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(self.outputs))
        bad = []
        if not isinstance(self.k, int) or self.k < 128 or self.k % 128:
            bad.append(f"k {self.k!r} (expected a positive multiple of 128)")
        if not isinstance(self.q, int) or not 1 <= self.q <= MAX_Q:
            bad.append(f"q {self.q!r} (expected 1..{MAX_Q})")
        if not self.outputs:
            bad.append("outputs () (expected at least one GemvOutput)")
        if any(not isinstance(o, GemvOutput) for o in self.outputs):
            bad.append("outputs (expected GemvOutput items)")
        if self.rows not in (0, 1, 2, 4, 8):
            bad.append(f"rows {self.rows!r} (expected 0, 1, 2, 4 or 8)")
        if bad:
            raise RenderError("GemvSpec: bad " + "; ".join(bad))

    def short(self) -> str:
        aq = "" if self.act_quant else " noaq"
        return f"K={self.k} q={self.q}{aq} [" + ", ".join(o.short() for o in self.outputs) + "]"


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one stored row of ``k`` values in ``fmt`` (K-quants: ``k // 256`` super-blocks)."""
    if fmt in KQUANTS:
        return k // QK_K * _KQ_BYTES[fmt]
    return {"bf16": 2 * k, "f32": 4 * k, "q8_0": k // 32 * 34, "mxfp4": k // 32 * 17}[fmt]


def weight_shape(out: GemvOutput, k: int) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of the weight tensor passed to the kernel: bf16 ``[N, K]`` torch.bfloat16 (any 2-byte dtype
    holding the bits works), f32 ``[N, K]`` float32, q8_0 / mxfp4 / K-quants uint8 ``[N, row_bytes]``."""
    if out.fmt == "bf16":
        return (out.n, k), torch.bfloat16
    if out.fmt == "f32":
        return (out.n, k), torch.float32
    return (out.n, row_bytes(out.fmt, k)), torch.uint8


def weight_bytes(spec: GemvSpec) -> int:
    """Bytes of all weights of a launch (what a decode step streams)."""
    return sum(o.n * row_bytes(o.fmt, spec.k) for o in spec.outputs)


# --------------------------------------------------------------------------------------------- the plan
def _pow2_floor(v: int) -> int:
    return 1 << (v.bit_length() - 1)


def _reduce_steps(v: int, sg: int) -> tuple[int, list[dict], int, int]:
    """Butterfly reduce-scatter of ``v`` values over ``sg`` lanes: (padded count, steps, values left per lane,
    mask of lane bits that must be zero for a lane to write). Chooses how many halving steps to take so that
    the shuffle count is smallest (each halving step needs an even count: ``v`` is padded with zeros)."""
    levels = sg.bit_length() - 1
    best = None
    for h in range(levels + 1):
        vp = -(-v // (1 << h)) * (1 << h)
        cost = sum(vp >> s for s in range(1, h + 1)) + (levels - h) * (vp >> h)
        if best is None or cost < best[0]:
            best = (cost, h, vp)
    _, h, vp = best
    steps, n, mask = [], vp, 0
    for s in range(levels):
        o = sg >> (s + 1)
        if s < h:
            steps.append({"kind": "half", "o": o, "n": n, "h": n // 2})
            n //= 2
        else:
            steps.append({"kind": "sum", "o": o, "n": n})
            mask |= o
    return vp, steps, n, mask


@dataclass
class OutPlan:
    """Render-time constants of one output (see the module docstring for the names)."""

    j: int
    n: int
    fmt: str
    mode: str
    out: str
    xv: str            # "q": quantized x, "p": plain x
    xsrc: str          # "xq" / "xp" (shared memory) or "x" (global)
    uc: int            # columns per unit
    upr: int           # units per row
    tg: int            # threads per row group
    nu: int            # units per thread per row
    g: int             # row groups per block
    r: int             # rows per thread
    rb: int            # rows per tile
    tiles: int
    toff: int = 0      # first tile index
    rowbytes: int = 0
    staged: bool = False
    ub: int = 1        # units loaded per batch (direct formats)
    sg: int = 32       # lanes reduced by shuffles
    subs: int = 1      # shuffle sub-groups per row group (summed through shared memory)
    v: int = 1         # values per thread: r * q
    vp: int = 1
    steps: list = field(default_factory=list)
    nfinal: int = 1
    wmask: int = 0


@dataclass
class Plan:
    """Render-time constants of a launch for one target."""

    spec: GemvSpec
    target: Target
    outs: list[OutPlan]
    total_tiles: int
    need_q: bool
    need_p: bool
    p_smem: bool
    xrow: int          # u16 per padded x row in shared memory
    off_xq: int
    off_xp: int
    off_stage: int
    off_red: int
    smem: int
    stage_bytes: int
    nch: int           # 16-byte prefetch registers per thread


def _out_plan(j: int, o: GemvOutput, spec: GemvSpec, r: int, wave: int) -> OutPlan:
    k = spec.k
    uc = UNIT_COLS[o.fmt]
    upr = k // uc
    tg = min(THREADS, _pow2_floor(upr))
    nu = -(-upr // tg)
    g = THREADS // tg
    rb = g * r
    xv = "q" if (o.mode == "fp8act" and spec.act_quant) else "p"
    p = OutPlan(j=j, n=o.n, fmt=o.fmt, mode=o.mode, out=o.out_dtype, xv=xv, xsrc="", uc=uc, upr=upr, tg=tg, nu=nu,
                g=g, r=r, rb=rb, tiles=-(-o.n // rb), rowbytes=row_bytes(o.fmt, k), staged=o.fmt in STAGED)
    if not p.staged:
        cap = max(1, 8 // r)
        p.ub = max(d for d in range(1, nu + 1) if nu % d == 0 and d <= cap)
    p.sg = min(tg, wave)
    p.subs = tg // p.sg
    p.v = r * spec.q
    p.vp, p.steps, p.nfinal, p.wmask = _reduce_steps(p.v, p.sg)
    return p


def plan(spec: GemvSpec, target: Target | None = None) -> Plan:
    """Compute every render-time constant of ``spec`` for ``target`` (default sm_90).

    Raises:
        RenderError: the activation does not fit in the target's shared memory (HIP: 64 KiB), a staged
            tile would not start on a 16-byte boundary, or K of a K-quant output is not a multiple of 256.
    """
    tgt = target or _target("sm_90")
    for j, o in enumerate(spec.outputs):
        if o.fmt in KQUANTS and spec.k % QK_K:
            raise RenderError(f"gemv output {j} ({o.fmt}): K={spec.k} is not a multiple of {QK_K} (rows of "
                              f"{o.fmt} are whole super-blocks of {QK_K} values)")
    rows0 = {o.fmt: (spec.rows or DEFAULT_ROWS[o.fmt]) for o in spec.outputs}
    if not spec.rows and _plain_q1(spec):
        rows0 = {f: 1 for f in rows0}
    elif not spec.rows and tgt.vendor == "cuda" and spec.q >= 2 and _plain(spec) and set(rows0) == {"bf16"}:
        rows0 = {"bf16": 8}  # H200 sweep: head q=5 293 -> 269 us (3.9 TB/s), 128 registers, no spills
    if not spec.rows and tgt.vendor == "hip" and spec.q >= 3 and "mxfp4" in rows0:
        rows0["mxfp4"] = 2  # clang keeps more of the mxfp4 decode live than ptxas: 4 rows spill at q = 5
    if not spec.rows and spec.q >= 3:
        # K-quant decodes (two halves' scales and mins, high-bit planes, 2-byte aligned Q3_K / Q6_K words) at
        # 4 rows spill at q = 5 under sm_90's 128 registers (2 blocks per SM); clang for gfx942 also needs 1 row
        # from q = 6 (2 rows: scratch at q = 8)
        for f in KQUANTS:
            if f in rows0:
                rows0[f] = 1 if (tgt.vendor == "hip" and spec.q >= 6) else 2
    scale = 1
    while True:
        outs = [_out_plan(j, o, spec, max(1, rows0[o.fmt] // scale), tgt.wave) for j, o in enumerate(spec.outputs)]
        total = sum(p.tiles for p in outs)
        if spec.rows or total >= DEFAULT_SMS or all(p.r == 1 for p in outs):
            break
        scale *= 2
    t = 0
    for p in outs:
        p.toff = t
        t += p.tiles
        if p.staged and (p.rb * p.rowbytes) % 16:
            raise RenderError(f"gemv output {p.j} ({p.fmt}, K={spec.k}): a tile of {p.rb} rows is "
                              f"{p.rb * p.rowbytes} bytes, not a multiple of 16")
    need_q = any(p.xv == "q" for p in outs)
    need_p = any(p.xv == "p" for p in outs)
    xrow = spec.k * 9 // 8
    xbytes = spec.q * xrow * 2
    stage = max([p.rb * p.rowbytes for p in outs if p.staged], default=0)
    stage_alloc = (stage + 16 + 15) // 16 * 16 if stage else 0  # +16: 4-byte reads may run 2 bytes past a row
    red = max(THREADS // p.sg * p.v for p in outs) * 4
    red = (red + 15) // 16 * 16
    limit = SMEM_LIMIT[tgt.vendor]
    base = (xbytes if need_q else 0) + stage_alloc + red
    if base > limit:
        raise RenderError(f"gemv {spec.short()}: needs {base} bytes of shared memory for {tgt.slug} (x {xbytes} B, "
                          f"stage {stage_alloc} B, reduction {red} B); the limit is {limit}")
    p_smem = need_p and base + xbytes <= limit
    off = 0
    off_xq = off
    off += xbytes if need_q else 0
    off_xp = off
    off += xbytes if p_smem else 0
    off_stage = off
    off += stage_alloc
    off_red = off
    off += red
    for p in outs:
        p.xsrc = "xq" if p.xv == "q" else ("xp" if p_smem else "x")
    nch = -(-stage // (16 * THREADS)) if stage else 0
    return Plan(spec, tgt, outs, t, need_q, need_p, p_smem, xrow, off_xq, off_xp, off_stage, off_red, off, stage, nch)


def _plain(spec: GemvSpec) -> bool:
    """Every output reads plain x (no FP8 activation prologue)."""
    return not any(o.mode == "fp8act" and spec.act_quant for o in spec.outputs)


def _plain_q1(spec: GemvSpec) -> bool:
    """A q = 1 launch whose outputs all read plain x."""
    return spec.q == 1 and _plain(spec)


def _plan_params(pl: Plan) -> dict[str, Any]:
    outs = []
    for p in pl.outs:
        d = dict(vars(p))
        d["wtype"] = {"bf16": "u16", "f32": "float"}.get(p.fmt, "u8")
        d["kq"] = p.fmt in KQUANTS
        d["fid"] = _FMT_ID.get(p.fmt, -1)
        d["bb"] = _KQ_BYTES.get(p.fmt, 0) if p.fmt in KQUANTS else 0
        d["ytype"] = "u16" if p.out == "bf16" else "float"
        outs.append(d)
    return {"kind": "gemv", "q": pl.spec.q, "k": pl.spec.k, "threads": THREADS, "outs": outs,
            "total_tiles": pl.total_tiles, "need_q": pl.need_q, "p_smem": pl.p_smem, "xrow": pl.xrow,
            "off_xq": pl.off_xq, "off_xp": pl.off_xp, "off_stage": pl.off_stage, "off_red": pl.off_red,
            "smem": pl.smem, "nch": pl.nch, "any_staged": any(p.staged for p in pl.outs),
            "staged": [o for o in outs if o["staged"]], "spec_text": pl.spec.short(),
            "any_kq": any(o["kq"] for o in outs)}


def render_gemv(spec: GemvSpec, target: Target, name: str) -> KernelSource:
    """Render the GEMV kernel of ``spec`` for ``target``; ``name`` gives the entry point (non-identifier
    characters replaced by ``_``). Launch with :func:`launch_shape` and :func:`arg_order`.

    Raises:
        RenderError: see :func:`plan`.
    """
    pl = plan(spec, target)
    return render(TEMPLATE, name, FAMILY, target, _plan_params(pl))


def launch_shape(spec: GemvSpec, target: Target | None = None, sms: int = DEFAULT_SMS
                 ) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    """(grid, block, dynamic shared memory bytes) of the kernel of ``spec`` on ``target`` (default sm_90) with
    ``sms`` multiprocessors: a persistent grid of ``min(tiles, blocks_per_sm * sms)`` blocks of 256 threads
    (blocks_per_sm: :data:`PLAIN_Q1_BLOCKS_PER_SM` for q = 1 without the FP8 prologue, else
    :data:`BLOCKS_PER_SM`; fewer when shared memory does not allow them).
    CUDA: shared memory above 48 KiB needs the function attribute (``CudaModule.function(entry, smem)``)."""
    pl = plan(spec, target)
    want = PLAIN_Q1_BLOCKS_PER_SM if _plain_q1(spec) else BLOCKS_PER_SM
    per_sm = max(1, min(want, SMEM_PER_SM[pl.target.vendor] // (pl.smem + 1024)))
    return (min(pl.total_tiles, per_sm * sms), 1, 1), (THREADS, 1, 1), pl.smem


def arg_order(spec: GemvSpec) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """The kernel's arguments in order: ``(name, role, shape, torch dtype)`` for ``x`` (bf16 ``[q, K]``), each
    weight ``w{j}`` (see :func:`weight_shape`) and each output ``y{j}`` (``[q, N_j]`` in ``out_dtype``). The
    kernel takes no integer arguments."""
    args: list[tuple[str, str, tuple[int, ...], torch.dtype]] = [("x", "in", (spec.q, spec.k), torch.bfloat16)]
    for j, o in enumerate(spec.outputs):
        shape, dt = weight_shape(o, spec.k)
        args.append((f"w{j}", "in", shape, dt))
    for j, o in enumerate(spec.outputs):
        args.append((f"y{j}", "out", (spec.q, o.n), o.torch_out_dtype))
    return args


# --------------------------------------------------------------------------------------------- reference
_GGML = {"bf16": "BF16", "f32": "F32", "q8_0": "Q8_0", "mxfp4": "MXFP4", **{f: f.upper() for f in KQUANTS}}


def dequantize_weight(out: GemvOutput, k: int, raw: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` values of a stored weight (any tensor holding exactly its bytes)."""
    from ds4c.quant import dequantize

    return dequantize(raw.detach().contiguous(), _GGML[out.fmt], (out.n, k), torch.float32)


def reference(spec: GemvSpec, x: torch.Tensor, weights_raw: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What the kernel computes, on the tensors' device, from the raw stored weights.

    Args:
        x: bf16 ``[q, K]``.
        weights_raw: one tensor per output holding the stored bytes (:func:`weight_shape`).
    Returns:
        one tensor per output, ``[q, N_j]`` in its ``out_dtype``: ``fp8act`` (with ``act_quant``) =
        ``primitives.linear_q`` (``act_quant_dequant`` in blocks of 128, fp32 product, bf16),
        ``bf16`` = ``primitives.linear_bf16``, ``f32`` = ``primitives.linear_f32``; a non-default
        ``out_dtype`` takes the fp32 product before its rounding.
    """
    from ds4c.quant import act_quant_dequant
    from ds4c.reference import primitives as P

    if tuple(x.shape) != (spec.q, spec.k) or x.dtype != torch.bfloat16:
        raise RenderError(f"gemv reference: x must be bf16 [{spec.q}, {spec.k}], found {x.dtype} {tuple(x.shape)}")
    if len(weights_raw) != len(spec.outputs):
        raise RenderError(f"gemv reference: {len(spec.outputs)} weights expected, found {len(weights_raw)}")
    outs = []
    for o, raw in zip(spec.outputs, weights_raw):
        w = dequantize_weight(o, spec.k, raw)
        quant = o.mode == "fp8act" and spec.act_quant
        if o.mode == "fp8act" and o.out_dtype == "bf16":
            y = P.linear_q(x, w, spec.act_quant)
        elif o.mode == "bf16" and o.out_dtype == "bf16":
            y = P.linear_bf16(x, w)
        elif o.mode == "f32" and o.out_dtype == "f32":
            y = P.linear_f32(x, w)
        else:
            xa = act_quant_dequant(x, 128) if quant else x.to(torch.float32)
            y = P.matmul_rows(xa, w).to(o.torch_out_dtype)
        outs.append(y)
    return outs


def random_weight(out: GemvOutput, k: int, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Fresh random valid stored bytes on ``device`` (``generator`` must live there too): bf16 / f32 values
    ~ N(0, 1/K); q8_0: random int8 codes and random fp16 scales in [0.5, 2]/(127*sqrt(K)); mxfp4: random
    nibbles and exponents 118..124; K-quants / IQ4_XS: :func:`ds4c.runtime.families.experts.random_weight`
    (every byte random but the fp16 super-block ``d`` / ``dmin``, set so values stay within ~1). Shapes and
    dtypes as :func:`weight_shape`."""
    n = out.n
    kw = {"generator": generator, "device": device}
    if out.fmt in KQUANTS:
        from ds4c.runtime.families.experts import random_weight as _kq_random

        return _kq_random(out.fmt, n, k, generator=generator, device=device)
    if out.fmt in ("bf16", "f32"):
        w = torch.randn(n, k, **kw) / math.sqrt(k)
        return w.to(torch.bfloat16 if out.fmt == "bf16" else torch.float32)
    nb = k // 32
    if out.fmt == "q8_0":
        q = torch.randint(-128, 128, (n, nb, 32), dtype=torch.int32, **kw).to(torch.int8)
        d = (0.5 + 1.5 * torch.rand(n, nb, 1, **kw)) / (127 * math.sqrt(k))
        db = d.to(torch.float16).view(torch.uint8).view(n, nb, 2)
        return torch.cat([db, q.view(torch.uint8)], dim=-1).reshape(n, nb * 34).contiguous()
    e = torch.randint(118, 125, (n, nb, 1), dtype=torch.int32, **kw).to(torch.uint8)
    qs = torch.randint(0, 256, (n, nb, 16), dtype=torch.int32, **kw).to(torch.uint8)
    return torch.cat([e, qs], dim=-1).reshape(n, nb * 17).contiguous()


# --------------------------------------------------------------------------------------------- argmax
@dataclass(frozen=True)
class ArgmaxSpec:
    """Greedy head epilogue: per row of fp32 logits ``[q, n]`` the index of the maximum (int32 ``[q]``)."""

    n: int
    q: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1 or not isinstance(self.q, int) or self.q < 1:
            raise RenderError(f"ArgmaxSpec: bad n {self.n!r} / q {self.q!r} (expected ints >= 1)")


def render_argmax(spec: ArgmaxSpec, target: Target, name: str) -> KernelSource:
    """Render ``gemv_argmax`` for ``spec``: grid ``(q,)``, block ``(1024,)`` (:func:`argmax_launch_shape`);
    arguments ``logits`` (fp32 ``[q, n]``), ``out`` (int32 ``[q]``)."""
    return render(TEMPLATE, name, FAMILY, target, {"kind": "argmax", "n": spec.n, "q": spec.q,
                                                   "threads": ARGMAX_THREADS})


def argmax_launch_shape(spec: ArgmaxSpec) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    return (spec.q, 1, 1), (ARGMAX_THREADS, 1, 1), 0


def argmax_arg_order(spec: ArgmaxSpec) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    return [("logits", "in", (spec.q, spec.n), torch.float32), ("out", "out", (spec.q,), torch.int32)]


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    """int32 ``[q]``: ``torch.argmax`` over the last dim (first maximum; NaN is the maximum)."""
    return torch.argmax(logits, dim=-1).to(torch.int32)
