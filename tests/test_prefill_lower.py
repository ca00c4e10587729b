"""Lowering prefill chunk graphs (runtime/lower_prefill.py, issue 12): every plan kernel of a C-row chunk graph
lowers to family launches whose arguments bind to graph values, weights, step scalars and sized workspaces that
exist, except the pending ones (the experts on targets moe_gemm does not build for), which are reported with a
one-line reason; the drafters' taps / record_hc are tap launches with n_valid; the routed + shared experts and moe_sum are moe_gemm calls; projections are GEMM calls (one shared actq, one GEMM per output, sized to C rows); the
compressor reads n_valid; HC stage mix runs over row blocks; a representative subset compiles for sm_90.
CPU only: nothing here runs a kernel (docs/prefill.md says what needs the GPU)."""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch

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
from emulators import launch_emu
from numerics import BF16_ULP, flip_fraction_bound, fp32_order_bound

STEP = {"pos", "positions", "tokens", "n_valid"}
#: plan kernels still pending at C rows (for other reasons than the experts): none
PENDING: set = set()
_CACHE: dict = {}


def _graph(name: str, c: int, ctx: int, taps: tuple = (), record_hc: bool = False):
    key = (name, c, ctx, taps, record_hc)
    if key not in _CACHE:
        _CACHE[key] = run_pipeline(build_step(preset(name), c, max_ctx=ctx, prefill=True, taps=taps,
                                              record_hc=record_hc), "default", context=ctx).graph
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
    # nothing pending but taps / record_hc; one moe_gemm plan kernel per layer
    assert {p.pattern for p in pend} <= PENDING, [p.message for p in pend]
    assert sum(k.family == "moe_gemm" for k in ks) == cfg.n_layers
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
            if rows < 16 or op.attrs["pattern"] in PENDING | {"moe_experts"}:  # the shared expert: moe_gemm dense
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
    # the default: per compressor op a flush launch (a block per flush) then a state launch, both bounded by n_valid
    assert [la.kernel.entry.rsplit("_", 1)[-1] for la in comps] == ["flush", "state"] * (len(comps) // 2)
    assert all("int nv = (int)n_valid[0];" in la.kernel.source for la in comps)
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
    _check_moe_experts(cfg, g, ks, c, names)
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


MOE_ORDER = ["gemm_route", "gemm_actq_x", "gemm_up", "gemm_actq_h", "gemm_down", "shexp_up", "shexp_actq_h",
             "shexp_down", "gemm_combine"]


def _check_moe_experts(cfg, g, ks, c: int, names: dict) -> None:
    """Each layer's moe_experts plan kernel with the default settings: the nine launches in order (routed route /
    actq_x / up / actq_h / down, the shared expert's dense up / actq_h / down on the routed call's quantized x, the
    combine with the shared output fused; mma.sync, the grids with the column blocks first), bound to the fused op's x / ids / weights / output, the layer's routed and shared
    weights (raw), and workspaces of exactly moe_gemm.arg_shapes' sizes, one size per name."""
    from ds4c.runtime.families import moe_gemm as MG

    ops = {o.layer: o for o in g.ops if o.kind == "fused" and o.attrs.get("pattern") == "moe_experts"}
    sizes: dict[str, int] = {}
    for k in (k for k in ks if k.family == "moe_gemm"):
        op = ops[k.layer]
        re_ = next(b for b in op.body if b.kind == "routed_experts")
        sh_i = int(next(b for b in op.body if b.kind == "swiglu").outputs[0].type.shape[-1])
        assert [la.kernel.entry.removeprefix("ds4c_moe_") for la in k.launches] == MOE_ORDER
        assert all(la.kernel.family == "moe_gemm" for la in k.launches)
        # the defaults: the grid with the column blocks first, e4m3 activation tiles (one byte a value)
        rs = MG.MoeGemmSpec(c, cfg.hidden_size, cfg.moe_inter, cfg.n_active_experts, cfg.n_experts, "mxfp4",
                            shared=True, cols_first=True, xfmt="e4m3")
        ds = MG.MoeGemmSpec(c, cfg.hidden_size, sh_i, 1, 1, "q8_0", dense=True, cols_first=True, xfmt="e4m3")
        route, actq_x, up, actq_h, down, s_up, s_actq, s_down, comb = k.launches
        assert not up.kernel.params["wg"] and up.kernel.params["cols_first"] and s_up.kernel.params["cols_first"]
        assert up.kernel.params["e4x"] and s_down.kernel.params["e4x"] and actq_x.kernel.params["form"] == "e4m3s"
        want = {"ds4c_moe_" + {"hbuf": "h", "ybuf": "y"}.get(n, n): MG.arg_shapes(rs)[n] for n in MG.workspaces(rs)}
        want.update({"ds4c_moe_sh_" + {"hbuf": "h"}.get(n, n): MG.arg_shapes(ds)[n] for n in ("hbuf", "hq", "hs")})
        want["ds4c_moe_shared"] = MG.arg_shapes(ds)["out"]
        for la in k.launches:
            for a in la.args:
                if a.kind == "workspace":
                    shape, dt = want[a.name]
                    assert a.nbytes == math.prod(shape) * dt.itemsize, (a.name, a.nbytes)
                    assert sizes.setdefault(a.name, a.nbytes) == a.nbytes
        x, ids, wts = (names[v] for v in re_.inputs[:3])
        assert route.args[0].name == ids and comb.args[0].name == ids and up.args[2].name == wts
        assert actq_x.args[0].name == x and s_up.args[:2] == actq_x.args[1:] == up.args[:2]
        assert comb.args[2] == s_down.args[-1] and comb.args[-1].name == names[op.outputs[0]]
        p = f"blk.{k.layer}."
        assert [(a.name, a.form) for a in up.args[3:5] + down.args[2:3]] == [
            (p + f"ffn_{n}_exps.weight", "raw") for n in ("gate", "up", "down")]
        assert [(a.name, a.form) for a in s_up.args[2:4] + s_down.args[2:3]] == [
            (p + f"ffn_{n}_shexp.weight", "raw") for n in ("gate", "up", "down")]
        assert up.grid == (cfg.moe_inter // 32, MG.tile_slots(rs), 1) and s_up.grid == (sh_i // 32, -(-c // MG.TM), 1)
        assert comb.grid == (cfg.hidden_size // 128, c, 1)


def test_prefill_refused_without_pending_names_the_kernel():
    """tiny lowers whole for sm_90 and gfx1151 (moe_gemm's WMMA body); for gfx1201 (no moe_gemm there) the first
    refusal names l0.moe_experts."""
    g = _graph("tiny", 64, 128)
    assert lower_graph(g, preset("tiny"), target("sm_90"))
    assert lower_graph(g, preset("tiny"), target("gfx1151"))
    with pytest.raises(PendingLowering, match=r"^l0\.moe_experts: moe_experts at 64 rows: the grouped-experts family "
                                              r"\(moe_gemm\) does not build for hip-gfx1201"):
        lower_graph(g, preset("tiny"), target("gfx1201"))


def test_routed_experts_hook_refusals():
    """lower_routed_experts: a one-line PendingLowering for expert weights moe_gemm cannot read (BF16) and for
    the FP8 activation quant off."""
    from ds4c.ir.graph import Op
    from ds4c.quant import GGMLType
    from ds4c.runtime.lower_step import _Ctx
    from ds4c.runtime.lower_prefill import lower_routed_experts
    from ds4c.tensors import storage_types

    cfg = preset("tiny")
    g = _graph("tiny", 64, 128)
    op = next(o for o in g.ops if o.kind == "fused" and o.attrs.get("pattern") == "moe_experts")
    types = dict(storage_types(cfg, "official"), **{"blk.0.ffn_down_shexp.weight": GGMLType.BF16})
    with pytest.raises(PendingLowering, match=r"^moe_experts at 64 rows: the shared down weights are stored as"):
        lower_routed_experts(_Ctx(g, cfg, target("sm_90"), types), op)
    body = [Op(b.kind, b.inputs, b.outputs, dict(b.attrs, emulate=False)) if b.kind == "routed_experts" else b
            for b in op.body]
    op2 = Op(op.kind, op.inputs, op.outputs, op.attrs, layer=op.layer, body=body)
    with pytest.raises(PendingLowering, match="FP8 activation quant is off"):
        lower_routed_experts(_Ctx(g, cfg, target("sm_90"), storage_types(cfg, "official")), op2)


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


@pytest.mark.parametrize("arch,tool", [("sm_90", "nvcc"), ("gfx1151", "clang-19")])
def test_prefill_kernels_compile(arch, tool, tmp_path):
    """Every distinct source of the tiny C=64 chunk (HC row blocks, GEMM + actq, grouped GEMM, row chains
    incl. the valid-gated ring write, compressor with n_valid, indexer, attention, router at q=64, take-row; with
    the drafters' taps and record_hc: the tap kernels with n_valid and the head's C-row streams) compiles for
    sm_90 (nvcc) and gfx1151 (clang-19; the GEMMs, the grouped experts and the attention there are the WMMA
    bodies)."""
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")
    from ds4c.runtime.cache import KernelCache

    ks = [k for g in (_graph("tiny", 64, 128), _graph("tiny", 64, 128, (3, 4, 5), True))
          for k in lower_graph(g, preset("tiny"), target(arch), pending=[])]
    srcs = list({la.kernel.digest(): la.kernel for k in ks for la in k.launches}.values())
    fams = {s.family for s in srcs}
    assert {"hc", "gemm", "rowchain", "compressor", "indexer", "attention", "router", "takerow", "gemv", "tap"} <= fams, fams
    assert sum(s.family == "tap" and s.params.get("valid", False) for s in srcs) == 2
    assert "moe_gemm" in fams, fams  # the routed + shared experts
    entries = KernelCache(tmp_path).compile_many(srcs, progress=False)
    assert len(entries) == len(srcs) and all(e.binary_path.stat().st_size > 0 for e in entries)


# ------------------------------------------------------------------------------- emulated plan kernels (CPU)
def _plan_case(name: str, c: int, ctx: int, pattern: str, layer: int, row_block: int | None = None,
               attn_mma: bool = False, cmp_parallel: bool = False, arch: str = "sm_90", indexer_mma: bool = False,
               **graph_kw):
    """The graph, context, fused op and lowered launches of plan kernel ``pattern`` of ``layer`` for ``arch``
    (``attn_mma``: the matrix-unit chunk attention, as ``lower_prefill`` chooses by default; ``cmp_parallel``: the
    compressors parallel over the flushes, DS4C_PREFILL_CMP_PARALLEL=1; ``indexer_mma``: the indexer scores on tensor
    cores, DS4C_PREFILL_INDEXER_MMA=1)."""
    import ds4c.runtime.lower_prefill as LP
    from ds4c.runtime.lower_step import _Ctx
    from ds4c.tensors import storage_types

    cfg = preset(name)
    g = _graph(name, c, ctx, **graph_kw)
    cx = _Ctx(g, cfg, target(arch), storage_types(cfg, "official"))
    cx.row_block = LP._hc_row_block(c) if row_block is None else row_block
    cx.linears = LP._gemm_linears
    cx.attn_mma = attn_mma
    cx.cmp_parallel = cmp_parallel
    cx.indexer_mma = indexer_mma
    op = next(o for o in g.ops if o.kind == "fused" and o.attrs.get("pattern") == pattern and o.layer == layer)
    return cfg, g, cx, op, LP._PATTERNS[pattern](cx, op)


def _external(op):
    made = {v for b in op.body for v in b.outputs}
    seen, out = set(), []
    for b in op.body:
        for v in b.inputs:
            if v not in made and v not in seen:
                seen.add(v)
                out.append(v)
    return out


def _ir_body(op, env: dict) -> dict:
    """Run the fused op's body leaf by leaf on the IR ops (the interpreter's semantics)."""
    from ds4c.ir.ops import OPS

    env = dict(env)
    for b in op.body:
        outs = OPS[b.kind].run(None, [env[v] for v in b.inputs], b.attrs)
        env.update(zip(b.outputs, outs))
    return env


def _random_inputs(cx, op, pos: int, n_valid: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    env = {}
    sel = {b.inputs[6] for b in op.body if b.kind == "sparse_attention" and b.attrs["kind"] == "csa"}
    for v in _external(op):
        p = cx.prod.get(v)
        shape, dt = tuple(int(d) for d in v.type.shape), v.type.dtype
        if v in sel:  # the indexer's picks: compressed row ids, -1 = none
            cap = next(int(b.inputs[5].type.shape[0]) for b in op.body if b.kind == "sparse_attention")
            env[v] = torch.randint(-1, cap, shape, generator=gen)
        elif p is not None and p.kind == "row_positions":
            env[v] = torch.arange(pos, pos + shape[0], dtype=torch.int64)
        elif cx.inputs.get(v) == "tokens":
            env[v] = torch.randint(0, cx.cfg.vocab_size, shape, generator=gen)
        elif p is not None and p.kind == "param" and dt == "i64":  # tid2eid: an expert id per (token, slot)
            env[v] = torch.randint(0, cx.cfg.n_experts, shape, generator=gen)
        elif v.type.shape == () and dt == "i64":
            env[v] = torch.tensor(n_valid, dtype=torch.int64)
        elif dt == "f32":
            env[v] = torch.rand(shape, generator=gen) if p is not None and p.kind == "rope_freqs" else \
                torch.randn(shape, generator=gen) * 0.5
        elif dt == "bf16":
            env[v] = torch.randn(shape, generator=gen).to(torch.bfloat16)
        else:
            raise AssertionError(f"no random input for {v.type}")
    return env


def _emulate(cx, launches, env: dict, pos: int, n_valid: int, tmp_path) -> tuple[dict, dict]:
    """Run ``launches`` on buffers bound the way the lowering bound them; returns (buffers after, key of each
    Arg)."""
    bufs = {"step.pos": torch.tensor([pos]), "step.n_valid": torch.tensor([n_valid])}
    for v, t in env.items():
        a = cx.arg(v)
        if a.kind in ("value", "weight"):
            bufs[f"{a.kind}.{a.name}"] = t.clone()
        elif a.kind == "step" and a.name in ("positions", "tokens"):
            bufs[f"step.{a.name}"] = t.clone()
    seq = []
    for la in launches:
        args = []
        for a in la.args:
            if a.kind == "int":
                args.append(a.value)
                continue
            key = f"{a.kind}.{a.name}"
            if key not in bufs:  # an output or scratch the kernel writes: NaN / zero poison of its size
                bufs[key] = torch.full((max(a.nbytes, 4) // 4,), float("nan")) if a.kind == "workspace" else None
            args.append(key)
        seq.append((la.kernel, la.grid, la.block, args, la.smem))
    return bufs, seq


def _outputs_as_buffers(cx, op, bufs: dict) -> dict:
    for b in op.body:
        for v in b.outputs:
            a = cx.arg(v)
            key = f"{a.kind}.{a.name}"
            if a.kind == "value" and bufs.get(key, 0) is None:
                bufs[key] = torch.full(tuple(int(d) for d in v.type.shape), float("nan")).to(
                    torch.bfloat16 if v.type.dtype == "bf16" else torch.float32)
    return bufs


def _skip_without_host():
    why = launch_emu.host_unavailable()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "flushes"])
@pytest.mark.parametrize("layer,pos,nv", [(2, 5, 37), (3, 9, 64), (3, 0, 20)])
def test_compressor_with_n_valid_emulated(layer, pos, nv, parallel, tmp_path):
    """The lowered compressor launch of a tiny C=64 chunk (layer 2: the CSA main + indexer compressors; layer 3:
    HCA ratio 16), run on CPU threads, against the IR compress ops with n_valid: the kv / score state bit for
    bit (every flush the chunk crosses; padded rows leave their slots alone), every compressed row within one
    bf16 rounding and the rows no valid row flushes untouched. Both lowerings: the row-serial kernel and the
    kernels parallel over the flushes (DS4C_PREFILL_CMP_PARALLEL)."""
    _skip_without_host()
    cfg, g, cx, op, launches = _plan_case("tiny", 64, 128, "compressor", layer, cmp_parallel=parallel)
    assert len(launches) == (2 if parallel else 1)
    env = _random_inputs(cx, op, pos, nv, seed=layer * 100 + nv)
    want = _ir_body(op, env)
    bufs, seq = _emulate(cx, launches, env, pos, nv, tmp_path)
    got = launch_emu.run(seq, bufs, tmp_path)
    for b in op.body:
        ins = b.inputs
        kv, sc, rows = (got[f"value.{cx.arg(ins[i]).name}"] for i in (4, 5, 6))
        assert torch.equal(kv, want[b.outputs[0]]) and torch.equal(sc, want[b.outputs[1]]), b.attrs["ratio"]
        w = want[b.outputs[2]].float()
        flushed = (torch.arange(w.shape[0]) * b.attrs["ratio"] + b.attrs["ratio"] - 1 >= pos) & \
                  (torch.arange(w.shape[0]) * b.attrs["ratio"] + b.attrs["ratio"] - 1 < pos + nv)
        assert flushed.any()
        assert torch.equal(rows[~flushed], env[ins[6]][~flushed])
        # bf16 roundings of fp32 pooled rows summed in another order: one bf16 ulp (2^-7 relative)
        assert torch.allclose(rows.float(), w, rtol=BF16_ULP, atol=1e-6), (rows.float() - w).abs().max()


def test_ring_write_emulated_for_a_chunk_longer_than_the_window(tmp_path):
    """The wo_a plan kernel's first launch (the valid-gated ring write) of a tiny C=64 chunk (window 16) on CPU
    threads: the ring equals the IR's ring_write with n_valid (40 valid rows, 24 padded) bit for bit."""
    _skip_without_host()
    cfg, g, cx, op, launches = _plan_case("tiny", 64, 128, "grouped_linear", 0)
    ring_op = next(b for b in op.body if b.kind == "ring_write")
    env = _random_inputs(cx, op, 1003, 40, seed=7)
    want = _ir_body(op, {v: env[v] for v in env})[ring_op.outputs[0]]
    bufs, seq = _emulate(cx, launches[:1], env, 1003, 40, tmp_path)
    got = launch_emu.run(seq, bufs, tmp_path)
    assert torch.equal(got[f"value.{cx.arg(ring_op.inputs[0]).name}"], want)
    assert not torch.equal(want, env[ring_op.inputs[0]])


def test_hc_row_blocks_emulated_equal_the_whole_chunk_kernel(tmp_path):
    """HcSpec.row_block: the tiny C=64 chunk's post_pre HC kernel (mix over 16 blocks of 4 rows, then norm) on
    CPU threads gives the same bits as the one-block-column kernel over all 64 rows, and the IR ops' values."""
    _skip_without_host()
    _, _, cx4, op, l4 = _plan_case("tiny", 64, 128, "hc_post_pre", 1, row_block=4)
    _, _, cx0, _, l0 = _plan_case("tiny", 64, 128, "hc_post_pre", 1, row_block=0)
    assert l4[0].grid[1] == 16 and l0[0].grid[1] == 1
    env = _random_inputs(cx4, op, 3, 64, seed=3)
    env = {v: (t * 0.1 if t.dtype == torch.float32 else t) for v, t in env.items()}
    res = []
    for cx, la, sub in ((cx4, l4, "a"), (cx0, l0, "b")):
        bufs, seq = _emulate(cx, la[:2], env, 3, 64, tmp_path / sub)
        res.append(launch_emu.run(seq, _outputs_as_buffers(cx, op, bufs), tmp_path / sub))
    keys = [k for k in res[0] if k.startswith("value.") and not res[0][k].isnan().all()]
    assert keys and all(torch.equal(res[0][k], res[1][k]) for k in keys)
    want = _ir_body(op, env)
    norm = next(b for b in op.body if b.kind == "rms_norm")
    y = res[0][f"value.{cx4.names[norm.outputs[0]]}"].float()
    # two bf16 roundings apart at most (the mixed row and the normed output): 2 ulps = 2^-6 relative
    assert torch.allclose(y, want[norm.outputs[0]].float(), rtol=2 * BF16_ULP, atol=1e-3)


def test_take_row_head_emulated(tmp_path):
    """The head of a tiny C=64 chunk with n_valid = 37: the take-row copy of row 36 and the q=1 post_head HC
    kernel on CPU threads give the IR head's normed row (hc_post, take_row, mix, head gate, pre-mix, norm)."""
    _skip_without_host()
    _, _, cx, op, launches = _plan_case("tiny", 64, 128, "hc_post_head", -1)
    env = _random_inputs(cx, op, 0, 37, seed=5)
    env = {v: (t * 0.1 if t.dtype == torch.float32 else t) for v, t in env.items()}
    bufs, seq = _emulate(cx, launches, env, 0, 37, tmp_path)
    got = launch_emu.run(seq, _outputs_as_buffers(cx, op, bufs), tmp_path)
    post = next(b for b in op.body if b.kind == "hc_post")
    assert torch.equal(got["workspace.ds4c_head_x"].view(torch.uint8),
                       env[post.inputs[1]][36].contiguous().view(torch.uint8).reshape(-1))
    norm = next(b for b in op.body if b.kind == "rms_norm")
    want = _ir_body(op, env)[norm.outputs[0]].float()
    y = got[f"value.{cx.names[norm.outputs[0]]}"].float()
    # two bf16 roundings apart at most (the mixed row and the normed output): 2 ulps = 2^-6 relative
    assert y.shape == want.shape and torch.allclose(y, want, rtol=2 * BF16_ULP, atol=1e-3)


@pytest.mark.parametrize("mma,arch", [(False, "sm_90"), (True, "sm_90"), (True, "gfx942")],
                         ids=["simt", "mma", "hip-mfma"])
@pytest.mark.parametrize("layer,kind", [(0, "swa"), (2, "csa"), (3, "hca")])
def test_attention_at_chunk_rows_emulated(layer, kind, mma, arch, tmp_path):
    """The chunk's attention at C = 64 rows of a tiny chunk (window 16, so every row's window mixes ring slots of
    positions before the chunk and this chunk's kv rows, and most rows see only chunk rows), on CPU threads, against
    the IR sparse_attention: every valid row within bf16 tolerance (hca: the compressed rows capped per row by
    (p+1)//16 and by live = (pos + n_valid)//16; csa: random picks with -1 among them). The kernels: the decode
    SIMT kernel at q = C, the tensor-core chunk kernel (one block per 64 heads and row, 4 of them used) and its
    HIP body on MFMA (wave 64), as lowered for gfx942."""
    _skip_without_host()
    pos, nv = 40, 50
    _, _, cx, op, launches = _plan_case("tiny", 64, 128, "sparse_attention", layer, attn_mma=mma, arch=arch)
    entry = f"ds4c_attn_mma_{kind}" if mma else f"ds4c_attn_{kind}"
    assert len(launches) == 1 and launches[0].kernel.entry == entry and launches[0].grid[1] == 64
    env = _random_inputs(cx, op, pos, nv, seed=layer)
    want = _ir_body(op, env)
    bufs, seq = _emulate(cx, launches, env, pos, nv, tmp_path)
    bufs["step.live_r16"] = torch.tensor([(pos + nv) // 16])
    got = launch_emu.run(seq, _outputs_as_buffers(cx, op, bufs), tmp_path)
    sa = next(b for b in op.body if b.kind == "sparse_attention")
    y = got[f"value.{cx.names[sa.outputs[0]]}"].float()[:nv]
    w = want[sa.outputs[0]].float()[:nv]
    # probabilities rounded to bf16 per block and the output's rounding: 2 bf16 ulps (2^-6 relative)
    assert torch.allclose(y, w, rtol=2 * BF16_ULP, atol=2e-3), (y - w).abs().max()


def test_prefill_kernel_choices_follow_the_target_and_settings(monkeypatch):
    """lower_prefill picks the matrix-unit chunk attention by default on CUDA and on the HIP archs with a matrix body
    (gfx942 MFMA, gfx1151 WMMA; gfx1201 keeps the SIMT kernel) and the flush / state compressor pair;
    DS4C_PREFILL_ATTN_MMA=0 keeps the SIMT attention, DS4C_PREFILL_CMP_PARALLEL=0 the row-serial compressor; the
    indexer's scores on tensor cores on CUDA with DS4C_PREFILL_INDEXER_MMA=1 (unset, and HIP: the SIMT stage)."""
    from ds4c.runtime.lower_prefill import lower_prefill

    cfg = preset("tiny")
    g = _graph("tiny", 64, 128)

    def attn_entries(arch):
        ks = lower_prefill(g, cfg, target(arch), pending=[])
        return sorted({la.kernel.entry for k in ks if k.family == "attention" for la in k.launches})

    def indexer_entries(arch):
        ks = lower_prefill(g, cfg, target(arch), pending=[])
        return [la.kernel.entry for k in ks if k.family == "indexer" for la in k.launches]

    def comp_entries(arch):
        ks = lower_prefill(g, cfg, target(arch), pending=[])
        return [la.kernel.entry.rsplit("_", 1)[-1] for k in ks if k.family == "compressor" for la in k.launches]

    monkeypatch.delenv("DS4C_PREFILL_ATTN_MMA", raising=False)
    monkeypatch.delenv("DS4C_PREFILL_CMP_PARALLEL", raising=False)
    monkeypatch.delenv("DS4C_PREFILL_INDEXER_MMA", raising=False)
    assert indexer_entries("sm_90") and not any("mma" in e for e in indexer_entries("sm_90"))  # off by default
    monkeypatch.setenv("DS4C_PREFILL_INDEXER_MMA", "1")
    # the indexer: tensor-core scores then the decode select on CUDA; both decode stages on HIP
    ix = indexer_entries("sm_90")
    assert ix and [e.split("_")[-1] for e in ix] == ["scores", "select"] * (len(ix) // 2)
    assert all("indexer_mma_scores" in e for e in ix[0::2]) and not any("mma" in e for e in ix[1::2])
    assert indexer_entries("gfx942") and not any("mma" in e for e in indexer_entries("gfx942"))
    assert attn_entries("sm_90") and all("attn_mma_" in e for e in attn_entries("sm_90"))
    for arch in ("gfx942", "gfx1151"):
        assert attn_entries(arch) and all("attn_mma_" in e for e in attn_entries(arch)), arch
    assert attn_entries("gfx1201") and all("attn_mma_" not in e for e in attn_entries("gfx1201"))
    assert comp_entries("sm_90") and comp_entries("sm_90") == ["flush", "state"] * (len(comp_entries("sm_90")) // 2)
    monkeypatch.setenv("DS4C_PREFILL_ATTN_MMA", "0")
    monkeypatch.setenv("DS4C_PREFILL_CMP_PARALLEL", "0")
    monkeypatch.setenv("DS4C_PREFILL_INDEXER_MMA", "0")
    assert attn_entries("sm_90") and all("attn_mma_" not in e for e in attn_entries("sm_90"))
    assert indexer_entries("sm_90") and not any("mma" in e for e in indexer_entries("sm_90"))
    assert set(comp_entries("sm_90")) == {"compressor"}


def test_prefill_gemm_tile_width_follows_its_setting(monkeypatch):
    """DS4C_PREFILL_GEMM_BN picks the projection GEMMs' weight rows per CTA (64 by default, 128: 256 threads and half
    the CTA columns); any other value is a one-line SettingsError naming the variable."""
    from ds4c.runtime.lower_prefill import lower_prefill
    from ds4c.settings import SettingsError

    cfg = preset("tiny")
    g = _graph("tiny", 64, 128)

    def gemms():
        ks = lower_prefill(g, cfg, target("sm_90"), pending=[])
        return [la for k in ks for la in k.launches if la.kernel.family == "gemm" and "actq" not in la.kernel.entry]

    monkeypatch.delenv("DS4C_PREFILL_GEMM_BN", raising=False)
    base = gemms()
    assert base and {la.block for la in base} == {(128, 1, 1)}
    monkeypatch.setenv("DS4C_PREFILL_GEMM_BN", "128")
    wide = gemms()
    assert len(wide) == len(base) and {la.block for la in wide} == {(256, 1, 1)}
    assert all(w.grid[0] == b.grid[0] and w.grid[1] <= b.grid[1] for w, b in zip(wide, base))
    assert sum(w.grid[1] for w in wide) < sum(b.grid[1] for b in base)  # fewer CTA columns of wider tiles
    monkeypatch.setenv("DS4C_PREFILL_GEMM_BN", "96")
    with pytest.raises(SettingsError, match=r"DS4C_PREFILL_GEMM_BN: expected 64 or 128, found '96'"):
        gemms()


@pytest.mark.parametrize("mma", [False, True], ids=["simt", "mma"])
def test_indexer_at_chunk_rows_emulated(mma, tmp_path):
    """The indexer kernels (scores: the decode SIMT stage or the tensor-core one, DS4C_PREFILL_INDEXER_MMA; then the
    decode select) at q = C = 64 rows of a tiny chunk's CSA layer, on CPU threads, against the IR indexer_topk: every
    valid row's selected ids (per-row causal limit (p+1)//4, live = (pos + n_valid)//4) equal."""
    _skip_without_host()
    pos, nv = 21, 50
    _, _, cx, op, launches = _plan_case("tiny", 64, 128, "indexer_topk", 2, indexer_mma=mma)
    assert ("indexer_mma_scores" in launches[0].kernel.entry) == mma
    assert [la.grid[1] for la in launches] == [1 if mma else 64, 1] and launches[1].grid[0] == 64
    env = _random_inputs(cx, op, pos, nv, seed=11)
    want = _ir_body(op, env)
    bufs, seq = _emulate(cx, launches, env, pos, nv, tmp_path)
    bufs["step.live_r4"] = torch.tensor([(pos + nv) // 4])
    it = next(b for b in op.body if b.kind == "indexer_topk")
    bufs[f"value.{cx.names[it.outputs[0]]}"] = torch.full(tuple(int(d) for d in it.outputs[0].type.shape), -7)
    got = launch_emu.run(seq, bufs, tmp_path)
    ids = got[f"value.{cx.names[it.outputs[0]]}"][:nv]
    w = want[it.outputs[0]][:nv]
    assert (w >= 0).any() and (w < 0).any()  # rows with fewer visible keys than top-k pad with -1
    assert torch.equal(ids, w)


@pytest.mark.parametrize("layer", [3, 0])
def test_router_at_chunk_rows_emulated(layer, tmp_path):
    """The decode router kernel at q = C = 64 rows (layer 3: scored routing with the selection bias; layer 0: hash
    routing by token id), on CPU threads, against the IR router_scores + route: ids equal, weights within fp32
    rounding."""
    _skip_without_host()
    _, _, cx, op, launches = _plan_case("tiny", 64, 128, "route", layer)
    assert launches[0].grid[0] == 64
    env = _random_inputs(cx, op, 0, 64, seed=layer)
    want = _ir_body(op, env)
    bufs, seq = _emulate(cx, launches, env, 0, 64, tmp_path)
    r = next(b for b in op.body if b.kind == "route")
    bufs[f"value.{cx.names[r.outputs[0]]}"] = torch.full((64, cx.cfg.n_active_experts), -7)
    bufs[f"value.{cx.names[r.outputs[1]]}"] = torch.full((64, cx.cfg.n_active_experts), float("nan"))
    got = launch_emu.run(seq, bufs, tmp_path)
    assert torch.equal(got[f"value.{cx.names[r.outputs[0]]}"], want[r.outputs[0]])
    # the weights come from fp32 scores (hidden-size dots in another order) normalized over k: fp32 order bound
    tol = fp32_order_bound(cx.cfg.hidden_size)
    assert torch.allclose(got[f"value.{cx.names[r.outputs[1]]}"], want[r.outputs[1]], rtol=tol, atol=1e-7)


@pytest.mark.parametrize("layer,nv", [(0, 40), (3, 64)])
def test_moe_experts_plan_kernel_emulated(layer, nv, tmp_path):
    """The whole moe_experts plan kernel of a tiny C=64 chunk (routed MXFP4 experts E 16 / k 4, the Q8_0 shared
    expert, moe_sum; layer 0 a hash layer, 3 a scored one; n_valid 40 or 64: the kernel computes every row, so all
    64 are compared), its nine launches on CPU threads with the stored (raw) weights, against the IR ops of the
    same fused op (routed_experts, linear / swiglu / cast / linear, moe_sum) on the dequantized weights:

    * the routed fp32 sum (the combine's ordered sum of the emulated ybuf) equals the IR's routed_experts bit for
      bit (MXFP4 x e4m3 products and their sums are exact in fp32 here: moe_gemm's documented floor is 0);
    * the shared expert's bf16 output (workspace ds4c_moe_shared) equals the IR's within Q8_0's documented floor
      (fp32-order flips of bf16 roundings: at most flip_fraction_bound(F) of the elements, rel-L2 within
      SHARED_FLOOR below);
    * the plan kernel's output equals moe_sum(IR routed, emulated shared) bit for bit (the fused combine is the
      IR's moe_sum exactly) and the IR's ffn_out within the shared floor. Dropping the shared add, or adding it
      outside the fp32 sum, fails these (the shared values are O(0.1), the floor 1.6e-3)."""
    _skip_without_host()
    from ds4c.runtime.families import moe_gemm as MG
    from ds4c.runtime.families.experts import dequantize_weight, random_weight

    cfg, g, cx, op, launches = _plan_case("tiny", 64, 128, "moe_experts", layer)
    C, D, I, k, E = 64, cfg.hidden_size, cfg.moe_inter, cfg.n_active_experts, cfg.n_experts
    gen = torch.Generator().manual_seed(40 + layer)
    re_ = next(b for b in op.body if b.kind == "routed_experts")
    lin = [b for b in op.body if b.kind == "linear"]
    x, ids_v, wts_v, bank = re_.inputs
    p = f"blk.{layer}."
    raw = {p + "ffn_gate_exps.weight": random_weight("mxfp4", I, D, E, gen), p + "ffn_up_exps.weight":
           random_weight("mxfp4", I, D, E, gen), p + "ffn_down_exps.weight": random_weight("mxfp4", D, I, E, gen)}
    deq: dict = {}
    env = {x: torch.randn(C, D, generator=gen).to(torch.bfloat16)}
    spec = MG.MoeGemmSpec(C, D, I, k, E)
    env[ids_v], env[wts_v] = MG.random_routing(spec, gen)
    for l in lin:  # the shared expert's Q8_0 weights: raw for the kernel, dequantized for the IR
        w = l.inputs[1]
        n_out, n_in = (int(d) for d in w.type.shape)
        name = cx.weight_name(w)
        raw[name] = random_weight("q8_0", n_out, n_in, 1, gen)
        env[w] = dequantize_weight("q8_0", raw[name], n_out, n_in, 0)

    class Ctx:  # the interpreter's expert bank: the layer's dequantized routed experts
        def expert(self, lay, e):
            assert lay == layer
            if e not in deq:
                deq[e] = tuple(dequantize_weight("mxfp4", raw[p + f"ffn_{n}_exps.weight"], r, cc, e)
                               for n, r, cc in (("gate", I, D), ("up", I, D), ("down", D, I)))
            return deq[e]

    from ds4c.ir.ops import OPS

    want = dict(env)
    for b in op.body:
        want.update(zip(b.outputs, OPS[b.kind].run(Ctx(), [want.get(v) for v in b.inputs], b.attrs)))
    bufs, seq = _emulate(cx, launches, {v: t for v, t in env.items()}, 0, nv, tmp_path)
    for name, t in raw.items():
        bufs[f"weight.{name}"] = t.contiguous()
    got = launch_emu.run(seq, _outputs_as_buffers(cx, op, bufs), tmp_path)
    moe = next(b for b in op.body if b.kind == "moe_sum")
    shared_ir = want[moe.inputs[1]]
    routed_ir = want[re_.outputs[0]]
    # the routed sum: the combine's order on the emulated ybuf, equal to the IR's routed_experts
    y = got["workspace.ds4c_moe_y"].view(torch.bfloat16)[:C * k * D].view(C, k, D).float()
    order = torch.argsort(env[ids_v], dim=-1)
    acc = torch.zeros(C, D)
    for j in range(k):
        acc += y.gather(1, order[:, j:j + 1, None].expand(C, 1, D))[:, 0]
    assert torch.equal(acc, routed_ir)
    sh = got["workspace.ds4c_moe_shared"].view(torch.bfloat16)[:C * D].view(C, D)
    # the shared expert's chain rounds twice to bf16 (h = swiglu cast, the down output) after fp32 sums that
    # the kernel orders otherwise: at most flip_fraction_bound(F) of the roundings flip, each by one ulp
    # (<= 2^-7 relative), so the rel-L2 is at most 2 * 2^-7 * sqrt(that fraction)
    flips = flip_fraction_bound(I)
    shared_floor = 2 * BF16_ULP * flips ** 0.5
    assert float((sh != shared_ir).float().mean()) <= flips and MG.rel_l2(sh, shared_ir) <= shared_floor
    out = got[f"value.{cx.names[moe.outputs[0]]}"]
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out.float()).all())
    assert torch.equal(out.view(torch.int16), (routed_ir + sh.float()).to(torch.bfloat16).view(torch.int16))
    ffn = want[moe.outputs[0]]
    assert MG.rel_l2(out, ffn) <= shared_floor and float((out != ffn).float().mean()) <= flips
    assert MG.rel_l2(routed_ir.to(torch.bfloat16), ffn) > 1e-2  # the shared add matters at this floor


# ------------------------------------------------------------- the drafters' taps / record_hc at C rows (tap family)
def _ring_rows(cfg, kind: str) -> int:
    from ds4c.config import MAX_WIDTH

    return cfg.window + (MAX_WIDTH if kind == "record_hc" else 0)


@pytest.mark.parametrize("name,c,ctx,taps,rec", [("tiny", 64, 128, (3, 4, 5), False), ("tiny", 64, 128, (), True),
                                                 ("tiny", 64, 128, (3, 4, 5), True), ("tiny", 256, 512, (1, 3), True),
                                                 ("flash-l4", 64, 4096, (1, 2, 3), True)])
def test_prefill_drafter_graphs_lower_whole(name, c, ctx, taps, rec):
    """Chunk graphs with DSpark taps and / or record_hc lower with nothing pending on sm_90 and gfx1151 (on gfx1201
    only the experts): each tap op is one tap-family launch with n_valid (``TapSpec.valid``), bound to pos, n_valid, the
    tapped layers' C-row streams and the ring, its grid over min(C, ring rows) rows; the head first writes the
    last layer's C-row streams (HC post_out over row blocks) that the taps read, then take-row + the q = 1 head."""
    from ds4c.ir.builder import FINAL_HC_RING, TAP_RING
    from ds4c.runtime.families import tap as TP

    cfg = preset(name)
    g, plain = _graph(name, c, ctx, taps, rec), _graph(name, c, ctx)
    pend: list = []
    ks = lower_graph(g, cfg, target("sm_90"), pending=pend)
    assert not pend, [p.message for p in pend]
    assert len(ks) == len([op for op in g.ops if op.kind == "fused"])
    base = lower_graph(plain, cfg, target("sm_90"))
    assert [k.name for k in ks if k.family != "tap"] == [k.name for k in base]
    names = value_names(g)
    by_name = {n: v for v, n in names.items()}
    tk = [k for k in ks if k.family == "tap"]
    assert sorted(k.name.split(".")[1] for k in tk) == sorted((["dspark_tap"] if taps else []) + (["record_hc"] if rec else []))
    n_tapped = 0
    for k in tk:
        (la,) = k.launches
        kind = k.name.split(".")[1]
        assert _n_params(la) == len(la.args)
        assert la.args[0] == la.args[0].__class__("step", "pos") and la.args[1] == la.args[1].__class__("step", "n_valid")
        ring = la.args[-1]
        assert ring.kind == "value" and ring.name == (FINAL_HC_RING if kind == "record_hc" else TAP_RING)
        rows = _ring_rows(cfg, kind)
        assert int(by_name[ring.name].type.shape[0]) == rows
        xs = la.args[2:-1]
        assert all(a.kind == "value" and tuple(by_name[a.name].type.shape) == (c, cfg.hc_mult, cfg.hidden_size)
                   for a in xs)
        n_tapped += len(xs) if kind == "dspark_tap" else 0
        p = la.kernel.params
        assert p["valid"] and p["q"] == c and p["grid_rows"] == min(c, rows) and "TP_Q <= TP_WIN" not in la.kernel.source
        nch = -(-p["hidden"] // (64 * p["vec"]))
        assert la.grid == (min(c, rows) * len(xs) * nch, 1, 1)
    assert n_tapped == len(taps)
    head = next(k for k in ks if k.name == "hc_post_head")
    assert [la.kernel.family for la in head.launches] == ["hc", "takerow", "hc", "hc"]
    ps = head.launches[0]
    assert ps.kernel.entry.endswith("post_streams_mix") and ps.grid[1] == c // 4 and "ds4c_bid_y() * NQ" in ps.kernel.source
    last = f"l{cfg.n_layers - 1}.x"
    assert ps.args[-1] == ps.args[-1].__class__("value", last)
    assert any(a.name == last for k in tk for a in k.launches[0].args)  # a tap / record_hc reads what it wrote
    pend = []
    lower_graph(g, cfg, target("gfx1151"), pending=pend)
    assert not pend, [p.message for p in pend]
    lower_graph(g, cfg, target("gfx1201"), pending=pend)
    assert {p.pattern for p in pend} == {"moe_experts"}


def _tap_case(kind: str):
    taps, rec = ((3, 4, 5), False) if kind == "dspark_tap" else ((), True)
    return _plan_case("tiny", 64, 128, kind, 5, taps=taps, record_hc=rec)


def _run_tap(cx, op, launches, pos: int, nv: int, tmp_path, mutate=None, reverse: bool = False):
    """The tap plan kernel's launch on CPU threads on a NaN-poisoned ring and random streams (each row distinct);
    returns (emulated ring, the IR op's ring, the poisoned ring). ``reverse`` runs the grid's blocks in the other
    order; ``mutate`` rewrites the source."""
    import dataclasses

    (la,) = launches
    env = _random_inputs(cx, op, pos, nv, seed=pos * 7 + nv)
    ring_v = op.body[0].inputs[0] if op.body else op.inputs[0]
    env[ring_v] = torch.full(tuple(int(d) for d in ring_v.type.shape), float("nan"), dtype=torch.bfloat16)
    want = _ir_body(op, env)[(op.body or [op])[0].outputs[0]]
    src = la.kernel.source
    if reverse:
        src = src.replace("const int b = ds4c_bid_x();", f"const int b = {la.grid[0] - 1} - ds4c_bid_x();")
        assert src != la.kernel.source
    if mutate is not None:
        src = mutate(src)
        assert src != la.kernel.source
    la = dataclasses.replace(la, kernel=dataclasses.replace(la.kernel, source=src))
    bufs, seq = _emulate(cx, [la], env, pos, nv, tmp_path)
    got = launch_emu.run(seq, bufs, tmp_path)[f"value.{cx.arg(ring_v).name}"]
    return got, want, env[ring_v]


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("kind", ["dspark_tap", "record_hc"])
@pytest.mark.parametrize("pos,nv", [(77, 40), (3, 9), (1000, 64), (21, 1)])
def test_tap_plan_kernels_emulated_equal_the_ir_rings(kind, pos, nv, tmp_path):
    """The tiny C=64 chunk's dspark_tap (taps 3, 4, 5: the mean of each row's streams) and record_hc (a copy)
    launches on CPU threads, window 16 (record_hc's ring 21 rows) < C, against the IR ops with n_valid: the ring
    bit for bit (NaN-poisoned: rows no valid row writes keep the poison), with the grid's blocks run in either
    order (so no padded row and no row that a later valid row of the chunk overwrites writes its slot: one writer
    per slot)."""
    _skip_without_host()
    cfg, g, cx, op, launches = _tap_case(kind)
    rows = _ring_rows(cfg, kind)
    for rev in (False, True):
        got, want, ring0 = _run_tap(cx, op, launches, pos, nv, tmp_path / f"r{int(rev)}", reverse=rev)
        assert torch.equal(_bits(got), _bits(want)), (kind, pos, nv, rev)
        written = {(pos + i) % rows for i in range(nv)}
        for s in range(rows):
            assert torch.isnan(got[s].float()).all() == (s not in written), s  # untouched slots keep the poison
        assert len(written) == min(nv, rows)


@pytest.mark.parametrize("kind", ["dspark_tap", "record_hc"])
@pytest.mark.parametrize("delta", ["+ 1", "- 1"])
def test_tap_guard_off_by_one_fails(kind, delta, tmp_path):
    """Mutation: the row offset of the valid rows moved by one (a padded row writes / the last valid row does not,
    and the first row of the window writes the slot of the last) gives a ring that differs from the IR op's."""
    _skip_without_host()
    cfg, g, cx, op, launches = _tap_case(kind)
    old = "(int)(n_valid[0] - TP_QG)"
    got, want, _ = _run_tap(cx, op, launches, 77, 40, tmp_path, mutate=lambda s: s.replace(old, f"({old} {delta})"))
    assert not torch.equal(_bits(got), _bits(want))


def test_head_streams_emulated_for_the_taps(tmp_path):
    """The prefill head of a drafter chunk graph: its first launch (HC post_out over row blocks) writes the last
    layer's C-row streams that the taps read; on CPU threads they equal the IR's hc_post (all 64 rows)."""
    _skip_without_host()
    cfg, g, cx, op, launches = _plan_case("tiny", 64, 128, "hc_post_head", -1, taps=(3, 4, 5), record_hc=True)
    post = next(b for b in op.body if b.kind == "hc_post")
    env = _random_inputs(cx, op, 3, 40, seed=11)
    env = {v: (t * 0.1 if t.dtype == torch.float32 else t) for v, t in env.items()}
    want = _ir_body(op, env)[post.outputs[0]]
    bufs, seq = _emulate(cx, launches[:1], env, 3, 40, tmp_path)
    got = launch_emu.run(seq, _outputs_as_buffers(cx, op, bufs), tmp_path)[f"value.{cx.names[post.outputs[0]]}"]
    assert got.shape == want.shape == (64, cfg.hc_mult, cfg.hidden_size)
    assert torch.equal(_bits(got), _bits(want)), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("kind", ["dspark_tap", "record_hc"])
def test_every_valid_row_writing_is_caught_by_the_reversed_block_order(kind, tmp_path):
    """Mutation: every valid row writes its slot (the grid over all C rows: the rule without the window bound, a
    race on the GPU for C > ring rows). Blocks in grid order still leave the right rows (the emulator runs them
    one after another), in the reversed order the earliest writer stays: the check the test above relies on."""
    import dataclasses

    _skip_without_host()
    cfg, g, cx, op, (la,) = _tap_case(kind)
    rows = la.kernel.params["grid_rows"]
    assert rows < 64
    src = la.kernel.source.replace(f"#define TP_QG {rows}", "#define TP_QG 64").replace("TP_QG <= TP_WIN && ", "")
    la = dataclasses.replace(la, grid=(la.grid[0] // rows * 64, 1, 1), kernel=dataclasses.replace(la.kernel, source=src))
    fwd, want, _ = _run_tap(cx, op, [la], 77, 40, tmp_path / "f")
    rev, want2, _ = _run_tap(cx, op, [la], 77, 40, tmp_path / "r", reverse=True)
    assert torch.equal(_bits(fwd), _bits(want)) and not torch.equal(_bits(rev), _bits(want2))


def test_a_kquant_mix_lowers_every_chunk_kernel():
    """A llama-quantize Q4_K_M-like file (every projection and expert in K-quants: the official FP8 and FP4 roles
    as Q4_K) lowers every chunk plan kernel on sm_90 and on gfx942 (wave-64 AMD matrix cores), the projections'
    GEMMs reading the K-quant; on sm_80 (no f16 MMA on e4m3 activations) and gfx1151 (wave 32) those GEMMs and the
    experts stay pending with one-line reasons, never a refusal, so the engine prefills with verify steps there
    (test_prefill_exec)."""
    from ds4c.quant import GGMLType
    from ds4c.tensors import _OFFICIAL, ROLE_FP4, ROLE_FP8, storage_types

    cfg = preset("flash-l4")
    types = storage_types(cfg, {**_OFFICIAL, ROLE_FP8: GGMLType.Q4_K, ROLE_FP4: GGMLType.Q4_K})
    g = _graph("flash-l4", 64, 4096)
    pend: list = []
    def gemm_sources(arch: str) -> list[str]:
        ks = lower_graph(g, cfg, target(arch), types, pending=pend)
        assert not pend, pend[0].message
        return [la.kernel.source for k in ks if k.family == "gemm" for la in k.launches
                if "#define GM_FMT" in la.kernel.source]

    assert sum("#define GM_FMT 3" in src for src in gemm_sources("sm_90")) >= 4 * cfg.n_layers
    xm = [src for src in gemm_sources("gfx942") if "#define GM_XM 1" in src]
    assert sum("#define GM_FMT 3" in src for src in xm) >= 4 * cfg.n_layers
    for arch in ("sm_80", "gfx1151"):
        pend = []
        lower_graph(g, cfg, target(arch), types, pending=pend)
        pats = {p.pattern for p in pend}
        assert "moe_experts" in pats and len(pats) > 1 and all("\n" not in p.message for p in pend), (arch, pats)


@pytest.mark.parametrize("fmt,pending", [("q3_k", False), ("q4_k", False), ("bf16", True)])
def test_kquant_experts_lower_or_refuse_in_one_line(fmt, pending):
    """flash-l4 with its routed experts stored as a K-quant (``make-model --formats q3_k``, the 43-layer model's
    storage; Q4_K, a Q4_K_M file's): every chunk plan kernel lowers on sm_90, the routed call reading the K-quant
    (the shared expert stays Q8_0); experts the grouped GEMM has no decoder for (BF16) stay pending with a one-line
    reason naming the formats."""
    from ds4c.tensors import storage_types

    cfg = preset("flash-l4")
    g = _graph("flash-l4", 64, 4096)
    pend: list = []
    ks = lower_graph(g, cfg, target("sm_90"), storage_types(cfg, fmt), pending=pend)
    moe = [p for p in pend if p.pattern == "moe_experts"]
    if pending:
        assert len(moe) == cfg.n_layers and all("\n" not in p.message and "q3_k" in p.message and fmt in p.message
                                                for p in moe), moe[0].message
        return
    assert not pend
    ups = [la for k in ks if k.family == "moe_gemm" for la in k.launches if la.kernel.entry.endswith("_up")]
    assert len(ups) == 2 * cfg.n_layers  # the routed and the shared expert's up phase per layer
    assert sum("#define MG_FMT 2" in la.kernel.source for la in ups) == cfg.n_layers
    # HIP: the wave-64 MFMA body decodes K-quants (the chunk lowers whole on gfx942); wave-32 RDNA keeps them pending
    lower_graph(g, cfg, target("gfx942"), storage_types(cfg, fmt), pending=pend)
    assert not pend, pend[0].message
    lower_graph(g, cfg, target("gfx1151"), storage_types(cfg, fmt), pending=pend)
    assert {p.pattern for p in pend} == {"moe_experts"} and all("on wave 32" in p.message and "\n" not in p.message
                                                                 for p in pend)


def test_the_43_layer_flash_lowers_its_32k_chunk_with_tensor_core_indexer_scores(monkeypatch):
    """The issue-33 target's shape: the 43-layer flash with Q3_K experts, a 2048-row chunk at a 32K context, lowers
    every plan kernel on sm_90 (nothing pending) with DS4C_PREFILL_INDEXER_MMA=1: each CSA layer's indexer is the
    tensor-core scores over the context's 8192 keys (grid (64, 32)) then the decode select."""
    from ds4c.runtime.lower_prefill import lower_prefill
    from ds4c.tensors import storage_types

    monkeypatch.setenv("DS4C_PREFILL_INDEXER_MMA", "1")
    cfg = preset("flash")
    pend: list = []
    ks = lower_prefill(_graph("flash", 2048, 32768), cfg, target("sm_90"), storage_types(cfg, "q3_k"), pending=pend)
    assert not pend, pend[0].message
    ix = [la for k in ks if k.family == "indexer" for la in k.launches]
    n_csa = sum(1 for r in cfg.compress_ratios[:cfg.n_layers] if r == 4)
    assert n_csa > 10 and len(ix) == 2 * n_csa
    assert all("indexer_mma_scores" in la.kernel.entry and la.grid == (64, 32, 1) for la in ix[0::2])
    assert all(la.kernel.entry.endswith("_select") and la.grid[0] == 2048 for la in ix[1::2])
