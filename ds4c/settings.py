"""Every environment setting of ds4c and every default path, read when asked for (never at import time).

Nothing else in ``ds4c`` reads a ``DS4C_*`` variable: each has one reader function here, and ``ds4c info --env``
prints them all with the value in force (docs/settings.md has the same table).

=============================  ==========================  =======================================================
variable                       default                     what it does (reader)
=============================  ==========================  =======================================================
``DS4C_HOME``                  ``~/.cache/ds4c``           where the built-in default model is written, under
                                                           ``models/`` (:func:`home`)
``DS4C_CACHE``                 ``~/.cache/ds4c/kernels``   the compiled-kernel cache (:func:`kernel_cache_root`)
``DS4C_NVCC``                  (search)                    the nvcc to use before PATH and the CUDA toolkit
                                                           folders (:func:`nvcc`)
``DS4C_CLANG``                 (search)                    the clang to use for HIP before ``clang-30`` ..
                                                           ``clang-19`` and ``clang`` (:func:`clang`)
``DS4C_PDL``                   ``0``                       ``1``: launch the step kernels with programmatic
                                                           dependent launch on sm_90+ (:func:`pdl`)
``DS4C_XP_PREQUANT``           ``1``                       ``0``: the experts quantize their activations in every
                                                           block instead of once per launch (an A/B; other
                                                           kernels) (:func:`experts_prequant`)
``DS4C_XP_DOWN_SPLIT``         ``1``                       job groups of the decode experts' down phase (an A/B
                                                           knob) (:func:`experts_down_split`)
``DS4C_GEMV_ROWS``             ``16``                      the most rows one multi-output GEMV launch takes (1..16;
                                                           a lanes step's wider rows run in passes of this many)
                                                           (:func:`gemv_rows`)
``DS4C_LANE_STREAMS``          ``0``                       ``1``: a compiled lanes step's per-lane launches on a
                                                           stream per lane, where they are not merged (an A/B
                                                           knob) (:func:`lane_streams`)
``DS4C_LANE_BATCH``            ``1``                       ``0``: a compiled lanes step's per-lane launches one per
                                                           lane instead of one per kernel over the lanes (an A/B
                                                           knob) (:func:`lane_batch`)
``DS4C_PREFILL_ATTN_MMA``      ``1``                       ``0``: the prefill chunks' attention on CUDA cores
                                                           (the decode kernel at C rows) instead of tensor cores
                                                           (an A/B knob; HIP always takes the CUDA-core kernel)
                                                           (:func:`prefill_attn_mma`)
``DS4C_PREFILL_INDEXER_MMA``   ``0``                       ``1``: the prefill chunks' indexer scores on tensor
                                                           cores instead of CUDA cores (the decode stage at C
                                                           rows); off until a GPU has timed it (HIP always takes
                                                           the CUDA-core stage) (:func:`prefill_indexer_mma`)
``DS4C_PREFILL_CMP_PARALLEL``  ``1``                       ``0``: the prefill chunks' compressors one block per
                                                           compressor walking the rows instead of one block per
                                                           flush (the same bits; an A/B knob)
                                                           (:func:`prefill_cmp_parallel`)
``DS4C_PREFILL_ATTN_HPB``      ``4``                       heads per block of the prefill chunks' attention on
                                                           CUDA cores (an int >= 1)
                                                           (:func:`prefill_attn_heads_per_block`)
``DS4C_PREFILL_ATTN_THREADS``  ``0``                       threads per block of the prefill chunks' attention
                                                           (0: automatic) (:func:`prefill_attn_threads`)
``DS4C_PREFILL_GEMM_BN``       ``64``                      weight rows per CTA of the prefill chunks' GEMMs
                                                           (projections, grouped wo_a, FFN router, an all-logits
                                                           head), 64 or 128 (an A/B knob) (:func:`prefill_gemm_bn`)
``DS4C_PREFILL_GEMM_XQ``       ``f16``                     the prefill chunks' projection GEMMs' quantized x: f16
                                                           or e4m3 (one-byte codes) (:func:`prefill_gemm_xq`)
``DS4C_PREFILL_MOE_BN``        ``64``                      weight rows per CTA of the prefill chunks' grouped
                                                           experts GEMM, 64 or 128 (an A/B knob)
                                                           (:func:`prefill_moe_bn`)
``DS4C_PREFILL_STAGES``        ``auto``                    K-step stages of the prefill chunks' GEMMs and grouped
                                                           experts: 2 (registers, double buffered) or 3 (the
                                                           cp.async pipeline); auto: 3 for 64-wide grouped
                                                           experts whose weights are K-quants staged by cp.async
                                                           (Q2_K, Q3_K, Q6_K), else 2 (:func:`prefill_stages`)
``DS4C_PREFILL_MOE_MMA``       ``sync``                    the prefill chunks' routed experts' up / down MMA: sync
                                                           (mma.sync everywhere), wgmma, wgmma8 or fp8 (where
                                                           moe_gemm.auto_mma allows: MXFP4; wgmma / wgmma8 on
                                                           sm_90 / sm_90a)
                                                           (:func:`prefill_moe_mma`)
``DS4C_PREFILL_MOE_XQ``        ``e4m3``                    the grouped experts' quantized activations: f16 or e4m3
                                                           (one-byte codes; CUDA mma.sync) (:func:`prefill_moe_xq`)
``DS4C_PREFILL_MOE_WG_BN``     ``256``                     weight rows per CTA of the routed experts on wgmma: 64,
                                                           128 or 256 (1, 2 or 4 warpgroups)
                                                           (:func:`prefill_moe_wg_bn`)
``DS4C_PREFILL_L2_PREFETCH``   ``0``                       L2 prefetch size of the grouped experts' cp.async
                                                           copies: 0, 128 or 256 (an A/B knob)
                                                           (:func:`prefill_l2_prefetch`)
``DS4C_PREFILL_MOE_COLS_FIRST`` ``1``                      1: the grouped experts' grids with the column blocks
                                                           first; 0: tiles first (:func:`prefill_moe_cols_first`)
``DS4C_DEBUG``                 (unset)                     any value: print the traceback of a torch.compile mode
                                                           that fails in ``ds4c bench`` (:func:`debug`)
``DS4C_API_KEY``               (unset)                     the bearer token ``ds4c serve`` requires when
                                                           ``--api-key`` is not given; a secret: ``ds4c info
                                                           --env`` shows only whether it is set (:func:`api_key`)
=============================  ==========================  =======================================================

The CUDA and ROCm toolkit folders are searched as their own tools do: ``$CUDA_HOME``, ``$CUDA_PATH``, then
``/usr/local/cuda`` (:func:`cuda_roots`); ``$ROCM_PATH``, then ``/opt/rocm`` (:func:`rocm_roots`).

Tests and tools read four more for development only (not ds4c's behaviour): ``DS4C_DS4RUN`` (llama.cpp's
``ds4run`` for ``pytest -m interop``), ``DS4C_XP_CASES`` and ``DS4C_XP_STAGES_SWEEP`` (the experts GPU check's
case filter and stage sweep) and ``DS4C_MG_CASES`` (the grouped-experts GPU check's case filter).

An empty value counts as unset. A value that cannot be read (``DS4C_PREFILL_ATTN_HPB=x``) raises
:class:`SettingsError`, one line naming the variable, when the setting is first used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from ds4c.errors import Ds4cError

_T = TypeVar("_T")


class SettingsError(Ds4cError):
    """An environment setting holds a value ds4c cannot use (the message names the variable and the value;
    ``expected`` says what it must be)."""

    def __init__(self, name: str, value: str, expected: str, default: object):
        super().__init__(f"${name}: expected {expected}, found {value!r} (unset it for the default {default})")
        self.expected = expected


@dataclass(frozen=True)
class Setting:
    """One environment variable: its ``name``, its ``default`` as documented, what it does, its reader, and
    whether its value is a ``secret``."""

    name: str
    default: str
    doc: str
    read: Callable[[], object]
    secret: bool = False    # its value is never shown (:func:`describe` says only whether it is set)


def raw(name: str) -> str | None:
    """The value of environment variable ``name``, None when unset or empty."""
    value = os.environ.get(name)
    return value if value else None


def _int(name: str, default: int, least: int, most: int | None = None) -> int:
    """An int setting of at least ``least`` (and at most ``most``); unset: ``default``. Raises SettingsError for
    anything else."""
    value = raw(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < least or (most is not None and n > most):
        raise SettingsError(name, value, f"an int >= {least}" if most is None else f"an int in {least}..{most}",
                            default)
    return n


def _flag(name: str, default: bool) -> bool:
    """An on/off setting: ``1`` or ``0`` (surrounding spaces ignored); unset: ``default``.

    Raises:
        SettingsError: any other value (``true``, ``off``, ``2``...: refused rather than read as one or the other).
    """
    value = raw(name)
    if value is None:
        return default
    if value.strip() not in ("0", "1"):
        raise SettingsError(name, value, "1 or 0", int(default))
    return value.strip() == "1"


def home() -> Path:
    """``$DS4C_HOME``, else ``~/.cache/ds4c``: the folder of the built-in default model (``models/``)."""
    return Path(raw("DS4C_HOME") or Path.home() / ".cache" / "ds4c")


def kernel_cache_root() -> Path:
    """``$DS4C_CACHE`` (``~`` expanded), else ``~/.cache/ds4c/kernels``: the compiled-kernel cache."""
    env = raw("DS4C_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ds4c" / "kernels"


def nvcc() -> str | None:
    """``$DS4C_NVCC``: the nvcc tried first (None: search PATH and :func:`cuda_roots`)."""
    return raw("DS4C_NVCC")


def clang() -> str | None:
    """``$DS4C_CLANG``: the clang tried first for HIP (None: ``clang-30`` .. ``clang-19``, then ``clang``)."""
    return raw("DS4C_CLANG")


def cuda_roots() -> list[str]:
    """The CUDA toolkit folders searched for its tools (``bin/``): ``$CUDA_HOME``, ``$CUDA_PATH``,
    ``/usr/local/cuda`` (those set)."""
    return [h for h in (raw("CUDA_HOME"), raw("CUDA_PATH"), "/usr/local/cuda") if h]


def rocm_roots() -> list[str]:
    """The ROCm folders searched for its tools (``bin/``): ``$ROCM_PATH``, ``/opt/rocm``."""
    return [h for h in (raw("ROCM_PATH"), "/opt/rocm") if h]


def pdl() -> bool:
    """``$DS4C_PDL=1``: programmatic dependent launch of the kernels that allow it (sm_90+). Off by default: on
    the H200 it gave nothing at q = 1 and cost 5% at q = 5 (docs/perf.md)."""
    return _flag("DS4C_PDL", False)


def experts_prequant() -> bool:
    """The experts quantize their activations once per launch (``ExpertsSpec.prequant``; docs/perf.md,
    Optimisation 6); ``$DS4C_XP_PREQUANT=0`` turns it off for an A/B (other kernels: the kernel cache and an
    artifact compiled with one setting do not mix with the other)."""
    return _flag("DS4C_XP_PREQUANT", True)


def experts_down_split() -> int:
    """``ExpertsSpec.down_split`` of the decode experts (``$DS4C_XP_DOWN_SPLIT``; default 1: one block per 16 output
    dims runs every job; more groups measured no faster at 8 distinct rows on the H100, docs/perf.md Optimisation 9:
    an A/B knob).

    Raises:
        SettingsError: a value that is not an int >= 1.
    """
    return _int("DS4C_XP_DOWN_SPLIT", 1, 1)


def gemv_rows() -> int:
    """The most rows one multi-output GEMV launch takes (``$DS4C_GEMV_ROWS``, 1..16, default 16): a lanes step of more
    rows runs its GEMVs in passes of at most this many (each pass reads the weights again). 16 reads them once for
    every row of a 16-row step (1 block per SM instead of 2): 16 lanes 5.29 -> 4.83 ms on the H100, rows bit-equal
    (docs/perf.md, Optimisation 13); 8 is the A/B knob. HIP targets whose shared memory does not hold 16 rows of x
    take fewer (the lowering's passes).

    Raises:
        SettingsError: a value that is not an int in 1..16.
    """
    return _int("DS4C_GEMV_ROWS", 16, 1, 16)


def lane_streams() -> bool:
    """``$DS4C_LANE_STREAMS=1``: the decode lanes' per-lane launches that are not merged (:func:`lane_batch`) run on
    a stream per lane (``StepGraphs.lane_streams``; a captured lanes graph holds them as parallel branches). Off:
    merging the launches gains more (docs/perf.md, Optimisations 10 and 12)."""
    return _flag("DS4C_LANE_STREAMS", False)


def lane_batch() -> bool:
    """The decode lanes' per-lane launches merged into one launch per kernel over a grid of lanes
    (runtime/step/lane_batch.py): on by default (bit-equal rows, measured faster on the H100: docs/perf.md,
    Optimisation 12); ``$DS4C_LANE_BATCH=0`` launches them one per lane."""
    return _flag("DS4C_LANE_BATCH", True)


def prefill_attn_mma() -> bool:
    """The prefill chunks' attention on tensor cores (runtime/families/chunk_attention.py) where the target has them
    (``$DS4C_PREFILL_ATTN_MMA``, on by default since its GPU check and measurement: docs/perf.md, Optimisation 14;
    ``0`` runs the decode SIMT kernel at C rows, an A/B knob)."""
    return _flag("DS4C_PREFILL_ATTN_MMA", True)


def prefill_indexer_mma() -> bool:
    """The prefill chunks' indexer scores on tensor cores (runtime/families/chunk_indexer.py) where the target has
    them (``$DS4C_PREFILL_INDEXER_MMA=1``; off by default until a GPU has run and timed it: docs/perf.md,
    Optimisation 24; off runs the decode SIMT scores stage at C rows). Bit-identical scores for the model's FP4
    inputs on the CPU emulator."""
    return _flag("DS4C_PREFILL_INDEXER_MMA", False)


def prefill_cmp_parallel() -> bool:
    """The prefill chunks' compressors parallel over the chunk's flushes (templates/compressor/compress_chunk.cu.j2;
    ``$DS4C_PREFILL_CMP_PARALLEL``, on by default since its GPU check and measurement: docs/perf.md, Optimisation
    15; ``0`` runs the row-serial kernel, the same bits, an A/B knob)."""
    return _flag("DS4C_PREFILL_CMP_PARALLEL", True)


def prefill_attn_heads_per_block() -> int:
    """``AttentionSpec.heads_per_block`` at C rows (``$DS4C_PREFILL_ATTN_HPB``, default 4; docs/perf.md,
    Optimisation 7).

    Raises:
        SettingsError: a value that is not an int >= 1.
    """
    return _int("DS4C_PREFILL_ATTN_HPB", 4, 1)


def prefill_attn_threads() -> int:
    """``AttentionSpec.threads`` at C rows (``$DS4C_PREFILL_ATTN_THREADS``, default 0: automatic).

    Raises:
        SettingsError: a value that is not an int >= 0.
    """
    return _int("DS4C_PREFILL_ATTN_THREADS", 0, 0)


def _choice(name: str, choices: dict[str, _T], unset: str) -> _T:
    """A setting that is one of the words of ``choices`` (surrounding spaces ignored), read as its value; unset: the
    value of the word ``unset``. Raises SettingsError (naming the words) else."""
    value = raw(name)
    word = unset if value is None else value.strip()
    if word not in choices:
        words = list(choices)
        raise SettingsError(name, value, ", ".join(words[:-1]) + " or " + words[-1], unset)
    return choices[word]


def _tile_width(name: str) -> int:
    """A GEMM tile-width setting: 64 or 128; unset: 64. Raises SettingsError else."""
    return _choice(name, {"64": 64, "128": 128}, "64")


def prefill_gemm_bn() -> int:
    """``GemmSpec.bn`` of every GEMM of a prefill chunk: the projections, the grouped wo_a, the FFN router and an
    all-logits head (``$DS4C_PREFILL_GEMM_BN``, 64 or 128; default 64):
    128 weight rows per CTA stage each X tile once for twice the outputs, with half the CTAs (docs/perf.md, the
    prefill GEMM family; an A/B knob until a GPU run picks per shape).

    Raises:
        SettingsError: any value but 64 or 128.
    """
    return _tile_width("DS4C_PREFILL_GEMM_BN")


def prefill_gemm_xq() -> str:
    """``GemmSpec.xfmt`` of the prefill chunks' prequant projection GEMMs (``$DS4C_PREFILL_GEMM_XQ``): ``f16``, the
    default (actq's e4m3 values as f16, 16 KB an X tile per K step), or ``e4m3`` (the codes, one byte a value: half
    the bytes staged, the same outputs bit for bit; docs/perf.md Optimisation 22, not yet measured on a GPU).

    Raises:
        SettingsError: any value but f16 or e4m3.
    """
    return _choice("DS4C_PREFILL_GEMM_XQ", {"f16": "f16", "e4m3": "e4m3"}, "f16")


def prefill_moe_bn() -> int:
    """``MoeGemmSpec.bn`` of the prefill chunks' grouped experts GEMM (``$DS4C_PREFILL_MOE_BN``, 64 or 128; default
    64): weight rows per CTA of the up and down phases (an A/B knob until a GPU run picks).

    Raises:
        SettingsError: any value but 64 or 128.
    """
    return _tile_width("DS4C_PREFILL_MOE_BN")


def prefill_stages() -> int:
    """``GemmSpec.stages`` and ``MoeGemmSpec.stages`` of the prefill chunks' GEMMs (the prequant projections) and
    grouped experts (``$DS4C_PREFILL_STAGES``, 2 or 3 for every such launch; unset or ``auto``: 0, which the lowering
    resolves per launch, :func:`ds4c.runtime.families.moe_gemm.auto_stages`: 3 for 64-wide grouped experts whose gate /
    up and down weights are all K-quants staged by 4-byte cp.async (Q2_K, Q3_K, Q6_K: measured 0.89x with Q3_K on an
    H100, docs/perf.md Optimisation 18), else 2). 3
    copies every K step by cp.async straight into shared memory with two steps in flight; both give the same bits.

    Raises:
        SettingsError: any value but 2, 3 or auto.
    """
    return _choice("DS4C_PREFILL_STAGES", {"2": 2, "3": 3, "auto": 0}, "auto")


def prefill_moe_mma() -> str:
    """The MMA of the prefill chunks' routed experts' up / down phases (``$DS4C_PREFILL_MOE_MMA``): ``sync``, the
    default, the f16 mma.sync kernels everywhere; ``wgmma``: Hopper's wgmma on bf16 operands, ``wgmma8``: its FP8
    form (e4m3 operands, a per-128 promotion; docs/perf.md Optimisation 23), and ``fp8``: mma.sync on e4m3 operands
    (with e4m3 activation tiles), each for every call :func:`ds4c.runtime.families.moe_gemm.auto_mma` finds eligible
    -- MXFP4 weights both ways; wgmma on an sm_90 / sm_90a target -- and mma.sync for the rest. wgmma is not the
    default: on an H100 and an H200 it ran the routed experts no faster than mma.sync with one warpgroup a CTA
    (docs/perf.md Optimisation 19; with 2 / 4 warpgroups it is 0.74x / 0.71x at the kernel level, not yet in a chunk:
    Optimisation 21 measured); fp8 ran slower than f16 mma.sync on e4m3 tiles on an H100 (the same section).

    Raises:
        SettingsError: any value but sync, wgmma, fp8 or wgmma8.
    """
    return _choice("DS4C_PREFILL_MOE_MMA", {m: m for m in ("sync", "wgmma", "fp8", "wgmma8")}, "sync")


def prefill_moe_xq() -> str:
    """``MoeGemmSpec.xfmt`` of the prefill chunks' grouped experts on CUDA mma.sync (``$DS4C_PREFILL_MOE_XQ``):
    ``e4m3``, the default (the codes, one byte a value: half the bytes staged per K step, the same outputs bit for
    bit; on an H100 the routed up / down 0.86x / 0.81x, prefill at 4096 1.07x: docs/perf.md Optimisation 21), or
    ``f16`` (the quantized activations as f16, 16 KB a staged tile: the kernels measured before). The fp8 MMAs
    (``DS4C_PREFILL_MOE_MMA=fp8`` / ``wgmma8``) always stage e4m3; wgmma and the HIP body keep their own forms.

    Raises:
        SettingsError: any value but f16 or e4m3.
    """
    return _choice("DS4C_PREFILL_MOE_XQ", {"f16": "f16", "e4m3": "e4m3"}, "e4m3")


def prefill_moe_wg_bn() -> int:
    """``MoeGemmSpec.bn`` of the prefill chunks' routed experts on wgmma (``DS4C_PREFILL_MOE_MMA=wgmma`` or ``wgmma8``;
    ``$DS4C_PREFILL_MOE_WG_BN``: 64, 128 or 256, the default): weight rows per CTA, 1, 2 or 4 warpgroups on one
    tile, so the tile's activation rows are staged once for that many outputs (docs/perf.md Optimisation 20; on an
    H100 the routed up + down 5767 / 4090 / 3888 us at 2048 rows: Optimisation 21 measured). 256 needs the hidden
    width a multiple of 256; elsewhere the lowering takes 128 (:func:`ds4c.runtime.families.moe_gemm.wg_width`).

    Raises:
        SettingsError: any value but 64, 128 or 256.
    """
    return _choice("DS4C_PREFILL_MOE_WG_BN", {"64": 64, "128": 128, "256": 256}, "256")


def prefill_l2_prefetch() -> int:
    """``MoeGemmSpec.prefetch`` of the prefill chunks' grouped experts (``$DS4C_PREFILL_L2_PREFETCH``: 0, the default,
    128 or 256): the L2 prefetch size of their cp.async copies (docs/perf.md Optimisation 19).

    Raises:
        SettingsError: any value but 0, 128 or 256.
    """
    return _choice("DS4C_PREFILL_L2_PREFETCH", {"0": 0, "128": 128, "256": 256}, "0")


def prefill_moe_cols_first() -> bool:
    """``MoeGemmSpec.cols_first`` of the prefill chunks' grouped experts (``$DS4C_PREFILL_MOE_COLS_FIRST``: 1, the
    default, or 0): the up / down grids with the column blocks first, so the CTAs sharing a tile's activation rows run
    together and read them from DRAM once (the routed down phase 0.85x on an H100, bit-identical; docs/perf.md
    Optimisation 19).

    Raises:
        SettingsError: any value but 0 or 1.
    """
    return bool(_choice("DS4C_PREFILL_MOE_COLS_FIRST", {"0": 0, "1": 1}, "1"))


def debug() -> bool:
    """``$DS4C_DEBUG`` set (any value): a torch.compile mode of the reference that fails (``ds4c bench``'s
    torch.compile column) prints its traceback, not only its first line."""
    return raw("DS4C_DEBUG") is not None


def api_key() -> str | None:
    """``$DS4C_API_KEY``: the bearer token ``ds4c serve`` requires when ``--api-key`` is not given (None: no
    key). An environment variable keeps the key out of the process list, where a command-line option shows it."""
    return raw("DS4C_API_KEY")


#: Every setting, in the order of the module docstring's table (``ds4c info --env`` prints them).
SETTINGS: tuple[Setting, ...] = (
    Setting("DS4C_HOME", "~/.cache/ds4c", "where the built-in default model is written (models/)", home),
    Setting("DS4C_CACHE", "~/.cache/ds4c/kernels", "the compiled-kernel cache", kernel_cache_root),
    Setting("DS4C_NVCC", "(search)", "the nvcc to use before PATH and the CUDA toolkit folders", nvcc),
    Setting("DS4C_CLANG", "(search)", "the clang to use for HIP before clang-30 .. clang-19 and clang", clang),
    Setting("DS4C_PDL", "0", "1: programmatic dependent launch of the step kernels on sm_90+", pdl),
    Setting("DS4C_XP_PREQUANT", "1", "0: the experts quantize activations in every block (an A/B)",
            experts_prequant),
    Setting("DS4C_XP_DOWN_SPLIT", "1", "job groups of the decode experts' down phase (an A/B knob)",
            experts_down_split),
    Setting("DS4C_GEMV_ROWS", "16", "the most rows one GEMV launch takes (1..16; more run in passes)", gemv_rows),
    Setting("DS4C_LANE_STREAMS", "0", "1: a lanes step's unmerged per-lane launches on a stream per lane (A/B knob)",
            lane_streams),
    Setting("DS4C_LANE_BATCH", "1", "0: a lanes step's per-lane launches one per lane, not merged (A/B knob)",
            lane_batch),
    Setting("DS4C_PREFILL_ATTN_MMA", "1", "0: the prefill chunks' attention on CUDA cores, not tensor cores (A/B knob)",
            prefill_attn_mma),
    Setting("DS4C_PREFILL_INDEXER_MMA", "0",
            "1: the prefill chunks' indexer scores on tensor cores, not CUDA cores (not yet run on a GPU)",
            prefill_indexer_mma),
    Setting("DS4C_PREFILL_CMP_PARALLEL", "1",
            "0: the prefill chunks' compressors one block walking the rows, not one per flush (A/B knob)",
            prefill_cmp_parallel),
    Setting("DS4C_PREFILL_ATTN_HPB", "4", "heads per block of the prefill chunks' attention on CUDA cores",
            prefill_attn_heads_per_block),
    Setting("DS4C_PREFILL_ATTN_THREADS", "0", "threads per block of the prefill chunks' attention (0: automatic)",
            prefill_attn_threads),
    Setting("DS4C_PREFILL_GEMM_BN", "64", "weight rows per CTA of the prefill chunks' GEMMs (64 or 128)",
            prefill_gemm_bn),
    Setting("DS4C_PREFILL_GEMM_XQ", "f16", "the prefill chunks' projection GEMMs' quantized x: f16 or e4m3 (one byte)",
            prefill_gemm_xq),
    Setting("DS4C_PREFILL_MOE_BN", "64", "weight rows per CTA of the prefill chunks' grouped experts GEMM (64 or 128)",
            prefill_moe_bn),
    Setting("DS4C_PREFILL_STAGES", "auto",
            "K-step stages of the prefill chunks' GEMMs and grouped experts (2, 3 or auto)", prefill_stages),
    Setting("DS4C_PREFILL_MOE_MMA", "sync", "the prefill chunks' routed experts' MMA: sync, or wgmma / wgmma8 / fp8 "
            "where it applies", prefill_moe_mma),
    Setting("DS4C_PREFILL_MOE_XQ", "e4m3", "the grouped experts' quantized activations: e4m3 (one byte a value) or f16",
            prefill_moe_xq),
    Setting("DS4C_PREFILL_MOE_WG_BN", "256", "weight rows per CTA of the routed experts on wgmma (64, 128 or 256)",
            prefill_moe_wg_bn),
    Setting("DS4C_PREFILL_L2_PREFETCH", "0", "L2 prefetch size of the grouped experts' cp.async copies (0, 128, 256)",
            prefill_l2_prefetch),
    Setting("DS4C_PREFILL_MOE_COLS_FIRST", "1", "the grouped experts' grids with the column blocks first (0: tiles)",
            prefill_moe_cols_first),
    Setting("DS4C_DEBUG", "(unset)", "any value: print the traceback of a failing torch.compile mode (bench)",
            debug),
    Setting("DS4C_API_KEY", "(unset)", "the bearer token ds4c serve requires (when --api-key is not given)",
            api_key, secret=True),
)


def describe() -> list[dict[str, object]]:
    """One record per setting, for ``ds4c info --env``: ``name``, ``value`` (as set, None when unset), ``used``
    (what ds4c uses now: a path or a number as text, a flag as on/off; a value ds4c cannot use: ``invalid``
    and why; a secret's value is ``(hidden)`` in both), ``default`` and ``doc``."""
    out = []
    for s in SETTINGS:
        try:
            used = s.read()
        except SettingsError as e:
            used = f"invalid (expected {e.expected})"
        text = ("on" if used else "off") if isinstance(used, bool) else ("(search)" if used is None else str(used))
        value = os.environ.get(s.name)
        if s.secret:
            value, text = (None, "(unset)") if used is None else ("(hidden)", "(hidden)")
        out.append({"name": s.name, "value": value, "used": text, "default": s.default, "doc": s.doc})
    return out
