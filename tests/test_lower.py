"""Lowering the kernel plan to family launches (runtime/lower.py): every plan kernel lowers, every argument
binding names something that exists, identical kernels of different layers share one source, and every
kernel of the tiny step compiles for sm_90 and gfx1151."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from ds4c.config import preset
from ds4c.ir import build_step
from ds4c.ir.printer import value_names
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lowered import LoweringError
from ds4c.runtime.targets import target
from ds4c.tensors import tensor_specs

STEP = {"pos", "positions", "tokens", "accepted"}


def _graph(name: str, q: int, ctx: int):
    return run_pipeline(build_step(preset(name), q, max_ctx=ctx), "default", context=ctx).graph


@pytest.mark.parametrize("name,ctx", [("tiny", 128), ("flash-l4", 4096)])
@pytest.mark.parametrize("q", [1, 5])
@pytest.mark.parametrize("arch", ["sm_90", "gfx1151"])
def test_every_plan_kernel_lowers_with_resolvable_bindings(name, ctx, q, arch):
    cfg = preset(name)
    g = _graph(name, q, ctx)
    ks = lower_graph(g, cfg, target(arch))
    plan = [op for op in g.ops if op.kind == "fused"]
    # a verify graph ends with its rollback kernel (runtime/families/undo.py), which is no plan kernel
    rollback = [k for k in ks if k.name == "rollback"]
    assert len(rollback) == (1 if q > 1 else 0) and (not rollback or ks[-1] is rollback[0])
    assert len(ks) - len(rollback) == len(plan) and all(k.launches for k in ks)
    values = set(value_names(g).values())
    weights = {s.name for s in tensor_specs(cfg)}
    for k in ks:
        for la in k.launches:
            # the entry's parameter count equals the bindings
            src = re.sub(r"//[^\n]*", "", la.kernel.source)
            sig = re.search(r"\b" + la.kernel.entry + r"\s*\(([^)]*)\)", src)
            assert sig, la.kernel.entry
            assert len([p for p in sig.group(1).split(",") if p.strip()]) == len(la.args), (k.name, la.kernel.entry)
            assert all(d >= 1 for d in la.grid + la.block)
            for a in la.args:
                if a.kind == "value":
                    assert a.name in values, (k.name, a)
                elif a.kind == "weight":
                    assert a.name in weights, (k.name, a)
                elif a.kind == "step":
                    assert a.name in STEP or a.name.startswith("live_r"), a
                elif a.kind == "workspace":
                    assert a.nbytes > 0


@pytest.mark.parametrize("q", [1, 5])
def test_experts_prequant_lowers_four_launches(q, monkeypatch):
    """ExpertsSpec.prequant (ds4c.settings.experts_prequant: on by default, ``DS4C_XP_PREQUANT=0`` for an A/B, read
    at each lowering): each MoE layer's experts kernel is four launches (x quantized once, up, h quantized once,
    down) whose workspaces are bound and whose parameter counts are their bindings; with it off, two."""
    from ds4c import settings

    cfg = preset("flash-l4")
    g = _graph("flash-l4", q, 4096)
    assert settings.experts_prequant() or os.environ.get("DS4C_XP_PREQUANT") == "0"
    monkeypatch.setenv("DS4C_XP_PREQUANT", "0")
    base = [k for k in lower_graph(g, cfg, target("sm_90")) if k.launches[0].kernel.family == "experts"]
    monkeypatch.delenv("DS4C_XP_PREQUANT")
    pq = [k for k in lower_graph(g, cfg, target("sm_90")) if k.launches[0].kernel.family == "experts"]
    assert len(base) == len(pq) == cfg.n_layers and all(len(k.launches) == 2 for k in base)
    for k in pq:
        assert [la.kernel.name.rsplit("_", 1)[-1] for la in k.launches] == ["x", "up", "h", "down"]
        for la in k.launches:
            src = re.sub(r"//[^\n]*", "", la.kernel.source)
            sig = re.search(r"\b" + la.kernel.entry + r"\s*\(([^)]*)\)", src)
            assert len([p for p in sig.group(1).split(",") if p.strip()]) == len(la.args), la.kernel.entry
        ws = {a.name: a.nbytes for la in k.launches for a in la.args if a.kind == "workspace"}
        assert sorted(n.rsplit("_", 1)[-1] for n in ws) == ["h", "hq", "hs", "xq", "xs"]
        assert ws[next(n for n in ws if n.endswith("_xq"))] == 2 * q * cfg.hidden_size


def test_identical_layers_share_sources():
    g = _graph("flash-l4", 1, 4096)
    ks = lower_graph(g, preset("flash-l4"), target("sm_90"))
    launches = [la for k in ks for la in k.launches]
    assert len({la.kernel.digest() for la in launches}) < len(launches) * 0.6


@pytest.mark.parametrize("arch,expect", [("sm_90", True), ("sm_90a", True), ("sm_80", False), ("gfx942", False)])
def test_step_kernels_allow_programmatic_launch_on_sm90_only(arch, expect):
    """Every step kernel calls DS4C_PDL_ENTRY() before reading what the previous kernel writes, so on sm_90+ all
    are launched with programmatic stream serialization; on sm_80 and HIP none (the macro is a no-op there)."""
    from ds4c.runtime.render import PDL_CALL, render

    for q in (1, 5):
        ks = lower_graph(_graph("flash-l4", q, 4096), preset("flash-l4"), target(arch))
        flags = {la.kernel.entry: la.kernel.programmatic_launch for k in ks for la in k.launches}
        assert all(PDL_CALL in la.kernel.source for k in ks for la in k.launches)
        assert set(flags.values()) == {expect}, flags
    assert not render("selftest/axpy.cu.j2", "axpy", "selftest", target(arch),
                      {"threads": 256, "per_thread": 4}).programmatic_launch


def test_unpartitioned_graph_is_refused():
    g = run_pipeline(build_step(preset("tiny"), 1, max_ctx=128), "static", context=128).graph
    with pytest.raises(LoweringError, match="partitioned"):
        lower_graph(g, preset("tiny"), target("sm_90"))


@pytest.mark.parametrize("arch,tool", [("sm_90", "nvcc"), ("gfx1151", "clang-19")])
def test_tiny_step_kernels_compile(arch, tool, tmp_path):
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")
    from ds4c.runtime.cache import KernelCache

    ks = lower_graph(_graph("tiny", 1, 128), preset("tiny"), target(arch))
    srcs = list({la.kernel.digest(): la.kernel for k in ks for la in k.launches}.values())
    entries = KernelCache(tmp_path).compile_many(srcs, progress=False)
    assert len(entries) == len(srcs) and all(e.binary_path.stat().st_size > 0 for e in entries)
