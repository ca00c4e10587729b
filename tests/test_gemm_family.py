"""The batched-prefill GEMM family (runtime/families/gemm.py, templates/gemm/gemm.cu.j2), on the CPU:

* the torch reference against ``primitives.linear_q`` / ``linear_bf16`` / ``linear_f32`` on the weights decoded
  here by hand from their bytes (MXFP4, Q8_0, bf16; several C, N, K), and the idempotence of the activation
  quant that lets the kernel take a raw or an already-quantized bf16 X;
* the rendered kernel run on CPU threads (tests/emulators/gemm_emu.py: ``mma.sync`` emulated from its fragment layouts,
  the HIP ``xm`` body's MFMA / WMMA from the AMD ISA's), the output poisoned with NaN and followed by a guard tile of
  NaN rows, C and N not multiples of the 64 x 64 tile: every element of rows < C written and within tolerance of the
  reference, no write past row C;
* device compiles: sm_90 (nvcc; no spills, no stack; registers printed) and gfx942 / gfx1151 (clang-19, the
  matrix-core body; the SIMT one on request; no scratch), skipped with the reason when the compiler is missing;
* prequant (``GemmSpec.prequant``: actq form f16s once, then the GEMM copying its X tiles by cp.async): the
  call's plan and fallback rule, and in emulation its output bit for bit the in-tile quant kernel's (MXFP4,
  Q8_0, bn 128, C and N partial tiles, the one-stage pipeline), its workspaces act_quant_fp8's, and a
  missing cp.async wait caught by the emulator;
* bad specs raise RenderError with a one-line message; the GPU check's cases build on the CPU.

Tolerances (emulation; tests/numerics.py derives them): kernel and reference have the same products (codes,
scales and e4m3 values are exact) and differ only in fp32 summation order over K terms. bf16 outputs: every
element equal to the reference's bf16 or one ulp from it (``|y - ref| <= 2^-7 |ref|``), at most ``4 K 2^-16`` of
them (>= 1%) differing; the observed flips are 0 or 1 element per case, and a flip in a short row moves that
row's relative L2 by up to ~1.6e-3 (so the former fixed row bound of 1e-3 failed on CPUs whose MKL orders its
fp32 sums differently, e.g. AVX2-only). fp32 outputs: row rel-L2 <= K 2^-24 (observed 0.7e-7 to 2.7e-7).
The emulator sums each MMA in double; the hardware's fp32 MMA accumulation adds a little more, which the GPU
check's 1e-2 / 1e-4 tolerances (tests/gpu_checks/gemm.py) cover.
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4c import quant
from ds4c.quant import act_quant_dequant
from ds4c.reference import primitives as P
from ds4c.runtime.families import gemm as GM
from ds4c.runtime.render import PDL_CALL, RenderError
from ds4c.runtime.targets import target
from emulators import gemm_emu
from gpu_checks import FAMILIES
from gpu_checks import gemm as gemm_check
from kernel_compile import assert_no_spills, compile_kernel, compiler_missing
from numerics import assert_same_roundings, fp32_order_bound, rel_l2

BF16, F32 = torch.bfloat16, torch.float32
SHAPES = [(20, 64, 256), (64, 128, 128), (77, 96, 512), (1, 40, 384)]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _inputs(spec: GM.GemmSpec, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return GM.random_x(spec, g), GM.random_weight(spec, g)


def _decode(spec: GM.GemmSpec, w: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] of the stored bytes, decoded here (not through ds4c.quant) from the layouts of the spec."""
    n, k = spec.n, spec.k
    if spec.fmt == "bf16":
        return w.float()
    b = w.view(torch.uint8).reshape(n, k // 32, -1)
    if spec.fmt == "q8_0":
        d = b[..., :2].contiguous().view(torch.float16).float()
        return (b[..., 2:].contiguous().view(torch.int8).float() * d).reshape(n, k)
    qs = b[..., 1:].long()
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # element j: byte j low nibble, j+16: high nibble
    scale = torch.pow(2.0, b[..., :1].double() - 127).float()
    return (E2M1[codes] * scale).reshape(n, k)


def _rel_rows(got: torch.Tensor, want: torch.Tensor) -> float:
    return rel_l2(got, want, dim=-1)


def _assert_matches_reference(y: torch.Tensor, want: torch.Tensor, k: int, what: str = "") -> None:
    """The kernel's output against :func:`GM.reference` of the same products (the module docstring's bounds):
    bf16 within one rounding per element, fp32 within the reordering bound of a K-term sum per row."""
    if y.dtype == BF16:
        assert_same_roundings(y, want, k=k, what=what)
    else:
        e = _rel_rows(y, want)
        assert e <= fp32_order_bound(k), (what, e)


# ------------------------------------------------------------------------------------------------ reference
BLOCK_FORMATS = ("mxfp4", "q8_0", "bf16")  # decoded by hand here (the K-quants' dequantizers: test_quant.py)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "c{}-n{}-k{}".format(*s))
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_reference_is_linear_q(fmt: str, shape: tuple) -> None:
    """reference() on the raw bytes == primitives.linear_q on the hand-decoded weight, bit for bit."""
    spec = GM.GemmSpec(*shape, fmt=fmt)
    x, w = _inputs(spec, 3 + shape[0])
    wd = _decode(spec, w)
    assert torch.equal(GM.dequantize_weight(spec, w), wd)
    assert wd.abs().max() > 0 and x.float().abs().max() > 0
    y = GM.reference(spec, x, w)
    assert y.dtype == BF16 and y.shape == (spec.rows, spec.n)
    assert torch.equal(y, P.linear_q(x, wd))
    assert torch.isfinite(y.float()).all() and y.float().abs().max() > 0


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_reference_modes(fmt: str) -> None:
    """The other modes / output dtypes are the primitives they name (spec 2.3, the GEMV family's modes)."""
    kw = dict(rows=33, n=64, k=256, fmt=fmt)
    x, w = _inputs(GM.GemmSpec(**kw), 7)
    wd = _decode(GM.GemmSpec(**kw), w)
    assert torch.equal(GM.reference(GM.GemmSpec(**kw, mode="bf16"), x, w), P.linear_bf16(x, wd))
    assert torch.equal(GM.reference(GM.GemmSpec(**kw, mode="f32"), x, w), P.linear_f32(x, wd))
    assert torch.equal(GM.reference(GM.GemmSpec(**kw, act_quant=False), x, w), P.linear_q(x, wd, False))
    y32 = GM.reference(GM.GemmSpec(**kw, out_dtype="f32"), x, w)
    assert y32.dtype == F32 and torch.equal(y32, P.matmul_rows(act_quant_dequant(x, 128), wd))
    assert torch.equal(y32.to(BF16), P.linear_q(x, wd))


def test_prequantized_activation_is_idempotent() -> None:
    """An X already quantized by actq (bf16 holding e4m3 * 2^k) re-quantizes to itself, so the kernel's
    in-tile quant serves both producers."""
    spec = GM.GemmSpec(80, 64, 512)
    x, w = _inputs(spec, 11)
    xq = act_quant_dequant(x, 128).to(BF16)
    assert torch.equal(xq.float(), act_quant_dequant(x, 128))  # exact in bf16
    assert torch.equal(act_quant_dequant(xq, 128), xq.float())
    assert torch.equal(GM.reference(spec, xq, w), GM.reference(spec, x, w))


# ------------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "gfx942"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_render(fmt: str, arch: str) -> None:
    spec, t = GM.GemmSpec(100, 200, 512, fmt), target(arch)
    src = GM.render_gemm(spec, t)
    assert src.family == "gemm" and not re.search(r"^\s*#include", src.source, re.M)
    body = src.source.split(f"{src.entry}(", 1)[1].split("{", 1)[1]
    assert body.lstrip().startswith(PDL_CALL)
    assert src.programmatic_launch == (arch == "sm_90")
    assert ('asm("mma.sync' in src.source) == (t.vendor == "cuda")
    pl = GM.plan(spec, t)
    assert pl.form == (0 if arch == "sm_90" and fmt != "bf16" else 1)
    assert ("#define GM_HWQ 1" in src.source) == (pl.form == 0)  # cvt.rn.satfinite.e4m3x2 rounding
    sw = GM.render_gemm(GM.GemmSpec(100, 200, 512, fmt, sw_quant=True), t)
    assert "#define GM_HWQ 0" in sw.source
    ln = GM.launch_shape(spec, t)
    assert ln.grid == (2, 4, 1) and ln.block == (128, 1, 1) and 0 < ln.smem <= GM.SMEM_LIMIT[t.vendor]
    assert [a[0] for a in GM.arg_order(spec)] == ["x", "w", "y"]
    assert GM.arg_order(spec)[1][2:] == GM.weight_shape(spec)


def test_hip_bf16_fits_one_stage() -> None:
    """bf16 weights: two stages are 72 KB, over HIP's 64 KiB LDS, so one stage there; two on CUDA."""
    spec = GM.GemmSpec(64, 64, 256, "bf16")
    assert GM.plan(spec, target("sm_90")).nstage == 2
    assert GM.plan(spec, target("gfx942")).nstage == 1
    wide = GM.GemmSpec(100, 300, 256, "mxfp4", bn=128)
    ln = GM.launch_shape(wide, target("sm_90"))
    assert ln.grid == (2, 3, 1) and ln.block == (256, 1, 1)
    assert GM.plan(wide, target("gfx942")).nstage == 2 and GM.plan(GM.GemmSpec(64, 64, 256, "q8_0", bn=128),
                                                                    target("gfx942")).nstage == 1


# ------------------------------------------------------------------------------------ emulated kernels
# (engine, arch, spec): C and N not multiples of 64 somewhere in every format; forms 0 (sm_90 f16 MMA) and 1
# (bf16 MMA: bf16 weights, act_quant off, sm_80), the SIMT body, fp32 and bf16 outputs, every mode
EMU_CASES = [
    ("mma", "sm_90", dict(rows=77, n=96, k=512, fmt="mxfp4")),
    ("mma", "sm_90", dict(rows=20, n=128, k=256, fmt="q8_0")),
    ("mma", "sm_90", dict(rows=70, n=64, k=256, fmt="bf16", mode="bf16")),
    ("mma", "sm_90", dict(rows=33, n=72, k=256, fmt="mxfp4", out_dtype="f32")),
    ("mma", "sm_80", dict(rows=64, n=64, k=384, fmt="q8_0")),
    ("mma", "sm_90", dict(rows=24, n=64, k=128, fmt="q8_0", act_quant=False)),
    ("simt", "sm_90", dict(rows=80, n=100, k=256, fmt="mxfp4")),
    ("simt", "sm_90", dict(rows=17, n=64, k=256, fmt="q8_0", mode="f32")),
    ("simt", "sm_90", dict(rows=65, n=64, k=128, fmt="bf16", out_dtype="f32")),
    # the software e4m3 rounding on the f16 MMA path (the default there is cvt.rn.satfinite.e4m3x2, emulated
    # by emulators/gemm_emu.py's own nearest-value search)
    ("mma", "sm_90", dict(rows=21, n=80, k=256, fmt="mxfp4", sw_quant=True)),
    # 128-row weight tiles (256 threads, 4 x 2 warps), N a partial tile
    ("mma", "sm_90", dict(rows=70, n=200, k=256, fmt="mxfp4", bn=128)),
    ("simt", "sm_90", dict(rows=30, n=128, k=256, fmt="q8_0", bn=128, x_prequant=False)),
    # every K-quant and IQ4_XS (form 0 only): prequant and in-tile quant, bn 64 and 128, fp32 out, N partial; Q3_K
    # / Q6_K rows of two super-blocks (the second 2 bytes past a word); Q2_K / Q3_K / Q6_K weights by cp.async
    ("mma", "sm_90", dict(rows=77, n=96, k=512, fmt="q4_k", prequant=True)),
    ("mma", "sm_90", dict(rows=33, n=72, k=512, fmt="q6_k", out_dtype="f32")),
    ("mma", "sm_90", dict(rows=70, n=200, k=512, fmt="q2_k", bn=128, prequant=True)),
    ("mma", "sm_90", dict(rows=20, n=64, k=512, fmt="q3_k", prequant=True)),
    ("mma", "sm_90", dict(rows=40, n=64, k=256, fmt="q5_k")),
    ("mma", "sm_90", dict(rows=64, n=64, k=256, fmt="iq4_xs", prequant=True)),
    # the HIP matrix-core body (engine xm: MFMA on gfx942, wave 64; gfx11 WMMA on gfx1151, wave 32), B = the X tile's
    # bf16(q*s): MXFP4 with its scale folded into A, Q8_0 scaled per 32-block, bf16 weights and mode, fp32 out,
    # bn 128, N partial; every K-quant and IQ4_XS on wave 64
    ("xm", "gfx942", dict(rows=77, n=96, k=512, fmt="mxfp4")),
    ("xm", "gfx942", dict(rows=20, n=128, k=256, fmt="q8_0", out_dtype="f32")),
    ("xm", "gfx1151", dict(rows=70, n=64, k=256, fmt="bf16", mode="bf16")),
    ("xm", "gfx1151", dict(rows=70, n=200, k=256, fmt="mxfp4", bn=128)),
    ("xm", "gfx1151", dict(rows=33, n=80, k=256, fmt="q8_0")),
    ("xm", "gfx942", dict(rows=77, n=96, k=512, fmt="q4_k")),
    ("xm", "gfx942", dict(rows=33, n=72, k=512, fmt="q6_k", out_dtype="f32")),
    ("xm", "gfx942", dict(rows=70, n=200, k=512, fmt="q2_k", bn=128)),
    ("xm", "gfx942", dict(rows=20, n=64, k=512, fmt="q3_k")),
    ("xm", "gfx942", dict(rows=40, n=64, k=256, fmt="q5_k")),
    ("xm", "gfx942", dict(rows=64, n=64, k=256, fmt="iq4_xs")),
    # one stage (bn 128 K-quant: the late loads beside the single stage's barrier); mode f32 (plain x, fp32 out)
    ("xm", "gfx942", dict(rows=50, n=200, k=512, fmt="q4_k", bn=128)),
    ("xm", "gfx1151", dict(rows=40, n=64, k=256, fmt="q8_0", mode="f32")),
]


@pytest.fixture(scope="module")
def emu_exes(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The host builds of every EMU_CASES kernel, compiled two at a time (the host compile is most of a case's
    time)."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    E, root = gemm_emu, tmp_path_factory.mktemp("gemm-emu")

    def job(i: int) -> tuple[int, Path]:
        eng, arch, kw = EMU_CASES[i]
        return i, E.build(GM.GemmSpec(**kw, engine=eng), root / str(i), arch)

    with ThreadPoolExecutor(2) as ex:
        return dict(ex.map(job, range(len(EMU_CASES))))


@pytest.mark.parametrize("i", range(len(EMU_CASES)),
                         ids=[f"{e}-{a}-" + "-".join(f"{v}" for v in kw.values()) for e, a, kw in EMU_CASES])
def test_kernel_emulated(i: int, emu_exes: dict[int, Path], tmp_path: Path) -> None:
    engine, arch, kw = EMU_CASES[i]
    spec = GM.GemmSpec(**kw, engine=engine)
    x, w = _inputs(spec, 5)
    y, guard = gemm_emu.run(spec, x, w, tmp_path, arch=arch, exe=emu_exes[i])
    want = GM.reference(spec, x, w)
    assert not torch.isnan(y.float()).any(), "unwritten output elements"
    assert torch.isnan(guard.float()).all(), "the kernel wrote rows beyond C"
    _assert_matches_reference(y, want, spec.k)


@pytest.mark.parametrize("engine,kw", [
    ("mma", dict(rows=70, n=72, k=256, fmt="bf16", mode="bf16", groups=3)),  # the prefill wo_a form
    ("mma", dict(rows=64, n=64, k=128, fmt="q8_0", groups=2)),
    ("simt", dict(rows=20, n=40, k=128, fmt="mxfp4", out_dtype="f32", groups=2)),
    ("xm", dict(rows=70, n=72, k=256, fmt="bf16", mode="bf16", groups=3))])  # on gfx942
def test_grouped_kernel_emulated(engine: str, kw: dict, tmp_path: Path) -> None:
    """GemmSpec.groups (the prefill chunk's wo_a): G GEMMs on x's column slices and w's row slices in one launch,
    each group's y columns equal to the ungrouped reference of its slices, nothing past row C written; groups = 1
    renders the ungrouped kernel."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    spec = GM.GemmSpec(**kw, engine=engine)
    x, w = _inputs(spec, 11)
    assert tuple(x.shape) == (spec.rows, spec.groups * spec.k) and w.shape[0] == spec.groups * spec.n
    arch = "gfx942" if engine == "xm" else "sm_90"
    y, guard = gemm_emu.run(spec, x, w, tmp_path, arch=arch)
    assert not torch.isnan(y.float()).any(), "unwritten output elements"
    assert torch.isnan(guard.float()).all(), "the kernel wrote rows beyond C"
    one = dataclasses.replace(spec, groups=1)
    for g in range(spec.groups):
        want = GM.reference(one, x[:, g * spec.k:(g + 1) * spec.k].contiguous(), w[g * spec.n:(g + 1) * spec.n])
        _assert_matches_reference(y[:, g * spec.n:(g + 1) * spec.n], want, spec.k, f"group {g}")
    t = target(arch)
    assert GM.render_gemm(one, t, "e").source == GM.render_gemm(GM.GemmSpec(**{**kw, "groups": 1}, engine=engine), t,
                                                                  "e").source
    assert "GM_NTN" in GM.render_gemm(spec, t, "e").source and "GM_NTN" not in GM.render_gemm(one, t, "e").source
    with pytest.raises(RenderError, match="groups"):
        GM.GemmSpec(**{**kw, "prequant": True})


@pytest.mark.parametrize("engine,fmt,arch", [("mma", "q8_0", "sm_90"), ("simt", "mxfp4", "sm_90"),
                                             ("xm", "q6_k", "gfx942")])
def test_kernel_emulated_prequantized_x(engine: str, fmt: str, arch: str, tmp_path: Path) -> None:
    """An X already quantized by actq: the default kernel (full in-tile quant) gives the same bits as on the raw
    X (the idempotence the module docstring relies on), and so does the ``x_prequant`` kernel, which skips the
    rounding (the f16-MMA form 0 for q8_0; form 1 in the SIMT body and the HIP matrix-core one)."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    E = gemm_emu
    k = 512 if fmt == "q6_k" else 256
    spec = GM.GemmSpec(40, 64, k, fmt, engine=engine)
    x, w = _inputs(spec, 9)
    xq = act_quant_dequant(x, 128).to(BF16)
    exe = E.build(spec, tmp_path / "full", arch)
    y, _ = E.run(spec, x, w, tmp_path / "full", arch=arch, exe=exe)
    yq, _ = E.run(spec, xq, w, tmp_path / "full", arch=arch, exe=exe)
    pre = GM.GemmSpec(40, 64, k, fmt, engine=engine, x_prequant=True)
    yp, guard = E.run(pre, xq, w, tmp_path / "pre", arch=arch)
    assert not torch.isnan(y.float()).any() and torch.isnan(guard.float()).all()
    assert torch.equal(y.view(torch.int16), yq.view(torch.int16))
    assert torch.equal(y.view(torch.int16), yp.view(torch.int16))
    _assert_matches_reference(y, GM.reference(spec, x, w), spec.k)


def test_kernel_emulated_one_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-stage pipeline (HIP's 64 KiB with bf16 weights: a second barrier before each store), forced on
    a CUDA render by a smaller shared-memory limit so the emulator runs it."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    monkeypatch.setitem(GM.SMEM_LIMIT, "cuda", 40 * 1024)
    spec = GM.GemmSpec(50, 64, 512, "bf16", "bf16", engine="simt")
    assert GM.plan(spec, target("sm_90")).nstage == 1
    x, w = _inputs(spec, 13)
    y, guard = gemm_emu.run(spec, x, w, tmp_path)
    assert torch.isnan(guard.float()).all() and not torch.isnan(y.float()).any()
    _assert_matches_reference(y, GM.reference(spec, x, w), spec.k)


# ------------------------------------------------------------------------------------------------ prequant
def _params(src) -> int:
    """The parameter count of the kernel's entry (its first ``(`` after the last ``DS4C_GLOBAL``)."""
    g = src.source.rindex("DS4C_GLOBAL")
    sig = src.source[src.source.index(src.entry + "(", g):]
    return sig[:sig.index(")")].count(",") + 1


def test_prequant_plan() -> None:
    """GemmSpec.prequant on sm_90's mma engine (form 0, MXFP4 / Q8_0, fp8act): two launches (actq f16s, then the
    GEMM on xq / xs), the workspaces, argument lists matching the kernels' parameters; the rendered GEMM copies
    its X tiles with cp.async and has no in-tile quant."""
    t = target("sm_90")
    for fmt in ("mxfp4", "q8_0"):
        sp = GM.GemmSpec(100, 200, 512, fmt, prequant=True)
        assert GM.uses_prequant(sp, t) and GM.kernel_names(sp, t) == ["actq", "gemm"]
        la = GM.launch_shapes(sp, t)
        assert [x.kernel for x in la] == ["actq", "gemm"]
        assert (la[0].grid, la[0].block, la[0].smem) == ((1, 100, 1), (256, 1, 1), 0)  # actq.py: warp layout from 64 rows
        ln = GM.launch_shape(sp, t)
        assert (la[1].grid, la[1].block, la[1].smem) == (ln.grid, ln.block, ln.smem) == ((2, 4, 1), (128, 1, 1),
                                                                                      GM.plan(sp, t).smem)
        names = GM.arg_names(sp, t)
        assert names == {"actq": ["x", "xq", "xs"], "gemm": ["xq", "xs", "w", "y"]}
        srcs = GM.render_call(sp, t, "k")
        assert [k.entry for k in srcs] == ["k_actq", "k"]
        for k, kn in zip(srcs, GM.kernel_names(sp, t)):
            assert _params(k) == len(names[kn]), kn
        g = srcs[1].source
        assert "#define GM_PQ 1" in g and "cp.async.cg.shared.global" in g and "#define GM_HWQ 1" in g
        assert "const u16* DS4C_RESTRICT xq, const float* DS4C_RESTRICT xsg" in g
        assert srcs[1].source == GM.render_gemm(sp, t, "k").source
        assert "#define GM_PQ 0" in GM.render_gemm(GM.GemmSpec(100, 200, 512, fmt), t).source
        assert GM.workspaces(sp, t) == {"xq": ((100, 512), torch.float16), "xs": ((100, 4), torch.float32)}
        assert GM.workspace_bytes(sp, t) == 100 * 512 * 2 + 100 * 4 * 4
        ao = GM.arg_order(sp, t)
        assert [a[:2] for a in ao] == [("xq", "in"), ("xs", "in"), ("w", "in"), ("y", "out")]
        assert ao[2][2:] == GM.weight_shape(sp) and ao[3][2:] == ((100, 200), BF16)
        assert GM.arg_order(sp) == ao  # without a target: as spec.prequant asks
    assert "_pq" in sp.key() and "_pq" not in GM.GemmSpec(100, 200, 512).key() and " pq" in sp.short()


@pytest.mark.parametrize("arch,kw", [
    ("sm_90", dict(engine="simt")), ("sm_80", {}), ("gfx942", {}), ("sm_90", dict(fmt="bf16")),
    ("sm_90", dict(act_quant=False)), ("sm_90", dict(mode="bf16")), ("sm_90", dict(mode="f32")),
], ids=["simt", "sm_80", "hip", "bf16-weights", "noaq", "mode-bf16", "mode-f32"])
def test_prequant_falls_back(arch: str, kw: dict) -> None:
    """Where the tile is not the form-0 activation (bf16 values: SIMT / HIP, sm_80, bf16 weights, act_quant off,
    modes bf16 / f32), prequant is off (the documented rule, GM.uses_prequant): one launch, the in-tile
    kernel's source, bf16 x, no workspaces."""
    t = target(arch)
    kw = dict(dict(rows=100, n=200, k=512, fmt="q8_0"), **kw)
    sp, base = GM.GemmSpec(**kw, prequant=True), GM.GemmSpec(**kw)
    assert not GM.uses_prequant(sp, t) and GM.kernel_names(sp, t) == ["gemm"]
    assert GM.arg_names(sp, t) == {"gemm": ["x", "w", "y"]} and GM.workspaces(sp, t) == {}
    assert GM.workspace_bytes(sp, t) == 0 and GM.arg_order(sp, t) == GM.arg_order(base)
    assert [ln.kernel for ln in GM.launch_shapes(sp, t)] == ["gemm"]
    srcs = GM.render_call(sp, t, "k")
    assert len(srcs) == 1 and srcs[0].source == GM.render_gemm(base, t, "k").source


# (arch, spec fields): C not a multiple of 64 and N a partial tile in each; MXFP4 and Q8_0; bn 128; fp32 out
PQ_CASES = [
    dict(rows=77, n=96, k=512, fmt="mxfp4"),
    dict(rows=20, n=72, k=256, fmt="q8_0"),
    dict(rows=70, n=200, k=256, fmt="mxfp4", bn=128),
    dict(rows=65, n=40, k=384, fmt="q8_0", out_dtype="f32"),
]


def _pq_check(kw: dict, tmp_path: Path, seed: int) -> None:
    E = gemm_emu
    spec, base = GM.GemmSpec(**kw, prequant=True), GM.GemmSpec(**kw)
    assert GM.uses_prequant(spec, target("sm_90"))
    x, w = _inputs(spec, seed)
    y, guard = E.run(spec, x, w, tmp_path / "pq")
    yb, gb = E.run(base, x, w, tmp_path / "in_tile")
    xq, xs = E.read_prequant(spec, tmp_path / "pq")
    qx, sx = quant.act_quant_fp8(x)
    assert torch.equal(xq.float(), qx) and torch.equal(xs, sx)  # the actq launch is spec 2.3.1
    assert not torch.isnan(y.float()).any(), "unwritten output elements"
    assert torch.isnan(guard.float()).all() and torch.isnan(gb.float()).all(), "a kernel wrote rows beyond C"
    iv = torch.int16 if y.dtype == BF16 else torch.int32
    assert torch.equal(y.view(iv), yb.view(iv)), "prequant differs from the in-tile quant"
    _assert_matches_reference(y, GM.reference(spec, x, w), spec.k)


@pytest.mark.parametrize("kw", PQ_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_prequant_emulated_equals_in_tile_quant(kw: dict, tmp_path: Path) -> None:
    """The prequant call (actq, then the GEMM copying xq / xs) on the CPU emulator: the workspaces are
    act_quant_fp8 of x, and y is the in-tile quant kernel's bit for bit (the same e4m3 values and scales in the
    same MMA order); rows past C unwritten."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    _pq_check(kw, tmp_path, 21)


#: the cp.async pipeline (stages 3): partial C and N tiles, weight units of 4 (MXFP4, Q3_K), 8 (Q8_0) and 16 bytes
#: (Q4_K), bn 128, fp32 out
PIPE_CASES = PQ_CASES + [dict(rows=70, n=72, k=512, fmt="q3_k"), dict(rows=33, n=130, k=256, fmt="q4_k", bn=128)]


@pytest.mark.parametrize("eager", [False, True], ids=["cp-at-wait", "cp-at-issue"])
@pytest.mark.parametrize("kw", PIPE_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_pipeline_emulated_equals_two_stages(kw: dict, eager: bool, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``stages`` 3 (the cp.async pipeline: every step's weights, X tile and scales copied straight into one of three
    stages, two in flight) on the CPU emulator, its cp.async copies landing at their wait (a read before the wait
    sees old bytes) and, ``eager``, at their issue (a copy issued into a stage another thread still reads overwrites
    its operands): y is the 2-stage prequant kernel's bit for bit (the same MMAs in the same order), rows past C
    unwritten; without prequant (or off the form-0 path) the request renders the 2-stage kernel."""
    E = gemm_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    if eager:
        monkeypatch.setenv("DS4C_EMU_CP_EAGER", "1")
    t = target("sm_90")
    spec, base = GM.GemmSpec(**kw, prequant=True, stages=3), GM.GemmSpec(**kw, prequant=True)
    pl = GM.plan(spec, t)
    assert pl.pipe and pl.nstage == 3 and pl.smem == 3 * pl.stage_bytes and "_st3" in spec.key()
    assert "_st3" not in GM.GemmSpec(**kw, stages=3).key()  # no prequant: the 2-stage kernel, its name
    x, w = _inputs(spec, 29)
    y, guard = E.run(spec, x, w, tmp_path / "pipe")
    yb, _ = E.run(base, x, w, tmp_path / "two")
    assert not torch.isnan(y.float()).any(), "unwritten output elements"
    assert torch.isnan(guard.float()).all(), "a kernel wrote rows beyond C"
    iv = torch.int16 if y.dtype == BF16 else torch.int32
    assert torch.equal(y.view(iv), yb.view(iv)), "the 3-stage pipeline differs from the 2-stage kernel"
    plain = GM.GemmSpec(**kw, stages=3)  # no prequant: the request does not apply
    assert not GM.plan(plain, t).pipe and GM.plan(plain, t).nstage == 2
    assert "gm_issue" not in GM.render_gemm(plain, t, "k").source and "gm_issue" in GM.render_gemm(spec, t, "k").source


#: e4m3 X tiles (GemmSpec.xfmt): MXFP4 with partial C / N tiles, Q8_0 at bn 128 with fp32 out, a K-quant, the
#: pipeline with 4-byte weight units
E4_CASES = [dict(rows=77, n=96, k=512, fmt="mxfp4"), dict(rows=65, n=40, k=384, fmt="q8_0", bn=128, out_dtype="f32"),
            dict(rows=70, n=72, k=512, fmt="q3_k"), dict(rows=70, n=200, k=256, fmt="mxfp4", stages=3)]


@pytest.mark.parametrize("kw", E4_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_e4m3_tiles_emulated_equal_f16_tiles(kw: dict, tmp_path: Path) -> None:
    """``xfmt`` e4m3 (actq form e4m3s, the X tile of one-byte codes, B fragments by the exact e4m3 -> f16 cvt) on the
    CPU emulator: ``xq`` holds act_quant_fp8's values as e4m3 bytes (every element written over the NaN poison), y is
    the f16-tile call's bit for bit, rows past C unwritten; the plan's stage is 64 x 128 bytes smaller; off the form-0
    path (HIP) the request falls back with prequant."""
    E = gemm_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    t = target("sm_90")
    spec, base = GM.GemmSpec(**kw, prequant=True, xfmt="e4m3"), GM.GemmSpec(**kw, prequant=True)
    pl = GM.plan(spec, t)
    assert pl.e4x and GM.plan(base, t).stage_bytes - pl.stage_bytes == GM.BM * 128 and "_x8" in spec.key()
    assert GM.workspaces(spec, t)["xq"] == ((spec.rows, spec.k), torch.float8_e4m3fn)
    srcs = GM.render_call(spec, t, "k")
    assert srcs[0].params["form"] == "e4m3s" and "const u8* DS4C_RESTRICT xq" in srcs[1].source
    assert not GM.uses_prequant(spec, target("gfx942")) and not GM.plan(spec, target("gfx942")).e4x
    x, w = _inputs(spec, 31)
    y, guard = E.run(spec, x, w, tmp_path / "e4")
    yb, _ = E.run(base, x, w, tmp_path / "f16")
    xq, xs = E.read_prequant(spec, tmp_path / "e4")
    qx, sx = quant.act_quant_fp8(x)
    assert xq.dtype == torch.float8_e4m3fn and torch.equal(xq.float(), qx) and torch.equal(xs, sx)
    assert not torch.isnan(y.float()).any(), "unwritten output elements"
    assert torch.isnan(guard.float()).all(), "a kernel wrote rows beyond C"
    iv = torch.int16 if y.dtype == BF16 else torch.int32
    assert torch.equal(y.view(iv), yb.view(iv)), "the e4m3 tiles differ from the f16 tiles"


def test_prefill_lowering_gemm_xq(monkeypatch: pytest.MonkeyPatch) -> None:
    """DS4C_PREFILL_GEMM_XQ=e4m3: every prequant projection GEMM of a prefill chunk reads e4m3 tiles (its actq
    launches form e4m3s, the ``ds4c_gemm_xq`` workspace one byte a value); unset: f16 (the default until its GPU
    run); a bad word: one line."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.settings import SettingsError

    g = run_pipeline(build_step(preset("tiny"), 64, max_ctx=128, prefill=True), "default", context=128).graph

    def launches(value: str | None) -> list:
        monkeypatch.setenv("DS4C_PREFILL_GEMM_XQ", value) if value else monkeypatch.delenv("DS4C_PREFILL_GEMM_XQ",
                                                                                           raising=False)
        return [la for k in lower_graph(g, preset("tiny"), target("sm_90"), pending=[]) if k.family == "gemm"
                for la in k.launches]

    e4, f16 = launches("e4m3"), launches(None)
    pq = [la for la in e4 if la.kernel.params.get("prequant")]
    assert pq and all(la.kernel.params["e4x"] for la in pq)
    assert {la.kernel.params["form"] for la in e4 if "form" in la.kernel.params and la.kernel.entry.endswith("actq")
            } == {"e4m3s"}
    assert not any(la.kernel.params.get("e4x") for la in f16) and len(f16) == len(e4)
    xq = {a.nbytes for la in pq for a in la.args if a.name == "ds4c_gemm_xq"}
    xq16 = {a.nbytes for la in f16 for a in la.args if a.name == "ds4c_gemm_xq"}
    assert xq and {2 * n for n in xq} == xq16
    with pytest.raises(SettingsError) as ei:
        launches("bf16")
    assert "DS4C_PREFILL_GEMM_XQ" in str(ei.value) and "\n" not in str(ei.value)


def test_prequant_emulated_one_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The single-stage pipeline with prequant (the copies of step k+1 issued only after the barrier that ends
    step k's reads), forced by a smaller shared-memory limit."""
    why = gemm_emu.host_unavailable()
    if why:
        pytest.skip(why)
    monkeypatch.setitem(GM.SMEM_LIMIT, "cuda", 40 * 1024)
    kw = dict(rows=50, n=64, k=512, fmt="mxfp4")
    assert GM.plan(GM.GemmSpec(**kw, prequant=True), target("sm_90")).nstage == 1
    _pq_check(kw, tmp_path, 23)


def test_prequant_emulator_catches_missing_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its cp.async waits the GEMM ends its blocks with copies in flight: the emulator aborts."""
    E = gemm_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    real = GM.render_gemm

    def no_wait(spec, tgt, name=None):
        k = real(spec, tgt, name)
        assert "  gm_cp_wait_all();" in k.source
        return dataclasses.replace(k, source=k.source.replace("  gm_cp_wait_all();", "  "))

    monkeypatch.setattr(GM, "render_gemm", no_wait)
    spec = GM.GemmSpec(30, 64, 256, "q8_0", prequant=True)
    x, w = _inputs(spec, 3)
    exe = E.build(spec, tmp_path)  # it compiles: the failure is the run's
    with pytest.raises(RuntimeError, match="cp.async copies never waited for"):
        E.run(spec, x, w, tmp_path, exe=exe)


# -------------------------------------------------------------------------------------- device compiles
COMPILE_CASES = [("mxfp4", "fp8act"), ("q8_0", "fp8act"), ("bf16", "bf16"), ("q8_0", "bf16")]


@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_device_compile(arch: str, tmp_path: Path) -> None:
    """Official-sized kernels (C 4096, N 4096, K 4096) compile without spills or local / scratch memory;
    sm_90 and gfx942 also with the SIMT engine; the HIP archs' default is the matrix-core body (xm), gfx942's with
    K-quants too. Registers printed (pytest -s)."""
    t = target(arch)
    specs = [GM.GemmSpec(4096, 4096, 4096, f, m) for f, m in COMPILE_CASES]
    specs.append(GM.GemmSpec(4096, 4096, 4096, "mxfp4", x_prequant=True))
    specs += [GM.GemmSpec(4096, 4096, 4096, f, bn=128) for f in ("mxfp4", "q8_0")]
    specs.append(GM.GemmSpec(4096, 4096, 4096, "q8_0", sw_quant=True))
    # prequant (on gfx942 the in-tile fallback): the GEMM copying xq / xs, and (CUDA) its actq launch
    specs += [GM.GemmSpec(4096, 4096, 4096, f, prequant=True) for f in ("mxfp4", "q8_0")]
    specs.append(GM.GemmSpec(4096, 4096, 4096, "q8_0", bn=128, prequant=True))
    # e4m3 X tiles (CUDA; elsewhere the in-tile fallback): Q8_0 (the most registers) and the pipelined MXFP4
    specs += [GM.GemmSpec(4096, 4096, 4096, "q8_0", prequant=True, xfmt="e4m3"),
              GM.GemmSpec(4096, 4096, 4096, "mxfp4", prequant=True, stages=3, xfmt="e4m3")]
    if arch != "gfx1151":
        specs.append(GM.GemmSpec(4096, 4096, 4096, "q8_0", engine="simt"))
    if t.vendor == "cuda" or t.wave == 64:
        # K-quants (form 0 / wave-64 xm): with a min term and chained halves (Q4_K), per-16 mins and cp.async
        # weights on CUDA (Q2_K), neither (Q6_K, the in-tile quant: the most registers)
        specs += [GM.GemmSpec(4096, 4096, 4096, "q4_k", prequant=True), GM.GemmSpec(4096, 4096, 4096, "q2_k", bn=128,
                  prequant=True), GM.GemmSpec(4096, 4096, 4096, "q6_k")]
    why = compiler_missing(arch)
    if why:
        pytest.skip(f"no compiler for {arch}: {why}")
    pq = GM.GemmSpec(4096, 4096, 4096, "mxfp4", prequant=True)
    assert GM.uses_prequant(pq, t) == (t.vendor == "cuda")
    srcs = [(s, GM.render_gemm(s, t)) for s in specs] + [(pq, k) for k in GM.render_call(pq, t)[:-1]]

    def job(i: int) -> tuple[GM.GemmSpec, object, object]:
        spec, src = srcs[i]
        d = tmp_path / str(i)
        d.mkdir()
        return spec, src, compile_kernel(src, d)

    lines = []
    with ThreadPoolExecutor(2) as ex:
        built = list(ex.map(job, range(len(srcs))))
    for spec, src, c in built:
        if t.vendor == "hip" and spec.fmt == "q6_k":
            # the one known exception: the Q6_K decode beside the in-tile quant spills ~23 SGPRs into VGPR lanes on
            # gfx942 (v_writelane / v_readlane, no memory); no VGPR spill and no scratch
            assert c.usage.get("vgpr_spills", 0) == 0 and c.usage.get("scratch_bytes", 0) == 0, c.log
            assert c.usage.get("sgpr_spills", 0) <= 32, c.log
        else:
            assert_no_spills(c.usage, src, c.log)
        assert c.usage.get("registers", 0) <= 256
        kn = "actq" if src.entry.endswith("_actq") else "gemm"
        lines.append(f"{arch} {spec.short()} {GM.resolve_engine(spec, t)} {kn}: "
                     f"{c.usage.get('registers')} registers, smem {GM.plan(spec, t).smem} B")
    print("\n" + "\n".join(lines))  # shown with pytest -s


# ------------------------------------------------------------------------------------------- bad specs
@pytest.mark.parametrize("kw,needle", [
    (dict(rows=64, n=64, k=200), "k 200 (expected a positive multiple of 128"),
    (dict(rows=64, n=64, k=64), "k 64 (expected a positive multiple of 128"),
    (dict(rows=64, n=64, k=128, fmt="q4_k"), "k 128 with q4_k (expected a multiple of 256: whole super-blocks"),
    (dict(rows=64, n=64, k=256, fmt="q3_k"), "k 256 with q3_k (expected a multiple of 512"),
    (dict(rows=64, n=64, k=256, fmt="f32"), "fmt 'f32' (expected one of ('mxfp4', 'q8_0', 'bf16', 'q2_k'"),
    (dict(rows=0, n=64, k=256), "rows 0 (expected an int in 1.."),
    (dict(rows=64, n=64, k=256, mode="fp4"), "mode 'fp4' (expected one of"),
    (dict(rows=64, n=64, k=256, out_dtype="f16"), "out_dtype 'f16' (expected one of"),
    (dict(rows=64, n=64, k=256, mode="bf16", x_prequant=True), "x_prequant with mode 'bf16' and act_quant True"),
    (dict(rows=64, n=64, k=256, bn=96), "bn 96 (expected 0 or one of (64, 128))"),
    (dict(rows=64, n=64, k=256, bn=128.0), "bn 128.0 (expected 0 or one of (64, 128))"),
    (dict(rows=64, n=64, k=256, prequant=1), "prequant 1 (expected a bool)"),
    (dict(rows=64, n=64, k=256, prequant=True, x_prequant=True), "prequant with x_prequant (expected at most one"),
    (dict(rows=64, n=64, k=256, xfmt="e4m3"), "xfmt e4m3 without prequant"),
    (dict(rows=64, n=64, k=256, prequant=True, xfmt="e5m2"), "xfmt 'e5m2' (expected one of ('f16', 'e4m3'))"),
])
def test_bad_spec(kw: dict, needle: str) -> None:
    with pytest.raises(RenderError) as ei:
        GM.GemmSpec(**kw)
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize("arch,kw", [("sm_80", {}), ("gfx1151", {}), ("gfx942", dict(engine="simt")),
                                     ("gfx942", dict(mode="bf16")), ("gfx1201", {}), ("sm_90", dict(engine="simt")),
                                     ("sm_90", dict(mode="bf16")), ("sm_90", dict(act_quant=False))])
def test_kquants_refuse_off_the_f16_mma_path(arch: str, kw: dict) -> None:
    """K-quant weights run only on form 0 (the f16 MMA on e4m3 activations, CUDA sm_89+) and on wave-64 AMD matrix
    cores (engine xm, fp8act with act_quant): elsewhere (wave-32 RDNA, the SIMT engine, other modes, sm_80) render
    and launch_shape refuse in one line (a lowering then keeps the chunk graph pending or refuses it)."""
    spec = GM.GemmSpec(64, 64, 512, "q4_k", **kw)
    for fn in (GM.render_gemm, GM.launch_shape):
        with pytest.raises(RenderError, match="K-quant weights run only on the f16 MMA") as ei:
            fn(spec, target(arch))
        assert "\n" not in str(ei.value)


def test_bad_engine_and_reference_input() -> None:
    with pytest.raises(RenderError, match="CUDA only, found target hip-gfx942"):
        GM.render_gemm(GM.GemmSpec(64, 64, 256, engine="mma"), target("gfx942"))
    spec = GM.GemmSpec(8, 64, 256)
    x, w = _inputs(spec, 1)
    with pytest.raises(RenderError, match=r"x must be bf16 \[8, 256\], found torch.float32"):
        GM.reference(spec, x.float(), w)


# --------------------------------------------------------------------------------------- the GPU check
def test_gpu_check_cases_build_on_cpu() -> None:
    """tests/gpu_checks/gemm.py imports without a GPU, every case renders for sm_90, and its input builder
    gives the shapes and the NaN-poisoned output with its guard rows."""
    assert "gemm" in FAMILIES
    cs = gemm_check.cases()
    assert len(cs) == len({n for n, _ in cs}) and any(s.engine == "simt" for _, s in cs)
    names = dict(cs)
    assert all(names[sw].sw_quant and not names[hw].sw_quant and names[sw].rows == names[hw].rows
               for sw, hw in gemm_check.TWINS)
    assert all(names[pq].prequant and not names[it].prequant
               and dataclasses.replace(names[pq], prequant=False) == names[it] for pq, it in gemm_check.PQ_TWINS)
    assert all(names[st].stages == 3 and dataclasses.replace(names[st], stages=0) == names[two]
               for st, two in gemm_check.ST_TWINS)
    assert all(names[x8].xfmt == "e4m3" and dataclasses.replace(names[x8], xfmt="f16") == names[f16]
               for x8, f16 in gemm_check.X8_TWINS)
    assert torch.isnan(gemm_check.workspace_buffers(names["pq_x8_partial_q8_c77"], target("sm_90"),
                                                    "cpu")["xq"].float()).all()  # e4m3fn NaN poison
    for n, s in cs:
        ks = GM.render_call(s, target("sm_90"), f"gemm_{n}")
        assert len(ks) == (2 if s.prequant else 1)
    pq = GM.GemmSpec(20, 64, 256, "q8_0", prequant=True)
    ws = gemm_check.workspace_buffers(pq, target("sm_90"), "cpu")
    assert ws["xq"].shape == (20, 256) and ws["xs"].shape == (20, 2) and torch.isnan(ws["xq"]).all()
    spec = GM.GemmSpec(20, 64, 256, "q8_0")
    x, w, ybuf = gemm_check.case_buffers(spec, torch.Generator().manual_seed(0), "cpu")
    assert x.shape == (20, 256) and x.dtype == BF16
    assert (tuple(w.shape), w.dtype) == GM.weight_shape(spec)
    assert ybuf.shape == (20 + GM.BM, 64) and torch.isnan(ybuf.float()).all()
