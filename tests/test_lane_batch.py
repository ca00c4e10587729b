"""Lane batching (runtime/step/lane_batch.py, issue 30): a lanes step's per-lane launches merged into one launch per
kernel over a grid of lanes. On the CPU: which launches merge and in what order, the batched kernel source (its
wrapper compiles for CUDA and HIP), the binding rule (one constant stride per pointer, equal integers) and the
arena layout that gives per-lane values a constant stride. That the merged launches compute what the per-lane ones
did is checked on a GPU (tests/test_lanes_gpu.py, lanes against each sequence alone with DS4C_LANE_BATCH=1)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.ir import build_step
from ds4c.passes.manager import run_pipeline
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lowered import Arg, Launch
from ds4c.runtime.step.binding import arena_layout, lane_of
from ds4c.runtime.step.lane_batch import SUFFIX, batch_lanes, batched_source, bind_lane_args
from ds4c.runtime.targets import target


def lowered(lanes: tuple[int, ...], arch: str = "sm_90", name: str = "tiny", ctx: int = 128):
    cfg = preset(name)
    g = run_pipeline(build_step(cfg, sum(lanes), ctx, lanes=lanes), "default", context=ctx).graph
    return g, lower_graph(g, cfg, target(arch))


def test_per_lane_kernels_merge_in_each_lanes_order():
    """Three decode lanes: every per-lane kernel becomes one launch over grid z = 3 carrying each lane's arguments
    (lane q's arguments name lane q), in lane 0's order; the row-wise kernels stay as they were, in place; a prompt
    lane of 5 rows beside two decode lanes keeps its own launches after the two lanes' merged ones."""
    _g, ks = lowered((1, 1, 1))
    out = batch_lanes(ks)
    per_lane = [k for k in ks if {lane_of(la.args) for la in k.launches} == {0}]
    merged = [k for k in out if "@lanes" in k.name]
    assert [k.family for k in merged] == [k.family for k in per_lane]
    assert [la.kernel.entry for k in merged for la in k.launches] == \
        [la.kernel.entry + SUFFIX for k in per_lane for la in k.launches]
    for k in merged:
        for la in k.launches:
            assert la.grid[2] == 3 and len(la.lanes) == 3 and la.args == la.lanes[0]
            assert [lane_of(a) for a in la.lanes] == [0, 1, 2]
    shared = [k.name for k in ks if all(lane_of(la.args) is None for la in k.launches)]
    assert [k.name for k in out if "@lanes" not in k.name] == shared  # nothing per-lane left over, order kept
    assert len(out) == len(shared) + len(per_lane)

    _g, ks = lowered((1, 1, 5))
    out = batch_lanes(ks)
    merged = [k for k in out if "@lanes" in k.name]
    assert merged and all(la.grid[2] == 2 for k in merged for la in k.launches)
    prompt = [k for k in out if {lane_of(la.args) for la in k.launches} == {2}]
    assert prompt and all(out.index(p) > out.index(merged[0]) for p in prompt)
    assert not [k for k in out if "@lanes" not in k.name and {lane_of(la.args) for la in k.launches} & {0, 1}]


def test_one_lane_is_left_alone():
    _g, ks = lowered((1,))
    assert [k.name for k in batch_lanes(ks)] == [k.name for k in ks]


def test_batched_source_wraps_the_entry():
    _g, ks = lowered((1, 1))
    la = next(la for k in batch_lanes(ks) for la in k.launches if la.lanes and la.kernel.family == "attention")
    src = la.kernel.source
    entry = la.kernel.entry.removesuffix(SUFFIX)
    assert la.kernel.entry.endswith(SUFFIX) and f"DS4C_DEVICE void {entry}_body(" in src
    sig = re.search(re.escape(la.kernel.entry) + r"\(([^)]*)\)", src).group(1)
    params = [p for p in sig.split(",") if p.strip()]
    pointers = [p for p in params[:len(la.args)] if "*" in p]
    assert len(params) == len(la.args) + len(pointers)  # one i64 stride per pointer
    assert "blockIdx.z" in src and len(re.findall(r"^DS4C_GLOBAL void", src, re.M)) == 1


@pytest.mark.parametrize("arch,tool", [("sm_90", "nvcc"), ("gfx1151", "clang-19")])
def test_batched_kernels_compile(arch, tool, tmp_path):
    """Every merged kernel of a three-lane tiny step compiles for the target (CUDA nvcc, HIP clang)."""
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")
    from ds4c.runtime.cache import KernelCache

    _g, ks = lowered((1, 1, 1), arch)
    srcs = list({la.kernel.digest(): la.kernel for k in batch_lanes(ks) for la in k.launches if la.lanes}.values())
    assert srcs
    entries = KernelCache(tmp_path).compile_many(srcs, progress=False)
    assert len(entries) == len(srcs) and all(e.binary_path.stat().st_size > 0 for e in entries)


def test_binding_takes_one_stride_per_pointer():
    src = batched_source(lowered((1, 1))[1][0].launches[0].kernel)
    args = [(Arg("value", "x", row=q), Arg("weight", "w"), Arg("int", "n", value=4)) for q in range(3)]
    la = Launch(src, (1, 1, 3), (32, 1, 1), 0, args[0], tuple(args))
    x, w = torch.zeros(3, 8), torch.zeros(4)

    def resolve(a, q):
        return {"x": x[a.row:], "w": w, "n": a.value}[a.name]

    bound = bind_lane_args(la, resolve)
    assert bound[0].data_ptr() == x.data_ptr() and bound[2] == 4 and bound[3:] == [("i64", 32), ("i64", 0)]
    with pytest.raises(StepError, match="constant stride"):
        bind_lane_args(la, lambda a, q: x[[0, 1, 0][q]:] if a.name == "x" else resolve(a, q))
    with pytest.raises(StepError, match="differs between lanes"):
        bind_lane_args(la, lambda a, q: q if a.name == "n" else resolve(a, q))


def test_arena_places_per_lane_values_a_constant_stride_apart():
    """The arena layout of a merged lanes step: for every merged launch argument naming one value per lane, the
    lanes' slots are equal in size and evenly spaced (what the binding requires)."""
    g, ks = lowered((1, 1, 1))
    out = batch_lanes(ks)
    layout, _ = arena_layout(g, out, set())
    checked = 0
    for la in (la for k in out for la in k.launches if la.lanes):
        for n in range(len(la.args)):
            names = [lane[n].name for lane in la.lanes]
            if la.args[n].kind != "value" or len(set(names)) == 1 or names[0] not in layout:
                continue
            offs = [layout[v][0] for v in names]
            assert len({layout[v][1] for v in names}) == 1
            assert all(b - a == offs[1] - offs[0] for a, b in zip(offs, offs[1:])), names
            checked += 1
    assert checked
