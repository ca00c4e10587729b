"""Lowering prefill chunk graphs (runtime/lower_prefill.py, issue 12): every plan kernel of a C-row chunk graph
lowers to family launches whose arguments bind to graph values, weights, step scalars and sized workspaces that
exist, except the pending ones (routed experts, wo_a + ring write, the take_row head), which are reported with a
one-line reason; projections are GEMM calls (one shared actq, one GEMM per output, sized to C rows); the
compressor reads n_valid; HC stage mix runs over row blocks; a representative subset compiles for sm_90.
CPU only: nothing here runs a kernel (docs/prefill.md says what needs the GPU)."""

from __future__ import annotations

import math
import re
import shutil

import pytest

from ds4c.config import preset
from ds4c.ir import build_step
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.families import gemm as G
from ds4c.runtime.families.compressor import CompressorSpec, render_compressor
from ds4c.runtime.families.hc import HcSpec, launch_shapes as hc_launch_shapes, render_hc
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lower_prefill import PendingLowering
from ds4c.runtime.targets import target
from ds4c.tensors import tensor_specs

STEP = {"pos", "positions", "tokens", "n_valid"}
PENDING = {"moe_experts"}
_CACHE: dict = {}


def _graph(name: str, c: int, ctx: int):
    key = (name, c, ctx)
    if key not in _CACHE:
        _CACHE[key] = run_pipeline(build_step(preset(name), c, max_ctx=ctx, prefill=True), "default",
                                   context=ctx).graph
    return _CACHE[key]


def _n_params(la) -> int:
    src = re.sub(r"//[^\n]*", "", la.kernel.source)
    sig = re.search(r"\b" + la.kernel.entry + r"\s*\(([^)]*)\)", src)
    assert sig, la.kernel.entry
    return len([p for p in sig.group(1).split(",") if p.strip()])


@pytest.mark.parametrize("name,c,ctx", [("tiny", 64, 128), ("tiny", 256, 512), ("flash-l4", 64, 4096),
                                        ("flash-l4", 256, 8192)])
def test_prefill_plan_lowers_except_pending(name, c, ctx):
    cfg = preset(name)
    g = _graph(name, c, ctx)
    pend: list = []
    ks = lower_graph(g, cfg, target("sm_90"), pending=pend)
    plan = [op for op in g.ops if op.kind == "fused"]
    assert len(ks) + len(pend) == len(plan) and all(k.launches for k in ks)
    assert "rollback" not in {k.name for k in ks}
    # exactly the pending kernels: one routed-experts per layer
    assert {p.pattern for p in pend} == PENDING
    assert sum(p.pattern == "moe_experts" for p in pend) == cfg.n_layers
    assert all("moe_gemm" in p.message for p in pend if p.pattern == "moe_experts")
    names = value_names(g)
    by_name = {n: v for v, n in names.items()}
    weights = {s.name for s in tensor_specs(cfg)}
    for k in ks:
        for la in k.launches:
            assert _n_params(la) == len(la.args), (k.name, la.kernel.entry)
            assert all(1 <= d <= 2 ** 31 - 1 for d in la.grid) and la.grid[1] <= 65535 and la.grid[2] <= 65535
            for a in la.args:
                if a.kind == "value":
                    assert a.name in by_name, (k.name, a)
                elif a.kind == "weight":
                    assert a.name in weights, (k.name, a)
                elif a.kind == "step":
                    assert a.name in STEP or a.name.startswith("live_r"), a
                elif a.kind == "workspace":
                    assert a.nbytes > 0
    # every linear of >= 16 rows is one GEMM launch writing its output, sized to its shapes
    gemms = {la.args[-1].name: la for k in ks for la in k.launches
             if la.kernel.family == "gemm" and not la.kernel.entry.endswith("_actq") and "wo_a" not in la.kernel.entry}
    n_lin = 0
    for op in plan:
        for lin in (b for b in op.body or [] if b.kind == "linear"):
            rows, kk = (int(d) for d in lin.inputs[0].type.shape)
            if rows < 16 or op.attrs["pattern"] in PENDING:
                continue
            n_lin += 1
            y = names[lin.outputs[0]]
            la = gemms.pop(y)
            n = int(lin.outputs[0].type.shape[-1])
            assert rows == c and la.grid[0] == math.ceil(c / G.BM) and la.grid[1] == math.ceil(n / G.BN), (y, la.grid)
            assert la.args[-2].kind == "weight" and la.args[-2].form == "raw"
            if la.args[0].kind == "workspace":  # prequant: xq f16 [C, K], xs f32 [C, K/128]
                assert la.args[0].nbytes == 2 * c * kk and la.args[1].nbytes == 4 * c * kk // 128
            else:
                assert by_name[la.args[0].name] is lin.inputs[0] or la.args[0].name == names[lin.inputs[0]]
    assert n_lin > 0 and not gemms  # no GEMM writes anything but a linear's output
    # one actq per prequant group, launched before its GEMMs
    for k in ks:
        ents = [la.kernel.entry for la in k.launches]
        for i, e in enumerate(ents):
            if e.endswith("_actq"):
                assert ents.count(e) == 1 and any(x.startswith("ds4c_gemm") or "router_gemm" in x for x in ents[i + 1:])
    # the compressor reads n_valid; the HC stage mix runs over C / row_block row blocks; the head stays a GEMV
    comps = [la for k in ks if k.family == "compressor" for la in k.launches]
    assert comps and all(la.args[1] == la.args[1].__class__("step", "n_valid") for la in comps)
    assert all("if (i >= nv) break;" in la.kernel.source for la in comps)
    mixes = [la for k in ks if k.family == "hc" and k.name != "hc_post_head" for la in k.launches
             if la.kernel.entry.endswith("_mix")]
    assert mixes and all(la.grid[1] == c // 4 and "ds4c_bid_y() * NQ" in la.kernel.source for la in mixes)
    head = next(k for k in ks if k.name == "linear")  # the logits: 1 row (take_row) -> GEMV
    assert [la.kernel.family for la in head.launches] == ["gemv"] and head.family == "gemv"
    # the head: row n_valid-1 of the HC post's inputs copied out, then the decode post_head kernel at q = 1
    hk = next(k for k in ks if k.name == "hc_post_head")
    assert [la.kernel.family for la in hk.launches] == ["takerow", "hc", "hc"]
    tr = hk.launches[0]
    assert tr.args[0] == tr.args[0].__class__("step", "n_valid")
    d, hcm = cfg.hidden_size, cfg.hc_mult
    assert [a.nbytes for a in tr.args[2::2]] == [2 * d, 2 * hcm * d, 4 * hcm, 4 * hcm * hcm]
    assert all(hk.launches[1].kernel.source.count(s) for s in ("#define NQ 1",))
    # wo_a: the valid-gated ring write, the inverse rope into a workspace, one grouped GEMM writing z
    for k in (k for k in ks if k.name.endswith("grouped_linear")):
        ring, rope, gm = k.launches
        assert ring.args[0] == ring.args[1] and ring.args[3].name == f"l{k.layer}.ring"
        assert ring.args[4] == ring.args[4].__class__("step", "n_valid") and ring.grid == (1, c, 1)
        assert f"row + {cfg.window} >= nv" in ring.kernel.source
        assert rope.args[1].kind == "workspace" and rope.args[1].nbytes == 2 * c * cfg.n_heads * cfg.head_dim
        assert gm.args[0] == rope.args[1] and gm.args[1].form == "bf16" and gm.args[1].name.endswith("attn_output_a.weight")
        assert gm.grid == (math.ceil(c / G.BM), cfg.o_groups * math.ceil(cfg.o_lora_rank / G.BN), 1)
        z = by_name[gm.args[2].name]
        assert tuple(z.type.shape) == (c, cfg.o_groups, cfg.o_lora_rank)


def test_prefill_refused_without_pending_names_the_kernel():
    g = _graph("tiny", 64, 128)
    with pytest.raises(PendingLowering, match=r"^l0\.moe_experts: moe_experts at 64 rows: .*\(moe_gemm\)"):
        lower_graph(g, preset("tiny"), target("sm_90"))


def test_routed_experts_hook_message():
    from ds4c.runtime.lower import _Ctx
    from ds4c.runtime.lower_prefill import lower_routed_experts
    from ds4c.tensors import storage_types

    cfg = preset("tiny")
    g = _graph("tiny", 64, 128)
    op = next(o for o in g.ops if o.kind == "fused" and o.attrs.get("pattern") == "moe_experts")
    with pytest.raises(PendingLowering, match=r"^moe_experts at 64 rows: the grouped-experts family \(moe_gemm\)"):
        lower_routed_experts(_Ctx(g, cfg, target("sm_90"), storage_types(cfg, "official")), op)


def test_prefill_options_leave_decode_kernels_alone():
    """valid=False / row_block=0 render the decode sources (tests/test_lower.py covers the step as a whole); the
    prefill variants differ only by the n_valid argument and loop bound, or the row-block pointer offsets."""
    t = target("sm_90")
    a = dict(ratio=4, d=128, indexer=True, emulate=True, nope=0, rope_dim=64, q=64)
    dec = render_compressor(CompressorSpec(**a), t, "c").source
    pf = render_compressor(CompressorSpec(**a, valid=True), t, "c").source
    assert "n_valid" not in dec and "const i64* DS4C_RESTRICT n_valid" in pf and "if (i >= nv) break;" in pf
    with pytest.raises(Exception, match="valid with undo"):
        CompressorSpec(**a, valid=True, undo=True)
    h0, h4 = HcSpec("post_pre", 64, 256), HcSpec("post_pre", 64, 256, row_block=4)
    (m0, n0), (m4, n4) = render_hc(h0, t, "h"), render_hc(h4, t, "h")
    assert n0.source == n4.source and "#define NQ 64" in m0.source and "#define NQ 4" in m4.source
    assert [l.grid for l in hc_launch_shapes(h4)][0] == (8, 16, 1) and hc_launch_shapes(h0)[0].grid == (8, 1, 1)
    with pytest.raises(Exception, match="row_block"):
        HcSpec("post_pre", 6, 256, row_block=4)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="nvcc is not installed")
def test_prefill_kernels_compile_sm90(tmp_path):
    """One source per kernel entry of the tiny C=64 chunk (HC row blocks, GEMM + actq, row chains, compressor
    with n_valid, indexer, attention, router at q=64) compiles for sm_90."""
    from ds4c.runtime.cache import KernelCache

    ks = lower_graph(_graph("tiny", 64, 128), preset("tiny"), target("sm_90"), pending=[])
    srcs = list({la.kernel.entry: la.kernel for k in ks for la in k.launches}.values())
    fams = {s.family for s in srcs}
    assert {"hc", "gemm", "rowchain", "compressor", "indexer", "attention", "router", "takerow", "gemv"} <= fams, fams
    entries = KernelCache(tmp_path).compile_many(srcs, progress=False)
    assert len(entries) == len(srcs) and all(e.binary_path.stat().st_size > 0 for e in entries)
