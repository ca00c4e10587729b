"""The experts family (runtime/families/experts.py, templates/experts/): rendering at the official (D 4096,
F 2048, E 256, k 6) and tiny (D 256, F 128, E 16, k 4) shapes, q = 1 and 5; device compiles for sm_90 (both
engines, no spills), gfx942 and gfx1151 (the vendor-neutral SIMT body; skipped with a reason when a compiler
is missing); the CPU reference the GPU check compares against, checked against ds4c.reference / the IR's ops
and against the synthetic tiny model's GGUF bytes; and the kernels' own logic run on the CPU
(tests/emulators/experts_emu.py: every GPU thread a fiber, mma.sync emulated from its fragment layouts)."""

from __future__ import annotations

import dataclasses

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4c.ir.ops import MoeSum, RoutedExperts, Swiglu
from ds4c.reference import primitives as P
from ds4c.runtime.families import experts as X
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from emulators import experts_emu
from kernel_compile import compile_kernel, toolchain_or_skip
from numerics import BF16_ULP

BF16, F32 = torch.bfloat16, torch.float32
ARCHS = ["sm_90", "gfx942", "gfx1151"]
OFFICIAL = dict(hidden=4096, inter=2048, n_experts=256, k=6)
TINY = dict(hidden=256, inter=128, n_experts=16, k=4)
CASES = [(name, shape, q) for name, shape in (("official", OFFICIAL), ("tiny", TINY)) for q in (1, 5)]


def _id(c: tuple) -> str:
    return f"{c[0]}-q{c[2]}"


def _sig_names(src: str, entry: str) -> list[str]:
    sig = src.split(f"{entry}(", 1)[1].split(")", 1)[0]
    return re.findall(r"(\w+)\s*(?:,|$)", sig.replace("\n", " "))


# ------------------------------------------------------------------------------------------------- render
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("arch", ARCHS)
def test_render(case: tuple, arch: str) -> None:
    _, shape, q = case
    spec, t = X.ExpertsSpec(q=q, **shape), target(arch)
    ks = X.render_experts(spec, t)
    assert [k.entry.rsplit("_", 1)[1] for k in ks] == ["up", "down"]
    names = X.arg_names(spec)
    for k, ph in zip(ks, X.PHASES):
        assert k.family == "experts" and not re.search(r"^\s*#include", k.source, re.M)
        assert _sig_names(k.source, k.entry) == names[ph]
        assert "prelude/common.h.j2" in k.templates and f"prelude/{t.vendor}.h.j2" in k.templates
        assert ('asm("mma.sync' in k.source) == (t.vendor == "cuda")
    up, dn = X.launch_shapes(spec, t)
    assert up.grid == (spec.inter // 16, q * spec.k + 1, 1) and dn.grid == (spec.hidden // 16, 1, 1)
    for ln in (up, dn):
        assert ln.block[0] % 32 == 0 and ln.block[0] <= 128 and 0 < ln.smem <= X.SMEM_LIMIT[t.vendor]
    shapes = X.arg_shapes(spec)
    assert shapes["hbuf"][0] == (q, spec.k + 1, spec.inter) and shapes["out"][0] == (q, spec.hidden)
    if shape is OFFICIAL:
        assert shapes["w1"][0] == (256, 2048, 4096 // 32 * 17) and shapes["sh_w2"][0] == (4096, 2048 // 32 * 34)


def test_official_geometry() -> None:
    t = target("sm_90")
    up = X.plan(X.ExpertsSpec(q=5), t, "up")
    assert (up.nw, up.kw) == (4, 1024)
    (rt, sh) = up.geos
    assert (rt.ch, rt.v, rt.rb, rt.rbp, rt.form) == (16, 16, 272, 272, 0)  # f16 MMA, e4m3 activations
    assert (sh.ch, sh.v, sh.rb, sh.form) == (8, 16, 272, 0)
    assert X.plan(X.ExpertsSpec(q=5, shared_fmt="bf16"), t, "up").geos[1].form == 1  # bf16 MMA
    assert X.plan(X.ExpertsSpec(q=5, act_quant=False), t, "up").geos[0].form == 1
    dn = X.plan(X.ExpertsSpec(q=5), t, "down")
    assert (dn.nw, dn.kw, dn.geos[0].ch, dn.geos[1].ch) == (4, 512, 16, 8)
    hip = X.plan(X.ExpertsSpec(q=5), target("gfx942"), "up")
    assert all(g.form == 1 for g in hip.geos) and hip.smem <= 64 * 1024
    # sm_80 has no e4m3 mma: the bf16 MMA for every format
    assert X.plan(X.ExpertsSpec(q=1), target("sm_80"), "up").geos[0].form == 1


def test_stage_choice() -> None:
    """The cp.async ring: chosen (2 stages, the measured best) for the official MXFP4 / Q8_0 shapes on CUDA's
    mma engine where it keeps at least as many blocks per SM as the register path (not q = 5's up phase,
    whose activations take the shared memory), never for SIMT / HIP, K-quants, or chunks that are not 16-byte
    aligned; an explicit count is kept (and named in the key), 0 turns it off."""
    t = target("sm_90")
    for q in (1, 2, 3, 4, 5):
        for ph in ("up", "down"):
            pl = X.plan(X.ExpertsSpec(q=q), t, ph)
            assert pl.stages == (0 if (q, ph) == (5, "up") else X.RING_STAGES), (q, ph)
            assert pl.smem <= X.SMEM_LIMIT["cuda"]
            assert X.SMEM_SM_BYTES // (pl.smem + X.SMEM_BLOCK_RESERVED) >= 2  # two blocks per SM at least
    assert X.plan(X.ExpertsSpec(q=1, engine="simt"), t, "up").stages == 0
    assert X.plan(X.ExpertsSpec(q=5), target("gfx942"), "down").stages == 0
    assert X.plan(X.ExpertsSpec(q=1, routed_fmt="q4_k"), t, "up").stages == 0  # aligned, but a K-quant
    assert X.plan(X.ExpertsSpec(q=1, routed_fmt="q4_k", stages=3), t, "up").stages == 3
    assert X.plan(X.ExpertsSpec(q=5, routed_fmt="q3_k", stages=3), t, "up").stages == 0  # 110-byte super-blocks
    assert X.plan(X.ExpertsSpec(q=1, **TINY), t, "up").stages == 0  # 68-byte chunks
    assert X.plan(X.ExpertsSpec(q=1, stages=0), t, "up").stages == 0
    pl4 = X.plan(X.ExpertsSpec(q=1, stages=4), t, "up")
    assert pl4.stages == 4 and pl4.smem > X.plan(X.ExpertsSpec(q=1, stages=2), t, "up").smem
    assert X.ExpertsSpec(q=1, stages=4).key().endswith("_st4") and "_st" not in X.ExpertsSpec(q=1).key()
    src = X.render_experts(X.ExpertsSpec(q=1), t)[0].source
    assert "cp.async.cg.shared.global" in src and "#define XP_NST 2" in src
    assert "cp.async.cg" not in X.render_experts(X.ExpertsSpec(q=1, stages=0), t)[0].source
    for bad in (1, 9, -1, True, 2.0):
        with pytest.raises(RenderError, match="stages"):
            X.ExpertsSpec(q=1, stages=bad)
    with pytest.raises(RenderError, match="8 stages need"):
        X.plan(X.ExpertsSpec(q=8, hidden=8192, stages=8), t, "up")


def test_k_quant_geometry() -> None:
    """K-quant chunks: whole super-blocks per warp K range; Q3_K / Q6_K chunk rows of 110 / 210 bytes stream the
    u32s around them (MIS); HIP falls back to one super-block per chunk when two overflow its 64 KB; every
    K-quant has the e4m3 (f16 MMA) form with act_quant on sm_90."""
    t = target("sm_90")
    for f in X.KQUANTS:
        for ph in X.PHASES:
            pl = X.plan(X.ExpertsSpec(q=5, routed_fmt=f), t, ph)
            g = pl.geos[0]
            assert pl.kw % 256 == 0 and g.vb == 256 and g.form == 0 and g.rb == g.ch * X.BLOCK_BYTES[f]
            assert pl.kw // 256 % g.ch == 0 and g.rbl % 4 == 0 and g.rbp >= g.rbl
            assert g.mis == (g.rb % 4 != 0 or g.rs % 4 != 0) and g.rbl == (g.rb + 2 if g.mis else g.rb)
    q6 = X.plan(X.ExpertsSpec(q=5, routed_fmt="q6_k"), t, "up").geos[0]
    assert (q6.ch, q6.rb, q6.rbl, q6.v, q6.mis) == (1, 210, 212, 4, 1)
    tiny_q3 = X.plan(X.ExpertsSpec(q=2, **TINY, routed_fmt="q3_k", down_fmt="q8_0"), t, "up")
    assert (tiny_q3.nw, tiny_q3.geos[0].rs, tiny_q3.geos[0].mis) == (1, 110, 1)  # rows of 110 bytes
    hip = X.plan(X.ExpertsSpec(q=5, routed_fmt="q5_k"), target("gfx942"), "up")
    assert hip.geos[0].ch == 1 and hip.smem <= 64 * 1024
    assert X.plan(X.ExpertsSpec(q=5, routed_fmt="q5_k"), t, "up").geos[0].ch == 2


def test_spec_validation() -> None:
    with pytest.raises(RenderError, match="q 0"):
        X.ExpertsSpec(q=0)
    with pytest.raises(RenderError, match="hidden"):
        X.ExpertsSpec(q=1, hidden=200)
    with pytest.raises(RenderError, match="routed_fmt"):
        X.ExpertsSpec(q=1, routed_fmt="q4_0")
    with pytest.raises(RenderError, match="down_fmt q4_k with inter 128 .rows of q4_k are multiples of 256"):
        X.ExpertsSpec(q=1, **TINY, routed_fmt="q4_k")  # tiny's w2 rows hold 128 values
    assert X.ExpertsSpec(q=1, **TINY, routed_fmt="q4_k", down_fmt="q8_0").down_fmt == "q8_0"
    with pytest.raises(RenderError, match="shared_down_fmt q6_k with inter 128"):
        X.ExpertsSpec(q=1, **TINY, shared_fmt="q6_k")
    sp = X.ExpertsSpec(q=1, **TINY, shared_fmt="q6_k", shared_down_fmt="q8_0")
    assert X.arg_shapes(sp)["sh_w2"][0] == (256, 128 // 32 * 34) and "_shdnq8_0" in sp.key()
    with pytest.raises(RenderError, match="engine"):
        X.ExpertsSpec(q=1, engine="wgmma")
    with pytest.raises(RenderError, match="CUDA only"):
        X.render_experts(X.ExpertsSpec(q=1, engine="mma"), target("gfx942"))
    with pytest.raises(RenderError, match="shared memory"):  # HIP LDS is 64 KiB
        X.render_experts(X.ExpertsSpec(q=8, hidden=8192, act_quant=False), target("gfx942"))


# ------------------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("arch", ARCHS)
def test_compile_all(arch: str, tmp_path: Path) -> None:
    """Both kernels of official and tiny at q = 1 and 5 compile (CUDA: both engines, the SIMT one being the
    HIP body); CUDA: no spills, no stack; HIP: no scratch."""
    toolchain_or_skip(arch)
    t = target(arch)
    engines = ("mma", "simt") if t.vendor == "cuda" else ("simt",)
    srcs = [k for _, shape, q in CASES for eng in engines
            for k in X.render_experts(X.ExpertsSpec(q=q, engine=eng, **shape), t)]
    # K-quants at the official shape, q = 5: a format with mins (Q2_K) and one whose chunks start at byte 2 of
    # a u32 (Q6_K), each as shared expert of the other, one per engine (tests/gpu_checks/experts.py and the
    # device build cover every format and engine)
    kq = [("mma", "q2_k", "q6_k"), ("simt", "q6_k", "q2_k")] if t.vendor == "cuda" else [("simt", "q6_k", "q2_k")]
    srcs += [k for eng, rf, sf in kq
             for k in X.render_experts(X.ExpertsSpec(q=5, engine=eng, routed_fmt=rf, shared_fmt=sf, **OFFICIAL), t)]
    if t.vendor == "cuda":  # prequant: the activation quant launches (actq form f16s) and the copying phases
        srcs += X.render_experts(X.ExpertsSpec(q=5, engine="mma", prequant=True, **OFFICIAL), t)
    # the split down phase and its sum launch (ExpertsSpec.down_split), at the rows a lanes step gives it (CUDA 8;
    # HIP's 64 KB of LDS hold the up phase's activations of 5)
    qs = 8 if t.vendor == "cuda" else 5
    eng = "mma" if t.vendor == "cuda" else "simt"  # the SIMT body is HIP's, compiled there
    srcs += [k for k in X.render_experts(X.ExpertsSpec(q=qs, engine=eng, down_split=4, **OFFICIAL), t)
             if k.entry.endswith(("_down", "_sum"))]
    # longest first (official before tiny, q 5 before q 1; a q = 5 official compile takes ~5x a tiny one), so the
    # pool does not end on one long compile while the other workers idle
    srcs.sort(key=lambda k: ("_d4096_" not in k.entry, not k.entry.startswith("experts_q5_")))

    def job(k):
        d = tmp_path / k.entry
        d.mkdir()
        return k, compile_kernel(k, d, require_usage=False)

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(job, srcs))
    report = []
    for k, c in results:
        use = {**c.usage, "seconds": c.seconds}
        report.append(f"{k.entry}: {use}")
        if t.vendor == "cuda":
            assert not use.get("spills"), f"{k.entry} spills: {use}"
            assert use.get("stack_bytes", 0) == 0, f"{k.entry}: stack frame {use}"
            assert use.get("registers", 0) <= 255
        else:  # an SGPR spill goes to VGPR lanes (v_writelane), not memory: only VGPR spills / scratch count
            assert use.get("scratch_bytes", 0) == 0 and not use.get("vgpr_spills"), f"{k.entry}: scratch {use}"
    print("\n".join(report))


# ---------------------------------------------------------------------------------------------- reference
class _Ctx:
    """The interpreter context RoutedExperts.run needs: ``expert(layer, e) -> (w1, w3, w2)``."""

    def __init__(self, fn):
        self.fn = fn

    def expert(self, layer: int, e: int):
        return self.fn(e)


def _ir_moe(spec: X.ExpertsSpec, inp: dict, expert, sh: tuple) -> torch.Tensor:
    """The unfused IR ops of the MoE (routed_experts; shared linear/linear/swiglu/cast/linear; moe_sum)."""
    a = {"layer": 0, "limit": spec.limit, "emulate": spec.act_quant}
    (routed,) = RoutedExperts.run(_Ctx(expert), [inp["x"], inp["ids"], inp["weights"], None], a)
    g = P.linear_q(inp["x"], sh[0], spec.act_quant)
    u = P.linear_q(inp["x"], sh[1], spec.act_quant)
    (h,) = Swiglu.run(None, [g, u], {"limit": spec.limit})
    ys = P.linear_q(h.to(BF16), sh[2], spec.act_quant)
    (y,) = MoeSum.run(None, [routed, ys], {})
    return y


@pytest.mark.parametrize("variant", [dict(), dict(act_quant=False), dict(shared_fmt="bf16"),
                                     dict(routed_fmt="q8_0", shared_fmt="mxfp4", limit=3.5),
                                     dict(routed_fmt="q3_k", down_fmt="q8_0")],
                         ids=["default", "noaq", "shared-bf16", "routed-q8_0", "routed-q3_k"])
@pytest.mark.parametrize("q", [1, 5])
def test_reference_matches_ir_ops(variant: dict, q: int) -> None:
    """reference() on raw bytes == the IR ops on the dequantized weights (fresh random data)."""
    spec = X.ExpertsSpec(q=q, **TINY, **variant)
    inp = X.random_inputs(spec, torch.Generator().manual_seed(10 + q))
    D, F = spec.hidden, spec.inter

    def expert(e: int):
        return tuple(X.dequantize_weight(f, inp[n], r, c, e) for f, n, r, c in
                     ((spec.routed_fmt, "w1", F, D), (spec.routed_fmt, "w3", F, D), (spec.down_fmt, "w2", D, F)))

    sh = tuple(X.dequantize_weight(spec.shared_fmt, inp[n], r, c)
               for n, r, c in (("sh_w1", F, D), ("sh_w3", F, D), ("sh_w2", D, F)))
    got = X.reference(spec, **inp)
    want = _ir_moe(spec, inp, expert, sh)
    assert got.dtype == BF16 and got.shape == (q, D)
    assert torch.equal(got, want)
    assert torch.isfinite(got.float()).all() and got.float().abs().max() > 0


@pytest.mark.parametrize("model", ["tiny_path", "tiny_bf16_path"])
def test_reference_on_model_bytes(model: str, request: pytest.FixtureRequest) -> None:
    """The raw GGUF bytes of the synthetic tiny model (official formats: MXFP4 routed, Q8_0 shared; and the
    bf16 variant) give the model reference's MoE: the layout the kernels read is the file's."""
    from ds4c.sources import open_model
    from ds4c.reference import ReferenceWeights

    path = request.getfixturevalue(model)
    mf = open_model(path)
    w = ReferenceWeights.load(mf)
    cfg, layer = mf.config, 3
    p = f"blk.{layer}."
    fmt = {"MXFP4": "mxfp4", "Q8_0": "q8_0", "BF16": "bf16"}
    rt = fmt[mf.ggml_type(p + "ffn_gate_exps.weight").name]
    shf = fmt[mf.ggml_type(p + "ffn_gate_shexp.weight").name]
    spec = X.ExpertsSpec(q=3, hidden=cfg.hidden_size, inter=cfg.moe_inter, k=cfg.n_active_experts,
                         n_experts=cfg.n_experts, routed_fmt=rt, shared_fmt=shf, limit=cfg.swiglu_limit)

    def raw(n: str) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(mf.raw(p + n)).view(np.uint8).copy())

    ids, wts = X.random_routing(spec, torch.Generator().manual_seed(3))
    x = torch.randn(3, spec.hidden, generator=torch.Generator().manual_seed(4)).to(BF16)
    got = X.reference(spec, x, ids, wts, raw("ffn_gate_exps.weight"), raw("ffn_up_exps.weight"),
                      raw("ffn_down_exps.weight"), raw("ffn_gate_shexp.weight"), raw("ffn_up_shexp.weight"),
                      raw("ffn_down_shexp.weight"))
    lw = w.layers[layer]
    want = _ir_moe(spec, {"x": x, "ids": ids, "weights": wts}, lambda e: w.experts.get(layer, e),
                   (lw.sh_w1, lw.sh_w3, lw.sh_w2))
    assert torch.equal(got, want)
    if model == "tiny_path":
        assert (rt, shf) == ("mxfp4", "q8_0")


def test_random_inputs_valid() -> None:
    spec = X.ExpertsSpec(q=5, **TINY)
    inp = X.random_inputs(spec, torch.Generator().manual_seed(0))
    ids = inp["ids"]
    assert all(len(set(r.tolist())) == spec.k for r in ids)  # distinct per row
    assert len(set(ids.reshape(-1).tolist())) < ids.numel()  # some experts shared by several rows
    assert torch.allclose(inp["weights"].sum(-1), torch.full((5,), 1.5))
    e = inp["w1"].view(-1, 17)[:, 0]
    assert int(e.min()) >= 118 and int(e.max()) <= 124
    assert X.bytes_read(spec, ids) == len(set(ids.reshape(-1).tolist())) * X.expert_bytes(spec) + \
        X.expert_bytes(spec, "q8_0")


# ------------------------------------------------------------------------------------ emulated kernels
EMU_CASES = [("mma", "sm_90", dict(q=1)), ("mma", "sm_90", dict(q=5)), ("simt", "sm_90", dict(q=1)),
             ("simt", "sm_90", dict(q=5)), ("mma", "sm_90", dict(q=4, act_quant=False)),
             ("mma", "sm_80", dict(q=3, shared_fmt="bf16")), ("simt", "sm_90", dict(q=3, routed_fmt="q8_0", shared_fmt="mxfp4")),
             ("mma", "sm_90", dict(q=2, hidden=512, inter=384, limit=3.0))]
# K-quants (D 512, F 256, E 8: w2 rows of 256 = one super-block per warp; Q3_K / Q6_K w2 rows of 110 / 210
# bytes, so rows and chunks start at byte 2 of a u32): every format as routed gate/up, routed down, shared and
# shared down, spread over engines and forms
KQ = dict(hidden=512, inter=256, n_experts=8, k=4)
EMU_CASES += [("mma", "sm_90", dict(q=3, routed_fmt="q2_k", shared_fmt="q4_k", down_fmt="q6_k", shared_down_fmt="q3_k")),
              ("simt", "sm_90", dict(q=3, routed_fmt="q3_k", shared_fmt="q6_k", down_fmt="iq4_xs", shared_down_fmt="q5_k")),
              ("mma", "sm_80", dict(q=3, routed_fmt="q5_k", shared_fmt="iq4_xs", down_fmt="q8_0")),
              ("mma", "sm_90", dict(q=2, routed_fmt="q6_k", shared_fmt="q2_k", act_quant=False))]
# the cp.async ring (16-byte aligned chunks: MXFP4 warps of >= 512 values, Q8_0 of >= 256): auto (2 stages; the
# down phase's ring wraps over the jobs); an up phase of 4 steps through 3 stages (D 4096, whose F 512 gives
# 68-byte down chunks: the register path there); Q8_0 routed at q = 5 with 5 stages
ST = dict(n_experts=8, k=4)
EMU_CASES += [("mma", "sm_90", dict(q=2, hidden=2048, inter=2048, **ST)),
              ("mma", "sm_90", dict(q=3, hidden=4096, inter=512, n_experts=8, k=2, stages=3)),
              ("mma", "sm_90", dict(q=5, hidden=1024, inter=1024, routed_fmt="q8_0", stages=5, **ST))]


# The kernels and the reference hold the same quantized products and differ in fp32 summation order only. That
# order can flip roundings along the chain: the intermediate h (bf16, then e4m3 codes when activations are
# quantized) and the output (bf16). An order difference of k 2^-24 relative (k <= 4096 here) lands near an e4m3
# rounding boundary (spacing 2^-3) for about k 2^-24 / 2^-3 <= 0.2% of the codes (flip_fraction_bound(k,
# float8_e4m3fn) with its margin 4: < 1%); each flip moves its element by one e4m3 ulp (2^-3 relative), so the
# output moves by at most 2^-3 sqrt(0.01) = 1.25e-2 in relative L2, plus one bf16 ulp for h's rounding and one for
# the output's.
EXPERTS_BOUND = 2 * BF16_ULP + 2.0 ** -3 * 0.01 ** 0.5


@pytest.mark.parametrize("engine,arch,kw", EMU_CASES, ids=[f"{e}-{a}-" + "-".join(f"{k}{v}" for k, v in kw.items())
                                                          for e, a, kw in EMU_CASES])
def test_kernels_emulated(engine: str, arch: str, kw: dict, tmp_path: Path) -> None:
    """The rendered kernel bodies, run on CPU threads, match the reference (bf16 output within EXPERTS_BOUND:
    in practice bit-identical, as the fp32 sums of these shapes rarely round differently) and write every
    intermediate."""
    why = experts_emu.host_unavailable()
    if why:
        pytest.skip(why)
    E = experts_emu
    spec = X.ExpertsSpec(**{**(KQ if any(f in X.KQUANTS for f in kw.values()) else TINY), **kw}, engine=engine)
    inp = X.random_inputs(spec, torch.Generator().manual_seed(5))
    got = E.run(spec, inp, tmp_path, arch=arch)
    want = X.reference(spec, **inp)
    assert torch.isfinite(got["hbuf"].float()).all(), "hbuf not fully written"
    assert E.rel_err(got["out"], want) < EXPERTS_BOUND


def test_emulated_ring_without_its_wait_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The emulator's cp.async completes a copy only at the wait_group that covers it: the up phase with its
    wait removed reads tiles that never arrive, and the run fails (a kernel that reads its ring early is
    caught on the CPU)."""
    E = experts_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    spec = X.ExpertsSpec(q=1, hidden=4096, inter=512, n_experts=8, k=2, stages=3, engine="mma")
    real = X.render_experts

    def no_wait(sp, tgt, name=None):
        ks = real(sp, tgt, name)
        up = ks[0]
        assert "xp_cp_wait<XP_NST - 1>();" in up.source
        return [dataclasses.replace(up, source=up.source.replace("xp_cp_wait<XP_NST - 1>();", "", 1))] + ks[1:]

    monkeypatch.setattr(X, "render_experts", no_wait)
    inp = X.random_inputs(spec, torch.Generator().manual_seed(5))
    exe = E.build(spec, tmp_path, arch="sm_90")  # it compiles: the failure below is the run's
    with pytest.raises(RuntimeError, match="cp.async copies never waited for"):
        E.run(spec, inp, tmp_path, arch="sm_90", exe=exe)


def test_prequant_plan() -> None:
    """ExpertsSpec.prequant: four launches (x quantized once, up, h quantized once, down) where every phase reads
    the form-0 activation (CUDA mma, sm_89+, act_quant); elsewhere the two launches of in-block quantization."""
    t = target("sm_90")
    sp = X.ExpertsSpec(q=5, prequant=True)
    assert X.uses_prequant(sp, t) and X.kernel_names(sp, t) == ["actq_x", "up", "actq_h", "down"]
    la = {x.kernel: x for x in X.launch_shapes(sp, t)}
    assert la["actq_x"].grid == (4096 // 128, 5, 1) and la["actq_h"].grid == (2048 // 128, 5 * 7, 1)
    names = X.arg_names(sp, t)
    srcs = X.render_experts(sp, t)
    assert srcs[0].name.endswith("_actq_x") and srcs[2].name.endswith("_actq_h") and "#define XP_PREQ 1" in srcs[1].source
    for k, kn in zip(srcs, X.kernel_names(sp, t)):  # the kernel's parameter count is the argument list's
        sig = k.source[k.source.index(k.entry + "("):]
        sig = sig[:sig.index(")")]
        assert sig.count(",") + 1 == len(names[kn]), (kn, sig)
    shapes = X.arg_shapes(sp)
    assert shapes["xq"] == ((5, 4096), torch.float16) and shapes["hs"] == ((5, 7, 2048 // 128), torch.float32)
    assert sp.key().endswith("_pq") and "_pq" not in X.ExpertsSpec(q=5).key()
    for off in (X.ExpertsSpec(q=5, prequant=True, engine="simt"), X.ExpertsSpec(q=5, prequant=True, act_quant=False),
                X.ExpertsSpec(q=5, prequant=True, shared_fmt="bf16")):
        assert not X.uses_prequant(off, t) and X.kernel_names(off, t) == ["up", "down"]
    assert not X.uses_prequant(sp, target("sm_80")) and not X.uses_prequant(sp, target("gfx942"))
    assert list(X.arg_names(X.ExpertsSpec(q=5, prequant=True, engine="simt"), t)) == ["up", "down"]
    with pytest.raises(RenderError, match="prequant"):
        X.ExpertsSpec(q=1, prequant=1)


def test_down_split_plan() -> None:
    """ExpertsSpec.down_split: the down phase's grid gets the job groups as y, writes ybuf instead of out, and a
    ``sum`` launch (one thread per output element) reads ybuf and the ids and writes out; each kernel's parameter
    count is its argument list's; a bad value is one RenderError naming the field."""
    t = target("sm_90")
    for sp, names in ((X.ExpertsSpec(q=8, prequant=True, down_split=4), ["actq_x", "up", "actq_h", "down", "sum"]),
                      (X.ExpertsSpec(q=3, engine="simt", down_split=2), ["up", "down", "sum"])):
        assert X.kernel_names(sp, t) == names
        la = {x.kernel: x for x in X.launch_shapes(sp, t)}
        assert la["down"].grid == (4096 // 16, sp.down_split, 1)
        assert la["sum"].grid == (4096 // X.SUM_THREADS, sp.q, 1) and la["sum"].block == (X.SUM_THREADS, 1, 1)
        args = X.arg_names(sp, t)
        assert args["down"][-1] == "ybuf" and args["sum"] == ["ybuf", "ids", "out"]
        for k, kn in zip(X.render_experts(sp, t), names):
            sig = k.source[k.source.index(k.entry + "("):]
            sig = sig[:sig.index(")")]
            assert sig.count(",") + 1 == len(args[kn]), (kn, sig)
        assert f"_ds{sp.down_split}" in sp.key()
    assert X.arg_shapes(X.ExpertsSpec(q=8))["ybuf"] == ((8, 7, 4096), torch.bfloat16)
    assert X.kernel_names(X.ExpertsSpec(q=8), t) == ["up", "down"] and "_ds" not in X.ExpertsSpec(q=8).key()
    for bad in (0, X.MAX_SPLIT + 1, True, 2.0):
        with pytest.raises(RenderError, match="down_split"):
            X.ExpertsSpec(q=1, down_split=bad)


# the split down phase: the ring (MXFP4 warps of 512 values) with prequant, more groups than jobs (empty groups
# return at once); the register path (SIMT, tiny); K-quant rows that start at byte 2 of a u32 (Q6_K down)
SPLIT_CASES = [(dict(q=5, hidden=1024, inter=1024, n_experts=8, k=4, engine="mma", prequant=True), 3),
               (dict(q=3, engine="simt", **TINY), 32),
               (dict(q=2, engine="mma", routed_fmt="q4_k", down_fmt="q6_k", **KQ), 3)]


@pytest.mark.parametrize("kw,split", SPLIT_CASES, ids=["ring-prequant", "simt-tiny", "q6_k-down"])
def test_down_split_emulated_equals_one_block(kw: dict, split: int, tmp_path: Path) -> None:
    """The split down phase and its sum launch, run on the CPU emulator, give the one-block down phase's output
    bit for bit (the same y_e, added in the same order), on rows routing mostly to distinct experts with some
    shared (the dedup path's jobs of several columns); 32 groups leave some without a job. ybuf starts poisoned
    with NaN, so a y_e no group wrote shows in the output."""
    E = experts_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    base_spec = X.ExpertsSpec(**kw)
    inp = X.random_inputs(base_spec, torch.Generator().manual_seed(13))
    base = E.run(base_spec, inp, tmp_path / "one")
    assert E.rel_err(base["out"], X.reference(base_spec, **inp)) < EXPERTS_BOUND
    got = E.run(X.ExpertsSpec(**kw, down_split=split), inp, tmp_path / "split")
    assert torch.equal(got["out"], base["out"])


@pytest.mark.parametrize("kw", [dict(q=2, hidden=2048, inter=2048, n_experts=8, k=4),  # the cp.async ring
                                dict(q=5, hidden=512, inter=256, n_experts=8, k=4, routed_fmt="q4_k"),
                                dict(q=3, **TINY)], ids=["ring", "q4_k", "tiny"])
def test_prequant_emulated_equals_in_block_quant(kw: dict, tmp_path: Path) -> None:
    """The prequant call, run on the CPU emulator: x quantized once (the actq kernel's f16 values and scales equal
    ds4c.quant.act_quant_fp8 of x) and every output and intermediate bit for bit the in-block quantization's."""
    E = experts_emu
    why = E.host_unavailable()
    if why:
        pytest.skip(why)
    from ds4c import quant

    spec = X.ExpertsSpec(engine="mma", prequant=True, **kw)
    assert X.uses_prequant(spec, target("sm_90"))
    inp = X.random_inputs(spec, torch.Generator().manual_seed(9))
    (tmp_path / "pq").mkdir()
    (tmp_path / "in_block").mkdir()
    got = E.run(spec, inp, tmp_path / "pq", arch="sm_90")
    base = E.run(X.ExpertsSpec(engine="mma", **kw), inp, tmp_path / "in_block", arch="sm_90")
    qx, sx = quant.act_quant_fp8(inp["x"])
    assert torch.equal(got["xq"].float(), qx) and torch.equal(got["xs"], sx)
    assert torch.equal(got["hbuf"], base["hbuf"]) and torch.equal(got["out"], base["out"])
    assert E.rel_err(got["out"], X.reference(spec, **inp)) < EXPERTS_BOUND
