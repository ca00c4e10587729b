"""The indexer's scores stage of a prefill chunk on tensor cores (runtime/families/chunk_indexer.py,
templates/indexer/chunk_scores_mma.cu.j2): its rendering and refusals, nvcc's register use, and its kernel on the CPU
emulator (every thread a fiber; ``mma.sync``, ``ldmatrix`` and ``cp.async`` emulated from their PTX definitions)
against the SIMT stage's exact arithmetic (:func:`indexer.kernel_scores`) and the reference's ids, on fresh random
data with the scores buffer poisoned so unwritten elements show."""

from __future__ import annotations

import pytest
import torch

from ds4c.runtime.families import chunk_indexer as CI
from ds4c.runtime.families import indexer as IX
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators import launch_emu
from kernel_compile import assert_no_spills, compile_kernel
from numerics import BF16_ULP

POISON = 0x7FC1  # a NaN no kernel writes


def _emulate(spec: IX.IndexerSpec, x: dict[str, torch.Tensor], tmp_path, arch: str = "sm_90") -> torch.Tensor:
    why = launch_emu.host_unavailable()
    if why:
        pytest.skip(why)
    src = CI.render_chunk_scores(spec, target(arch), "cis")
    la = CI.launch_shape(spec)
    bufs = {k: x[k] for k in ("qi", "keys", "hw", "positions", "live")}
    bufs["scores"] = torch.full((spec.q, spec.cap), POISON, dtype=torch.int16).view(torch.bfloat16)
    got = launch_emu.run([(src, la.grid, la.block, IX.arg_names(spec)["scores"], la.smem)], bufs, tmp_path)
    return got["scores"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


#: (q, heads, dim, cap, pos, live): 70 rows = a full and a partial row tile, 200 keys = a full and a partial key tile
CASES = {
    # rows see 117..135 keys: the second key tile partly visible, per row; keys past live = cap are never read
    "partial": (70, 8, 64, 200, 467, None),
    # rows see 25..42 keys: the second key tile masked for every row (the block's -inf-only exit)
    "masked_tile": (70, 8, 64, 200, 100, None),
    # live caps every row below its (p + 1) // 4; 16 heads of 128 (8 MMA k steps)
    "live": (40, 16, 128, 256, 560, 145),
    # the prompt's first chunk: rows 0..2 see no key (all -inf), row 69 sees 17
    "first": (70, 8, 64, 200, 0, None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_emulated_scores_equal_the_simt_stage_for_fp4_inputs(case, tmp_path):
    """The model's inputs (qi and keys FP4 fake-quantized, exact score ties, zero keys): every score bit-identical to
    the SIMT stage's arithmetic (every partial sum of a dot is exact in fp32, so the MMA's order gives the same
    bits), -inf past each row's nvalid, every element written; select's ids from them are the reference's."""
    q, h, d, cap, pos, live = CASES[case]
    spec = IX.IndexerSpec(q, h, d, 16, cap, 4)
    x = IX.random_inputs(spec, torch.Generator().manual_seed(len(case)), pos=pos, live=live)
    got = _emulate(spec, x, tmp_path)
    want = IX.kernel_scores(spec, x["qi"], x["keys"], x["hw"], x["positions"], x["live"])
    assert torch.equal(_bits(got), _bits(want)), (_bits(got) != _bits(want)).sum().item()
    nv = IX.nvalid(spec, x["positions"], x["live"])
    assert len(set(nv)) > 1  # rows differ in what they see
    assert (min(nv) == 0) == (case == "first")
    ref = IX.reference(spec, x["qi"], x["keys"], x["hw"], x["positions"], x["live"])
    assert torch.equal(IX.kernel_select(spec, got, x["positions"], x["live"]), ref["out"])


def test_emulated_scores_for_plain_bf16_inputs(tmp_path):
    """Plain bf16 inputs (partial sums not exact): each dot may round to a neighbouring bf16 where its fp32 sum's order
    differs, so a score may differ from the SIMT stage's by a few of its head terms' ulps; the scores as a whole
    within one bf16 ulp (2^-8) relative, most bit-identical, the masking exact."""
    spec = IX.IndexerSpec(70, 8, 64, 16, 200, 4)
    x = IX.random_inputs(spec, torch.Generator().manual_seed(5), fp4=False, pos=467)
    got = _emulate(spec, x, tmp_path)
    want = IX.kernel_scores(spec, x["qi"], x["keys"], x["hw"], x["positions"], x["live"])
    fin = torch.isfinite(want.float())
    assert torch.equal(fin, torch.isfinite(got.float()))
    assert torch.equal(_bits(got)[~fin], _bits(want)[~fin])  # -inf past nvalid
    g, w = got.float()[fin], want.float()[fin]
    assert ((g - w).norm() / w.norm()).item() < BF16_ULP
    assert (g == w).float().mean().item() > 0.9


def test_a_nan_query_stays_in_its_row(tmp_path):
    """A NaN in one row's query spoils that row's scores only (the key tile and the other rows' products are
    unaffected)."""
    spec = IX.IndexerSpec(70, 8, 64, 16, 200, 4)
    x = IX.random_inputs(spec, torch.Generator().manual_seed(9), pos=467)
    x["qi"][3, 5, 7] = float("nan")
    got = _emulate(spec, x, tmp_path)
    want = IX.kernel_scores(spec, x["qi"], x["keys"], x["hw"], x["positions"], x["live"])
    others = torch.arange(spec.q) != 3
    assert torch.equal(_bits(got)[others], _bits(want)[others])
    nv = IX.nvalid(spec, x["positions"], x["live"])[3]
    assert got[3, :nv].float().isnan().all()


def test_official_shapes_render_and_refuse():
    """Official widths (64 heads of 128, a 32K context's 8192 keys, a 2048-row chunk): 84.5 KiB of shared memory, grid
    (64, 32); HIP and a dim that is not a multiple of 16 refused in one line."""
    spec = IX.IndexerSpec(2048, 64, 128, 512, 8192, 4)
    la = CI.launch_shape(spec)
    assert la.grid == (64, 32, 1) and la.block == (256, 1, 1) and la.smem == CI.smem_bytes(spec) == 86528
    src = CI.render_chunk_scores(spec, target("sm_90"), "ds4c_ix")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in src.source and "ldmatrix" in src.source
    with pytest.raises(RenderError, match="gfx942 is not supported"):
        CI.check(spec, target("gfx942"))
    with pytest.raises(RenderError, match="multiple of 16"):
        CI.check(IX.IndexerSpec(2048, 64, 24, 512, 8192, 4), target("sm_90"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_chunk_scores_compile_without_spills(arch, tmp_path):
    """nvcc builds the official kernel with no spills and no stack frame (a thread's 32 score and 32 sum
    accumulators live in registers)."""
    spec = IX.IndexerSpec(2048, 64, 128, 512, 8192, 4)
    src = CI.render_chunk_scores(spec, target(arch), "ds4c_ix")
    c = compile_kernel(src, tmp_path)
    assert_no_spills(c.usage, src, c.log)
