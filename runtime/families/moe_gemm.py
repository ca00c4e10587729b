"""The grouped experts GEMM family (batched prefill, docs/prefill.md): the routed experts of one MoE layer for a
chunk of ``C`` rows (the IR op ``routed_experts``: docs/model.md 5.2 o.5-o.7, 2.3 quantized linear, P11 clamped
SwiGLU), as per-expert tensor-core GEMMs over the rows that picked each expert. Template:
``templates/moe_gemm/moe_gemm.cu.j2``; the activation quant launches are ``templates/actq/act_quant.cu.j2``
form ``f16s``. Lowered from a prefill chunk's ``moe_experts`` plan kernel by
:func:`ds4c.runtime.lower_prefill.lower_routed_experts`: the routed call with ``shared`` (``moe_sum`` fused into
the combine) and a ``dense`` call for the shared expert (options below; both off render the measured sources
byte for byte).

Launches, in order on one stream (:func:`kernel_names`, :func:`launch_shapes`); every shape depends on ``C``,
``k``, ``E``, ``D``, ``I`` only, never on the routing (CUDA-graph capturable):

* ``route``: grid (1,), 256 threads. From ``ids`` int64 [C, k] builds ``perm`` int32 [C*k] (the pair indices
  ``row*k + slot`` grouped by expert in ascending id, by ascending row inside an expert) and ``tiles`` int32
  [T, 4] (``expert, first pair position, count (1..TM), 0``; the slots past the last tile have count 0) with
  ``T = floor(C*k / TM) + min(E, C*k)`` (:func:`tile_slots`: every expert's last tile partially filled).
  Deterministic: per group of 32 rows a 32-bit mask per expert (bit r = row r picked it) built with shared
  ``atomicOr`` (bits commute: the masks do not depend on the atomics' order), counts = popcounts, exclusive
  scans by one thread, the rank of a pair = earlier groups' counts + the popcount of its expert's mask below
  its row.
* ``actq_x`` (runtime/families/actq.py: the ``warp`` layout from 64 rows on): x bf16 [C, D] -> ``xq`` f16 [C, D] (the e4m3 values) + ``xs`` fp32 [C, D/128].
* ``up``: grid (T, I/32), 128 threads (``bn`` 128: grid (T, I/64), 256 threads, 64 columns; below). CTA = one
  tile of <= 64 pairs x 32 intermediate columns: a 64 x 64 MMA tile of the gathered x rows against 32 rows of
  W1_e then the same 32 rows of W3_e; epilogue ``g = bf16(.)``, ``u = bf16(.)``, ``h = silu(min(g, L)) *
  clamp(u, -L, L)`` (fp32), ``h *= weight[row, slot]`` (fp32), ``hbuf[pair position] = bf16(h)``: bf16 [C*k,
  I], rows in ``perm`` order (a tile's rows are contiguous).
* ``actq_h`` (over the C*k pair rows): hbuf -> ``hq`` f16 [C*k, I] + ``hs`` fp32 [C*k, I/128] (linear_q's FP8
  quant of h per (pair, 128-block)).
* ``down``: grid (T, D/64), 128 threads (``bn`` 128: grid (T, D/128), 256 threads): ``y = bf16(W2_e . qa(h))``
  -> ``ybuf`` bf16 [C, k, D] at (row, slot). bf16, not fp32: the reference rounds every expert's output to bf16
  (``linear_q``) before its fp32 sum, so bf16 holds it exactly at half the bytes (C = 4096: 200 MB instead of
  400).
* ``combine``: grid (D/128, C), 128 threads: ``out[row] = sum_j fp32(ybuf[row, slot_j])`` over the row's slots
  in ascending expert id, from 0.0 (the order of :func:`ds4c.reference.blocks.routed_sum`), no atomics. With
  ``MoeGemmSpec.shared``: an input ``shared`` bf16 [C, D] after ``ybuf`` and ``out`` bf16 [C, D] =
  ``bf16(sum + fp32(shared[row]))``, the IR's ``moe_sum`` (the same fp32 sum, one more fp32 add, one RNE
  rounding: exact against ``moe_sum`` of the same two inputs).

``MoeGemmSpec.dense`` (``k = 1``, ``E = 1``: a plain SwiGLU FFN, the shared expert): four launches, actq_x, up,
actq_h, down; pair ``p`` is row ``p`` and tile ``t`` rows ``[64 t, min(64 t + 64, C))`` (grid ``ceil(C/64)``
tiles, no route, no ``perm`` / ``tiles`` / ``ids`` / ``weights`` arguments); the up epilogue stores
``bf16(silu(min(g, L)) * clamp(u, -L, L))`` without the weight multiply (weight 1: ``1.0 * h`` is ``h``, so
skipping it is exact); down writes ``out`` bf16 [C, D]. That is the IR's shared expert op for op: ``linear``
fp8act gate / up (bf16 out), ``swiglu`` (fp32 from the bf16 g / u), ``cast`` bf16, ``linear`` fp8act down (bf16
out); same numerics as a routed expert of weight 1.

GEMM engine (CUDA ``mma.sync`` m16n8k16 f16, sm_89+: form 0 of :mod:`ds4c.runtime.families.gemm`, whose module
docstring is the design): A = the weight codes as exact f16 (MXFP4 through e4m3 codes of e2m1 * 2^-6 and
``cvt.rn.f16x2.e4m3x2``, the 2^6 folded into the block scale; Q8_0 through the 0x6400 magic), B = the
activation's e4m3 values (exact f16); per 32-block the fp32 MMA result times the weight block scale (fp32),
summed over the 128-block, then times the activation's per-128 scale. 4 warps (2 x 2, each 32 x 32 = 2 x 4
MMA tiles), K steps of 128, weights and activations of step k+1 prefetched into registers while step k is
computed from the other shared-memory stage (two stages: 44.5 KB MXFP4, 52.5 KB Q8_0). Activation rows of the
up phase are gathered (``perm[p] / k``), of the down phase contiguous. Rows of a tile past its count are zeros
(scale 0) and are not stored.

The wide tile, ``MoeGemmSpec.bn = 128`` (the prefill setting ``DS4C_PREFILL_MOE_BN``; the gemm family's
``GemmSpec.bn``): 128 weight rows per CTA, 256 threads = 8 warps (4 weight-row groups x 2 pair groups, each warp
still 32 x 32 = 2 x 4 MMA tiles, so its per-warp code is the 64-wide kernel's); up = 64 rows of W1 then the same
64 rows of W3 (grid (T, I/64)), down = 128 rows of W2 (grid (T, D/128)). Each staged activation tile (64
gathered rows, 16 KB per K step) feeds twice the outputs, the grid has half the CTA columns, and the X prefetch
takes 4 instead of 8 16-byte registers per thread (256 threads share the 64 x 128 f16 tile); the weight tile per
stage doubles (two stages: MXFP4 54.5 KB, Q8_0 70.5 KB, K-quants / IQ4_XS 62.5-94.5 KB; all under sm_90's 227
KB). ``__launch_bounds__(256, 1)`` (255 registers a thread at most: one CTA of 8 warps per SM, the warps of the
64-wide kernel's two CTAs). Every output element is the same MMAs on the same operands in the same order, then
the same epilogue, so the two widths' outputs are bit-identical; ``bn`` 0 / 64 render the 64-wide sources byte
for byte. I and D are multiples of 128 (the spec's check), so both widths tile them exactly: there is no partial
CTA column to refuse or mask.

K-quant / IQ4_XS weights (``q2_k`` .. ``q6_k``, ``iq4_xs``: the 43-layer model's Q3_K routed experts, a Q4_K_M
file's Q4_K / Q6_K ones; the reduction a multiple of 256, of 512 for Q3_K / Q6_K, whose 110 / 210-byte super-blocks
are not whole words): a K step of 128 is half a 256-value super-block; each weight row stages the super-block's
bytes from the 4-aligned word at or before it (Q3_K 112, Q6_K 212 bytes, so a step's words never leave the row).
Per 32-block the shared decoder (``templates/prelude/kquant.h.j2``, the experts' and GEMV's) gives each lane's int8
codes and each 16-value half's scale ``sc = d * sub-scale`` and min ``mn = dmin * sub-min``; one MMA per half on
the codes (exact f16 through the int8 path; Q4_K / Q5_K / IQ4_XS, one scale per 32 values, chain the two), its
fp32 result times ``sc`` (exact in fp32: the reference's value is ``sc * q - mn``), minus ``mn`` times the half's
activation sum, which an MMA of a ones matrix on the same B fragments gives (Q2_K, Q4_K, Q5_K); then the
activation scale as for the other formats. The formats staged in 4-byte units (Q2_K, Q3_K, Q6_K) copy their
weights by 4-byte ``cp.async`` straight into shared memory instead of through registers (``PhasePlan.w_async``).

Supported: CUDA sm_90 / sm_90a / sm_100a (the e4m3 cvt), weights ``mxfp4``, ``q8_0``, the K-quants or ``iq4_xs``
(w1 and w3 in one format, w2 in ``down_fmt``), the FP8 activation quant on (the reference's ``emulate=True``).

HIP (:data:`ds4c.runtime.targets.HIP_MATRIX`: gfx90a / gfx942 on ``v_mfma_f32_16x16x16_bf16``, wave 64; gfx1100 /
gfx1151 on gfx11's ``v_wmma_f32_16x16x16_bf16``, wave 32; templates/prelude/amd_matrix.h.j2): the same launches,
arguments, grids, tiles and register-staged 2-stage loop (route, the activation quant and the combine are the CUDA
kernels' source; the route's atomics through clang builtins), with the up / down K step on matrix cores: wave ``w``
owns 16 ``DS4C_WAVE / 32`` of the tile's weight rows x its 64 pairs; A = the staged weight blocks decoded to exact
bf16 (MXFP4: e2m1 times the block's 2^(E-127), inside bf16's exponent range; Q8_0: the int8 code, the f16 block scale
applied to the 32-block's fp32 partial; K-quants / IQ4_XS: the int8 codes of prelude/kquant.h.j2's decoder, per
16-value half ``sc * partial - mn * (the half's activation sum)``), B = the pairs' e4m3 values times their
activation scale (a power of two) as exact bf16, so every partial goes straight into the accumulators. On wave 32,
and for K-quants on wave 64, the next K step's tiles are loaded after the products (beside the 16-value WMMA
fragments or the K-quant decode they spilled). Every format on wave 64 (K-quants / IQ4_XS not on wave 32: their WMMA step spills past 256 VGPRs on
gfx1151, pending), 2 stages (weights staged through registers, no cp.async), no L2 prefetch, tiles within 64 KiB of
LDS (a 128-wide Q8_0 tile is not); compile-checked with clang and emulated (the ISA's fragment layouts), not run on
an AMD GPU.

Anything else (sm_80, gfx1201, bf16 weights, ``emulate=False``) raises :class:`RenderError` with a one-line
message.

Arguments (:func:`arg_names`, shapes :func:`arg_shapes`): ``ids`` int64 [C, k] (distinct per row, in [0, E);
an id outside is skipped by ``route`` and leaves that (row, slot)'s ybuf unwritten, so ``combine`` reads
garbage), ``weights`` fp32 [C, k], ``x`` bf16 [C, D], ``w1``/``w3`` [E, I, D/32*bb] uint8, ``w2`` [E, D,
I/32*bb] uint8, the workspaces ``perm``, ``tiles``, ``xq``, ``xs``, ``hbuf``, ``hq``, ``hs``, ``ybuf`` and the
output ``out`` fp32 [C, D] (every element written). Pointers 16-byte aligned, tensors contiguous.

Numerics vs :func:`reference` (per row ``routed_sum`` / ``expert_ffn`` of ds4c.reference.blocks on the
dequantized weights): the same operands and products (codes, scales and e4m3 values are exact in f16 / fp32);
the fp32 summation order inside each projection differs (per-32-block MMA partials, then scales), ~1e-7
relative, so a bf16 rounding of g, u, h or y flips for about one element in 10^3-10^4 (more with a longer K);
the combine's fp32 sums are the reference's exactly. Every differing output element is within one bf16 ulp of
one expert output of the reference's down phase on the kernel's own h (:func:`reference_down`); against the
full reference a flipped h element also moves all D outputs of its pair. Observed on the CPU emulator: out
rel-L2 0 (MXFP4, D 256) to 2.4e-5 vs :func:`reference_down` and 1.4e-4 vs :func:`reference` (Q8_0, D 1024,
I 512); tests/test_moe_gemm_family.py states its floor and tolerances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.families import Launch
from ds4c.runtime.families.actq import actq_launch, render_actq
from ds4c.runtime.families.experts import BLOCK_BYTES as _XP_BYTES, E4M3_ARCHS, FMT_ID as _XP_FMT_ID, KQUANTS
from ds4c.runtime.families.experts import _float_literal, dequantize_weight
from ds4c.runtime.families.gemm import SM_SMEM, STAGES, launch_min_blocks
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import HIP_LDS, HIP_MATRIX, Target, target as make_target

TEMPLATE = "moe_gemm/moe_gemm.cu.j2"
FAMILY = "moe_gemm"
FORMATS = ("mxfp4", "q8_0") + KQUANTS
#: the template's MG_FMT: 0 MXFP4, 1 Q8_0, 2 a K-quant / IQ4_XS super-block (which one: MG_KQ, the shared decoder's
#: format id, :data:`ds4c.runtime.families.experts.FMT_ID`)
FMT_ID = {"mxfp4": 0, "q8_0": 1, **{f: 2 for f in KQUANTS}}
BLOCK_BYTES = {"mxfp4": 17, "q8_0": 34}  # per block of 32 values (K-quants: SUPER_BYTES per 256)
SUPER_BYTES = {f: _XP_BYTES[f] for f in KQUANTS}
#: K-quants whose super-block is not a whole number of words (Q3_K 110, Q6_K 210 bytes): a row must hold an even
#: number of super-blocks, so every row starts on a word and a K step's staged words stay inside the row
UNALIGNED_KQ = tuple(f for f in KQUANTS if SUPER_BYTES[f] % 4)
#: the formats whose weights a phase stages by 4-byte cp.async (PhasePlan.w_async): Q2_K (84-byte super-blocks, rows
#: not 8-aligned), Q3_K, Q6_K
W_ASYNC = ("q2_k", "q3_k", "q6_k")


def kq_segment(fmt: str) -> int:
    """Bytes of a K-quant row staged per K step (half a super-block of values): the whole super-block from the
    4-aligned word at or before it (Q3_K 112, Q6_K 212; the aligned formats their super-block)."""
    bb = SUPER_BYTES[fmt]
    return bb + (2 if bb % 4 else 0)
TM = 64            # pairs per tile (the MMA tile's pair side)
KSTEP = 128
XST = 272          # bytes between the X tile's rows: 128 f16 + 16 (x_stride: 144 for e4m3 codes)
ROUTE_THREADS = 256
GEMM_THREADS = 128  # threads of the up / down CTAs at the default width (MoeGemmSpec.bn 64); 2 * bn in general
BN = 64            # weight rows per up / down CTA by default (MoeGemmSpec.bn: 64 or 128)
BNS = (64, 128)
WG_BNS = (64, 128, 256)  # wgmma: 1, 2 or 4 warpgroups, each 64 weight rows (WGMMA)
WG_REGS = 128  # registers a thread the wgmma kernels are bounded to from 2 warpgroups on (2 CTAs of 8 warps a SM)
# K-step stages of the up / down phases (MoeGemmSpec.stages), gemm.STAGES: 2 = register-staged double buffering
# (the measured sources), 3 = the cp.async pipeline. Not 4: ptxas spills Q6_K's down phase at 255 registers with 4,
# and a fourth stage of shared memory costs MXFP4's 64-wide kernel a CTA per SM (2 instead of 3: the same steps in
# flight). The launch bounds (registers a thread, CTAs a SM) of both families: gemm.launch_min_blocks.
SMEM_LIMIT = 227 * 1024
KERNELS = ("route", "actq_x", "up", "actq_h", "down", "combine")
MMAS = ("sync", "wgmma", "fp8", "wgmma8")
#: the MMAs on Hopper's warpgroup instructions (sm_90a code, WGMMA_ARCHS, 1 / 2 / 4 warpgroups a CTA, 3 stages)
WG_MMAS = ("wgmma", "wgmma8")
XFMTS = ("f16", "e4m3")
XFMT_E4M3 = """MoeGemmSpec.xfmt = "e4m3" (issue 33; docs/perf.md Optimisation 21). The activation quant launches write
form ``e4m3s`` (the e4m3 codes, one byte a value, and the per-128 scales) instead of ``f16s`` (the same values as f16),
and the up / down phases stage those bytes: a 64-pair tile of one K step is 8 KB instead of 16 KB (X rows of 144 bytes:
128 codes + 16, so the 8 rows of a B fragment read on distinct banks), 8 instead of 16 threads a row, half the
16-byte copies. Each B fragment is one 32-bit shared read of four codes turned into two f16x2 by
``cvt.rn.f16x2.e4m3x2`` (exact), so the MMAs see the f16 operands of the ``f16`` tile: the same outputs bit for bit.
Also half the bytes of ``xq`` / ``hq`` in global memory (the down phase's ``hq``: C * k * I bytes, 50 MB -> 25 MB at
C 2048). CUDA, ``mma`` sync (every format, width and stage count), fp8 and wgmma8; the HIP body and wgmma read f16 /
bf16.

``mma`` fp8 (MXFP4 weights both ways) goes one step further: the K step's products run on ``mma.sync
.m16n8k32.row.col.f32.e4m3.e4m3.f32`` (sm_89+), A = the MXFP4 codes turned into e4m3 codes of e2m1 * 2^-6 (the byte
arithmetic of the f16 path, without its cvt), B = the staged codes as read; one MMA per 32-block and (m16, n8) tile
instead of two, no operand conversion. Per 32-block and warp: 8 MMAs and ~40 other instructions where ``sync`` runs
16 MMAs and ~70. The block's fp32 partial times the weight block scale as before. Not bit-identical: the tensor core
sums a 32-block's 32 exact products in its own precision (Hopper's FP8 MMA keeps fewer bits than fp32 inside the
instruction), as the reference's TileLang FP8 GEMMs do.

``mma`` wgmma8 (MXFP4 both ways, sm_90 / sm_90a, ``bn`` 64 / 128 / 256, 3 stages; docs/perf.md Optimisation 23): the
FP8 form of :data:`WGMMA`, ``wgmma.mma_async.m64n64k32.f32.e4m3.e4m3``, B = the staged e4m3 tile (core matrices of 8
pairs x 16 codes, stride byte offset 1024) with the pairs' activation scales beside it, A from registers. The A
operand must be e4m3 and the MXFP4 blocks of a row carry their own power of two, so per row and K step the largest
exponent byte E of its four blocks sets the step's scale and block b's codes become e4m3 codes of e2m1 *
2^(6 - (E - E_b)) through a prmt table (the MXFP4 nibble's 3-bit magnitude indexes the 8 codes; exact while E - E_b <=
14, rounded beyond, where the block is 2^-15 of the row's largest); four wgmma (one per block, the first overwriting
the step's accumulator), one wait, then ``acc += tmp * 2^(E - 133) * x_scale`` per element: a promotion per K step of
128, as DeepGEMM promotes its FP8 accumulators. Staged bytes a K step per 64 outputs: half the bf16 tile's; the
tensor core at its FP8 rate. Not bit-identical to ``sync`` (the tensor core's FP8 sum inside a step; identical on the
emulator, which sums exactly)."""
PREFETCH = (0, 128, 256)
#: the targets whose up / down phases can run on wgmma, and the arch those kernels compile for (sm_90 binaries
#: run only on compute capability 9.0, the Hopper parts, all of which have sm_90a's wgmma)
WGMMA_ARCHS = ("sm_90", "sm_90a")
WGMMA = """MoeGemmSpec.mma = "wgmma" (issue 33; docs/perf.md Optimisations 19 and 20). ``bn / 64`` warpgroups (128
threads each) per CTA, all on one tile of 64 pairs; warpgroup j owns weight rows 64j .. 64j + 63 of the CTA's ``bn``
(up: W1 rows in the first half of the warpgroups, the same W3 rows in the second; down: W2 rows), as one m64n64 fp32
accumulator (32 registers a thread: warp w rows 16w + g, 16w + g + 8, pairs 8j + 2t, 8j + 2t + 1). Per K step of
128 values, 8 ``wgmma.mma_async.m64n64k16.f32.bf16.bf16``: A from registers, each thread building its fragments from
the staged MXFP4 bytes (bytes 4t .. 4t + 3 of a 32-block: the low nibbles are values 4t + j of the block's first
k16 slice, the high ones of its second) as bf16 e2m1 * 2^-126 (sign and the three code bits placed in the bf16 bits,
e2m1's subnormal on bf16's), times the block's 2^(E-1) (``mul.rn.bf16x2``; a second factor when E > 128): the exact
weight value. B from shared memory by descriptor: the activation tile in bf16, e4m3 * 2^k with the per-128 scale
folded in (exact), written by the actq launch in form ``bf16p`` (the k order of those A fragments inside every 16
values), in the canonical no-swizzle K-major layout (core matrices of 8 pairs x 16 bytes; leading byte offset 128
between K-adjacent ones, stride byte offset 2048 between pair groups). Every product exact, one fp32 accumulation
over the whole reduction (no per-block partials, no per-128 scaling). Tiles copied by the 3-stage cp.async pipeline
(weights in 4-byte units, activation chunks of 16 bytes); the warpgroup waits for its 8 MMAs before the barrier
that lets the stage be refilled. Instructions per 32-block and warp (16 weight rows x 64 pairs): ~60 to build the
A fragments and 2 wgmma, against ~128 and 16 mma.sync for the same products on the ``sync`` path. Measured (one
warpgroup): no faster than ``sync`` -- both are bound by the operand bytes each CTA stages from L2 per K step, not by
the instruction stream -- which is why 2 and 4 warpgroups share one staged activation tile (bn 128 / 256: 256 / 512
threads, 128 registers a thread; the same outputs bit for bit as bn 64)."""


def row_bytes(fmt: str, n_in: int) -> int:
    """Bytes of one stored weight row of ``n_in`` values."""
    if fmt in SUPER_BYTES:
        return n_in // 256 * SUPER_BYTES[fmt]
    return n_in // 32 * BLOCK_BYTES[fmt]


def x_stride(xfmt: str) -> int:
    """Bytes between the rows of a staged activation tile (128 values + 16 bytes of padding, so the 8 rows of a B
    fragment read on distinct banks): 272 for f16 values, 144 for e4m3 codes."""
    return XST if xfmt == "f16" else 144


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass(frozen=True)
class MoeGemmSpec:
    """The routed experts of one MoE layer over ``rows`` rows (all render-time).

    Attributes:
        rows: C, the prefill chunk's rows (1..65535 / k: the actq_h grid's y).
        hidden: D (4096 flash; a multiple of 128).
        inter: I, the expert intermediate width (2048 flash; a multiple of 128).
        k: routed experts per row (6 flash; 1..16).
        n_experts: E (256 flash; 1..512: the route kernel's static shared memory, 76 E bytes).
        fmt: storage of w1 / w3: ``mxfp4`` (official) | ``q8_0`` | a K-quant (``q2_k`` .. ``q6_k``) | ``iq4_xs``.
        down_fmt: storage of w2; None = ``fmt``.
        limit: the SwiGLU clamp L (P11; 10.0).
        act_quant: FP8 activation quant of x and h (the reference's ``emulate``); only True is supported.
        dense: a plain SwiGLU FFN (the shared expert, ``k = 1``, ``n_experts = 1``): every row is its own pair
            routed to expert 0 with weight 1; launches actq_x, up, actq_h, down only (:func:`kernel_names`), no
            ``ids`` / ``weights`` / ``perm`` / ``tiles``, the up epilogue skips the weight multiply (``h * 1.0``
            is ``h``: exact), tiles fixed by the row count (``ceil(C / TM)``); the down phase writes ``out``
            bf16 [C, D] (the FFN's bf16 output, ``linear_q``'s rounding).
        shared: ``moe_sum`` fused into the combine: the extra input ``shared`` bf16 [C, D] and ``out`` bf16
            [C, D] = ``bf16(routed fp32 sum + fp32(shared))`` (the IR op ``moe_sum``); not with ``dense``.
        bn: weight rows per CTA of the up / down phases: 0 (the default, 64) | 64 | 128 (the wide tile: 256
            threads, up = 64 rows of W1 then the same 64 of W3, down = 128 rows of W2; module docstring). Both
            widths give bit-identical outputs; route / actq / combine do not depend on it.
        stages: K-step stages of the up / down phases: 0 (the default, 2) | 2: step k+1 prefetched into registers
            while step k is computed, then stored to the other stage (the measured sources) | 3: the cp.async
            pipeline (``gemm.launch_min_blocks``, docs/perf.md Optimisation 18): every step's weights, activation rows and
            scales copied by cp.async straight into one of three shared-memory stages, two steps in flight, no
            staging registers. The same MMAs on the same operands in the same order: every stage count
            gives bit-identical outputs.
        mma: the up / down phases' tensor-core instruction: ``sync`` (the default: ``mma.sync`` m16n8k16 on f16
            codes, per-block scaled partials; every format, width and stage count) | ``wgmma`` (sm_90a's
            warpgroup MMA, m64n64k16 on bf16 operands with every scale folded in, one fp32 accumulation over K;
            MXFP4 weights both ways, ``bn`` 64 / 128 / 256 (1, 2 or 4 warpgroups), 3 stages: :data:`WGMMA` has the
            design) | ``fp8`` (``mma.sync`` m16n8k32 on e4m3 operands, one MMA per 32-block where ``sync`` runs two
            and converts both operands to f16: the MXFP4 codes as e4m3, the staged e4m3 tile as read; MXFP4 both
            ways, ``xfmt`` e4m3, every width and stage count: :data:`XFMT_E4M3`) | ``wgmma8`` (the FP8 wgmma,
            m64n64k32 e4m3 with a promotion per K step; MXFP4 both ways, ``xfmt`` e4m3, the widths and stages of
            ``wgmma``: :data:`XFMT_E4M3`). None is bit-identical to ``sync`` (the fp32 sums run in another order,
            and the FP8 MMAs sum in the tensor core's own precision, as the reference's FP8 GEMMs do); all are
            within the reference's bounds.
        prefetch: the L2 prefetch size of the up / down phases' cp.async copies: 0 (none: the measured text) | 128 |
            256 bytes (``cp.async ... .L2::256B``: a copy of a weight row's 68-byte piece of a K step brings the
            row's next bytes into L2 in the same DRAM burst). Only the cp.async paths copy with it (``mma`` wgmma,
            ``stages`` 3, the cp.async-staged K-quants); the outputs do not depend on it.
        cols_first: the up / down grids as (column blocks, tiles) instead of (tiles, column blocks): the CTAs of one
            tile, which read the same activation rows, run side by side (the hardware schedules x fastest), so those
            rows come from DRAM once and from L2 after; the same outputs bit for bit.
        xfmt: how the quantized activations (``xq``, ``hq``) are stored and staged: ``f16`` (the default: actq form
            ``f16s``, the e4m3 values as f16, 16 KB a 64-row tile per K step) | ``e4m3`` (form ``e4m3s``: the codes
            themselves, one byte a value, 8 KB a tile; the B fragments turned into f16 in registers by the same exact
            cvt as the MXFP4 weights). The same MMAs on the same values: bit-identical outputs. CUDA: with ``mma``
            sync (every format), and required by ``fp8`` / ``wgmma8``; not with ``wgmma`` (bf16p) nor on HIP
            (:data:`XFMT_E4M3`).

    Raises:
        RenderError: a field out of range or unsupported; the message names it and what was expected.
    """

    rows: int
    hidden: int = 4096
    inter: int = 2048
    k: int = 6
    n_experts: int = 256
    fmt: str = "mxfp4"
    down_fmt: str | None = None
    limit: float = 10.0
    act_quant: bool = True
    dense: bool = False
    shared: bool = False
    bn: int = 0
    stages: int = 0
    mma: str = "sync"
    prefetch: int = 0
    cols_first: bool = False
    xfmt: str = "f16"

    def __post_init__(self) -> None:
        if self.down_fmt is None:
            object.__setattr__(self, "down_fmt", self.fmt)
        bad = []
        if not (isinstance(self.k, int) and 1 <= self.k <= 16):
            bad.append(f"k {self.k!r} (expected an int in 1..16)")
        elif not (isinstance(self.rows, int) and 1 <= self.rows * self.k <= 65535):
            bad.append(f"rows {self.rows!r} (expected an int >= 1 with rows * k <= 65535)")
        for nm in ("hidden", "inter"):
            v = getattr(self, nm)
            if not (isinstance(v, int) and v >= KSTEP and v % KSTEP == 0):
                bad.append(f"{nm} {v!r} (expected a positive multiple of {KSTEP})")
        if not (isinstance(self.n_experts, int) and 1 <= self.n_experts <= 512):
            bad.append(f"n_experts {self.n_experts!r} (expected an int in 1..512: route keeps 2 x 8 x E words of masks and bases in static shared memory)")
        for nm in ("fmt", "down_fmt"):
            if getattr(self, nm) not in FORMATS:
                bad.append(f"{nm} {getattr(self, nm)!r} (the grouped GEMM supports {FORMATS} only)")
        if not (isinstance(self.limit, (int, float)) and math.isfinite(self.limit) and self.limit > 0):
            bad.append(f"limit {self.limit!r} (expected a positive finite float)")
        if self.act_quant is not True:
            bad.append("act_quant False (only the FP8 activation path, the reference's emulate=True, is built)")
        bns = WG_BNS if self.mma in WG_MMAS else BNS
        if type(self.bn) is not int or self.bn not in (0,) + bns:  # noqa: E721 (128.0, True are not widths)
            also = "" if self.mma in WG_MMAS else "; 256 with wgmma"
            bad.append(f"bn {self.bn!r} (expected 0 or one of {bns}{also})")
        if type(self.stages) is not int or self.stages not in (0,) + STAGES:  # noqa: E721
            bad.append(f"stages {self.stages!r} (expected 0 or one of {STAGES})")
        if type(self.cols_first) is not bool:  # noqa: E721
            bad.append(f"cols_first {self.cols_first!r} (expected a bool)")
        if type(self.prefetch) is not int or self.prefetch not in PREFETCH:  # noqa: E721
            bad.append(f"prefetch {self.prefetch!r} (expected one of {PREFETCH})")
        if self.mma not in MMAS:
            bad.append(f"mma {self.mma!r} (expected one of {MMAS})")
        elif self.mma != "sync" and (self.fmt != "mxfp4" or self.down_fmt != "mxfp4"):
            bad.append(f"mma {self.mma} with {self.fmt}/{self.down_fmt} weights (expected MXFP4 both ways: its A "
                       f"fragments are built from MXFP4 bytes)")
        if self.bn == 256 and isinstance(self.hidden, int) and self.hidden % 256:
            bad.append(f"bn 256 with hidden {self.hidden} (expected a multiple of 256: the down phase's CTA columns "
                       f"are 256 wide, a partial one would leave outputs unwritten)")
        if self.mma in WG_MMAS and self.stages not in (0, 3):
            bad.append(f"mma {self.mma} with stages {self.stages} (expected 0 / 3: its 3-stage cp.async pipeline)")
        if self.xfmt not in XFMTS:
            bad.append(f"xfmt {self.xfmt!r} (expected one of {XFMTS})")
        elif self.xfmt == "e4m3" and self.mma == "wgmma":
            bad.append("xfmt e4m3 with mma wgmma (its B operand is the bf16 tile of actq form bf16p)")
        elif self.mma in ("fp8", "wgmma8") and self.xfmt != "e4m3":
            bad.append(f"mma {self.mma} with xfmt {self.xfmt} (its B operand is the staged e4m3 codes: xfmt e4m3)")
        if self.dense and (self.k != 1 or self.n_experts != 1 or self.shared):
            bad.append(f"dense with k {self.k}, n_experts {self.n_experts}, shared {self.shared} (a dense call is "
                       f"k = 1, n_experts = 1, shared False)")
        for nm, fmt, kin in (("hidden", self.fmt, self.hidden), ("inter", self.down_fmt, self.inter)):
            if fmt in UNALIGNED_KQ and isinstance(kin, int) and kin % 512:
                bad.append(f"{nm} {kin} with {fmt} (expected a multiple of 512: an even number of 256-value "
                           f"super-blocks per row, so a K step's staged words stay inside the row)")
            elif fmt in KQUANTS and isinstance(kin, int) and kin % 256:
                bad.append(f"{nm} {kin} with {fmt} (expected a multiple of 256: whole super-blocks per row)")
        if bad:
            raise RenderError("MoeGemmSpec: bad " + "; ".join(bad))

    @property
    def pairs(self) -> int:
        """C * k, the (row, slot) pairs."""
        return self.rows * self.k

    def key(self) -> str:
        return (f"c{self.rows}_d{self.hidden}_i{self.inter}_k{self.k}_e{self.n_experts}_{self.fmt}"
                + ("" if self.down_fmt == self.fmt else f"_{self.down_fmt}")
                + ("" if self.limit == 10.0 else f"_l{self.limit:g}".replace(".", "p"))
                + ("_dense" if self.dense else "") + ("_sh" if self.shared else "")
                + (f"_bn{self.bn}" if self.bn > 64 else "") + (f"_st{self.stages}" if self.stages > 2 else "")
                + {"sync": "", "wgmma": "_wg", "fp8": "_f8", "wgmma8": "_w8"}.get(self.mma, "")
                + (f"_pf{self.prefetch}" if self.prefetch else "")
                + ("_cf" if self.cols_first else "") + ("_x8" if self.xfmt == "e4m3" else ""))

    def short(self) -> str:
        return (f"C={self.rows} D={self.hidden} I={self.inter} k={self.k} E={self.n_experts} "
                f"{self.fmt}/{self.down_fmt}" + (" dense" if self.dense else "") + (" +shared" if self.shared else "")
                + (f" bn{self.bn}" if self.bn > 64 else "") + (f" {self.stages} stages" if self.stages > 2 else "")
                + ("" if self.mma == "sync" else f" {self.mma}")
                + (f" L2 prefetch {self.prefetch}" if self.prefetch else "")
                + (" columns first" if self.cols_first else "") + (" e4m3 tiles" if self.xfmt == "e4m3" else ""))


def tile_slots(spec: MoeGemmSpec) -> int:
    """T, the tile table's rows: ``sum_e ceil(n_e / TM) <= floor(C*k / TM) + min(E, C*k)`` for any routing; a
    dense call's tiles are fixed: ``ceil(C / TM)``."""
    if spec.dense:
        return -(-spec.rows // TM)
    return spec.pairs // TM + min(spec.n_experts, spec.pairs)


def check_target(target: Target, spec: MoeGemmSpec | None = None) -> None:
    """Raises RenderError (one line) for a target the family does not build: neither CUDA with the e4m3 cvt
    (:data:`E4M3_ARCHS`) nor an AMD arch with matrix cores (:data:`ds4c.runtime.targets.HIP_MATRIX`); with ``spec``:
    ``mma`` wgmma off Hopper, and on HIP what its body does not build (3 stages, the L2 prefetch, wgmma, e4m3 tiles;
    K-quant / IQ4_XS weights on wave-32 RDNA)."""
    if target.vendor == "hip":
        if target.arch not in HIP_MATRIX:
            raise RenderError(f"moe_gemm: {target.slug} is not supported (AMD matrix cores on {'/'.join(HIP_MATRIX)}; "
                              f"CUDA {'/'.join(E4M3_ARCHS)})")
        if spec is None:
            return
        bad = []
        if target.wave == 32 and (spec.fmt in KQUANTS or spec.down_fmt in KQUANTS):
            bad.append(f"weights {spec.fmt}/{spec.down_fmt} on wave 32 (the WMMA K-quant step spills past 256 VGPRs "
                       f"on gfx1151: pending; MXFP4 / Q8_0 build, as do K-quants on wave-64 CDNA)")
        if spec.mma != "sync":
            bad.append(f"mma {spec.mma} (a CUDA instruction)")
        if spec.stages not in (0, 2):
            bad.append(f"stages {spec.stages} (the HIP body has the 2-stage register loop)")
        if spec.prefetch:
            bad.append(f"L2 prefetch {spec.prefetch} (a CUDA cp.async option)")
        if spec.xfmt != "f16":
            bad.append(f"xfmt {spec.xfmt} (the HIP K step reads f16 activation tiles)")
        if bad:
            raise RenderError(f"moe_gemm {spec.short()} on {target.slug}: " + "; ".join(bad))
        return
    if target.arch not in E4M3_ARCHS:
        raise RenderError(f"moe_gemm: {target.slug} is not supported (needs CUDA {'/'.join(E4M3_ARCHS)}: the f16 "
                          f"mma.sync on e4m3 activations; or AMD matrix cores on {'/'.join(HIP_MATRIX)})")
    if spec is not None and spec.mma in WG_MMAS and target.arch not in WGMMA_ARCHS:
        raise RenderError(f"moe_gemm {spec.short()}: wgmma runs on {'/'.join(WGMMA_ARCHS)} only, not {target.slug}")


@dataclass(frozen=True)
class PhasePlan:
    """Geometry of the ``up`` / ``down`` GEMM: reduction ``kin``, output width ``nout``, weight ``fmt``, row bytes
    ``rs``, vector load bytes ``v``, padded shared row stride ``rbp``, ``stage_bytes`` (one stage; ``stages`` of them),
    ``smem``,
    ``grid``, ``block`` (``2 * bn`` threads), ``nb``: the 4-byte words a thread loads of one K step's weights,
    ``bn``: the weight rows of a CTA (64 or 128), and ``w_async``: they
    are copied by 4-byte cp.async straight into shared memory instead of through registers (the K-quants staged in
    4-byte units, Q2_K / Q3_K / Q6_K: 11-27 registers otherwise, and sm_90 spills Q3_K's up and Q6_K's down
    phase at 255 registers)."""

    kin: int
    nout: int
    fmt: str
    rs: int
    v: int
    rbp: int
    stage_bytes: int
    smem: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    nb: int
    w_async: bool
    bn: int = BN
    stages: int = 2


def plan(spec: MoeGemmSpec, target: Target, phase: str) -> PhasePlan:
    """The geometry of GEMM phase ``up`` or ``down``.

    Raises:
        RenderError: an unsupported target, an unknown phase, or the shared memory exceeds the limit."""
    check_target(target, spec)
    if phase not in ("up", "down"):
        raise RenderError(f"moe_gemm: unknown GEMM phase {phase!r} (expected 'up' or 'down')")
    kin, nout, fmt = (spec.hidden, spec.inter, spec.fmt) if phase == "up" else (spec.inter, spec.hidden, spec.down_fmt)
    sb, rs = (kq_segment(fmt) if fmt in KQUANTS else 4 * BLOCK_BYTES[fmt]), row_bytes(fmt, kin)
    v = 4 if fmt in UNALIGNED_KQ else max(x for x in (16, 8, 4) if sb % x == 0 and rs % x == 0)
    rbp = _round16(sb + 4)  # + 4: the funnel reads of 17-byte blocks may touch the word after the segment
    while (rbp // 4) % 8 != 4 and target.vendor == "cuda":  # the 8 rows g of a fragment read on distinct banks
        rbp += 16  # (CUDA's mma.sync fragments; the HIP body reads by element, and Q6_K's padded tile passes 64 KiB)
    bn = spec.bn or BN
    threads = 2 * bn
    stages = spec.stages or 2
    if spec.mma == "wgmma":
        stages = 3
        stage = _round16(TM * 256 + bn * rbp)  # the bf16 activation tile, no scales
    elif spec.mma == "wgmma8":
        stages = 3
        stage = _round16(TM * 128 + TM * 4 + bn * rbp)  # the e4m3 tile and the pairs' scales
    else:
        stage = _round16(TM * x_stride(spec.xfmt) + TM * 4 + bn * rbp)
    smem = max(stages * stage, TM * (bn + 4) * 4)
    limit = SMEM_LIMIT if target.vendor == "cuda" else HIP_LDS
    if smem > limit:
        raise RenderError(f"moe_gemm {spec.short()} {phase}: needs {smem} bytes of shared memory, the limit is "
                          f"{limit} on {target.slug}")
    # up: bn / 2 intermediate columns per CTA (bn / 2 rows of W1, the same of W3); down: bn columns. I and D are
    # multiples of 128 and D of 256 at bn 256 (MoeGemmSpec), so every width divides them: no partial CTA column
    ny = spec.inter // (bn // 2) if phase == "up" else spec.hidden // bn
    nb = -(-bn * (sb // v) // threads) * v // 4  # MG_NJ loads of v bytes: MG_NB words
    grid = (ny, tile_slots(spec), 1) if spec.cols_first else (tile_slots(spec), ny, 1)
    return PhasePlan(kin, nout, fmt, rs, v, rbp, stage, smem, grid, (threads, 1, 1), nb,
                     fmt in KQUANTS and v == 4 and target.vendor == "cuda", bn, stages)


def auto_stages(fmt: str, down_fmt: str, bn: int = 0) -> int:
    """The K-step stages the prefill lowering gives a call by default (``DS4C_PREFILL_STAGES`` unset or ``auto``):
    3 when the weights of both phases are K-quants staged in 4-byte units (Q2_K, Q3_K, Q6_K: ``PhasePlan.w_async``,
    already copied by cp.async; the pipeline keeps two steps in flight: 0.89x with Q3_K at 2048 rows on an H100) at
    the 64-wide tile (``bn`` 0 / 64), else 2: the register-staged kernels, which the pipeline did not speed up (1.01x
    MXFP4), and the 128-wide tile, one CTA of 8 warps a SM, where it lost (1.17x MXFP4; docs/perf.md Optimisation
    18). CUDA's: the HIP body has the register-staged loop only (the prefill lowering gives it 2)."""
    return 3 if fmt in W_ASYNC and down_fmt in W_ASYNC and bn in (0, 64) else 2


def auto_mma(fmt: str, down_fmt: str, bn: int, stages: int, target: Target, want: str = "wgmma",
             hidden: int = 4096) -> str:
    """The up / down phases' MMA the prefill lowering gives a routed call with ``DS4C_PREFILL_MOE_MMA=want``:
    ``wgmma`` / ``wgmma8`` where they are built -- MXFP4 weights both ways, stages unset or 3, an sm_90 / sm_90a
    target (:data:`WGMMA_ARCHS`), any of their widths (:data:`WG_BNS`; 256 only when ``hidden``, the D of the call,
    is a multiple of 256); ``fp8`` for MXFP4 weights both ways on CUDA (every width and stage count); else ``sync``."""
    mx = fmt == down_fmt == "mxfp4" and target.vendor == "cuda"
    if want in WG_MMAS:
        ok = (mx and bn in (0,) + WG_BNS and stages in (0, 3) and target.arch in WGMMA_ARCHS
              and not (bn == 256 and hidden % 256))
    else:
        ok = want == "fp8" and mx
    return want if ok else "sync"


def wg_width(bn: int, hidden: int) -> int:
    """The wgmma width the prefill lowering gives a routed call asked for ``bn`` (``DS4C_PREFILL_MOE_WG_BN``): ``bn``,
    but 128 where 256 does not divide the hidden width D (the down phase's CTA columns; :class:`MoeGemmSpec` refuses
    the pair)."""
    return 128 if bn == 256 and hidden % 256 else bn


def act_form(spec: MoeGemmSpec) -> str:
    """The actq form of ``spec``'s quantized activations (``xq`` / ``hq``): ``bf16p`` (wgmma), ``e4m3s`` (``xfmt``
    e4m3) or ``f16s``; two calls of one form can share a quantized x."""
    return "bf16p" if spec.mma == "wgmma" else "e4m3s" if spec.xfmt == "e4m3" else "f16s"


def kernel_names(spec: MoeGemmSpec, target: Target) -> list[str]:
    """The launches in order: route, actq_x, up, actq_h, down, combine (:data:`KERNELS`); dense: actq_x, up,
    actq_h, down."""
    check_target(target, spec)
    return [k for k in KERNELS if k not in ("route", "combine")] if spec.dense else list(KERNELS)


def _common(spec: MoeGemmSpec) -> dict[str, Any]:
    return dict(rows=spec.rows, k=spec.k, n_experts=spec.n_experts, hidden=spec.hidden, inter=spec.inter, tm=TM,
                tiles=tile_slots(spec), dense=spec.dense, shared=spec.shared)


def _min_blocks(spec: MoeGemmSpec, pl: PhasePlan) -> int:
    """The ``__launch_bounds__`` minimum CTAs a SM: :func:`gemm.launch_min_blocks`; the wgmma kernels of 2 or 4
    warpgroups as many as the shared memory fits with :data:`WG_REGS` registers a thread (their 32 accumulator and 32
    A-fragment registers leave room; 2 CTAs of 8 warps a SM at bn 128)."""
    if spec.mma in WG_MMAS and pl.bn > 64:
        return max(1, min(SM_SMEM // (pl.smem + 1024), 65536 // (pl.block[0] * WG_REGS)))
    return launch_min_blocks(pl.block[0], pl.smem, pl.stages > 2, pl.fmt)


def _width(pl: PhasePlan, xfmt: str) -> dict[str, Any]:
    """The template's width parameters of an up / down phase: ``bn`` weight rows, ``threads`` (``2 * bn``),
    ``half`` (``bn / 2``: the W1 / W3 rows of an up CTA, its output columns), the X staging ``xch`` (16-byte chunks of
    a tile row: 16 of f16, 8 of e4m3 codes; ``xsh`` its log2), ``rstep`` (rows per pass, ``xch`` threads a row) and
    ``xi`` (passes: 16-byte registers per thread), ``e4x`` / ``xt`` (e4m3 tiles, the activation pointers' element
    type), the warp split ``wshift`` (log2 of the ``bn / 32`` warps along the weight rows) and the epilogue's shifts
    ``hshift`` / ``bshift`` (log2 of half, bn)."""
    bn = pl.bn
    threads = 2 * bn
    xch = 8 if xfmt == "e4m3" else 16
    return dict(bn=bn, threads=threads, half=bn // 2, rstep=threads // xch, xi=TM * xch // threads, xch=xch,
                xsh=xch.bit_length() - 1, e4x=xfmt == "e4m3", xt="u8" if xfmt == "e4m3" else "u16",
                wshift=(bn // 32).bit_length() - 1, hshift=(bn // 2).bit_length() - 1, bshift=bn.bit_length() - 1)


def render_moe_gemm(spec: MoeGemmSpec, target: Target, name: str | None = None) -> list[KernelSource]:
    """The kernels of ``spec`` for ``target`` in launch order (:func:`kernel_names`), named ``name + "_" +``
    the kernel (default name ``"moe_gemm_" + spec.key()``).

    Raises:
        RenderError: see :func:`plan`.
    """
    name = name or f"moe_gemm_{spec.key()}"
    wg = spec.mma in WG_MMAS
    form = act_form(spec)
    out = []
    for kn in kernel_names(spec, target):
        if kn == "actq_x":
            out.append(render_actq(f"{name}_{kn}", FAMILY, target, spec.hidden, spec.rows, form))
        elif kn == "actq_h":
            out.append(render_actq(f"{name}_{kn}", FAMILY, target, spec.inter, spec.pairs, form))
        elif kn in ("up", "down"):
            pl = plan(spec, target, kn)
            params = dict(_common(spec), kernel=kn, kin=pl.kin, nout=pl.nout, fmt_id=FMT_ID[pl.fmt],
                          kq_id=_XP_FMT_ID[pl.fmt], bb=BLOCK_BYTES.get(pl.fmt, SUPER_BYTES.get(pl.fmt, 0)),
                          sb=kq_segment(pl.fmt) if pl.fmt in KQUANTS else 0, rs=pl.rs, wrows=pl.nout, rbp=pl.rbp, v=pl.v,
                          stage_bytes=pl.stage_bytes, nb=pl.nb, w_async=pl.w_async,
                          limit=_float_literal(spec.limit),
                          stages=pl.stages, min_blocks=_min_blocks(spec, pl),
                          wg=wg, wg8=spec.mma == "wgmma8", f8=spec.mma == "fp8", prefetch=spec.prefetch,
                          cols_first=spec.cols_first,
                          matrix=HIP_MATRIX.get(target.arch, ""), **_width(pl, spec.xfmt))
            # wgmma needs sm_90a code; an sm_90 target's binaries run on Hopper only, which has it (WGMMA_ARCHS)
            tgt = make_target("sm_90a") if wg else target
            out.append(render(TEMPLATE, f"{name}_{kn}", FAMILY, tgt, params))
        else:
            out.append(render(TEMPLATE, f"{name}_{kn}", FAMILY, target, dict(_common(spec), kernel=kn)))
    return out


def launch_shapes(spec: MoeGemmSpec, target: Target) -> list[Launch]:
    """One launch per kernel of :func:`kernel_names` (dynamic shared memory only for up / down; above 48 KiB it
    needs the function attribute, ``CudaModule.function(entry, smem)``).

    Raises:
        RenderError: see :func:`plan`."""
    out = []
    for kn in kernel_names(spec, target):
        if kn == "route":
            out.append(Launch((1, 1, 1), (ROUTE_THREADS, 1, 1), 0, kernel=kn))
        elif kn == "actq_x":
            out.append(actq_launch(spec.hidden, spec.rows, target, kernel=kn))
        elif kn == "actq_h":
            out.append(actq_launch(spec.inter, spec.pairs, target, kernel=kn))
        elif kn == "combine":
            out.append(Launch((spec.hidden // 128, spec.rows, 1), (128, 1, 1), 0, kernel=kn))
        else:
            pl = plan(spec, target, kn)
            out.append(Launch(pl.grid, pl.block, pl.smem, kernel=kn))
    return out


def arg_names(spec: MoeGemmSpec | None = None) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel (of :func:`kernel_names`); ``spec`` None: the routed call
    without ``shared``."""
    if spec is not None and spec.dense:
        return {"actq_x": ["x", "xq", "xs"], "up": ["xq", "xs", "w1", "w3", "hbuf"], "actq_h": ["hbuf", "hq", "hs"],
                "down": ["hq", "hs", "w2", "out"]}
    comb = ["ids", "ybuf", "shared", "out"] if spec is not None and spec.shared else ["ids", "ybuf", "out"]
    return {"route": ["ids", "perm", "tiles"],
            "actq_x": ["x", "xq", "xs"],
            "up": ["xq", "xs", "weights", "w1", "w3", "perm", "tiles", "hbuf"],
            "actq_h": ["hbuf", "hq", "hs"],
            "down": ["hq", "hs", "w2", "perm", "tiles", "ybuf"],
            "combine": comb}


#: the arguments written by the call: workspaces, then the output
WORKSPACES = ("perm", "tiles", "xq", "xs", "hbuf", "hq", "hs", "ybuf")
DENSE_WORKSPACES = ("xq", "xs", "hbuf", "hq", "hs")


def workspaces(spec: MoeGemmSpec) -> tuple[str, ...]:
    """The workspaces of ``spec``'s call (:data:`WORKSPACES`, or :data:`DENSE_WORKSPACES`); ``out`` is the
    output (written, every element)."""
    return DENSE_WORKSPACES if spec.dense else WORKSPACES


def arg_shapes(spec: MoeGemmSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every argument of ``spec``'s call (inputs, :func:`workspaces`, ``out``: fp32 [C, D],
    bf16 [C, D] when ``dense`` or ``shared``; ``shared`` bf16 [C, D] with ``shared``)."""
    C, D, I, k, E, P = spec.rows, spec.hidden, spec.inter, spec.k, spec.n_experts, spec.pairs
    u8 = torch.uint8
    # actq form bf16p / e4m3s / f16s
    q16 = torch.bfloat16 if spec.mma == "wgmma" else torch.float8_e4m3fn if spec.xfmt == "e4m3" else torch.float16
    if spec.dense:
        return {"x": ((C, D), torch.bfloat16), "w1": ((1, I, row_bytes(spec.fmt, D)), u8),
                "w3": ((1, I, row_bytes(spec.fmt, D)), u8), "w2": ((1, D, row_bytes(spec.down_fmt, I)), u8),
                "xq": ((C, D), q16), "xs": ((C, D // 128), torch.float32),
                "hbuf": ((C, I), torch.bfloat16), "hq": ((C, I), q16), "hs": ((C, I // 128), torch.float32),
                "out": ((C, D), torch.bfloat16)}
    sh = {"shared": ((C, D), torch.bfloat16)} if spec.shared else {}
    return {**sh, "ids": ((C, k), torch.int64), "weights": ((C, k), torch.float32), "x": ((C, D), torch.bfloat16),
            "w1": ((E, I, row_bytes(spec.fmt, D)), u8), "w3": ((E, I, row_bytes(spec.fmt, D)), u8),
            "w2": ((E, D, row_bytes(spec.down_fmt, I)), u8),
            "perm": ((P,), torch.int32), "tiles": ((tile_slots(spec), 4), torch.int32),
            "xq": ((C, D), q16), "xs": ((C, D // 128), torch.float32),
            "hbuf": ((P, I), torch.bfloat16), "hq": ((P, I), q16), "hs": ((P, I // 128), torch.float32),
            "ybuf": ((C, k, D), torch.bfloat16), "out": ((C, D), torch.bfloat16 if spec.shared else torch.float32)}


def flops(spec: MoeGemmSpec) -> int:
    """Useful FLOPs: ``2 * C*k * 3 * D * I`` (gate, up, down per pair)."""
    return 2 * spec.pairs * 3 * spec.hidden * spec.inter


def expert_bytes(spec: MoeGemmSpec) -> int:
    """Stored bytes of one expert (w1 + w3 + w2)."""
    return 2 * spec.inter * row_bytes(spec.fmt, spec.hidden) + spec.hidden * row_bytes(spec.down_fmt, spec.inter)


# ------------------------------------------------------------------------------------------------ reference
def routing_tables(spec: MoeGemmSpec, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``route`` computes, in torch (CPU): ``perm`` int32 [C*k] and ``tiles`` int32 [T, 4] (module
    docstring). ids int64 [C, k] in [0, E)."""
    E = spec.n_experts
    flat = ids.reshape(-1).to(torch.int64).cpu()
    order = torch.sort(flat, stable=True).indices  # by expert, then by pair index (= row, then slot)
    perm = order.to(torch.int32)
    counts = torch.bincount(flat, minlength=E)
    tiles = torch.zeros(tile_slots(spec), 4, dtype=torch.int32)
    t, off = 0, 0
    for e in range(E):
        n = int(counts[e])
        for j in range(0, n, TM):
            tiles[t] = torch.tensor([e, off + j, min(TM, n - j), 0], dtype=torch.int32)
            t += 1
        off += n
    return perm, tiles


def reference(spec: MoeGemmSpec, x: torch.Tensor, ids: torch.Tensor | None = None,
              weights: torch.Tensor | None = None, w1: torch.Tensor | None = None, w3: torch.Tensor | None = None,
              w2: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
    """``routed_experts`` of ``x`` bf16 [C, D] with ``ids`` int64 [C, k], ``weights`` fp32 [C, k] and the stored
    weights (:func:`arg_shapes`): per row :func:`ds4c.reference.blocks.routed_sum` (``expert_ffn`` in ascending
    expert id, fp32 sum) of the dequantized experts, ``emulate = spec.act_quant``. Returns fp32 [C, D] on
    ``x``'s device; with ``spec.shared``: bf16 [C, D] ``moe_sum`` = ``bf16(that + fp32(shared))``; with
    ``spec.dense`` (``ids`` / ``weights`` ignored): bf16 [C, D], ``expert_ffn`` of expert 0 with no weight per
    row (the IR's shared expert: linear_q gate / up, swiglu, cast, linear_q down)."""
    from ds4c.reference import blocks as B

    if spec.dense:
        ws = [dequantize_weight(f, w, r, c, 0).to(x.device) for f, w, r, c in
              ((spec.fmt, w1, spec.inter, spec.hidden), (spec.fmt, w3, spec.inter, spec.hidden),
               (spec.down_fmt, w2, spec.hidden, spec.inter))]
        xb = x.to(torch.bfloat16)
        return torch.cat([B.expert_ffn(xb[i:i + 1], *ws, None, spec.limit, spec.act_quant) for i in range(x.shape[0])])

    D, I, dev = spec.hidden, spec.inter, x.device
    cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if e not in cache:
            cache[e] = tuple(dequantize_weight(f, w, r, c, e).to(dev)  # type: ignore[assignment]
                             for f, w, r, c in ((spec.fmt, w1, I, D), (spec.fmt, w3, I, D), (spec.down_fmt, w2, D, I)))
        return cache[e]

    x = x.to(torch.bfloat16)
    ids_c, wts = ids.to(torch.int64).cpu(), weights.to(torch.float32).to(dev)
    out = torch.cat([B.routed_sum(x[i:i + 1], ids_c[i], wts[i], expert, spec.limit, spec.act_quant)
                     for i in range(x.shape[0])])
    return (out + shared.to(dev).to(torch.float32)).to(torch.bfloat16) if spec.shared else out


def reference_h(spec: MoeGemmSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                w3: torch.Tensor) -> torch.Tensor:
    """The ``hbuf`` the up phase writes: bf16 [C*k, I], row ``p`` = ``bf16(weight * clamped_swiglu(g, u))`` of
    pair ``perm[p]`` (:func:`routing_tables`), with ``g``, ``u`` as ``expert_ffn`` forms them."""
    from ds4c.reference import primitives as P

    D, I = spec.hidden, spec.inter
    perm, _ = routing_tables(spec, ids)
    flat, wf = ids.reshape(-1).cpu(), weights.reshape(-1).to(torch.float32).cpu()
    out = torch.empty(spec.pairs, I, dtype=torch.bfloat16)
    ws: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for p, pair in enumerate(perm.tolist()):
        e, row = int(flat[pair]), pair // spec.k
        if e not in ws:
            ws[e] = (dequantize_weight(spec.fmt, w1, I, D, e), dequantize_weight(spec.fmt, w3, I, D, e))
        xr = x[row:row + 1].to(torch.bfloat16).cpu()
        g = P.linear_q(xr, ws[e][0], spec.act_quant).to(torch.float32)
        u = P.linear_q(xr, ws[e][1], spec.act_quant).to(torch.float32)
        out[p] = (wf[pair] * P.clamped_swiglu(g, u, spec.limit)).to(torch.bfloat16)[0]
    return out


def reference_down(spec: MoeGemmSpec, hbuf: torch.Tensor, ids: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The down phase and the combine of the reference applied to a given ``hbuf`` bf16 [C*k, I] (rows in
    :func:`routing_tables` order, e.g. the kernel's own): per pair ``y = linear_q(h, W2_e)`` (bf16), per row the
    fp32 sum in ascending expert id from 0.0. Isolates the down phase's numerics from the up phase's bf16 flips
    (one flipped h element moves every output of its pair). Returns fp32 [C, D] (CPU)."""
    from ds4c.reference import primitives as P

    D, I, k = spec.hidden, spec.inter, spec.k
    perm, _ = routing_tables(spec, ids)
    flat = ids.reshape(-1).cpu()
    y = torch.zeros(spec.pairs, D, dtype=torch.float32)
    ws: dict[int, torch.Tensor] = {}
    for p, pair in enumerate(perm.tolist()):
        e = int(flat[pair])
        if e not in ws:
            ws[e] = dequantize_weight(spec.down_fmt, w2, D, I, e)
        y[pair] = P.linear_q(hbuf[p:p + 1].to(torch.bfloat16).cpu(), ws[e], spec.act_quant).to(torch.float32)[0]
    y = y.view(spec.rows, k, D)
    out = torch.zeros(spec.rows, D, dtype=torch.float32)
    order = torch.argsort(ids.cpu(), dim=-1)
    for j in range(k):
        out += y.gather(1, order[:, j:j + 1, None].expand(spec.rows, 1, D))[:, 0]
    return out


# ------------------------------------------------------------------------------------------ random inputs
def random_routing(spec: MoeGemmSpec, generator: torch.Generator | None = None,
                   skew: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [C, k], weights fp32 [C, k]) on the CPU: distinct ids per row, uniformly random experts, or with
    ``skew`` a Zipf-like preference (expert e drawn with weight 1/(e+1)^1.2, so a few experts get many rows and
    some none); weights as the router makes them, ``s[ids] / sum * 1.5`` with ``s = sqrtsoftplus(z)``."""
    from ds4c.reference import primitives as P

    g = generator or torch.Generator().manual_seed(0)
    C, k, E = spec.rows, spec.k, spec.n_experts
    if skew:
        pw = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        ids = torch.stack([torch.multinomial(pw, k, replacement=False, generator=g) for _ in range(C)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(C)])
    s = P.sqrtsoftplus(torch.randn(C, E, generator=g) * 2.0)
    w = s.gather(-1, ids)
    return ids.to(torch.int64), (w / w.sum(-1, keepdim=True) * 1.5).to(torch.float32)


def random_inputs(spec: MoeGemmSpec, generator: torch.Generator | None = None, device: torch.device | str = "cpu",
                  skew: bool = False) -> dict[str, torch.Tensor]:
    """``x`` (bf16 N(0, 1)), ``ids``, ``weights`` (:func:`random_routing`) and random stored ``w1``, ``w3``, ``w2``
    (:func:`ds4c.runtime.families.experts.random_weight`) on ``device``; ``generator`` is a CPU generator. Dense: no
    ``ids`` / ``weights``; shared: + ``shared`` (bf16 N(0, 1) / 8, the order of a shared expert's output)."""
    from ds4c.runtime.families.experts import random_weight

    g = generator or torch.Generator().manual_seed(0)
    dev = torch.device(device)
    gd = g if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    D, I, E = spec.hidden, spec.inter, spec.n_experts
    ids, wts = random_routing(spec, g, skew)
    out = {"x": torch.randn(spec.rows, D, generator=g).to(torch.bfloat16).to(dev), "ids": ids.to(dev),
           "weights": wts.to(dev), "w1": random_weight(spec.fmt, I, D, E, gd, dev),
           "w3": random_weight(spec.fmt, I, D, E, gd, dev), "w2": random_weight(spec.down_fmt, D, I, E, gd, dev)}
    if spec.dense:
        del out["ids"], out["weights"]
    if spec.shared:
        out["shared"] = (torch.randn(spec.rows, D, generator=g) / 8).to(torch.bfloat16).to(dev)
    return out


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (fp64), infinite when ``got`` is not finite."""
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return math.inf
    return float((g - w).norm() / w.norm().clamp(min=1e-300))
