"""The matrix-unit chunk attention (runtime/families/chunk_attention.py; templates/attention/chunk_mma.cu.j2 on CUDA,
chunk_hip_matrix.cu.j2 on HIP): its rendering and refusals, and its kernels run on the CPU emulator (every thread a
fiber; ``mma.sync``, ``ldmatrix`` and ``cp.async`` emulated from their PTX definitions, MFMA / WMMA from the AMD
ISA's fragment layouts) against the reference's attention rows on fresh random data, with the output poisoned so
unwritten elements show."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ds4c.runtime.families import attention as A
from ds4c.runtime.families import chunk_attention as CA
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators import launch_emu
from kernel_compile import assert_no_spills, compile_kernel, toolchain_or_skip
from numerics import BF16_ULP


def _spec(kind: str, rows: int, heads: int, hd: int, window: int, cap: int = 0, topk: int = 0, ratio: int = 0):
    return A.AttentionSpec(kind, rows, heads, hd, window, cap, topk, ratio)


def _inputs(spec: A.AttentionSpec, pos: int, live: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    x = {"q": torch.randn(spec.q, spec.heads, spec.head_dim, generator=g).to(bf),
         "ring": torch.randn(spec.window, spec.head_dim, generator=g).to(bf),
         "kv_new": torch.randn(spec.q, spec.head_dim, generator=g).to(bf),
         "sink": torch.randn(spec.heads, generator=g),
         "pos": torch.tensor([pos], dtype=torch.int64)}
    if spec.kind in ("csa", "hca"):
        x["comp"] = torch.randn(spec.cap, spec.head_dim, generator=g).to(bf)
    if spec.kind == "csa":
        sel = torch.randint(0, spec.cap, (spec.q, spec.topk), generator=g)
        sel[torch.rand(spec.q, spec.topk, generator=g) < 0.2] = -1  # masked picks
        sel[:, 64 - spec.window % 64:128 - spec.window % 64] = -1    # one whole chunk of the list masked: skipped
        x["sel"] = sel
    if spec.kind == "hca":
        x["live"] = torch.tensor([live], dtype=torch.int64)
    return x


def _emulate(spec, x, tmp_path, n_stages=None, arch="sm_90", edit=None) -> torch.Tensor:
    """The kernel for ``arch`` on the emulator (``edit``: a function of the rendered source, for mutation tests)."""
    tgt = target(arch)
    src = CA.render_chunk_attention(spec, tgt, "ca", n_stages)
    if edit is not None:
        src = dataclasses.replace(src, source=edit(src.source))
    la = CA.launch_shape(spec, tgt, n_stages)
    bufs = dict(x)
    bufs["out"] = torch.full((spec.q, spec.heads, spec.head_dim), float("nan")).to(torch.bfloat16)
    args = A.arg_names(spec)["main"]
    got = launch_emu.run([(src, la.grid, la.block, args, la.smem)], bufs, tmp_path)
    return got["out"]


def _check(spec, x, got, pos, live):
    want = A.reference(spec, x["q"], x["ring"], x["kv_new"], x.get("comp"), x.get("sel"), x["sink"], pos, live)
    assert not got.isnan().any(), "unwritten output elements"
    # bf16(p) per chunk and the output's rounding, fp32 sums in the MMA's order: 2 bf16 ulps (2^-6 relative)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert torch.allclose(got.float(), want.float(), rtol=2 * BF16_ULP, atol=2e-3), (got.float() - want.float()).abs().max()
    assert err < BF16_ULP, err


def _skip_without_host():
    why = launch_emu.host_unavailable()
    if why:
        pytest.skip(why)


CASES = {
    # window 64, 192-dim heads (pairs 12: warps own 2 or 1), 80 heads (a second head block, 16 of 64 used);
    # rows 5..10 see ring slots and this chunk's rows; the sel list spans 3 chunks, one of them all masked
    "csa": (_spec("csa", 6, 80, 192, 64, cap=200, topk=160), 97, 0),
    # the compressed rows capped per row by (p+1)//4 and by live; 2 chunks
    "hca": (_spec("hca", 5, 64, 128, 64, cap=48, ratio=4), 150, 37),
    # the window at the start of the sequence (p + 1 < W: masked padding), one head block of 16
    "swa": (_spec("swa", 7, 16, 64, 128), 60, 0),
}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_chunk_attention_emulated_matches_reference(kind, tmp_path):
    _skip_without_host()
    spec, pos, live = CASES[kind]
    x = _inputs(spec, pos, live, seed=len(kind))
    _check(spec, x, _emulate(spec, x, tmp_path), pos, live)


def test_one_stage_equals_two_stages(tmp_path):
    """sm_80's one-stage loop (copies after every chunk) gives the bits of the two-stage pipeline."""
    _skip_without_host()
    spec, pos, live = CASES["csa"]
    x = _inputs(spec, pos, live, seed=11)
    one = _emulate(spec, x, tmp_path / "one", n_stages=1)
    two = _emulate(spec, x, tmp_path / "two", n_stages=2)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))
    _check(spec, x, one, pos, live)


def test_official_shapes_render_and_fit():
    """Official flash widths (64 heads of 512, window 128, 512 selected rows): two stages on sm_90 (within 227 KiB),
    one on sm_80 (163 KiB); an AMD arch without a matrix body (gfx1201) and split-K refused in one line."""
    spec = _spec("csa", 2048, 64, 512, 128, cap=1024, topk=512)
    assert CA.stages(spec, target("sm_90")) == 2 and CA.stages(spec, target("sm_80")) == 1
    assert CA.smem_bytes(spec, 2) <= CA.SMEM_LIMIT["sm_90"]
    la = CA.launch_shape(spec, target("sm_90"))
    assert la.grid == (1, 2048, 1) and la.block == (256, 1, 1) and la.smem == CA.smem_bytes(spec, 2)
    src = CA.render_chunk_attention(spec, target("sm_90"), "ds4c_attn_csa")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src.source and "ldmatrix" in src.source
    with pytest.raises(RenderError, match="gfx1201 is not supported"):
        CA.check(spec, target("gfx1201"))
    with pytest.raises(RenderError, match="splits 4"):
        CA.check(A.AttentionSpec("csa", 8, 64, 512, 128, 1024, 512, splits=4), target("sm_90"))
    with pytest.raises(RenderError, match="multiple of 16"):
        CA.check(_spec("swa", 8, 64, 72, 128), target("sm_90"))
    with pytest.raises(RenderError, match="do not fit"):
        CA.render_chunk_attention(spec, target("sm_80"), "x", n_stages=2)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_chunk_attention_compiles_without_spills(arch, tmp_path):
    """nvcc builds the official CSA kernel (the other kinds differ only in their list code) for the arch with no
    spills and no stack frame (the 128 fp32 accumulators of a thread's value product live in registers)."""
    spec = _spec("csa", 2048, 64, 512, 128, cap=1024, topk=512)
    src = CA.render_chunk_attention(spec, target(arch), "ds4c_attn_csa")
    c = compile_kernel(src, tmp_path)
    assert_no_spills(c.usage, src, c.log)


def test_small_head_dim_renders(tmp_path):
    """head_dim 16 (one MMA k step, one value-product column pair) passes the checks and renders: the chunk kernel
    does not need the SIMT kernel's block geometry, which has no block size for it; on the emulator it matches the
    reference with one head and a one-entry window."""
    _skip_without_host()
    spec = _spec("swa", 3, 1, 16, 1)
    CA.check(spec, target("sm_90"))
    x = _inputs(spec, 5, 0, seed=16)
    _check(spec, x, _emulate(spec, x, tmp_path), 5, 0)


# ------------------------------------------------------------------------------------------------ HIP matrix body
HIP_ARCHS = ("gfx1151", "gfx942")  # MFMA (wave 64), gfx11 WMMA (wave 32)


@pytest.mark.parametrize("arch", HIP_ARCHS)
@pytest.mark.parametrize("kind", sorted(CASES))
def test_hip_matrix_emulated_matches_reference(kind, arch, tmp_path):
    """The HIP body on MFMA (gfx942, wave 64) and WMMA (gfx1151, wave 32): every kind's case (a second head block,
    a chunk of the list all masked, the hca caps, the window's start) within the CUDA kernel's bound of the
    reference; its chunks of 32 entries make the online softmax's steps differ from the CUDA kernel's 64."""
    _skip_without_host()
    spec, pos, live = CASES[kind]
    x = _inputs(spec, pos, live, seed=len(kind) + 7)
    _check(spec, x, _emulate(spec, x, tmp_path, arch=arch), pos, live)


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_matrix_layout_mutation_is_caught(arch, tmp_path):
    """The emulator places fragments by the ISA's layouts, written apart from the template's xm_c_row: the body with
    a wrong C row layout (MFMA: neighbouring rows swapped; WMMA: halves instead of interleaved rows) no longer
    matches the reference."""
    _skip_without_host()
    spec, pos, live = CASES["hca"]
    x = _inputs(spec, pos, live, seed=3)
    wrong = ("DS4C_DEVICE int xm_c_row(int lane, int e) { return 4 * (lane >> 4) + e; }",
             "DS4C_DEVICE int xm_c_row(int lane, int e) { return (4 * (lane >> 4) + e) ^ 1; }")
    if arch == "gfx1151":
        wrong = ("DS4C_DEVICE int xm_c_row(int lane, int e) { return 2 * e + (lane >> 4); }",
                 "DS4C_DEVICE int xm_c_row(int lane, int e) { return e + 8 * (lane >> 4); }")

    def edit(text: str) -> str:
        assert wrong[0] in text
        return text.replace(wrong[0], wrong[1])

    got = _emulate(spec, x, tmp_path, arch=arch, edit=edit)
    with pytest.raises(AssertionError):
        _check(spec, x, got, pos, live)


def test_hip_matrix_renders_for_its_archs_and_fits_lds():
    """gfx90a / gfx942 render the MFMA body, gfx1100 / gfx1151 the WMMA one; the official CSA shape's LDS (one chunk
    of 32 KV rows of 512, scores, bf16(p), sel) within 64 KiB; a head_dim whose chunk does not fit is refused."""
    spec = _spec("csa", 2048, 64, 512, 128, cap=1024, topk=512)
    for arch, inst in {"gfx90a": "mfma", "gfx942": "mfma", "gfx1100": "wmma", "gfx1151": "wmma"}.items():
        src = CA.render_chunk_attention(spec, target(arch), "ds4c_attn_csa")
        assert f"__builtin_amdgcn_{inst}_f32_16x16x16" in src.source, arch
        la = CA.launch_shape(spec, target(arch))
        assert la.grid == (1, 2048, 1) and la.block == (256, 1, 1) and la.smem == CA.hip_smem_bytes(spec) <= 65536
    with pytest.raises(RenderError, match="bytes of shared memory"):
        CA.check(_spec("swa", 8, 64, 1024, 128), target("gfx942"))
    with pytest.raises(RenderError, match="HIP body has 1"):
        CA.render_chunk_attention(spec, target("gfx942"), "x", n_stages=2)


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hip_matrix_compiles_without_scratch(arch, tmp_path):
    """clang builds the official CSA kernel for the arch with no VGPR / SGPR spills and no scratch (the 128 fp32
    accumulators of a lane's value product in registers), the matrix instruction in its code."""
    toolchain_or_skip(arch)
    spec = _spec("csa", 2048, 64, 512, 128, cap=1024, topk=512)
    src = CA.render_chunk_attention(spec, target(arch), "ds4c_attn_csa")
    c = compile_kernel(src, tmp_path)
    assert_no_spills(c.usage, src, c.log)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_a_nan_query_stays_in_its_head(arch, tmp_path):
    """A NaN in a query row's head gives NaN in that head only, as the reference does, and every thread still meets
    every barrier and warp-wide MMA: both bodies decide a chunk's skip from its codes, not from a head's scores (from
    the scores, the NaN head's lanes skipped what the rest of the block waited at: a deadlock). Heads 5 and 29 (the
    CUDA body's last score head of a lane group, where its old per-head decision was taken)."""
    _skip_without_host()
    spec, pos, live = CASES["hca"]
    x = _inputs(spec, pos, live, seed=5)
    x["q"][2, 5, 7] = float("nan")
    x["q"][3, 29, 0] = float("nan")
    got = _emulate(spec, x, tmp_path, arch=arch)
    want = A.reference(spec, x["q"], x["ring"], x["kv_new"], x.get("comp"), x.get("sel"), x["sink"], pos, live)
    assert torch.equal(got.float().isnan(), want.float().isnan())
    assert bool(got[2, 5].float().isnan().all()) and bool(got[3, 29].float().isnan().all())
    ok = ~want.float().isnan()
    assert torch.allclose(got.float()[ok], want.float()[ok], rtol=2 * BF16_ULP, atol=2e-3)
