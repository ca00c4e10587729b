"""Lanes steps on the IR (issue 30, the compiled step's graph): ``build_step(cfg, R, lanes=(n0, n1, ...))`` runs
the rows of several sequences in one graph, row-wise work over all R rows and each lane's compressor, indexer,
attention and ring write on its own state. Through the interpreter, before and after the default pass pipeline,
every lane's logits and state buffers equal the same lane run alone through the one-sequence graph, bit for bit,
with lanes at different positions (across window wraps, flushes of both ratios and context buckets) and verify
rows beside decode rows.

The tiny preset: window 16, CSA ratio 4, HCA ratio 16.
"""

from __future__ import annotations

import pytest
import torch

from ds4c.buckets import BucketSpec
from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.ir import Interpreter, build_step, run_step
from ds4c.ir.builder import MAX_LANE_ROWS
from ds4c.ir.interpreter import run_lanes_step
from ds4c.ir.verify import verify
from ds4c.passes.manager import run_pipeline
from ds4c.passes.partition import kernel_plan
from ds4c.reference import Reference

TINY = preset("tiny")
MAX_CTX = 256


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _buffers(state) -> dict[str, torch.Tensor]:
    from ds4c.ir.interpreter import state_to_inputs

    return {k: v.clone() for k, v in state_to_inputs(state).items()}


class _Alone:
    """One-sequence graphs of widths 1..5 (raw, or through the default pipeline at each bucket)."""

    def __init__(self, weights, passes: bool):
        self.buckets = BucketSpec.build(TINY, (1,), MAX_CTX)
        self.passes = passes
        self.ip: dict[tuple[int, int], Interpreter] = {}
        for q in range(1, 6):
            g = build_step(TINY, q, MAX_CTX)
            for c in (self.buckets.contexts if passes else (0,)):
                self.ip[q, c] = Interpreter(run_pipeline(g, "default", context=c).graph if passes else g, weights)

    def bucket(self, end: int) -> int:
        return next(c for c in self.buckets.contexts if end <= c) if self.passes else 0

    def step(self, ref: Reference, toks: list[int]) -> torch.Tensor:
        return run_step(self.ip[len(toks), self.bucket(ref.state.pos + len(toks))], ref.state, toks, ref.state.pos)


def _start(weights, alone: _Alone, length: int, seed: int) -> Reference:
    ref = Reference(weights, max_ctx=MAX_CTX)
    for t in _tokens(length, seed):
        alone.step(ref, [t])
    return ref


@pytest.mark.parametrize("passes", [False, True], ids=["raw", "passes"])
def test_lanes_step_equals_each_lane_alone(tiny_weights, passes: bool) -> None:
    """Four lanes at positions 0, 15 (the window wraps in this step), 63 (ratio-16 and ratio-4 flushes) and 70,
    rows (1, 3, 1, 2): four steps, each lane's logits and every state buffer bit-equal to the lane alone. With
    passes, each lanes step runs the graph of the bucket holding its furthest lane."""
    lanes = (1, 3, 1, 2)
    alone = _Alone(tiny_weights, passes)
    starts = (0, 15, 63, 70)
    solo = [_start(tiny_weights, alone, n, seed=j) for j, n in enumerate(starts)]
    batch = [Reference(tiny_weights, max_ctx=MAX_CTX) for _ in starts]  # the same starts: copies of solo's states
    for b, s in zip(batch, solo):
        b.restore(s.snapshot())
    g = build_step(TINY, sum(lanes), MAX_CTX, lanes=lanes)
    verify(g)
    graphs = {}
    for step in range(4):
        toks = [_tokens(n, seed=100 * step + j) for j, n in enumerate(lanes)]
        end = max(s.state.pos + n for s, n in zip(batch, lanes))
        c = alone.bucket(end)
        if c not in graphs:
            graphs[c] = Interpreter(run_pipeline(g, "default", context=c).graph if passes else g, tiny_weights)
        got = run_lanes_step(graphs[c], [s.state for s in batch], toks)
        row = 0
        for j, (ref, t) in enumerate(zip(solo, toks)):
            want = alone.step(ref, t)
            assert torch.equal(got[row:row + len(t)], want), f"step {step} lane {j}: logits differ"
            row += len(t)
            a, b = _buffers(ref.state), _buffers(batch[j].state)
            bad = [k for k in a if not torch.equal(a[k], b[k])]
            assert not bad, f"step {step} lane {j}: state buffers differ: {bad}"
            assert ref.state.pos == batch[j].state.pos


def test_lanes_graph_shape_and_plan() -> None:
    """The lanes graph has per-lane state and positions, row views and one concat per layer; after the default
    pipeline each lane has its own compressor, indexer, attention and ring-write kernels and the row-wise kernels
    are shared (as many as the one-sequence graph has)."""
    lanes = (1, 1, 1)
    g = build_step(TINY, 3, MAX_CTX, lanes=lanes)
    assert g.meta["lanes"] == [1, 1, 1]
    assert {"tokens", "positions", "lane0.pos", "lane2.pos", "lane1.l0.ring", "lane2.l2.idx_keys"} <= set(g.inputs)
    assert "pos" not in g.inputs
    assert {"lane0.l3.comp", "lane2.l2.comp_kv", "logits"} <= set(g.outputs)
    assert sum(op.kind == "concat_rows" for op in g.ops) == TINY.n_layers
    out = run_pipeline(g, "default", context=64).graph
    assert {"lane0.live_r4", "lane2.live_r16"} <= set(out.inputs)
    plan = kernel_plan(out)
    one = kernel_plan(run_pipeline(build_step(TINY, 1, MAX_CTX), "default", context=64).graph)
    fams = lambda p, f: sum(k.family == f for k in p.kernels)  # noqa: E731
    for f in ("attention", "compressor", "indexer"):
        assert fams(plan, f) == 3 * fams(one, f), f
    for f in ("gemv", "hc", "experts", "router"):
        assert fams(plan, f) == fams(one, f), f


@pytest.mark.parametrize("bad", [(), (0,), (6,), (5, 5, 5, 2), (1.5,), "ab"])
def test_bad_lanes_are_one_line_errors(bad) -> None:
    with pytest.raises(StepError, match="lanes"):
        build_step(TINY, 1, MAX_CTX, lanes=bad)


def test_lanes_options_checked() -> None:
    with pytest.raises(StepError, match="width 2"):
        build_step(TINY, 3, MAX_CTX, lanes=(1, 1))
    with pytest.raises(StepError, match="prefill"):
        build_step(TINY, 2, MAX_CTX, lanes=(1, 1), prefill=True)
    with pytest.raises(StepError, match="record_hc"):
        build_step(TINY, 2, MAX_CTX, lanes=(1, 1), record_hc=True)
    assert MAX_LANE_ROWS >= 16
    g = build_step(TINY, 16, MAX_CTX, lanes=(1,) * 16)
    verify(g)


def test_run_lanes_step_checks_its_arguments(tiny_weights) -> None:
    g = build_step(TINY, 2, MAX_CTX, lanes=(1, 1))
    ip = Interpreter(g, tiny_weights)
    refs = [Reference(tiny_weights, max_ctx=MAX_CTX) for _ in range(2)]
    with pytest.raises(StepError, match="lanes have rows"):
        run_lanes_step(ip, [r.state for r in refs], [[1], [2, 3]])
    with pytest.raises(StepError, match="token ids"):
        run_lanes_step(ip, [r.state for r in refs], [[1], [TINY.vocab_size]])
    with pytest.raises(StepError, match="lanes graph"):
        run_lanes_step(Interpreter(build_step(TINY, 1, MAX_CTX), tiny_weights), [refs[0].state], [[1]])


@pytest.mark.parametrize("name,ctx,lanes", [("tiny", 128, (1, 2, 1)), ("tiny", 128, (1, 1, 5)),
                                           ("flash-l4", 4096, (1,) * 8)])
@pytest.mark.parametrize("arch", ["sm_90", "gfx1151"])
def test_lanes_step_lowers_with_lane_bindings(name, ctx, lanes, arch) -> None:
    """Every plan kernel of a lanes step lowers; each per-lane kernel binds its lane's state buffers, its rows of
    the row-wise values (Arg.row = the lane's first row) and its live lengths; row-wise kernels read each row's
    position; no rollback kernel."""
    import re

    from ds4c.ir.printer import value_names
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.targets import target

    cfg = preset(name)
    g = run_pipeline(build_step(cfg, sum(lanes), ctx, lanes=lanes), "default", context=ctx).graph
    ks = lower_graph(g, cfg, target(arch))
    assert len(ks) == sum(op.kind == "fused" for op in g.ops) and not any(k.name == "rollback" for k in ks)
    values = set(value_names(g).values())
    firsts = [sum(lanes[:j]) for j in range(len(lanes))]
    seen_rows = set()
    for k in ks:
        for la in k.launches:
            src = re.sub(r"//[^\n]*", "", la.kernel.source)
            sig = re.search(r"\b" + la.kernel.entry + r"\s*\(([^)]*)\)", src)
            assert sig and len([p for p in sig.group(1).split(",") if p.strip()]) == len(la.args), k.name
            lane_of = {int(a.name[4:a.name.index(".")]) for a in la.args
                       if a.kind == "value" and a.name.startswith("lane")}
            assert len(lane_of) <= 1, (k.name, lane_of)  # a kernel touches one lane's state at most
            for a in la.args:
                if a.kind == "value":
                    assert a.name in values, (k.name, a)
                elif a.kind == "step":
                    assert a.name in ("positions", "tokens") or re.fullmatch(r"lane\d+\.live_r\d+", a.name), a
                    assert "pos" != a.name
                if a.row:
                    assert a.row in firsts, (k.name, a)
                    seen_rows.add(a.row)
            if lane_of:  # a per-lane kernel reads its own lane's positions
                j = lane_of.pop()
                assert all(a.row == firsts[j] for a in la.args if a.kind == "step" and a.name == "positions"), k.name
    assert seen_rows == set(firsts) - {0}


@pytest.mark.parametrize("text", ["0", "-1", "17", "300000000", "99999999999999999999", "1,6", "a", "1,,2"])
def test_inspect_ir_bad_lanes_are_one_line_errors(text) -> None:
    """A fresh user's inputs: every bad --lanes is a short one-line usage error naming what was typed, before any
    list of that many lanes is built."""
    from click.testing import CliRunner

    from ds4c.cli import main

    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--lanes", text])
    assert r.exit_code != 0 and "Traceback" not in r.output and len(r.output) < 400, r.output
    assert "lanes" in r.output


def test_run_lanes_step_refuses_shared_states_floats_and_other_capacities(tiny_weights) -> None:
    g = build_step(TINY, 2, MAX_CTX, lanes=(1, 1))
    ip = Interpreter(g, tiny_weights)
    a, b = (Reference(tiny_weights, max_ctx=MAX_CTX) for _ in range(2))
    with pytest.raises(StepError, match="its own sequence state"):
        run_lanes_step(ip, [a.state, a.state], [[1], [2]])
    with pytest.raises(StepError, match="ints"):
        run_lanes_step(ip, [a.state, b.state], [[1.7], [2]])
    with pytest.raises(StepError, match="ints"):
        run_lanes_step(ip, [a.state, b.state], [["a"], [2]])
    with pytest.raises(StepError, match="max_ctx 256"):
        run_lanes_step(ip, [a.state, Reference(tiny_weights, max_ctx=128).state], [[1], [2]])
    assert a.state.pos == b.state.pos == 0


def test_lane_launches_are_tagged_and_cut_into_parallel_runs() -> None:
    """The compiled lanes step runs each lane's per-lane launches on a stream of its own (StepGraphs.lane_streams):
    ``lane_of`` tags every launch binding one lane's state or scalars with that lane and leaves the row-wise ones
    (GEMV, experts, HC, router, the grouped wo_a, the head) untagged; ``lane_segments`` cuts the launch list, in
    order and covering it once, into runs where the parallel ones hold per-lane launches of several lanes and no
    row-wise launch, each lane's launches keeping their order."""
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.step.binding import lane_of, lane_segments
    from ds4c.runtime.targets import target

    cfg, lanes = preset("tiny"), (1, 2, 1)
    g = run_pipeline(build_step(cfg, sum(lanes), MAX_CTX, lanes=lanes), "default", context=MAX_CTX).graph
    ks = lower_graph(g, cfg, target("sm_90"))
    tags = [(k.family, lane_of(la.args)) for k in ks for la in k.launches]
    per_lane = {f for f, j in tags if j is not None}
    assert {"attention", "compressor", "indexer"} <= per_lane
    assert not per_lane & {"gemv", "experts", "hc", "router", "grouped"}
    for f in per_lane:  # every lane has its own launches of each per-lane family
        assert {j for g_, j in tags if g_ == f} == set(range(len(lanes))), f
    assert lane_of([]) is None
    segs = lane_segments([j for _, j in tags])
    assert [i for a, b, _ in segs for i in range(a, b)] == list(range(len(tags)))
    par = [(a, b) for a, b, p in segs if p]
    assert par and all(len({tags[i][1] for i in range(a, b)}) > 1 and None not in {tags[i][1] for i in range(a, b)}
                       for a, b in par)
    assert lane_segments([None, 0, 1, 0, None, 2, 2, None]) == [(0, 1, False), (1, 4, True), (4, 5, False),
                                                               (5, 6, False), (6, 7, False), (7, 8, False)]
