"""The tensor-core GEMM family for batched prefill (docs/prefill.md): ``Y[C, N] = X[C, K] @ W[N, K]^T`` for a chunk
of ``C`` rows (16..4096 in prefill; any ``C >= 1`` renders) through one projection whose weight ``W`` is in
its stored GGUF form. docs/model.md 2.3 (the quantized linear: FP8 e4m3 activation quant in blocks of
128 with power-of-two scales, times the dequantized weight, fp32 accumulation, bf16 out) =
:func:`ds4c.reference.primitives.linear_q`; modes ``bf16`` / ``f32`` as the GEMV family's
(:mod:`ds4c.runtime.families.gemv`). Template: ``templates/gemm/gemm.cu.j2``. The prefill chunk lowering
(runtime/lower_prefill.py) runs every projection of >= 16 rows through it (``prequant=True``; wo_a as one
grouped call, ``GemmSpec.groups``).

Weights (``GemmSpec.fmt``; layouts docs/gguf-layout.md, :mod:`ds4c.quant`): ``mxfp4`` uint8
``[N, K/32*17]`` (e8m0 byte, then 16 bytes: byte j = element j low nibble, j+16 high nibble), ``q8_0`` uint8
``[N, K/32*34]`` (fp16 d, 32 int8), ``bf16`` ``[N, K]``; the K-quants ``q2_k`` .. ``q6_k`` and ``iq4_xs``
uint8 ``[N, K/256*bytes]`` (a llama-quantize Q4_K_M / Q3_K_M file's projections), on form 0 (below) and the
wave-64 ``xm`` engine, fp8act with act_quant: per K step half a super-block, the grouped experts GEMM's decode and
numerics (``templates/prelude/kq_mma.h.j2`` / ``amd_kstep.h.j2``, :mod:`ds4c.runtime.families.moe_gemm`); on CUDA
the formats staged in 4-byte units (Q2_K, Q3_K, Q6_K) copy their weights by 4-byte ``cp.async``
(``GemmPlan.w_async``). Elsewhere (sm_80, wave-32 RDNA, gfx1201, act_quant off) and for f32 weights
:class:`RenderError`.

Activation: ``x`` is bf16 ``[C, K]``. With mode ``fp8act`` and ``act_quant`` the kernel quantizes it per
(row, 128-block) while storing each X tile to shared memory (:func:`ds4c.quant.act_quant_fp8`: amax over
the 16 threads holding the row's 128 values, ``s = 2^ceil(log2(max(amax, 1e-4)/448))``, e4m3 RNE of
``x/s``). Chosen over requiring a pre-quantized input because it needs no extra launch and no ``[C, K]``
scratch, the kernel is numerically self-contained (one place implements spec 2.3.1 for it, tested against
the reference in emulation), and it is idempotent: an ``x`` already quantized by
``templates/actq/act_quant.cu.j2`` (bf16 holding ``e4m3 * 2^k``) re-quantizes to the same values
(tests/test_gemm_family.py checks it on the reference and on the emulated kernel), so the same kernel serves
both producers. The price: every CTA column of the grid (``ceil(N/bn)`` of them) re-quantizes its X tiles.
With the software e4m3 rounding (``ds4c_round_e4m3``, clamp, f16 pack) that is ~20 ALU instructions per value,
per K step ~1300 per thread against ~500 for its share of the MMAs, the weight decode and the per-block
scaling; so on the f16 MMA path (sm_89+) the rounding, clamp and f16 pack are two instructions per pair of
values, ``cvt.rn.satfinite.e4m3x2.f32`` (RNE, saturating at 448 = the spec's clamp) then
``cvt.rn.f16x2.e4m3x2`` (``GemmSpec.sw_quant`` forces the software rounding: the A/B, and the GPU check's
bit-for-bit comparison of the two; the emulator implements the cvt by its own nearest-value search).
``GemmSpec.x_prequant`` (x is actq's output) keeps only the amax / scale recovery: on the bf16 paths (sm_80,
bf16 weights, HIP) the tile is then a plain copy. Measured on an H200 (docs/perf.md), the in-tile quant is
about half of the GEMM's time (wq_a Q8_0 4096 -> 1024 at C = 512: 106 us, 57 us with act_quant off).

Prequant (``GemmSpec.prequant``; the experts family's ``ExpertsSpec.prequant``): the call is two launches
(:func:`kernel_names`, :func:`launch_shapes`): ``templates/actq/act_quant.cu.j2`` form ``f16s`` quantizes x
once (grid ``(K/128, C)``: ``xq`` f16 ``[C, K]`` the e4m3 values, exact in f16, and ``xs`` fp32 ``[C, K/128]``
the scales, :func:`workspaces`), then the GEMM copies each X tile into shared memory with ``cp.async`` (16-byte
copies, no per-value work, no X prefetch registers; rows >= C zeroed by plain stores) and prefetches the tile's
64 scales (one strided 4-byte load per thread of the first 64) like the weights; the MMAs and the
per-32 / per-128 scaling are the in-tile path's, on the same values in the same order, so the output is the
in-tile kernel's bit for bit (tests/test_gemm_family.py, in emulation). Only for form 0 (:func:`uses_prequant`:
the CUDA ``mma`` engine on sm_89+, MXFP4 / Q8_0, fp8act with act_quant): every other path's tile holds bf16
values, so there the request falls back to the one in-tile kernel on bf16 ``x`` (a lowering may ask for it
everywhere). Not measured yet (docs/perf.md has the prediction).

Tiling (render-time constants, :func:`plan`): CTA tile 64 rows of X x ``bn`` = 64 (default) or 128 weight
rows, ``2 * bn`` threads (warps ``bn/32`` x 2, each 32 x 32 = 2 x 4 ``mma.sync`` m16n8k16 tiles), K steps of
128 (one activation scale block; four 32-value weight blocks). Grid ``(ceil(C/64), ceil(N/bn))``,
``blockIdx.x`` over C so the CTAs sharing a weight tile run together and its bytes come from HBM about once.
Why 64 x 64: per K step a CTA stages 4.3 KB (MXFP4) / 8.7 KB (Q8_0) / 16 KB (bf16) of weights and 16 KB of X
for 64*64*128 MACs; every weight byte is reused by ``C`` rows (ceil(C/64) CTAs). At C = 64 a 4096 x 4096
MXFP4 projection moves 8.9 MB of weights for 2.1 GFLOP, ~240 FLOP per weight byte (Q8_0: ~120; C = 512: 8x
that), against the H200's ~200 FLOP/byte ridge (989 TFLOP/s dense f16 / 4.8 TB/s HBM); with ``mma.sync``
(not wgmma) and the per-32-block scaling FMAs the reachable MMA rate is well below 989, so from C ~ 64 up
the kernel is issue bound (MMAs, decode, scaling, the in-kernel quant), not HBM bound. A bigger tile buys
less X re-staging and re-quantization (X is re-read and re-quantized ``ceil(N/bn)`` times, from L2), which
is what ``bn = 128`` is for; its cost is half the CTAs (small N x C grids fill fewer of the 132 SMs). 64 x
64 keeps the accumulators at 32 fp32 (+32 per-128-block partials) per thread and two stages in 45-72 KB of
shared memory (bn 128: 56-108 KB); with the register prefetch of the next step (32 u32 of X at bn 64, 16 at
bn 128, and 9-32 of weights) ptxas uses 180-255 registers on sm_90 with no spills
(``__launch_bounds__(threads, 65536 / (threads * 255))``: 8 warps per SM either way). At C = 16 three
quarters of the MMA rows are padding (the GEMV family is the better kernel there). Not tuned on a GPU yet:
tests/gpu_checks/gemm.py times both ``bn``.

Staging: weights and X of step ``k+1`` are loaded into registers (16 / 8 / 4-byte vector loads: the row
segments of 68 / 136 bytes are only 4 / 8-byte aligned, so the experts kernel's register staging rather than
cp.async) while step ``k`` is computed from shared memory, then stored into the other stage (two stages; one,
with a second barrier, where two do not fit: HIP's 64 KiB with bf16 weights). bf16 weight rows and the bf16 X
rows are 16-byte aligned and could go by cp.async (fewer registers); not done: one staging path for every
format and target, which the CPU emulator runs as written. The one exception is prequant's X tile (above):
``xq`` rows of ``2K`` bytes are 16-byte aligned and need no per-value work, so cp.async. With prequant and
``GemmSpec.stages = 3`` (the cp.async pipeline) every step goes by cp.async instead: the weights in their 4 / 8 /
16-byte units (4 / 8-byte copies need only that alignment), the X tile and its scales, into one of three stages, two
steps in flight, one barrier per step; rows past C and weight rows past N are zeroed once. Bit-identical to the
2-stage kernel; measured 1.04-1.12x its time on an H100 (docs/perf.md Optimisation 18), so an A/B knob only.

Engines (``GemmSpec.engine``): ``mma`` (CUDA): form 0 on sm_89+ with act_quant and MXFP4 / Q8_0: the f16
MMA on the weight codes (exact f16) and the activation's e4m3 values held as f16; per 32-block the fp32 MMA
result is times the weight block scale, summed over the 128-block, then times the activation scale (the
experts family's numerics, spec 2.3.3). Form 1 (bf16 weights, act_quant off, mode bf16 / f32, or sm_80):
the bf16 MMA on codes / bf16 weights and the bf16 activation (``bf16(q*s)`` exactly, or ``x``). ``simt``:
fp32 FMAs with the same per-block scaling, the vendor-neutral body. ``xm`` (HIP on AMD matrix cores,
:data:`ds4c.runtime.targets.HIP_MATRIX`; templates/prelude/amd_kstep.h.j2, shared with the grouped experts' HIP body):
form 1's bf16 X tile as B, the weights decoded to exact bf16 as A (MXFP4 with its power-of-two block scale folded
in, Q8_0 codes with the block scale on the 32-block's partial, bf16 as stored; K-quants / IQ4_XS on wave 64 with
fp8act: codes per 16-value half, ``sc * partial - mn * sum(x)``), MFMA 16x16x16 bf16 (wave 64) or gfx11 WMMA (wave
32); compile-checked and emulated, not run on an AMD GPU. ``auto`` = ``mma`` on CUDA, ``xm`` on the HIP matrix-core
archs, ``simt`` on other HIP archs (gfx1201).

Kernel arguments (:func:`arg_order`): ``x`` bf16 ``[C, K]``, ``w`` the stored weight, ``y`` ``[C, N]`` in
``out_dtype`` (only rows < C and columns < N are written); a prequant GEMM ``xq``, ``xs``, ``w``, ``y`` and
its actq launch ``x``, ``xq``, ``xs`` (:func:`arg_names`, :func:`arg_shapes`). Pointers 16-byte aligned,
tensors contiguous.

Numerics vs :func:`reference`: the same operands and products (codes, scales and e4m3 values are exact in
f16 / bf16 / fp32); only the fp32 summation order differs (per-32-block MMA partials, then scales), so fp32
outputs agree to ~1e-6 relative and bf16 outputs to one bf16 rounding (a few elements differ by 1 ulp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.families import Launch
from ds4c.runtime.families.actq import actq_launch, render_actq
from ds4c.runtime.families.experts import BLOCK_BYTES as _XP_BYTES, E4M3_ARCHS, FMT_ID as _XP_FMT_ID, KQUANTS
from ds4c.runtime.render import KernelSource, RenderError, render, resolve_mma_engine
from ds4c.runtime.targets import HIP_LDS, HIP_MATRIX, Target

TEMPLATE = "gemm/gemm.cu.j2"
FAMILY = "gemm"
FORMATS = ("mxfp4", "q8_0", "bf16") + KQUANTS
#: the template's GM_FMT: 3 = a K-quant / IQ4_XS super-block (which one: GM_KQ, the shared decoder's format id)
FMT_ID = {"mxfp4": 0, "q8_0": 1, "bf16": 2, **{f: 3 for f in KQUANTS}}
MODES = ("fp8act", "bf16", "f32")
OUT_DTYPES = ("bf16", "f32")
ENGINES = ("auto", "mma", "simt", "xm")
#: bytes of one stored block of 32 values (K-quants / IQ4_XS: :data:`SUPER_BYTES` per 256)
BLOCK_BYTES = {"mxfp4": 17, "q8_0": 34, "bf16": 64}
SUPER_BYTES = {f: _XP_BYTES[f] for f in KQUANTS}
#: K-quants whose super-block is not a whole number of words (Q3_K 110, Q6_K 210 bytes): K a multiple of 512, so
#: every row starts on a word and a K step's staged words stay inside the row
UNALIGNED_KQ = tuple(f for f in KQUANTS if SUPER_BYTES[f] % 4)
BM = 64   # X rows per CTA
BN = 64   # weight rows (output columns) per CTA by default (GemmSpec.bn: 64 or 128; threads = 2 * bn)
BNS = (64, 128)
#: K-step stages (GemmSpec.stages): 2 = register-staged weights, double buffered; 3 = the cp.async pipeline
STAGES = (2, 3)
#: registers a thread of the cp.async pipeline needs (sm_90 ptxas, no spills): its __launch_bounds__ minimum of
#: CTAs per SM is what the shared memory fits with at least this many (:func:`min_blocks`)
PIPE_REGS = 168
SM_SMEM = 228 * 1024  # shared memory of an sm_90 SM, CTAs' reservations included
KSTEP = 128
XST = 272  # bytes between X tile rows in shared memory (128 f16 + 16; 144 with e4m3 codes: GemmSpec.xfmt)
XST_E4M3 = 144
XFMTS = ("f16", "e4m3")
#: dynamic shared memory a block may use (CUDA sm_90 opt-in maximum; HIP LDS per workgroup)
SMEM_LIMIT = {"cuda": 227 * 1024, "hip": HIP_LDS}
#: registers per thread the CUDA build may use: __launch_bounds__(threads, 65536 // (threads * this)), i.e. 2
#: CTAs of 128 threads or 1 of 256 per SM
REG_BUDGET = 255


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def row_bytes(fmt: str, k: int) -> int:
    """Bytes of one stored weight row of ``k`` values."""
    if fmt in SUPER_BYTES:
        return k // 256 * SUPER_BYTES[fmt]
    return k // 32 * BLOCK_BYTES[fmt]


def kq_segment(fmt: str) -> int:
    """Bytes of a K-quant row staged per K step (half a super-block of values): the whole super-block from the
    4-aligned word at or before it (Q3_K 112, Q6_K 212; the aligned formats their super-block)."""
    bb = SUPER_BYTES[fmt]
    return bb + (2 if bb % 4 else 0)


@dataclass(frozen=True)
class GemmSpec:
    """One GEMM (all render-time).

    Attributes:
        rows: C, the rows of X and Y (the prefill chunk; >= 1).
        n: N, the output width (weight rows; >= 1).
        k: K, the input width (a positive multiple of 128).
        fmt: weight storage: ``mxfp4`` | ``q8_0`` | ``bf16`` | a K-quant (``q2_k`` .. ``q6_k``) | ``iq4_xs``
            (K-quants: on the f16 MMA path, form 0 of :func:`plan`, and wave-64 ``xm``; ``k`` a multiple of 256,
            of 512 for Q3_K / Q6_K).
        mode: ``fp8act`` (spec 2.3: e4m3 activation quant when ``act_quant``) | ``bf16`` | ``f32`` (plain x).
        act_quant: quantize the activation of an ``fp8act`` GEMM (False = the reference's ``emulate=False``).
        out_dtype: ``bf16`` | ``f32``; None = ``f32`` for mode ``f32``, else ``bf16``.
        engine: ``auto`` | ``mma`` | ``simt`` | ``xm`` (module docstring).
        x_prequant: ``x`` is already quantized by ``templates/actq/act_quant.cu.j2`` (bf16 holding
            ``e4m3 * 2^k`` per 128-block); the kernel then only recovers each block's scale (same results; on
            the bf16 paths the tile is a plain copy). Only with mode ``fp8act`` and ``act_quant``.
        sw_quant: round the activation to e4m3 in software (``ds4c_round_e4m3``) even where the f16 MMA path
            would use ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+): the A/B and the hardware check of that
            instruction (tests/gpu_checks/gemm.py compares the two bit for bit).
        bn: weight rows per CTA, 64 (128 threads) or 128 (256 threads: the X tile's quant and staging shared
            by twice the outputs, half the CTAs); 0 = :data:`BN`. For a GPU sweep; not tuned yet.
        prequant: quantize x once per call (``templates/actq/act_quant.cu.j2`` form ``f16s``: ``xq`` f16
            ``[C, K]`` holding the e4m3 values, ``xs`` fp32 ``[C, K/128]`` the per-128 scales) instead of in every
            X tile of every CTA column; the GEMM then copies its tiles with cp.async (two launches,
            :func:`kernel_names`; the same output bits). A request: it applies only where the kernel reads the
            form-0 activation (:func:`uses_prequant`: the CUDA ``mma`` engine on sm_89+, MXFP4 / Q8_0 weights,
            mode ``fp8act`` with ``act_quant``); elsewhere the call is the one in-tile kernel on bf16 ``x``, as
            without it (the experts family's rule, ``ExpertsSpec.prequant``). Not with ``x_prequant`` (two
            different input contracts); ``sw_quant`` is moot with it (actq rounds in software anyway).
        stages: K-step stages of a prequant call's GEMM (:func:`uses_prequant`): 0 (the default, 2) | 2: the
            weights of step k+1 prefetched into registers while step k is computed (the measured sources) | 3:
            the cp.async pipeline: weights, X tile and scales of every step copied straight into shared memory,
            two steps in flight, no staging registers (the same MMAs in the same order: the same output bits).
            A request like ``prequant``: elsewhere the kernel is the 2-stage one.
        xfmt: how a prequant call (:func:`uses_prequant`) stores and stages ``xq``: ``f16`` (the default: actq form
            ``f16s``, the e4m3 values as f16) | ``e4m3`` (form ``e4m3s``: the codes, one byte a value; the X tile of a
            K step 8 KB instead of 16 KB, its B fragments turned into f16 by the exact cvt the MXFP4 weights use:
            the same MMAs on the same values, the same output bits; the grouped experts' ``MoeGemmSpec.xfmt``,
            docs/perf.md Optimisation 22). Only with ``prequant``; moot where the call falls back to the in-tile
            kernel.

    Raises:
        RenderError: a field out of range; the message names it, what was expected and what was found.
    """

    rows: int
    n: int
    k: int
    fmt: str = "mxfp4"
    mode: str = "fp8act"
    act_quant: bool = True
    out_dtype: str | None = None
    engine: str = "auto"
    x_prequant: bool = False
    bn: int = 0
    sw_quant: bool = False
    prequant: bool = False
    groups: int = 1
    """G > 1: a grouped call (the grouped output projection wo_a of a prefill chunk, spec 5.2(k)): G independent
    GEMMs ``y[:, g*N:(g+1)*N] = x[:, g*K:(g+1)*K] @ w[g*N:(g+1)*N]^T`` in one launch, ``x`` ``[C, G*K]``, ``w``
    ``[G*N, .]`` (group-major rows), ``y`` ``[C, G*N]``; grid ``(ceil(C/64), G * ceil(N/bn))`` (CTA column ``y`` is
    tile ``y % ceil(N/bn)`` of group ``y // ceil(N/bn)``). Not with ``prequant`` / ``x_prequant`` (their x is
    ``[C, K]``). 1 renders the ungrouped kernel byte for byte."""
    stages: int = 0
    xfmt: str = "f16"

    def __post_init__(self) -> None:
        if self.out_dtype is None:
            object.__setattr__(self, "out_dtype", "f32" if self.mode == "f32" else "bf16")
        bad = []
        if not (isinstance(self.rows, int) and 1 <= self.rows <= 65535 * BM):
            bad.append(f"rows {self.rows!r} (expected an int in 1..{65535 * BM})")
        if not (isinstance(self.n, int) and 1 <= self.n <= 65535 * BN):
            bad.append(f"n {self.n!r} (expected an int in 1..{65535 * BN})")
        if not (isinstance(self.k, int) and self.k >= KSTEP and self.k % KSTEP == 0):
            bad.append(f"k {self.k!r} (expected a positive multiple of {KSTEP}: one activation-quant block per "
                       f"K step)")
        if self.fmt in KQUANTS and isinstance(self.k, int) and self.k % (512 if self.fmt in UNALIGNED_KQ else 256):
            bad.append(f"k {self.k} with {self.fmt} (expected a multiple of "
                       f"{512 if self.fmt in UNALIGNED_KQ else 256}: whole super-blocks per row"
                       + (", an even number of them so every row starts on a word)" if self.fmt in UNALIGNED_KQ
                          else ")"))
        if self.fmt not in FORMATS:
            bad.append(f"fmt {self.fmt!r} (expected one of {FORMATS})")
        if self.mode not in MODES:
            bad.append(f"mode {self.mode!r} (expected one of {MODES})")
        if self.out_dtype not in OUT_DTYPES:
            bad.append(f"out_dtype {self.out_dtype!r} (expected one of {OUT_DTYPES})")
        if self.engine not in ENGINES:
            bad.append(f"engine {self.engine!r} (expected one of {ENGINES})")
        if type(self.bn) is not int or self.bn not in (0,) + BNS:  # noqa: E721 (128.0, True are not widths)
            bad.append(f"bn {self.bn!r} (expected 0 or one of {BNS})")
        if self.x_prequant and not (self.mode == "fp8act" and self.act_quant):
            bad.append(f"x_prequant with mode {self.mode!r} and act_quant {self.act_quant} (expected only with "
                       f"mode 'fp8act' and act_quant True)")
        if not isinstance(self.prequant, bool):
            bad.append(f"prequant {self.prequant!r} (expected a bool)")
        elif self.prequant and self.x_prequant:
            bad.append("prequant with x_prequant (expected at most one: prequant's x is actq's f16 values and "
                       "scales, x_prequant's its bf16 output)")
        if not (isinstance(self.groups, int) and 1 <= self.groups <= 1024):
            bad.append(f"groups {self.groups!r} (expected an int in 1..1024)")
        elif self.groups > 1 and (self.prequant or self.x_prequant):
            bad.append(f"groups {self.groups} with prequant / x_prequant (expected groups 1: their x is [C, K])")
        if type(self.stages) is not int or self.stages not in (0,) + STAGES:  # noqa: E721
            bad.append(f"stages {self.stages!r} (expected 0 or one of {STAGES})")
        if self.xfmt not in XFMTS:
            bad.append(f"xfmt {self.xfmt!r} (expected one of {XFMTS})")
        elif self.xfmt == "e4m3" and self.prequant is not True:
            bad.append("xfmt e4m3 without prequant (the e4m3 codes are actq's output, which only a prequant call "
                       "reads)")
        if bad:
            raise RenderError("GemmSpec: bad " + "; ".join(bad))

    @property
    def quant(self) -> bool:
        """The activation is FP8-quantized (mode ``fp8act`` with ``act_quant``)."""
        return self.mode == "fp8act" and self.act_quant

    @property
    def torch_out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.out_dtype == "bf16" else torch.float32

    def key(self) -> str:
        """Short name of the kernel variant (without the engine)."""
        return (f"c{self.rows}_n{self.n}_k{self.k}_{self.fmt}_{self.mode}" + ("" if self.act_quant else "_noaq")
                + ("_xpre" if self.x_prequant else "") + ("_swq" if self.sw_quant else "")
                + (f"_bn{self.bn}" if self.bn else "") + ("_pq" if self.prequant else "")
                + (f"_g{self.groups}" if self.groups > 1 else "")
                + (f"_st{self.stages}" if self.stages > 2 and self.prequant else "")
                + ("_x8" if self.xfmt == "e4m3" else "") + f"_{self.out_dtype}")

    def short(self) -> str:
        return (f"C={self.rows} N={self.n} K={self.k} {self.fmt}/{self.mode}"
                + ("" if self.act_quant else " noaq") + (" xpre" if self.x_prequant else "")
                + (" swq" if self.sw_quant else "")
                + (f" bn{self.bn}" if self.bn else "") + (" pq" if self.prequant else "")
                + (f" {self.stages} stages" if self.stages > 2 else "") + (" e4m3 tiles" if self.xfmt == "e4m3" else "")
                + f"->{self.out_dtype}")


def resolve_engine(spec: GemmSpec, target: Target) -> str:
    """``mma``, ``simt`` or ``xm`` for ``target``: ``auto`` is ``xm`` (AMD matrix cores, templates/prelude/
    amd_kstep.h.j2) on the HIP archs of :data:`ds4c.runtime.targets.HIP_MATRIX`, else as
    :func:`ds4c.runtime.render.resolve_mma_engine` (``mma`` on CUDA, ``simt`` on other HIP archs).

    Raises:
        RenderError: ``mma`` asked for a HIP target, ``xm`` for one without matrix cores.
    """
    if spec.engine == "xm" or (spec.engine == "auto" and target.vendor == "hip" and target.arch in HIP_MATRIX):
        if target.vendor != "hip" or target.arch not in HIP_MATRIX:
            raise RenderError(f"gemm: engine 'xm' (AMD matrix cores) runs on {'/'.join(HIP_MATRIX)}, not {target.slug}")
        return "xm"
    return resolve_mma_engine(spec.engine, target, "gemm")


@dataclass(frozen=True)
class GemmPlan:
    """Render-time geometry of one GEMM on one target: ``form`` (0: f16 MMA on e4m3 activations + per-128
    scales; 1: bf16 activations), ``bn`` weight rows per CTA (threads ``2 * bn``), weight staging (``sb`` bytes
    per row segment of a K step, ``v`` bytes per vector load, ``rbp`` padded shared-memory row stride),
    ``nstage`` shared-memory stages of ``stage_bytes``, ``smem`` dynamic shared bytes, ``grid`` / ``block``.
    """

    engine: str
    form: int
    bn: int
    sb: int
    v: int
    rbp: int
    stage_bytes: int
    nstage: int
    smem: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    w_async: bool = False
    """The weights are copied by 4-byte cp.async straight into shared memory instead of through registers (the
    K-quants staged in 4-byte units: Q2_K, Q3_K, Q6_K, as in the grouped experts GEMM)."""
    pipe: bool = False
    """The cp.async pipeline: ``GemmSpec.stages`` 3 on a prequant call (``nstage`` 3; :func:`uses_prequant`)."""
    e4x: bool = False
    """The X tile holds e4m3 codes (``GemmSpec.xfmt`` e4m3 on a prequant call)."""


def plan(spec: GemmSpec, target: Target) -> GemmPlan:
    """The geometry of ``spec`` on ``target``.

    Raises:
        RenderError: ``mma`` on HIP, or one stage does not fit the target's shared memory.
    """
    engine = resolve_engine(spec, target)
    form = 0 if (engine == "mma" and target.arch in E4M3_ARCHS and spec.quant and spec.fmt != "bf16") else 1
    kq = spec.fmt in KQUANTS
    if kq and form != 0 and not (engine == "xm" and target.wave == 64 and spec.quant):
        raise RenderError(f"gemm {spec.short()} on {target.slug}: K-quant weights run only on the f16 MMA over e4m3 "
                          f"activations (CUDA {'/'.join(E4M3_ARCHS)}, mode fp8act with act_quant) or on wave-64 AMD "
                          f"matrix cores (engine xm, fp8act with act_quant; wave 32's K-quant step spills)")
    sb = kq_segment(spec.fmt) if kq else 4 * BLOCK_BYTES[spec.fmt]
    rs = row_bytes(spec.fmt, spec.k)
    v = 4 if spec.fmt in UNALIGNED_KQ else max(x for x in (16, 8, 4) if sb % x == 0 and rs % x == 0)
    # padded row stride: a 16-byte multiple whose u32 stride puts the 8 rows g = 0..7 of a fragment read on
    # distinct banks (4-byte reads: stride % 8 words == 4; bf16's 8-byte reads: % 16 == 8)
    want = (16, 8) if spec.fmt == "bf16" else (8, 4)
    rbp = _round16(sb + 4)  # + 4: the funnel reads of 17-byte blocks may touch the word after the segment
    while (rbp // 4) % want[0] != want[1] and engine != "xm":  # (xm reads by element: no fragment bank rule)
        rbp += 16
    bn = spec.bn or BN
    pq = spec.prequant and form == 0  # uses_prequant's condition
    e4x = pq and spec.xfmt == "e4m3"
    stage = _round16(BM * (XST_E4M3 if e4x else XST) + BM * 4 + bn * rbp)
    lim = SMEM_LIMIT[target.vendor]
    epi = BM * (bn + 4) * 4
    pipe = pq and spec.stages == 3
    nstage = 3 if pipe else 2 if max(2 * stage, epi) <= lim else 1
    smem = max(nstage * stage, epi)
    if smem > lim:
        raise RenderError(f"gemm {spec.short()} on {target.slug}: needs {smem} bytes of shared memory, the limit "
                          f"is {lim}")
    grid = (-(-spec.rows // BM), spec.groups * -(-spec.n // bn), 1)
    return GemmPlan(engine, form, bn, sb, v, rbp, stage, nstage, smem, grid, (2 * bn, 1, 1),
                    kq and v == 4 and target.vendor == "cuda", pipe, e4x)


def launch_min_blocks(threads: int, smem: int, pipe: bool, fmt: str) -> int:
    """The ``__launch_bounds__`` minimum of CTAs per SM of this family's kernel and the grouped experts' up / down
    (:mod:`ds4c.runtime.families.moe_gemm`): ``65536 // (threads * REG_BUDGET)`` (the register-staged sources, as
    measured); the cp.async pipeline (``pipe``), which holds no staging registers, as many as the shared memory
    fits (:data:`SM_SMEM` per SM, 1 KB reserved per CTA) with at least :data:`PIPE_REGS` registers a thread (MXFP4,
    Q8_0) or :data:`REG_BUDGET` (``fmt`` a K-quant: its decoder; Q2_K's grouped up phase spills at 168)."""
    if not pipe:
        return max(1, 65536 // (threads * REG_BUDGET))
    regs = REG_BUDGET if fmt in KQUANTS else PIPE_REGS
    return max(1, min(SM_SMEM // (smem + 1024), 65536 // (threads * regs)))


def render_gemm(spec: GemmSpec, target: Target, name: str | None = None) -> KernelSource:
    """The kernel of ``spec`` for ``target``; ``name`` gives the entry (default ``"gemm_" + spec.key() + "_" +
    engine``; non-identifier characters become ``_``). Launch with :func:`launch_shape`, :func:`arg_order`.
    With :func:`uses_prequant` this is the call's second kernel (arguments ``xq``, ``xs``, ``w``, ``y``), which
    needs the actq launch before it: :func:`render_call` renders both.

    Raises:
        RenderError: see :func:`plan`.
    """
    pl = plan(spec, target)
    name = name or f"gemm_{spec.key()}_{pl.engine}"
    params: dict[str, Any] = dict(
        rows=spec.rows, n=spec.n, k=spec.k, fmt_id=FMT_ID[spec.fmt], form=pl.form, mma=pl.engine == "mma",
        xm=pl.engine == "xm", matrix=HIP_MATRIX.get(target.arch, ""),
        quant=spec.quant, x_prequant=spec.x_prequant, prequant=uses_prequant(spec, target),
        hw_quant=pl.form == 0 and spec.quant and not spec.x_prequant and not spec.sw_quant,
        out_f32=spec.out_dtype == "f32", bb=SUPER_BYTES.get(spec.fmt) or BLOCK_BYTES[spec.fmt], sb=pl.sb,
        kq_id=_XP_FMT_ID[spec.fmt], w_async=pl.w_async,
        rs=row_bytes(spec.fmt, spec.k), rbp=pl.rbp, v=pl.v, stage_bytes=pl.stage_bytes, nstage=pl.nstage,
        smem=pl.smem, bn=pl.bn, threads=pl.block[0], pipe=pl.pipe, e4x=pl.e4x,
        min_blocks=launch_min_blocks(pl.block[0], pl.smem, pl.pipe, spec.fmt),
        **({"groups": spec.groups, "ntn": -(-spec.n // pl.bn)} if spec.groups > 1 else {}))
    return render(TEMPLATE, name, FAMILY, target, params)


def launch_shape(spec: GemmSpec, target: Target) -> Launch:
    """Grid ``(ceil(C/64), ceil(N/bn), 1)``, block ``(2*bn, 1, 1)`` and the dynamic shared bytes (CUDA: above
    48 KiB needs the function attribute, ``CudaModule.function(entry, smem)``).

    Raises:
        RenderError: see :func:`plan`.
    """
    pl = plan(spec, target)
    return Launch(pl.grid, pl.block, pl.smem)


def weight_shape(spec: GemmSpec) -> tuple[tuple[int, ...], torch.dtype]:
    """Storage shape and dtype of ``w``: uint8 ``[N, row_bytes]`` for the block formats, bf16 ``[N, K]``."""
    if spec.fmt == "bf16":
        return (spec.groups * spec.n, spec.k), torch.bfloat16
    return (spec.groups * spec.n, row_bytes(spec.fmt, spec.k)), torch.uint8


def arg_order(spec: GemmSpec, target: Target | None = None) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """``(name, role, shape, dtype)`` of the GEMM kernel's arguments in kernel order: ``x`` (bf16 ``[C, K]``),
    ``w`` (:func:`weight_shape`) and ``y`` (``[C, N]`` in ``out_dtype``); with prequant (:func:`uses_prequant`
    on ``target``; without a target: as ``spec.prequant`` asks) ``xq`` (f16 ``[C, K]``) and ``xs`` (fp32
    ``[C, K/128]``), both role ``in``, in place of ``x``. No integer arguments (every size is render-time). The
    actq launch's arguments: :func:`arg_names`."""
    sh = arg_shapes(spec)
    return [(n, "out" if n == "y" else "in") + sh[n] for n in arg_names(spec, target)["gemm"]]


# ------------------------------------------------------------------------------------------------ prequant
#: the activation quant of a prequant call (form ``f16s``)


def uses_prequant(spec: GemmSpec, target: Target) -> bool:
    """Whether ``spec`` on ``target`` runs as the two-launch prequant call: ``spec.prequant`` and the kernel reads
    the form-0 activation (:func:`plan`: CUDA ``mma`` engine, sm_89+, mode ``fp8act`` with ``act_quant``, MXFP4 /
    Q8_0 weights). Everywhere else (SIMT / HIP, sm_80, bf16 weights, modes ``bf16`` / ``f32``, act_quant off) the
    tile holds bf16 values, which a copy of actq's f16 e4m3 values cannot give, so the call falls back to the one
    in-tile kernel on bf16 ``x`` (same outputs).

    Raises:
        RenderError: see :func:`plan`.
    """
    return spec.prequant and plan(spec, target).form == 0


def kernel_names(spec: GemmSpec, target: Target) -> list[str]:
    """The call's kernels in launch order: ``["actq", "gemm"]`` with :func:`uses_prequant`, else ``["gemm"]``."""
    return ["actq", "gemm"] if uses_prequant(spec, target) else ["gemm"]


def render_call(spec: GemmSpec, target: Target, name: str | None = None) -> list[KernelSource]:
    """The call's kernels for ``target`` in launch order (:func:`kernel_names`): the actq kernel (entry
    ``name + "_actq"``, form ``f16s``, ``e4m3s`` with ``xfmt`` e4m3, ``k = K``) and :func:`render_gemm`'s kernel
    (entry ``name``; default ``"gemm_" + spec.key() + "_" + engine``).

    Raises:
        RenderError: see :func:`plan`.
    """
    name = name or f"gemm_{spec.key()}_{resolve_engine(spec, target)}"
    out = []
    for kn in kernel_names(spec, target):
        if kn == "actq":
            out.append(render_actq(f"{name}_actq", FAMILY, target, spec.k, spec.rows,
                                   "e4m3s" if spec.xfmt == "e4m3" else "f16s"))
        else:
            out.append(render_gemm(spec, target, name))
    return out


def launch_shapes(spec: GemmSpec, target: Target) -> list[Launch]:
    """One :class:`Launch` per kernel of :func:`kernel_names` (``kernel`` set), to be launched in that order on
    one stream: ``actq`` (:func:`~ds4c.runtime.families.actq.actq_launch`: the ``warp`` layout from 64 rows on,
    no dynamic shared memory); ``gemm`` :func:`launch_shape`. The GEMM reads what actq wrote (the prelude's PDL entry waits for it).

    Raises:
        RenderError: see :func:`plan`.
    """
    out = []
    for kn in kernel_names(spec, target):
        if kn == "actq":
            out.append(actq_launch(spec.k, spec.rows, target, kernel=kn))
        else:
            ln = launch_shape(spec, target)
            out.append(Launch(ln.grid, ln.block, ln.smem, kernel=kn))
    return out


def arg_names(spec: GemmSpec, target: Target | None = None) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel of :func:`kernel_names` (with ``target``; without, as
    ``spec.prequant`` asks): ``{"gemm": ["x", "w", "y"]}``, or ``{"actq": ["x", "xq", "xs"], "gemm": ["xq",
    "xs", "w", "y"]}`` (``xq``, ``xs``: the call's workspaces, :func:`workspaces`). Shapes: :func:`arg_shapes`."""
    if not (uses_prequant(spec, target) if target is not None else spec.prequant):
        return {"gemm": ["x", "w", "y"]}
    return {"actq": ["x", "xq", "xs"], "gemm": ["xq", "xs", "w", "y"]}


def arg_shapes(spec: GemmSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every argument name of :func:`arg_names`: ``x`` bf16 ``[C, K]``, ``w``
    :func:`weight_shape`, ``y`` ``[C, N]`` in ``out_dtype``, ``xq`` f16 ``[C, K]`` (float8_e4m3fn with ``xfmt``
    e4m3), ``xs`` fp32 ``[C, K/128]``."""
    g = spec.groups
    return {"x": ((spec.rows, g * spec.k), torch.bfloat16), "w": weight_shape(spec),
            "y": ((spec.rows, g * spec.n), spec.torch_out_dtype),
            "xq": ((spec.rows, spec.k), torch.float8_e4m3fn if spec.xfmt == "e4m3" else torch.float16),
            "xs": ((spec.rows, spec.k // KSTEP), torch.float32)}


def workspaces(spec: GemmSpec, target: Target) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The call's scratch tensors (written by one launch, read by a later one of the same call, dead after it):
    with :func:`uses_prequant` ``{"xq": f16 [C, K] (float8_e4m3fn with xfmt e4m3), "xs": fp32 [C, K/128]}``, else
    ``{}``. 16-byte aligned, contiguous.

    Raises:
        RenderError: see :func:`plan`.
    """
    if not uses_prequant(spec, target):
        return {}
    sh = arg_shapes(spec)
    return {"xq": sh["xq"], "xs": sh["xs"]}


def workspace_bytes(spec: GemmSpec, target: Target) -> int:
    """Bytes of :func:`workspaces`: ``2 C K + 4 C K / 128`` with prequant (``C K + ...`` with ``xfmt`` e4m3), else
    0."""
    return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in workspaces(spec, target).values())


def flops(spec: GemmSpec) -> int:
    """``2 * C * N * K`` (times G for a grouped call)."""
    return 2 * spec.rows * spec.n * spec.k * spec.groups


def weight_bytes(spec: GemmSpec) -> int:
    """Stored bytes of ``w``."""
    return spec.groups * spec.n * row_bytes(spec.fmt, spec.k)


# ------------------------------------------------------------------------------------------------ reference
_GGML = {"bf16": "BF16", "q8_0": "Q8_0", "mxfp4": "MXFP4"}


def dequantize_weight(spec: GemmSpec, raw: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` of the stored weight ``raw`` (any tensor holding exactly its bytes), through
    :func:`ds4c.quant.dequantize` (bit-identical to gguf's dequantizers)."""
    from ds4c.quant import dequantize

    return dequantize(raw.detach().contiguous(), _GGML.get(spec.fmt, spec.fmt.upper()), (spec.n, spec.k),
                      torch.float32)


def reference(spec: GemmSpec, x: torch.Tensor, w_raw: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, on ``x``'s device.

    Args:
        x: bf16 ``[C, K]``.
        w_raw: the stored weight (:func:`weight_shape`).
    Returns:
        ``[C, N]`` in ``out_dtype``: mode ``fp8act`` with bf16 out = ``primitives.linear_q(x, W, act_quant)``
        (spec 2.3), ``bf16`` = ``primitives.linear_bf16``, ``f32`` = ``primitives.linear_f32``; another
        ``out_dtype`` takes the same fp32 product before its rounding.
    Raises:
        RenderError: ``x`` is not bf16 ``[C, K]``.
    """
    from ds4c.quant import act_quant_dequant
    from ds4c.reference import primitives as P

    if spec.groups > 1:  # G independent GEMMs on column / row slices (GemmSpec.groups)
        import dataclasses

        one, gk = dataclasses.replace(spec, groups=1), spec.k
        if tuple(x.shape) != (spec.rows, spec.groups * gk) or x.dtype != torch.bfloat16:
            raise RenderError(f"gemm reference: x must be bf16 [{spec.rows}, {spec.groups * gk}], found {x.dtype} "
                              f"{tuple(x.shape)}")
        rows = w_raw.shape[0] // spec.groups
        return torch.cat([reference(one, x[:, g * gk:(g + 1) * gk].contiguous(), w_raw[g * rows:(g + 1) * rows])
                          for g in range(spec.groups)], dim=1)
    if tuple(x.shape) != (spec.rows, spec.k) or x.dtype != torch.bfloat16:
        raise RenderError(f"gemm reference: x must be bf16 [{spec.rows}, {spec.k}], found {x.dtype} "
                          f"{tuple(x.shape)}")
    w = dequantize_weight(spec, w_raw).to(x.device)
    if spec.mode == "fp8act" and spec.out_dtype == "bf16":
        return P.linear_q(x, w, spec.act_quant)
    if spec.mode == "bf16" and spec.out_dtype == "bf16":
        return P.linear_bf16(x, w)
    if spec.mode == "f32" and spec.out_dtype == "f32":
        return P.linear_f32(x, w)
    xa = act_quant_dequant(x, 128) if spec.quant else x.to(torch.float32)
    return P.matmul_rows(xa, w).to(spec.torch_out_dtype)


# ------------------------------------------------------------------------------------------ random inputs
def random_weight(spec: GemmSpec, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Fresh random valid stored bytes on ``device`` (``generator`` must live there): bf16 ~N(0, 1/K); q8_0
    random int8 codes with fp16 scales in [0.5, 2]/(127 sqrt(K)); mxfp4 random nibbles with exponent bytes
    118..124 (:func:`ds4c.runtime.families.gemv.random_weight`)."""
    from ds4c.runtime.families import gemv as G

    return G.random_weight(G.GemvOutput(spec.groups * spec.n, spec.fmt), spec.k, generator, device)


def random_x(spec: GemmSpec, generator: torch.Generator | None = None,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """bf16 ``[C, K]``: N(0, 1) times a per-(row, 128-block) magnitude 10^U(-2, 2) (varied activation
    scales); with C > 1 row 1 has magnitude 1e-6 (every block under the 1e-4 amax floor)."""
    c, nb = spec.rows, spec.groups * spec.k // KSTEP
    mag = 10.0 ** (torch.rand(c, nb, 1, generator=generator, device=device) * 4 - 2)
    if c > 1:
        mag[1] = 1e-6
    x = torch.randn(c, nb, KSTEP, generator=generator, device=device) * mag
    return x.reshape(c, nb * KSTEP).to(torch.bfloat16)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (fp64), infinite when ``got`` is not finite."""
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return math.inf
    return float((g - w).norm() / w.norm().clamp(min=1e-300))
