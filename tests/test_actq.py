"""The activation quant launch's two layouts (runtime/families/actq.py): the ``block`` render is the template's
original text (the decode kernels validated on the H200 are unchanged); the ``warp`` layout for many rows writes,
on the CPU emulation, exactly ``ds4c.quant.act_quant_fp8``'s values and scales, in every form, with every element
written over NaN poison and nothing past the last row; both layouts compile for sm_90 and gfx942."""

from __future__ import annotations

import pytest
import torch

from ds4c import quant
from ds4c.runtime.families import actq as A
from ds4c.runtime.render import RenderError, render
from ds4c.runtime.targets import target
from emulators import launch_emu
from emulators.experts_emu import host_unavailable


def _emu():
    why = host_unavailable()
    if why:
        pytest.skip(why)
    return launch_emu


def test_layout_rule_and_launch_shapes():
    t = target("sm_90")
    assert A.layout_for(63) == "block" and A.layout_for(64) == "warp"
    assert A.actq_launch(4096, 5, t).grid == (32, 5, 1) and A.actq_launch(4096, 5, t).block == (128, 1, 1)
    la = A.actq_launch(4096, 4096, t)
    assert la.grid == (1, 4096, 1) and la.block == (256, 1, 1) and la.smem == 0  # 8 warps x 4 blocks = a row
    assert A.actq_launch(1024, 64, t).grid == (1, 64, 1)
    assert A.actq_launch(8192, 64, t).grid == (2, 64, 1)
    assert A.actq_launch(4096, 100, target("gfx942")).block == (512, 1, 1)  # wave 64


def test_block_layout_renders_the_original_text():
    for arch in ("sm_90", "gfx942"):
        for form in ("bf16", "f16s"):
            params = {"k": 1024} if form == "bf16" else {"k": 1024, "form": form}
            old = render(A.TEMPLATE, "t", "gemm", target(arch), params).source
            assert A.render_actq("t", "gemm", target(arch), 1024, 8, form).source == old
            assert "AQ_ITER" not in old and "AQ_ITER" in A.render_actq("t", "gemm", target(arch), 1024, 64, form).source


@pytest.mark.parametrize("bad, what", [(dict(k=100), "k 100"), (dict(rows=0), "rows 0"), (dict(rows=70000), "rows 70000"),
                                       (dict(form="x"), "form 'x'")])
def test_bad_shapes_are_one_line_errors(bad, what):
    kw = dict(k=256, rows=64, form="f16s") | bad
    with pytest.raises(RenderError, match=what):
        A.render_actq("t", "gemm", target("sm_90"), kw["k"], kw["rows"], kw["form"])


@pytest.mark.parametrize("rows, k, form", [(64, 384, "f16s"), (70, 1152, "f16s"), (65, 256, "bf16"), (80, 128, "f16s"),
                                           # bf16p (the wgmma grouped experts' activations) in both layouts
                                           (66, 384, "bf16p"), (5, 256, "bf16p"),
                                           # e4m3s (the grouped experts' one-byte tiles) in both layouts
                                           (70, 1152, "e4m3s"), (5, 384, "e4m3s")])
def test_warp_layout_equals_the_reference_quant(rows, k, form, tmp_path):
    """Rows with a wide dynamic range (some 128-blocks tiny, so the 1e-4 amax floor is hit, some past 448) and
    k = 1152 (9 blocks: a partial last group of 8 warps x iters)."""
    emu = _emu()
    g = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-6, 3, k // 128).repeat_interleave(128)).to(torch.bfloat16)
    src = A.render_actq("aq", "gemm", target("sm_90"), k, rows, form)
    la = A.actq_launch(k, rows, target("sm_90"))
    dt = {"f16s": torch.float16, "e4m3s": torch.float8_e4m3fn}.get(form, torch.bfloat16)
    out = torch.full((rows + 1, k), float("nan"), dtype=dt)
    bufs = {"x": x, "out": out}
    args = ["x", "out"]
    if form in ("f16s", "bf16p", "e4m3s"):
        bufs["s"] = torch.full((rows + 1, k // 128), float("nan"), dtype=torch.float32)
        args.append("s")
    got = emu.run([(src, la.grid, la.block, args)], bufs, tmp_path)
    q, s = quant.act_quant_fp8(x)
    if form in ("f16s", "e4m3s"):  # e4m3s: every code's value (its zeros' signs too) as the quant gives it
        assert torch.equal(got["out"][:rows].float(), q) and torch.equal(got["s"][:rows], s)
        assert torch.equal(got["out"][:rows].float().signbit(), q.signbit())
        assert torch.isnan(got["s"][rows]).all()
    else:
        want = (q.view(rows, -1, 128) * s.unsqueeze(-1)).view(rows, k).to(torch.bfloat16)
        if form == "bf16p":  # value i at bf16p_positions[i]; the scales as f16s writes them
            perm = torch.empty_like(want)
            perm[:, torch.tensor(A.bf16p_positions(k))] = want
            want = perm
            assert torch.equal(got["s"][:rows], s) and torch.isnan(got["s"][rows]).all()
        assert torch.equal(got["out"][:rows], want)
    assert torch.isnan(got["out"][rows].float()).all()


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_both_layouts_compile_without_spills(arch, tmp_path):
    from kernel_compile import assert_no_spills, compile_kernel

    for rows in (8, 64):
        src = A.render_actq("aq", "gemm", target(arch), 4096, rows, "f16s")
        (tmp_path / str(rows)).mkdir()
        c = compile_kernel(src, tmp_path / str(rows))
        assert_no_spills(c.usage, src, c.log)
