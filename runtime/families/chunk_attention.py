"""The sparse attention of a prefill chunk on tensor cores: the ``sparse_attention`` IR op at ``C`` rows (docs/model.md
P9, 5.2(e),(i)), kinds ``swa`` / ``csa`` / ``hca``, as one kernel that computes each row's scores and value product
on matrix units: ``mma.sync`` bf16 on CUDA (``templates/attention/chunk_mma.cu.j2``, its header has the block
layout), MFMA / WMMA bf16 on HIP (below).

Why a second attention kernel: K = V = one bf16 row per list entry, shared by all H heads (MQA), so for one query
row the H = 64 heads form the M side of a dense product against the row's list (window, then the selected or all
compressed rows): ``S = Q . K^T`` [64, 64 entries] per chunk and ``acc += bf16(P) . V`` [64, head_dim]. The SIMT
kernel of :mod:`ds4c.runtime.families.attention` (written for the 1..5 rows of a decode or verify step) computes
the same on CUDA cores: at ``C`` rows it took ~38% of a 2048-row chunk (docs/perf.md, Optimisation 7). This one
keeps its lists, chunks of 64, online softmax, masking and argument list, so the lowering binds either the same
way (:func:`ds4c.runtime.lower_prefill._lower_attention`: this kernel by default, ``DS4C_PREFILL_ATTN_MMA=0`` the
SIMT one).

One launch: grid ``(ceil(H / 64), C)``, 256 threads, :func:`smem_bytes` of dynamic shared memory (the query rows
of 64 heads and one or two stages of 64 KV rows, padded so every ``ldmatrix`` row lands on its own banks). Two
stages (the next chunk's rows copied with ``cp.async`` while this one is computed) where shared memory holds
them (sm_90: 227 KiB), else one (sm_80: 163 KiB).

Supported: CUDA sm_80 / sm_90 / sm_90a / sm_100a, ``head_dim`` a multiple of 16 whose shared memory fits.

HIP: ``templates/attention/chunk_hip_matrix.cu.j2``, the same lists, softmax and arguments on AMD matrix cores in
16 x 16 x 16 bf16 tiles: ``v_mfma_f32_16x16x16_bf16`` on CDNA (gfx90a, gfx942; wave 64), ``v_wmma_f32_16x16x16_bf16``
on RDNA 3 (gfx1100, gfx1151; wave 32). The 64 KiB of LDS a block gets there holds one chunk of 32 KV rows (33 KB
at head_dim 512), the chunk's scores and bf16(p); the query rows come from global memory (L2) into the score
product's fragments. gfx1201 (RDNA 4: another WMMA operand layout) is not built: :func:`check` refuses it and the
lowering keeps the SIMT kernel there. No AMD GPU runs it here: it is compile-checked (clang) and run on the CPU
emulator (tests/test_chunk_attention.py), unmeasured.

Numerics: the SIMT kernel's, with the fp32 sums of the dot products and of the value product in the MMA's order;
both within bf16 tolerance of :func:`ds4c.runtime.families.attention.reference` (tests/test_chunk_attention.py).
"""

from __future__ import annotations

from ds4c.runtime.families import Launch
from ds4c.runtime.families.attention import AttentionSpec
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import CUDA_SMEM, HIP_LDS, HIP_MATRIX, Target

TEMPLATE = "attention/chunk_mma.cu.j2"
HIP_TEMPLATE = "attention/chunk_hip_matrix.cu.j2"
FAMILY = "attention"
KINDS = ("swa", "csa", "hca")
HEADS_PER_BLOCK = 64   # the MMA's M side: 4 tiles of 16 heads
THREADS = 256          # 8 warps
CHUNK = 64             # list entries per chunk (P9)
SMEM_LIMIT = CUDA_SMEM  # the most dynamic shared memory one block may have, per CUDA arch
HIP_CHUNK = 32  # list entries per chunk of the HIP body


def smem_bytes(spec: AttentionSpec, stages: int) -> int:
    """Dynamic shared memory of the kernel (the template's layout): query rows [64][hd + 8] bf16, KV rows
    [stages][64][hd + 8] bf16, bf16(p) [64][72], 11 x 64 floats, codes [2][64] and ``sel`` [topk] ints."""
    ld = spec.head_dim + 8
    return (HEADS_PER_BLOCK * ld * 2 + stages * CHUNK * ld * 2 + HEADS_PER_BLOCK * (CHUNK + 8) * 2
            + 11 * HEADS_PER_BLOCK * 4 + (2 * CHUNK + max(spec.topk if spec.kind == "csa" else 0, 1)) * 4)


def hip_smem_bytes(spec: AttentionSpec) -> int:
    """LDS of the HIP body (its template's layout): KV rows [32][hd + 8] bf16, scores [64][33] f32, bf16(p) [64][40],
    3 x 64 floats, codes [32] and ``sel`` [topk] ints."""
    return (HIP_CHUNK * (spec.head_dim + 8) * 2 + HEADS_PER_BLOCK * (HIP_CHUNK + 1) * 4
            + HEADS_PER_BLOCK * (HIP_CHUNK + 8) * 2 + 3 * HEADS_PER_BLOCK * 4
            + (HIP_CHUNK + max(spec.topk if spec.kind == "csa" else 0, 1)) * 4)


def stages(spec: AttentionSpec, target: Target) -> int:
    """KV stages: 2 where they fit the target's shared memory, else 1 (HIP: 1, the body has one).

    Raises:
        RenderError: the target or the spec is not supported (:func:`check`)."""
    check(spec, target)
    if target.vendor != "cuda":
        return 1
    return 2 if smem_bytes(spec, 2) <= SMEM_LIMIT[target.arch] else 1


def check(spec: AttentionSpec, target: Target) -> None:
    """Raises RenderError (one line) for what the kernel does not build: an arch without a matrix body (gfx1201), a
    kind other than swa / csa / hca, split K, a head_dim not a multiple of 16, or one stage that does not fit the
    target's shared memory."""
    if target.arch not in SMEM_LIMIT and target.arch not in HIP_MATRIX:
        raise RenderError(f"chunk attention: {target.slug} is not supported (mma.sync bf16 on CUDA "
                          f"{'/'.join(SMEM_LIMIT)}; AMD matrix cores on {'/'.join(HIP_MATRIX)})")
    if spec.kind not in KINDS:
        raise RenderError(f"chunk attention: kind {spec.kind!r} is not built (expected one of {', '.join(KINDS)})")
    if spec.splits != 1:
        raise RenderError(f"chunk attention: splits {spec.splits} (a chunk has enough rows; expected 1)")
    if spec.head_dim % 16:
        raise RenderError(f"chunk attention: head_dim {spec.head_dim} is not a multiple of 16")
    need, limit = ((smem_bytes(spec, 1), SMEM_LIMIT[target.arch]) if target.vendor == "cuda"
                   else (hip_smem_bytes(spec), HIP_LDS))
    if need > limit:
        raise RenderError(f"chunk attention: {need} bytes of shared memory for head_dim {spec.head_dim}, "
                          f"{target.arch} has {limit}")


def render_chunk_attention(spec: AttentionSpec, target: Target, name: str, n_stages: int | None = None) -> KernelSource:
    """The kernel of ``spec`` (its ``q`` is the chunk's C rows) for ``target``, named ``name``; ``n_stages`` forces 1
    or 2 KV stages (default :func:`stages`; the tests run both).

    Raises:
        RenderError: see :func:`check`; forced stages that do not fit.
    """
    st = stages(spec, target) if n_stages is None else _forced(spec, target, n_stages)
    params = spec.list_params()  # the lists and scale only: the SIMT kernel's block geometry is not this kernel's
    if target.vendor != "cuda":
        return render(HIP_TEMPLATE, name, FAMILY, target,
                      {**params, "matrix": HIP_MATRIX[target.arch], "smem": hip_smem_bytes(spec)})
    return render(TEMPLATE, name, FAMILY, target, {**params, "stages": st, "smem": smem_bytes(spec, st)})


def _forced(spec: AttentionSpec, target: Target, n: int) -> int:
    check(spec, target)
    if target.vendor != "cuda":
        if n != 1:
            raise RenderError(f"chunk attention: {n} KV stages on {target.arch} (the HIP body has 1)")
        return n
    if n not in (1, 2) or smem_bytes(spec, n) > SMEM_LIMIT[target.arch]:
        raise RenderError(f"chunk attention: {n} KV stages do not fit {target.arch} (expected 1 or 2 within "
                          f"{SMEM_LIMIT[target.arch]} bytes)")
    return n


def launch_shape(spec: AttentionSpec, target: Target, n_stages: int | None = None) -> Launch:
    """The one launch: grid (ceil(H / 64), C), 256 threads, the dynamic shared memory of its stages (HIP: of its
    body)."""
    st = stages(spec, target) if n_stages is None else _forced(spec, target, n_stages)
    smem = smem_bytes(spec, st) if target.vendor == "cuda" else hip_smem_bytes(spec)
    return Launch((-(-spec.heads // HEADS_PER_BLOCK), spec.q, 1), (THREADS, 1, 1), smem, kernel="main")
