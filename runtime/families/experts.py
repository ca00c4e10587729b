"""The experts family: all routed experts and the shared expert of one MoE layer for ``q`` rows (1..5), the
fused IR op ``moe_experts`` (passes/fuse_projections.py: ``routed_experts`` + the shared expert's gate/up
GEMVs, SwiGLU, bf16 cast, down GEMV + ``moe_sum``). docs/model.md 5.2(o.5-7), 2.3 (quantized linear:
FP8 e4m3 activation quant in blocks of 128, W4A8 experts), P11 (clamped SwiGLU). Template:
``templates/experts/experts.cu.j2`` (its header describes the kernel design in detail).

Two launches (:func:`launch_shapes`), because the down projection of an expert needs its whole intermediate
``h`` (and the activation quant of ``h`` the amax of each 128-block of it), which no block of the first
launch holds:

* ``up``: grid ``(F/16, q*k + 1)``. ``blockIdx.y`` = slot ``s``: the routed slot ``(row s // k, rank s % k)``
  or the shared expert (``s = q*k``). Rows that picked the same expert share one block (the first slot
  holding it, the "owner"; the other slots' blocks return at once), so each expert's weights are streamed
  once per launch. Per block: 16 output rows of ``g = bf16(W1 . qa(x))``, ``u = bf16(W3 . qa(x))`` (fp32
  accumulate), ``h = silu(min(g, L)) * clamp(u, -L, L)`` (fp32), routed: ``h *= weight[row, k]``; stores
  ``bf16(h)`` into the scratch ``hbuf`` bf16 ``[q, k+1, F]`` (slot ``k`` = the shared expert).
* ``down``: grid ``(D/16,)``. Block ``b`` owns output dims ``16b..16b+15`` of every row: the shared expert
  first, then the distinct routed experts in ascending id, ``y_e = bf16(W2_e . qa(h_e))``; per row
  ``acc = sum of fp32(y_e)`` over its experts in ascending id, then ``out = bf16(acc + fp32(y_shared))``:
  exactly the order of :func:`ds4c.reference.blocks.routed_sum` and ``moe_sum``, with no atomics.
* with ``down_split`` G > 1 (many distinct experts: decode lanes of several sequences), ``down`` has grid
  ``(D/16, G)``: block ``(b, g)`` runs the g-th of G contiguous runs of those jobs and writes each ``y_e`` to
  the workspace ``ybuf`` bf16 ``[q, k+1, D]``; a third launch ``sum`` (templates/experts/sum.cu.j2) adds each
  row's ``y_e`` in ascending id, then the shared expert's: the same additions in the same order, bit for bit.

Engines (``ExpertsSpec.engine``): ``mma`` (CUDA only, ``mma.sync`` m16n8k16). On sm_89+ with ``act_quant``:
MXFP4 / Q8_0 weights as exact f16 (MXFP4 through e4m3 codes and ``cvt.f16x2.e4m3x2``, Q8_0 through the
``0x6400`` magic) times the activation's e4m3 values held once as f16; per 32-block the fp32 product is
scaled by the block's weight scale, summed per 128-block, then times the activation scale (spec 2.3.3).
Hopper's ``mma.sync`` has no fp8 form (ptxas lowers an e4m3 ``mma.sync`` to these f16 MMAs, converting the
activations again for every tile). BF16 weights, ``act_quant`` off, or sm_80: m16n8k16 bf16 with the
activation's exact bf16 value. ``simt``: fp32 FMAs, the vendor-neutral body the HIP builds use (the GPU check
runs it on CUDA too so the HIP body is validated). ``auto`` = ``mma`` on CUDA, ``simt`` on HIP.

Resources (nvcc 13, sm_90, official shapes): 128 threads per block; ~168 registers (``__launch_bounds__``
with 3 blocks per SM), dynamic shared memory 30-63 KB (up) / 26-44 KB (down) for q = 1..5, no spills.

Kernel arguments, in order (:func:`arg_names`, shapes :func:`arg_shapes`):

* up: ``x`` bf16 [q, D], ``ids`` int64 [q, k], ``weights`` fp32 [q, k], ``w1``, ``w3`` routed [E, F, D],
  ``sh_w1``, ``sh_w3`` shared [F, D], ``hbuf`` bf16 [q, k+1, F] (written).
* down: ``hbuf``, ``ids``, ``w2`` routed [E, D, F], ``sh_w2`` shared [D, F], ``out`` bf16 [q, D] (written).

Weights are the raw stored bytes (docs/gguf-layout.md): ``mxfp4`` uint8 rows of ``in/32*17`` bytes (e8m0
byte, 16 bytes of nibbles: byte j = element j low, j+16 high), ``q8_0`` rows of ``in/32*34`` bytes (fp16 d,
32 int8), ``bf16`` rows of ``in`` bf16. Expert tensors are consecutive experts. ``ids`` and ``weights`` come
from device memory (the router kernel's outputs), never by value, so a captured graph replays with new
routing. All pointers 16-byte aligned and contiguous. Expert ids of one row must be distinct (top-k and
``tid2eid`` give distinct ids) and in ``[0, E)``.

Numerics vs :func:`reference` (``ds4c.reference.blocks.routed_sum`` + ``expert_ffn`` on the dequantized
weights): the same operands and roundings (bf16 g, u, h, y_e; fp32 SwiGLU and routing weight; ordered fp32
sums); only fp32 summation orders inside the GEMVs differ (and the Hopper FP8 MMA's internal accumulation
inside one 32-block), so a bf16 intermediate can round the other way: outputs agree to ~1e-2 relative.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ds4c.quant import SUPER_BLOCKS
from ds4c.runtime.render import KernelSource, RenderError, render, resolve_mma_engine
from ds4c.runtime.families import Launch
from ds4c.runtime.families.actq import actq_launch, render_actq
from ds4c.runtime.targets import Target

TEMPLATE = "experts/experts.cu.j2"
SUM_TEMPLATE = "experts/sum.cu.j2"
FAMILY = "experts"
#: llama.cpp's K-quants and IQ4_XS: super-blocks of 256 values (layouts in ds4c.quant and the template's
#: ``ds4c_kq`` decoder, templates/prelude/kquant.h.j2)
KQUANTS = tuple(sb.name for sb in SUPER_BLOCKS.values())  # q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs
FORMATS = ("mxfp4", "q8_0", "bf16") + KQUANTS
#: the template's format ids (``XpGeo::FMT``; the K-quant decoder switches on 3..8 in this order)
FMT_ID = {"mxfp4": 0, "q8_0": 1, "bf16": 2, "q2_k": 3, "q3_k": 4, "q4_k": 5, "q5_k": 6, "q6_k": 7, "iq4_xs": 8}
#: values of one stored block (32; a K-quant super-block holds 256)
BLOCK_VALUES = {"mxfp4": 32, "q8_0": 32, "bf16": 32, **{sb.name: sb.values for sb in SUPER_BLOCKS.values()}}
#: bytes of one stored block
BLOCK_BYTES = {"mxfp4": 17, "q8_0": 34, "bf16": 64, **{sb.name: sb.nbytes for sb in SUPER_BLOCKS.values()}}
#: blocks per streamed chunk row (about 256-272 bytes per row segment; K-quants: two super-blocks, 168-352
#: bytes; Q3_K and Q6_K one, of 110 / 210 bytes: their decode needs the registers)
CHUNK_BLOCKS = {"mxfp4": 16, "q8_0": 8, "bf16": 4, **{f: 2 for f in KQUANTS}, "q3_k": 1, "q6_k": 1}
#: K-quant random weights (:func:`random_weight`): (a, byte offsets of the fp16 d / dmin in the super-block)
KQ_SCALE = {"q2_k": (1e-3, (80, 82)), "q3_k": (1e-4, (108,)), "q4_k": (1e-4, (0, 2)), "q5_k": (5e-5, (0, 2)),
            "q6_k": (1e-5, (208,)), "iq4_xs": (1e-5, (0,))}
ENGINES = ("auto", "mma", "simt")
PHASES = ("up", "down")
ROWS_PER_BLOCK = 16
MAX_WARPS = 4
MAX_Q = 8
#: most job groups of the down phase (ExpertsSpec.down_split)
MAX_SPLIT = 64
#: threads of a ``sum`` block (down_split > 1): one output element each
SUM_THREADS = 128
#: registers per thread the CUDA build may use (``__launch_bounds__`` min blocks = 64K / (threads * this));
#: the prefetch buffers alone take ~72
REG_BUDGET = 168
#: ... with a K-quant in the phase: its decode (packed 6-bit scales, high-bit planes, sign extension) and the
#: 4-byte loads of Q3_K / Q6_K chunks need more (2 blocks per SM)
REG_BUDGET_KQ = 255
#: dynamic shared memory a block may use (CUDA sm_90 opt-in maximum; HIP LDS per workgroup)
SMEM_LIMIT = {"cuda": 227 * 1024, "hip": 64 * 1024}
#: CUDA archs with cvt.f16x2.e4m3x2 (sm_89+): the f16-MMA path with e4m3 activations
E4M3_ARCHS = ("sm_90", "sm_90a", "sm_100a")
#: weight tiles in flight per warp in the cp.async ring when :func:`plan` chooses it. Measured on the H200
#: (docs/perf.md, Optimisation 5, official shapes q = 1..5): 2 stages was the fastest depth at every q, each
#: further stage slower (fewer resident blocks, and the phases are bound by the latency of their instruction
#: stream, not by the bytes in flight)
RING_STAGES = 2
MAX_STAGES = 8
#: shared memory of one SM (CUDA sm_90: 228 KB, of which 1 KB per resident block is the driver's)
SMEM_SM_BYTES = 228 * 1024
SMEM_BLOCK_RESERVED = 1024
#: multiprocessors the stage choice plans for (an H200 / H100 SXM has 132): only how many blocks of a small grid
#: share an SM depends on it
PLAN_SMS = 132


def _float_literal(x: float) -> str:
    """C hex literal of fp32(x), exact."""
    return float(torch.tensor(x, dtype=torch.float32)).hex() + "f"


def row_bytes(fmt: str, n_in: int) -> int:
    """Bytes of one stored weight row of ``n_in`` values."""
    return n_in // BLOCK_VALUES[fmt] * BLOCK_BYTES[fmt]


@dataclass(frozen=True)
class ExpertsSpec:
    """One ``moe_experts`` call (all render-time).

    Attributes:
        q: rows (verify width, 1..5; up to 8 supported).
        hidden: D (4096 official, 256 tiny).
        inter: F, the expert intermediate width (2048 official, 128 tiny).
        k: routed experts per row (6 official, 4 tiny).
        n_experts: E (256 official, 16 tiny).
        routed_fmt: storage of the routed experts' gate/up (w1, w3): ``mxfp4`` (official GGUF files) |
            ``q8_0`` | ``bf16`` | a K-quant (``q2_k`` .. ``q6_k``, ``iq4_xs``; rows must be multiples of 256).
        shared_fmt: storage of the shared expert's gate/up: ``q8_0`` (official GGUF files) | any of the above.
        down_fmt: storage of the routed experts' down projection (w2); None = ``routed_fmt``. llama.cpp's
            quantizer often gives ffn_down another type than gate/up, and a K-quant model whose F is not a
            multiple of 256 stores w2 in Q8_0.
        shared_down_fmt: storage of the shared expert's down projection; None = ``shared_fmt``.
        act_quant: FP8 activation quant of x and h (spec 2.3.1; the reference's ``emulate``).
        limit: SwiGLU clamp (P11; 10.0).
        engine: ``auto`` | ``mma`` | ``simt`` (module docstring).
        stages: weight chunks each warp keeps in flight through a ``cp.async`` ring in shared memory (CUDA
            ``mma`` engine, geometries of 16-byte aligned chunks: the official MXFP4 / Q8_0 shapes, Q4_K, Q5_K,
            IQ4_XS): None = chosen by :func:`plan` (:data:`RING_STAGES` for MXFP4 / Q8_0 / BF16 phases where the
            ring keeps at least as many blocks per SM as the register path: it frees the prefetch registers,
            but its tiles take shared memory; K-quants keep the register path, the ring measured slower there),
            0 = the register double buffer (also every geometry the ring cannot stream, and HIP), 2..8 = that
            many.
        prequant: quantize x and h once per launch (``templates/actq``, form ``f16s``: the e4m3 values as f16 and
            the per-128 scales) instead of in every block of the phase that reads them (the up phase's 128 x
            (q*k+1) blocks re-quantize x for their K range; each of the down phase's D/16 blocks re-quantizes every
            job's h). Four launches then: ``actq_x``, ``up``, ``actq_h``, ``down`` (:func:`launch_shapes`), the same
            values (spec 2.3.1 in one place per launch). Only where every phase reads the form-0 activation
            (CUDA's mma engine on sm_89+, MXFP4 / Q8_0 / K-quant weights, ``act_quant``); elsewhere it is off.
            False here; the lowering turns it on (runtime/lower_step.py, :func:`ds4c.settings.experts_prequant`: measured on the H200,
            experts q = 5 357 -> 160 us, q = 1 85 -> 77 us, docs/perf.md Optimisation 6).
        down_split: job groups of the down phase. 1: each of its D/16 blocks runs the shared expert and every
            distinct routed expert one after another (two launches, or four with ``prequant``). G > 1: grid
            (D/16, G), block (b, g) runs the g-th of G contiguous runs of the jobs (the shared expert first, then
            the routed ones in ascending id) and writes each ``y_e`` (bf16) to the workspace ``ybuf`` bf16
            [q, k+1, D]; a third launch ``sum`` adds each row's ``y_e`` in ascending expert id, then the shared
            expert's: the same operations in the same order as one block, bit for bit. For many distinct
            experts (the decode lanes of several sequences: up to q k of them) one block per 16 output dims
            walks every expert's 16 rows in turn; the groups spread them over the SMs.

    Raises:
        RenderError: a field out of range (the message names it).
    """

    q: int
    hidden: int = 4096
    inter: int = 2048
    k: int = 6
    n_experts: int = 256
    routed_fmt: str = "mxfp4"
    shared_fmt: str = "q8_0"
    act_quant: bool = True
    limit: float = 10.0
    engine: str = "auto"
    down_fmt: str | None = None
    shared_down_fmt: str | None = None
    stages: int | None = None
    prequant: bool = False
    down_split: int = 1

    def __post_init__(self) -> None:
        if self.down_fmt is None:
            object.__setattr__(self, "down_fmt", self.routed_fmt)
        if self.shared_down_fmt is None:
            object.__setattr__(self, "shared_down_fmt", self.shared_fmt)
        bad = []
        if not (isinstance(self.q, int) and 1 <= self.q <= MAX_Q):
            bad.append(f"q {self.q!r} (expected 1..{MAX_Q})")
        for name in ("hidden", "inter"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 128 and v % 128 == 0):
                bad.append(f"{name} {v!r} (expected a positive multiple of 128)")
        if not (isinstance(self.n_experts, int) and self.n_experts >= 1):
            bad.append(f"n_experts {self.n_experts!r} (expected >= 1)")
        if not (isinstance(self.k, int) and 1 <= self.k <= max(1, self.n_experts if isinstance(self.n_experts, int) else 1)):
            bad.append(f"k {self.k!r} (expected 1..n_experts)")
        for name, dims in (("routed_fmt", ("hidden",)), ("shared_fmt", ("hidden",)), ("down_fmt", ("inter",)),
                           ("shared_down_fmt", ("inter",))):
            f = getattr(self, name)
            if f not in FORMATS:
                bad.append(f"{name} {f!r} (expected one of {FORMATS})")
                continue
            for dim in dims:
                v = getattr(self, dim)
                if isinstance(v, int) and v % BLOCK_VALUES[f]:
                    bad.append(f"{name} {f} with {dim} {v} (rows of {f} are multiples of {BLOCK_VALUES[f]} values)")
        if self.stages is not None and not (isinstance(self.stages, int) and not isinstance(self.stages, bool)
                                            and (self.stages == 0 or 2 <= self.stages <= MAX_STAGES)):
            bad.append(f"stages {self.stages!r} (expected None, 0 or 2..{MAX_STAGES})")
        if not isinstance(self.prequant, bool):
            bad.append(f"prequant {self.prequant!r} (expected a bool)")
        if isinstance(self.down_split, bool) or not isinstance(self.down_split, int) or \
                not 1 <= self.down_split <= MAX_SPLIT:
            bad.append(f"down_split {self.down_split!r} (expected 1..{MAX_SPLIT})")
        if self.engine not in ENGINES:
            bad.append(f"engine {self.engine!r} (expected one of {ENGINES})")
        if not (isinstance(self.limit, (int, float)) and math.isfinite(self.limit) and self.limit > 0):
            bad.append(f"limit {self.limit!r} (expected a positive finite float)")
        if bad:
            raise RenderError("ExpertsSpec: bad " + "; ".join(bad))

    @property
    def slots(self) -> int:
        """Routed slots ``q * k``."""
        return self.q * self.k

    def key(self) -> str:
        """Short name of the kernel variant (without the engine)."""
        down = ("" if self.down_fmt == self.routed_fmt else f"_dn{self.down_fmt}") + \
            ("" if self.shared_down_fmt == self.shared_fmt else f"_shdn{self.shared_down_fmt}")
        return (f"q{self.q}_d{self.hidden}_f{self.inter}_k{self.k}_e{self.n_experts}_{self.routed_fmt}_"
                f"{self.shared_fmt}{down}{'' if self.act_quant else '_noaq'}"
                + ("" if self.limit == 10.0 else f"_l{self.limit:g}".replace(".", "p"))
                + ("" if self.stages is None else f"_st{self.stages}") + ("_pq" if self.prequant else "")
                + ("" if self.down_split == 1 else f"_ds{self.down_split}"))

    def short(self) -> str:
        return (f"q={self.q} D={self.hidden} F={self.inter} E={self.n_experts} k={self.k} "
                f"{self.routed_fmt}/{self.shared_fmt}" + ("" if self.down_fmt == self.routed_fmt else f" down {self.down_fmt}")
                + ("" if self.shared_down_fmt == self.shared_fmt else f" shared down {self.shared_down_fmt}")
                + ("" if self.act_quant else " noaq"))


def resolve_engine(spec: ExpertsSpec, target: Target) -> str:
    """``mma`` or ``simt`` for ``target`` (:func:`ds4c.runtime.render.resolve_mma_engine`).

    Raises:
        RenderError: ``mma`` asked for a HIP target.
    """
    return resolve_mma_engine(spec.engine, target, "experts")


@dataclass(frozen=True)
class _Geo:
    fmt: int
    bb: int
    ch: int
    v: int
    rb: int
    rbp: int
    rs: int
    form: int
    nj: int
    vb: int
    rbl: int
    mis: int


@dataclass(frozen=True)
class PhasePlan:
    """Render-time geometry of one phase: ``nw`` warps per block, each owning ``kw`` of the reduction length
    ``kin``; per slot class (routed, shared) the chunk geometry; shared-memory layout (bytes) and launch."""

    phase: str
    kin: int
    nout: int
    nw: int
    kw: int
    geos: tuple[_Geo, _Geo]
    stages: int
    nb: int
    ast16: int
    act_wb: int
    tile_wb: int
    off_extra: int
    smem: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _geo(fmt: str, kin: int, kw: int, e4m3: bool, act_quant: bool, cap: int = 16) -> _Geo:
    bb, vb = BLOCK_BYTES[fmt], BLOCK_VALUES[fmt]
    nkb = kw // vb
    ch = max(c for c in (16, 8, 4, 2, 1) if c <= min(cap, CHUNK_BLOCKS[fmt]) and nkb % c == 0)
    rb, rs = ch * bb, row_bytes(fmt, kin)
    # chunks or rows not a multiple of 4 bytes (Q3_K / Q6_K super-blocks are 110 / 210): stream the u32s
    # covering each chunk row (every address is even, so 2 more bytes) and let the kernel find its start
    mis = int(rb % 4 != 0 or rs % 4 != 0)
    rbl = rb + 2 + (-(rb + 2)) % 4 if mis else rb
    v = 4 if mis else max(v for v in (16, 8, 4) if rb % v == 0 and rs % v == 0)
    # padded row stride of the shared tile: 16-byte multiple, bank-conflict-free fragment reads
    want = (16, 8) if fmt == "bf16" else (8, 4)
    rbp = _round16(rbl)
    while (rbp // 4) % want[0] != want[1]:
        rbp += 16
    # form 0: f16 activations + per-128 scale (the f16 MMA on MXFP4 / Q8_0 with act_quant, sm_89+: MXFP4 needs
    # the e4m3 -> f16 cvt); form 1: bf16 activations (bf16 MMA, SIMT)
    form = 0 if (e4m3 and fmt != "bf16" and act_quant) else 1
    nj = -(-(16 * rbl // v) // 32)
    return _Geo(FMT_ID[fmt], bb, ch, v, rb, rbp, rs, form, nj, vb, rbl, mis)


def plan(spec: ExpertsSpec, target: Target, phase: str) -> PhasePlan:
    """The geometry of ``phase`` (``up`` | ``down``) on ``target``.

    Raises:
        RenderError: unknown phase, ``mma`` on HIP, or the shared memory exceeds the target's limit.
    """
    if phase not in PHASES:
        raise RenderError(f"experts: unknown phase {phase!r} (expected one of {PHASES})")
    engine = resolve_engine(spec, target)
    e4m3 = engine == "mma" and target.arch in E4M3_ARCHS
    kin, nout = (spec.hidden, spec.inter) if phase == "up" else (spec.inter, spec.hidden)
    routed = spec.routed_fmt if phase == "up" else spec.down_fmt
    shared = spec.shared_fmt if phase == "up" else spec.shared_down_fmt
    unit = max(128, BLOCK_VALUES[routed], BLOCK_VALUES[shared])  # a warp's K range holds whole blocks
    nw = max(w for w in (4, 2, 1) if w <= MAX_WARPS and kin % (unit * w) == 0)
    kw = kin // nw
    lim = SMEM_LIMIT[target.vendor]
    for cap in (16, 1):  # K-quant chunks of two super-blocks can overflow HIP's 64 KB: then one per chunk
        pl = _plan_with(spec, target, phase, engine, e4m3, kin, nout, nw, kw, routed, shared, cap, 0)
        if pl.smem > lim:
            continue
        if engine != "mma" or not all(g.v == 16 and not g.mis for g in pl.geos) or spec.stages == 0:
            return pl
        if spec.stages is not None:
            pl = _plan_with(spec, target, phase, engine, e4m3, kin, nout, nw, kw, routed, shared, cap, spec.stages)
            if pl.smem > lim:
                raise RenderError(f"experts {phase} for {spec.short()} on {target.slug}: {spec.stages} stages need "
                                  f"{pl.smem} bytes of shared memory, the limit is {lim}")
            return pl
        if _reg_budget(spec, phase) == REG_BUDGET_KQ:  # K-quants: the ring was slower at 3-5 stages, 2 not measured
            return pl
        ring = _plan_with(spec, target, phase, engine, e4m3, kin, nout, nw, kw, routed, shared, cap, RING_STAGES)
        if ring.smem <= lim and _blocks_per_sm(spec, phase, ring) >= _blocks_per_sm(spec, phase, pl):
            return ring
        return pl
    raise RenderError(f"experts {phase} for {spec.short()} on {target.slug}: needs {pl.smem} bytes of shared memory, "
                      f"the limit is {lim}")


def _blocks_per_sm(spec: ExpertsSpec, phase: str, pl: PhasePlan) -> int:
    """Blocks of ``pl`` one SM holds at once: shared memory, the register budget, and the grid (a grid under
    :data:`PLAN_SMS` x n blocks gives each SM fewer)."""
    by_smem = SMEM_SM_BYTES // (pl.smem + SMEM_BLOCK_RESERVED)
    by_regs = 65536 // (pl.block[0] * (_reg_budget(spec, phase) if not pl.stages or
                                       _reg_budget(spec, phase) == REG_BUDGET_KQ else 128))
    by_grid = -(-pl.grid[0] * pl.grid[1] // PLAN_SMS)
    return max(0, min(by_smem, by_regs, by_grid, 4))


def _plan_with(spec: ExpertsSpec, target: Target, phase: str, engine: str, e4m3: bool, kin: int, nout: int, nw: int,
               kw: int, routed: str, shared: str, cap: int, stages: int) -> PhasePlan:
    geos = (_geo(routed, kin, kw, e4m3, spec.act_quant, cap), _geo(shared, kin, kw, e4m3, spec.act_quant, cap))
    if engine == "simt":
        assert all(g.form == 1 for g in geos)
    nb = max(g.nj * g.v // 4 for g in geos)
    q = spec.q
    ast16 = 2 * kw + 32
    act = 0
    if any(g.form == 0 for g in geos):  # f16 values + fp32 scale per 128-block
        act = max(act, q * ast16 + q * (kw // 128) * 4)
    if any(g.form == 1 for g in geos):  # bf16 values
        act = max(act, q * ast16)
    act_wb = _round16(act)
    tile_wb = _round16(ROWS_PER_BLOCK * max(g.rbp for g in geos))
    pbuf = (2 * nw * 128 * 4)  # up: [NW][2 mats][16][8]; down: [2 parities][NW][16][8]
    off_extra = nw * act_wb + nw * tile_wb * max(1, stages) + pbuf
    extra = 0 if phase == "up" else (5 * spec.slots + 1) * 4 + 2 * q * 16 * 4
    smem = _round16(off_extra + extra)
    if phase == "up":
        grid = (spec.inter // ROWS_PER_BLOCK, spec.slots + 1, 1)
    else:
        grid = (spec.hidden // ROWS_PER_BLOCK, spec.down_split, 1)
    return PhasePlan(phase, kin, nout, nw, kw, geos, stages, nb, ast16, act_wb, tile_wb, off_extra, smem, grid,
                     (nw * 32, 1, 1))


def _params(spec: ExpertsSpec, target: Target, phase: str) -> dict[str, Any]:
    pl = plan(spec, target, phase)
    return dict(phase=phase, q=spec.q, topk=spec.k, hidden=spec.hidden, inter=spec.inter, kin=pl.kin, nw=pl.nw,
                act_quant=spec.act_quant, mma=resolve_engine(spec, target) == "mma",
                limit=_float_literal(spec.limit), nb=pl.nb, ast16=pl.ast16, act_wb=pl.act_wb,
                tile_wb=pl.tile_wb, off_extra=pl.off_extra, smem=pl.smem,
                geos=[asdict(g) for g in pl.geos], n_experts=spec.n_experts, stages=pl.stages,
                min_blocks=_min_blocks(spec, phase, pl), prequant=uses_prequant(spec, target), split=spec.down_split)


def uses_prequant(spec: ExpertsSpec, target: Target) -> bool:
    """Whether ``spec`` runs with its activations quantized once per launch on ``target``: ``spec.prequant`` and
    every phase's weights read the form-0 activation (the e4m3 values as f16 and per-128 scales)."""
    return spec.prequant and all(g.form == 0 for ph in PHASES for g in plan(spec, target, ph).geos)


def _min_blocks(spec: ExpertsSpec, phase: str, pl: PhasePlan) -> int:
    """``__launch_bounds__``' blocks per SM: the register budget's (168 registers: 3 blocks; a K-quant's 255:
    2); with the cp.async ring (no prefetch registers) as many as the shared memory holds, up to 4 (128
    registers)."""
    regs = max(1, min(4, 65536 // (pl.block[0] * _reg_budget(spec, phase))))
    if not pl.stages:
        return regs
    by_smem = SMEM_SM_BYTES // (pl.smem + SMEM_BLOCK_RESERVED)
    cap = regs if _reg_budget(spec, phase) == REG_BUDGET_KQ else 4
    return max(1, min(cap, by_smem))


def _reg_budget(spec: ExpertsSpec, phase: str) -> int:
    """Registers per thread the CUDA build of ``phase`` may use (:data:`REG_BUDGET`, :data:`REG_BUDGET_KQ`)."""
    fmts = (spec.routed_fmt, spec.shared_fmt) if phase == "up" else (spec.down_fmt, spec.shared_down_fmt)
    return REG_BUDGET_KQ if any(f in KQUANTS for f in fmts) else REG_BUDGET


def _actq_rows(spec: ExpertsSpec, kernel: str) -> int:
    """Rows of a prequant call's activation quant launch: x's q, or h's q (k + 1) (routed slots + shared)."""
    return spec.q if kernel == "actq_x" else spec.q * (spec.k + 1)


def kernel_names(spec: ExpertsSpec, target: Target) -> list[str]:
    """The call's kernels in launch order: ``up``, ``down``; with :func:`uses_prequant` ``actq_x``, ``up``,
    ``actq_h``, ``down``; then ``sum`` when ``down_split > 1``."""
    names = ["actq_x", "up", "actq_h", "down"] if uses_prequant(spec, target) else list(PHASES)
    return names + (["sum"] if spec.down_split > 1 else [])


def render_experts(spec: ExpertsSpec, target: Target, name: str | None = None) -> list[KernelSource]:
    """The kernels of ``spec`` for ``target`` in launch order (:func:`kernel_names`), named ``name + "_" +``
    the kernel (default name ``"experts_" + spec.key() + "_" + engine``).

    Raises:
        RenderError: see :func:`plan`.
    """
    engine = resolve_engine(spec, target)
    name = name or f"experts_{spec.key()}_{engine}"
    out = []
    for kn in kernel_names(spec, target):
        if kn.startswith("actq_"):
            k = spec.hidden if kn == "actq_x" else spec.inter
            out.append(render_actq(f"{name}_{kn}", FAMILY, target, k, _actq_rows(spec, kn)))
        elif kn == "sum":
            out.append(render(SUM_TEMPLATE, f"{name}_{kn}", FAMILY, target,
                              dict(topk=spec.k, hidden=spec.hidden, threads=SUM_THREADS)))
        else:
            out.append(render(TEMPLATE, f"{name}_{kn}", FAMILY, target, _params(spec, target, kn)))
    return out




def launch_shapes(spec: ExpertsSpec, target: Target) -> list[Launch]:
    """One launch per kernel of :func:`kernel_names`, to be launched in that order on one stream (an ``actq_*``
    launch: :func:`~ds4c.runtime.families.actq.actq_launch`, at a step's q or q (k + 1) rows the ``block`` layout,
    grid ``(K / 128, rows)``, 128 threads, no dynamic shared memory)."""
    out = []
    for kn in kernel_names(spec, target):
        if kn.startswith("actq_"):
            out.append(actq_launch(spec.hidden if kn == "actq_x" else spec.inter, _actq_rows(spec, kn), target,
                                   kernel=kn))
        elif kn == "sum":
            out.append(Launch((spec.hidden // SUM_THREADS, spec.q, 1), (SUM_THREADS, 1, 1), 0, kernel=kn))
        else:
            pl = plan(spec, target, kn)
            out.append(Launch(pl.grid, pl.block, pl.smem, kernel=kn))
    return out


def arg_names(spec: ExpertsSpec, target: Target | None = None) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel (with ``target``: of the kernels :func:`kernel_names` gives;
    without, as ``spec.prequant`` asks)."""
    dst = "ybuf" if spec.down_split > 1 else "out"  # the split down phase writes each y_e, ``sum`` adds them
    if not (uses_prequant(spec, target) if target is not None else spec.prequant):
        names = {"up": ["x", "ids", "weights", "w1", "w3", "sh_w1", "sh_w3", "hbuf"],
                 "down": ["hbuf", "ids", "w2", "sh_w2", dst]}
    else:
        names = {"actq_x": ["x", "xq", "xs"],
                 "up": ["xq", "xs", "ids", "weights", "w1", "w3", "sh_w1", "sh_w3", "hbuf"],
                 "actq_h": ["hbuf", "hq", "hs"],
                 "down": ["hq", "hs", "ids", "w2", "sh_w2", dst]}
    if spec.down_split > 1:
        names["sum"] = ["ybuf", "ids", "out"]
    return names


def weight_shape(fmt: str, rows: int, n_in: int, experts: int | None = None) -> tuple[tuple[int, ...], torch.dtype]:
    """Storage shape and dtype of a weight of ``rows`` x ``n_in`` (``experts`` consecutive ones if given):
    uint8 rows of :func:`row_bytes` for the block formats, bf16 ``[.., rows, n_in]`` for ``bf16``."""
    lead = () if experts is None else (experts,)
    if fmt == "bf16":
        return lead + (rows, n_in), torch.bfloat16
    return lead + (rows, row_bytes(fmt, n_in)), torch.uint8


def arg_shapes(spec: ExpertsSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every argument."""
    q, D, F, k, E = spec.q, spec.hidden, spec.inter, spec.k, spec.n_experts
    return {"x": ((q, D), torch.bfloat16), "ids": ((q, k), torch.int64), "weights": ((q, k), torch.float32),
            "w1": weight_shape(spec.routed_fmt, F, D, E), "w3": weight_shape(spec.routed_fmt, F, D, E),
            "w2": weight_shape(spec.down_fmt, D, F, E), "sh_w1": weight_shape(spec.shared_fmt, F, D),
            "sh_w3": weight_shape(spec.shared_fmt, F, D), "sh_w2": weight_shape(spec.shared_down_fmt, D, F),
            "hbuf": ((q, k + 1, F), torch.bfloat16), "out": ((q, D), torch.bfloat16),
            # prequant's workspaces: the e4m3 values as f16 and the per-128 scales of x and h
            "xq": ((q, D), torch.float16), "xs": ((q, D // 128), torch.float32),
            "hq": ((q, k + 1, F), torch.float16), "hs": ((q, k + 1, F // 128), torch.float32),
            # down_split > 1: each row's y_e per routed slot and the shared expert's, before ``sum``
            "ybuf": ((q, k + 1, D), torch.bfloat16)}


def expert_bytes(spec: ExpertsSpec, fmt: str | None = None) -> int:
    """Stored bytes of one expert (w1 + w3 + w2) all in ``fmt``; default: a routed expert (w1, w3 in
    ``routed_fmt``, w2 in ``down_fmt``)."""
    up, down = (fmt, fmt) if fmt else (spec.routed_fmt, spec.down_fmt)
    return 2 * spec.inter * row_bytes(up, spec.hidden) + spec.hidden * row_bytes(down, spec.inter)


def bytes_read(spec: ExpertsSpec, ids: torch.Tensor) -> int:
    """Expert weight bytes one call streams: each distinct routed expert once, plus the shared expert."""
    n = int(torch.unique(ids.reshape(-1)).numel())
    shared = 2 * spec.inter * row_bytes(spec.shared_fmt, spec.hidden) + spec.hidden * row_bytes(spec.shared_down_fmt, spec.inter)
    return n * expert_bytes(spec) + shared


# ------------------------------------------------------------------------------------------------ reference
def _flat_bytes(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.uint8).reshape(-1)


def dequantize_weight(fmt: str, raw: torch.Tensor, rows: int, n_in: int, e: int | None = None) -> torch.Tensor:
    """fp32 ``[rows, n_in]`` of stored weight bytes ``raw`` (expert ``e`` of consecutive experts if given),
    through :func:`ds4c.quant.dequantize` (bit-identical to gguf's dequantizers)."""
    from ds4c import quant

    b = _flat_bytes(raw)
    n = quant.nbytes(quant.GGMLType[fmt.upper()], (rows, n_in))
    if e is not None:
        b = b[e * n:(e + 1) * n]
    return quant.dequantize(b, quant.GGMLType[fmt.upper()], (rows, n_in))


def reference(spec: ExpertsSpec, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
              w3: torch.Tensor, w2: torch.Tensor, sh_w1: torch.Tensor, sh_w3: torch.Tensor,
              sh_w2: torch.Tensor) -> torch.Tensor:
    """``moe_experts`` of ``x`` bf16 [q, D] with ``ids`` int64 [q, k], ``weights`` fp32 [q, k] and the raw
    stored weights (shapes :func:`arg_shapes`): per row :func:`ds4c.reference.blocks.routed_sum` of the
    dequantized experts, plus the shared expert (:func:`~ds4c.reference.blocks.expert_ffn`, no weight),
    combined as ``moe_sum``: ``bf16(routed_fp32 + fp32(shared))``. Computed on ``x``'s device (the weights
    are dequantized per used expert on their own device, then moved). Returns bf16 [q, D]."""
    from ds4c.reference import blocks as B

    D, F, dev = spec.hidden, spec.inter, x.device
    cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if e not in cache:
            cache[e] = tuple(dequantize_weight(f, w, r, c, e).to(dev)  # type: ignore[assignment]
                             for f, w, r, c in ((spec.routed_fmt, w1, F, D), (spec.routed_fmt, w3, F, D),
                                                (spec.down_fmt, w2, D, F)))
        return cache[e]

    x = x.to(torch.bfloat16)
    ids_c, wts = ids.to(torch.int64).cpu(), weights.to(torch.float32).to(dev)
    routed = torch.cat([B.routed_sum(x[i:i + 1], ids_c[i], wts[i], expert, spec.limit, spec.act_quant)
                        for i in range(x.shape[0])])
    sh = [dequantize_weight(f, w, r, c).to(dev) for f, w, r, c in ((spec.shared_fmt, sh_w1, F, D),
                                                                    (spec.shared_fmt, sh_w3, F, D),
                                                                    (spec.shared_down_fmt, sh_w2, D, F))]
    ys = B.expert_ffn(x, sh[0], sh[1], sh[2], None, spec.limit, spec.act_quant)
    return (routed + ys.to(torch.float32)).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------ random inputs
def random_weight(fmt: str, rows: int, n_in: int, experts: int | None = None,
                  generator: torch.Generator | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random valid stored bytes: ``mxfp4`` random nibbles with exponent bytes 118..124 (values up to 0.75);
    ``q8_0`` random int8 with fp16 scales in [1e-3, 1e-2); ``bf16`` values ~N(0, 0.05); K-quants: every byte
    random (codes, packed sub-block scales and mins, high-bit planes) except the fp16 super-block scales
    ``d`` (and ``dmin``), uniform in [a, 10a) with ``a`` (:data:`KQ_SCALE`) keeping values within ~±1.
    Generated on ``device`` (``generator`` must live there)."""
    shape, _ = weight_shape(fmt, rows, n_in, experts)
    nblk = math.prod(shape[:-1]) * (n_in // BLOCK_VALUES[fmt])
    if fmt in KQUANTS:
        b = torch.randint(0, 256, (nblk, BLOCK_BYTES[fmt]), generator=generator, device=device, dtype=torch.uint8)
        a, offs = KQ_SCALE[fmt]
        for o in offs:
            d = ((torch.rand(nblk, generator=generator, device=device) * 9 + 1) * a).to(torch.float16)
            b[:, o:o + 2] = d.view(torch.uint8).view(nblk, 2)
        return b.view(shape)
    if fmt == "bf16":
        return (torch.randn(shape, generator=generator, device=device) * 0.05).to(torch.bfloat16)
    if fmt == "mxfp4":
        b = torch.randint(0, 256, (nblk, 17), generator=generator, device=device, dtype=torch.uint8)
        b[:, 0] = torch.randint(118, 125, (nblk,), generator=generator, device=device, dtype=torch.uint8)
        return b.view(shape)
    b = torch.randint(0, 256, (nblk, 34), generator=generator, device=device, dtype=torch.uint8)
    d = (torch.rand(nblk, generator=generator, device=device) * 9e-3 + 1e-3).to(torch.float16)
    b[:, :2] = d.view(torch.uint8).view(nblk, 2)
    return b.view(shape)


def random_routing(spec: ExpertsSpec, generator: torch.Generator | None = None,
                   shared_rows: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [q, k], weights fp32 [q, k]) on the CPU: distinct ids per row; with ``shared_rows`` and
    q > 1 some experts are picked by several rows (rows copy a few of row 0's ids, so the dedup path runs);
    weights as the router makes them: ``s[ids] / sum * 1.5`` with ``s = sqrtsoftplus(z)``."""
    from ds4c.reference import primitives as P

    g = generator or torch.Generator().manual_seed(0)
    q, k, E = spec.q, spec.k, spec.n_experts
    rows = []
    for i in range(q):
        perm = torch.randperm(E, generator=g)[:k]
        if shared_rows and i > 0 and k >= 2:
            common = rows[0][: min(2, k) if i % 2 else 1]
            rest = [int(e) for e in perm if int(e) not in set(common.tolist())][: k - len(common)]
            perm = torch.cat([common, torch.tensor(rest, dtype=torch.int64)])
            perm = perm[torch.randperm(k, generator=g)]
        rows.append(perm.to(torch.int64))
    ids = torch.stack(rows)
    s = P.sqrtsoftplus(torch.randn(q, E, generator=g) * 2.0)
    w = s.gather(-1, ids)
    return ids, (w / w.sum(-1, keepdim=True) * 1.5).to(torch.float32)


def random_inputs(spec: ExpertsSpec, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu", shared_rows: bool = True) -> dict[str, torch.Tensor]:
    """Every input of one call (names of :func:`arg_names`, without the outputs) on ``device``; x ~N(0, 1)
    in bf16. ``generator`` is a CPU generator; device tensors use a device generator seeded from it."""
    g = generator or torch.Generator().manual_seed(0)
    dev = torch.device(device)
    gd = g if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
    D, F, E = spec.hidden, spec.inter, spec.n_experts
    ids, wts = random_routing(spec, g, shared_rows)
    rw: Callable[..., torch.Tensor] = random_weight
    return {"x": torch.randn(spec.q, D, generator=g).to(torch.bfloat16).to(dev), "ids": ids.to(dev),
            "weights": wts.to(dev),
            "w1": rw(spec.routed_fmt, F, D, E, gd, dev), "w3": rw(spec.routed_fmt, F, D, E, gd, dev),
            "w2": rw(spec.down_fmt, D, F, E, gd, dev), "sh_w1": rw(spec.shared_fmt, F, D, None, gd, dev),
            "sh_w3": rw(spec.shared_fmt, F, D, None, gd, dev), "sh_w2": rw(spec.shared_down_fmt, D, F, None, gd, dev)}
