"""The indexer's scores stage for a prefill chunk on tensor cores: the first launch of an ``indexer_topk`` call at
``C`` rows (docs/model.md 5.2(f.6)) as dense products, ``templates/indexer/chunk_scores_mma.cu.j2`` (its header has
the block layout). The select stage is :mod:`ds4c.runtime.families.indexer`'s, unchanged, reading the same scores.

Why a second scores kernel: the SIMT stage (written for the 1..5 rows of a decode or verify step) computes each
row's ``H x D`` dot products against every visible compressed key with one FMA chain per dot on CUDA cores. At ``C``
rows that is ``C x keys x H x D x 2`` FLOPs per CSA layer (~0.26 TFLOP for a 2048-row chunk at position 30K, 64
heads of 128): the part of a chunk that grows with the prompt (docs/perf.md, Optimisation 24). Here a block takes 64
rows x 128 keys, keeps the key tile in shared memory and, head by head in order, multiplies the head's 64 query
rows against it with ``mma.sync`` bf16 (fp32 accumulation) and folds the per-head epilogue (bf16, ReLU, times the
head weight, bf16, fp32 sum in head order) into registers.

One launch: grid ``(ceil(cap / 128), ceil(C / 64))``, 256 threads, :func:`smem_bytes` of dynamic shared memory (84.5
KiB at D = 128, H = 64: two blocks per SM on sm_90). Arguments: the scores stage's
(:func:`ds4c.runtime.families.indexer.arg_names`), so the lowering swaps one for the other
(:func:`ds4c.runtime.lower_prefill._lower_indexer`, with ``DS4C_PREFILL_INDEXER_MMA=1``: off by default until a GPU
has run and timed it).

Supported: CUDA sm_80 / sm_90 / sm_90a / sm_100a, ``dim`` a multiple of 16. HIP keeps the SIMT stage.

Numerics: the SIMT stage's epilogue and head order; the dot products summed in the MMA's order. On the CPU emulator
(whose MMA sums exactly) bit-identical to it and to :func:`ds4c.runtime.families.indexer.kernel_scores` for the
model's FP4 fake-quantized ``qi`` and keys, every partial sum of a dot being exact in fp32; otherwise within one bf16
rounding of a dot (tests/test_chunk_indexer.py). On the GPU the tensor cores align each k16 step's terms to the
largest and truncate: exact while the terms span few binades, as FP4 blocks of similar scale do; the GPU check
(tests/gpu_checks/indexer.py, chunk cases) compares the two stages bit for bit, and its selected ids.
"""

from __future__ import annotations

from ds4c.runtime.families import Launch
from ds4c.runtime.families.indexer import IndexerSpec
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import CUDA_SMEM, Target

TEMPLATE = "indexer/chunk_scores_mma.cu.j2"
FAMILY = "indexer"
ROW_TILE = 64    # rows per block: the MMA's M side (2 warp rows x 2 tiles of 16)
KEY_TILE = 128   # keys per block (4 warp columns x 4 tiles of 8)
THREADS = 256    # 8 warps


def smem_bytes(spec: IndexerSpec) -> int:
    """Dynamic shared memory (the template's layout): keys [128][D + 8] bf16, query rows [2][64][D + 8] bf16, the
    head weights [64][H + 1] f32 (rows on distinct banks for both their writes and the epilogue's reads), nvalid [64]
    ints."""
    ld = spec.dim + 8
    return KEY_TILE * ld * 2 + 2 * ROW_TILE * ld * 2 + ROW_TILE * (spec.heads + 1) * 4 + ROW_TILE * 4


def check(spec: IndexerSpec, target: Target) -> None:
    """Raises RenderError (one line) for what the kernel does not build: a target without ``mma.sync`` bf16 (HIP), a
    ``dim`` not a multiple of 16, or shared memory past the arch's."""
    if target.vendor != "cuda" or target.arch not in CUDA_SMEM:
        raise RenderError(f"chunk indexer scores: {target.slug} is not supported (mma.sync bf16 on CUDA "
                          f"{'/'.join(CUDA_SMEM)})")
    if spec.dim % 16:
        raise RenderError(f"chunk indexer scores: dim {spec.dim} is not a multiple of 16")
    if smem_bytes(spec) > CUDA_SMEM[target.arch]:
        raise RenderError(f"chunk indexer scores: {smem_bytes(spec)} bytes of shared memory for {spec.heads} heads "
                          f"of {spec.dim}, {target.arch} has {CUDA_SMEM[target.arch]}")


def render_chunk_scores(spec: IndexerSpec, target: Target, name: str) -> KernelSource:
    """The scores kernel of ``spec`` (its ``q`` is the chunk's C rows) for ``target``, named ``name``.

    Raises:
        RenderError: see :func:`check`.
    """
    check(spec, target)
    return render(TEMPLATE, name, FAMILY, target,
                  {"heads": spec.heads, "dim": spec.dim, "cap": spec.cap, "ratio": spec.ratio, "rows": spec.q,
                   "row_tile": ROW_TILE, "key_tile": KEY_TILE, "smem": smem_bytes(spec)})


def launch_shape(spec: IndexerSpec) -> Launch:
    """The one launch: grid (ceil(cap / 128), ceil(C / 64)), 256 threads, :func:`smem_bytes`."""
    return Launch((-(-spec.cap // KEY_TILE), -(-spec.q // ROW_TILE), 1), (THREADS, 1, 1), smem_bytes(spec),
                  kernel="scores")
