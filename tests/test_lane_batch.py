"""Lane batching (runtime/step/lane_batch.py, issue 30): a lanes step's per-lane launches merged into one launch per
kernel over a grid of lanes. On the CPU: which launches merge and in what order, the batched kernel source (its
wrapper compiles for CUDA and HIP), the binding rule (one constant stride per pointer, equal integers) and the
arena layout that gives per-lane values a constant stride; and, on the CPU emulator (tests/emulators/launch_emu.py),
that one layer's merged launches leave every buffer as its per-lane launches do, bit for bit. On a GPU:
tests/test_lanes_gpu.py (lanes against each sequence alone with DS4C_LANE_BATCH=1)."""

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


# ------------------------------------------------------------------------------------------ emulated
class _Ptr:
    """A bound buffer address for :func:`bind_lane_args`: a buffer (its own 2^40-byte space) and a byte offset."""

    def __init__(self, key: str, off: int, base: dict[str, int]):
        self.key, self.off = key, off
        self._p = base.setdefault(key, (len(base) + 1) << 40) + off

    def data_ptr(self) -> int:
        return self._p


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_merged_lanes_emulated_equal_the_per_lane_launches(layer, tiny_path, tmp_path):
    """Three decode lanes of tiny at positions 3, 19 and 47 (flushes of both ratios, a wrapped window), random
    state and activations laid out as ``LanesStep`` lays them out (stacked slot state, the arena of the merged
    graph, the lanes step buffer): one layer's per-lane launches run on CPU threads one lane after another, then
    its merged launches (one per kernel, grid z = 3) on a copy of the same buffers: every state buffer and every
    activation equal bit for bit, and the state changed. Layer 0: the window attention, layer 2: the CSA
    compressor, indexer and attention, layer 3: the HCA ones, each with its ring write."""
    from emulators import launch_emu

    why = launch_emu.host_unavailable()
    if why:
        pytest.skip(why)
    from ds4c.ir.builder import lane_state_name, state_inputs
    from ds4c.ir.printer import value_names
    from ds4c.runtime.step.binding import DTYPES
    from ds4c.runtime.step.weights import StepWeights
    from ds4c.sources import open_model

    cfg, ctx, lanes, pos = preset("tiny"), 128, 3, [3, 19, 47]
    g, ks = lowered((1,) * lanes, ctx=ctx)
    merged = batch_lanes(ks)
    per = [k for k in ks if k.layer == layer and len({lane_of(la.args) for la in k.launches} - {None}) == 1]
    both = [k for k in merged if k.layer == layer and "@lanes" in k.name]
    assert len(per) == lanes * len(both) and both
    gen = torch.Generator().manual_seed(layer)

    def rand(shape, dt):
        if dt == torch.int64:
            return torch.zeros(shape, dtype=dt)
        return (torch.randn(shape, generator=gen) * 0.5).to(dt)

    specs = state_inputs(cfg, ctx)
    state = {k: rand((lanes,) + tuple(t.shape), DTYPES[t.dtype]) for k, t in specs.items()}
    layout, need = arena_layout(g, merged, {lane_state_name(j, k) for j in range(lanes) for k in specs} |
                                {"logits", "hc_in", "hc_out"})
    arena = torch.zeros(need, dtype=torch.uint8)
    for off, n, shape, dt in layout.values():
        arena[off:off + n] = rand(shape, dt).contiguous().view(torch.uint8).reshape(-1)
    ratios = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r})
    offsets = {"positions": 0, "tokens": lanes}
    for j in range(lanes):
        for r in ratios:
            offsets[lane_state_name(j, f"live_r{r}")] = len(offsets) + lanes - 1
    step = torch.zeros(len(offsets) + 2 * lanes - 2, dtype=torch.int64)
    step[:lanes] = torch.tensor(pos)
    for j, p in enumerate(pos):
        for r in ratios:
            step[offsets[lane_state_name(j, f"live_r{r}")]] = (p + 1) // r
    names = value_names(g)
    consts = {names[op.outputs[0]]: op.attrs["data"] for op in g.ops if op.kind == "const"}
    weights = StepWeights(open_model(tiny_path), {}, torch.device("cpu"))
    bufs: dict[str, torch.Tensor] = {"arena": arena, "step": step}
    bufs.update({f"state.{k}": v for k, v in state.items()})
    base: dict[str, int] = {}

    def row_bytes(t: torch.Tensor) -> int:
        return t[0].numel() * t.element_size() if t.dim() else 0

    def bind(a, lane_q=None, m=None):
        if a.kind == "int":
            return a.value
        if a.kind == "weight":
            key = f"w.{a.name}.{a.form}"
            bufs.setdefault(key, weights.convert(a.name, a.form or "f32").contiguous())
            return _Ptr(key, 0, base)
        if a.kind == "step":
            return _Ptr("step", (offsets[a.name] + a.row) * 8, base)
        if a.kind == "workspace":
            part = (a.nbytes + 255) // 256 * 256
            key = f"ws.{a.name}" + (f"@x{m}" if m else "")
            bufs.setdefault(key, torch.zeros(part * (m or 1), dtype=torch.uint8))
            return _Ptr(key, part * (lane_q or 0), base)
        if a.name.startswith("lane") and a.name.split(".", 1)[1] in specs:
            j, k = int(a.name[4:a.name.index(".")]), a.name.split(".", 1)[1]
            t = state[k]
            return _Ptr(f"state.{k}", j * row_bytes(t) + a.row * row_bytes(t[0]), base)
        if a.name in consts:
            t = consts[a.name].contiguous()
            bufs.setdefault(f"const.{a.name}", t)
            return _Ptr(f"const.{a.name}", a.row * row_bytes(t), base)
        off, _n, shape, dt = layout[a.name]
        return _Ptr("arena", off + a.row * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
                    * torch.empty(0, dtype=dt).element_size(), base)

    def host(v):
        return v if isinstance(v, (int, tuple)) and not isinstance(v, _Ptr) else (v.key, v.off)

    seq_per = [(la.kernel, la.grid, la.block, [host(bind(a)) for a in la.args], la.smem)
               for k in per for la in k.launches]
    seq_both = []
    for k in both:
        for la in k.launches:
            m = len(la.lanes)
            bound = bind_lane_args(la, lambda a, q, m=m: bind(a, q, m))
            seq_both.append((la.kernel, la.grid, la.block, [host(v) for v in bound], la.smem))
    got_per = launch_emu.run(seq_per, {k: v.clone() for k, v in bufs.items()}, tmp_path / "per")
    got_both = launch_emu.run(seq_both, {k: v.clone() for k, v in bufs.items()}, tmp_path / "both")
    for k in [k for k in bufs if k.startswith("state.")] + ["arena"]:
        assert torch.equal(got_per[k].view(torch.uint8), got_both[k].view(torch.uint8)), k
    assert any(not torch.equal(got_per[k], bufs[k]) for k in bufs if k.startswith("state."))
