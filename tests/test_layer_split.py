"""Layer split (issue: layer split with the HC-state handoff): the shard plan, the shard graphs of the IR and
their lowering, and the interpreter chain of shard graphs against the unsplit reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ds4c.buckets import BucketSpec
from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.ir import Interpreter, build_step, run_split_step
from ds4c.passes.manager import run_pipeline
from ds4c.reference import Reference
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.targets import target
from ds4c.shard_plan import MemoryModel, ShardPlan, ShardPlanError, auto_split, even_split, parse_plan

TINY = preset("tiny")
MAX_CTX = 64


# ------------------------------------------------------------------------------------------------ the plan
def test_parse_plan_explicit_and_default():
    p = parse_plan("cuda:0, cuda:1", "4,2", 6)
    assert p.devices == ("cuda:0", "cuda:1") and p.layers == (4, 2) and p.ranges == [(0, 4), (4, 6)]
    assert p.describe() == "cuda:0 [0,4) | cuda:1 [4,6)" and p.is_split and p.kind == "cuda"
    assert parse_plan(None, None, 6, default_device="cpu") == ShardPlan(("cpu",), (6,))
    assert parse_plan("cpu,cpu,cpu", None, 7).layers == (3, 2, 2)  # even split without a memory model
    assert parse_plan(["cpu", "cpu"], [1, 5], 6).ranges == [(0, 1), (1, 6)]
    # the hash is of the layer ranges: the same split on other ordinals serves the same artifact
    assert parse_plan("cuda:2,cuda:3", "4,2", 6).hash() == p.hash() != parse_plan("cuda:0,cuda:1", "3,3", 6).hash()


@pytest.mark.parametrize("devices,split,n,msg", [
    ("cuda:0,cuda:1", "3,2", 6, "expected counts summing to the model's 6 layers, found 5"),
    ("cuda:0,cuda:1", "6", 6, "expected 2 layer counts"),
    ("cuda:0,cuda:1", "6,0", 6, "expected counts >= 1, found 0"),
    ("cuda:0,cuda:1", "a,b", 6, "--layer-split 'a,b': expected comma-separated layer counts"),
    ("cpu,cuda:0", "3,3", 6, "expected all cpu or all cuda, found both"),
    ("gpu0", None, 6, "device 'gpu0': expected cpu, cuda or cuda:N"),
    ("cuda:0,,cuda:1", None, 6, "expected a comma-separated list"),
    ("cpu,cpu,cpu", None, 2, "3 devices for 2 layers"),
])
def test_parse_plan_errors(devices, split, n, msg):
    with pytest.raises(ShardPlanError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_plan(devices, split, n)
    assert "\n" not in str(e.value)


def test_even_split():
    assert even_split(43, 2) == [22, 21] and even_split(6, 3) == [2, 2, 2] and even_split(5, 1) == [5]


def test_auto_split_balances_and_fits():
    mem = MemoryModel(layer_bytes=(10,) * 8, first_bytes=5, last_bytes=25, shard_bytes=2, headroom=0.0)
    # equal devices: the head's 25 bytes push layers to shard 0
    counts = auto_split(mem, [100, 100], ["cuda:0", "cuda:1"])
    assert sum(counts) == 8
    a = counts[0]
    assert max(mem.need(0, a) / 100, mem.need(a, 8) / 100) == min(
        max(mem.need(0, b) / 100, mem.need(b, 8) / 100) for b in range(1, 8))
    assert counts == [5, 3]  # 57 and 57 bytes; [4, 4] would need 47 and 67
    # an uneven pair of devices gets an uneven split
    assert auto_split(mem, [40 + 5 + 2, 200], ["cuda:0", "cuda:1"])[0] <= 4
    # the exact need of every shard is within its capacity
    counts = auto_split(mem, [60, 160], ["cuda:0", "cuda:1"])
    assert mem.need(0, counts[0]) <= 60 and mem.need(counts[0], 8) <= 160


def test_auto_split_names_the_shortfall():
    mem = MemoryModel(layer_bytes=(2**30,) * 4, headroom=0.0)
    with pytest.raises(ShardPlanError, match=r"does not fit cuda:0,cuda:1: shard \d \(layers \[\d,\d\) on cuda:\d\) "
                                             r"needs 2\.00 GiB, 1\.00 GiB usable") as e:
        auto_split(mem, [2**30, 2**30], ["cuda:0", "cuda:1"])
    assert "all shards need 4.00 GiB, the devices have 2.00 GiB" in str(e.value)
    plan = parse_plan("cuda:0,cuda:1", None, 4, memory=MemoryModel((1,) * 4), free_bytes=[100, 100])
    assert plan.layers == (2, 2)


# ------------------------------------------------------------------------------------------------ the IR
def _shard_graphs(q: int, plan: ShardPlan, context: int = 64):
    return [run_pipeline(build_step(TINY, q, MAX_CTX, r), "default", context=context).graph for r in plan.ranges]


def test_shard_graphs_have_the_boundary_io():
    plan = ShardPlan(("cpu",) * 3, (2, 2, 2))
    g0, g1, g2 = [build_step(TINY, 2, MAX_CTX, r) for r in plan.ranges]
    assert "hc_in" not in g0.inputs and str(g1.inputs["hc_in"].type) == str(g2.inputs["hc_in"].type)
    assert tuple(g1.inputs["hc_in"].type.shape[1:]) == (TINY.hc_mult, TINY.hidden_size)
    assert set(g0.outputs) - {k for k in g0.outputs if k.startswith("l0.") or k.startswith("l1.")} == {"hc_out"}
    assert "logits" in g2.outputs and "hc_out" not in g2.outputs
    assert {k.split(".")[0] for k in g1.inputs if k.startswith("l")} == {"l2", "l3"}
    assert g1.meta["layers"] == [2, 4] and "layers" not in build_step(TINY, 2, MAX_CTX).meta
    with pytest.raises(StepError, match=r"layer range \[4,9\): expected 0 <= start < stop <= 6"):
        build_step(TINY, 1, MAX_CTX, (4, 9))
    with pytest.raises(StepError, match=r"layer range \[3,3\)"):
        build_step(TINY, 1, MAX_CTX, (3, 3))


def test_shard_kernels_cut_the_hc_boundary():
    """The shard boundary is one hc_post_out kernel (the last HC post, one launch) then one hc_pre kernel (the
    HC pre on hc_in); every other kernel of the split equals the unsplit graph's, source for source."""
    t = target("sm_90")
    def lowered(g):  # without the verify graph's rollback kernel: each shard has its own (its layers only)
        ks = lower_graph(g, TINY, t)
        assert ks[-1].name == "rollback"
        return ks[:-1]

    whole = lowered(run_pipeline(build_step(TINY, 3, MAX_CTX), "default", context=64).graph)
    plan = ShardPlan(("cpu", "cpu"), (3, 3))
    k0, k1 = [lowered(g) for g in _shard_graphs(3, plan)]
    assert k0[0].name == "l0.hc_embed_pre" and k0[-1].name == "l2.hc_post_out" and len(k0[-1].launches) == 1
    assert k1[0].name == "l3.hc_pre" and len(k1[0].launches) == 2 and k1[-1].name == "linear"
    cut = {"l2.hc_post_out", "l3.hc_pre"}
    split_src = [la.kernel.source for k in k0 + k1 if k.name not in cut for la in k.launches]
    whole_src = [la.kernel.source for k in whole if k.name != "l3.hc_post_pre" for la in k.launches]
    assert split_src == whole_src
    # the boundary carries the HC state: hc_out written by shard 0's last launch, hc_in read by shard 1's first
    assert "hc_out" in [a.name for a in k0[-1].launches[0].args]
    assert "hc_in" in [a.name for a in k1[0].launches[0].args]


@pytest.mark.parametrize("split", [(1, 5), (2, 4), (3, 3), (4, 2), (5, 1), (2, 2, 2)])
def test_interpreted_shards_equal_the_reference_bit_for_bit(tiny_weights, split):
    """Every split point of tiny (and a 3-shard split): the shard graphs, through the default pipeline and the
    interpreter, chained by hc_out -> hc_in, give the unsplit reference's logits and state bit for bit, over
    verify steps of widths 3 and 1 crossing ratio-4 and ratio-16 flushes and the window (16)."""
    plan = ShardPlan(("cpu",) * len(split), split)
    g = torch.Generator().manual_seed(sum(split) * 7 + len(split))
    toks = torch.randint(1, TINY.vocab_size, (40,), generator=g).tolist()
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    state = ref.snapshot()
    shards = {q: [Interpreter(gr, tiny_weights) for gr in _shard_graphs(q, plan)] for q in (1, 3)}
    pos = 0
    for q in (3,) * 8 + (1,) * 6:
        want = ref.verify(toks[pos:pos + q], pos)
        got = run_split_step(shards[q], state, toks[pos:pos + q], pos)
        assert torch.equal(got, want), f"split {split} pos {pos}: logits differ by {(got - want).abs().max()}"
        pos += q
    assert state.equal(ref.state), f"split {split}: state differs after {pos} positions"


def test_split_step_needs_a_boundary(tiny_weights):
    g1 = run_pipeline(build_step(TINY, 1, MAX_CTX, (3, 6)), "default", context=64).graph
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    from ds4c.ir.interpreter import InterpreterError

    with pytest.raises(InterpreterError, match="reads hc_in, but no earlier shard wrote hc_out"):
        run_split_step([Interpreter(g1, tiny_weights)], ref.snapshot(), [1], 0)


def test_bucket_spec_of_a_plan_is_the_models():
    """Shards share the model's buckets: every shard graph of a key pads the same context."""
    spec = BucketSpec.build(TINY, max_ctx=MAX_CTX, contexts=(16, MAX_CTX))
    plan = ShardPlan(("cpu", "cpu"), (2, 4))
    for r in plan.ranges:
        g = run_pipeline(build_step(TINY, 2, MAX_CTX, r), "default", context=spec.contexts[0]).graph
        assert g.meta["context"] == 16


# ------------------------------------------------------------------------------------------ CLI and API
def _cli(*args):
    from click.testing import CliRunner

    from ds4c.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_generate_through_a_split_gives_the_unsplit_tokens(tiny_path):
    import json

    base = ["generate", tiny_path, "--prompt-ids", "5,17,301,42,7", "--max-new-tokens", "12", "--json"]
    whole = json.loads(_cli(*base).stdout)
    assert whole["shards"] is None
    for extra in (["--devices", "cpu,cpu"], ["--layer-split", "1,5"], ["--devices", "cpu,cpu,cpu", "--layer-split",
                                                                      "3,2,1"]):
        r = _cli(*base, *extra)
        assert r.exit_code == 0, r.output
        rec = json.loads(r.stdout)
        assert rec["tokens"] == whole["tokens"], extra
        assert sum(rec["shards"]["layers"]) == 6 and len(set(rec["shards"]["devices"])) == 1


@pytest.mark.parametrize("extra,msg", [
    (["--devices", "cpu,cuda"], "expected all cpu or all cuda, found both"),
    (["--layer-split", "2,2"], "expected counts summing to the model's 6 layers, found 4"),
    (["--layer-split", "x"], "--layer-split 'x': expected comma-separated layer counts"),
    (["--devices", "tpu:0"], "device 'tpu:0': expected cpu, cuda or cuda:N"),
    (["--devices", "cpu,cpu", "--layer-split", "6"], "expected 2 layer counts"),
    (["--layer-split", ""], "--layer-split '': expected comma-separated layer counts"),
    (["--layer-split", "2_0,4"], "--layer-split '2_0,4': expected comma-separated layer counts"),
    (["--devices", "cpu,,cpu"], "--devices 'cpu,,cpu': expected a comma-separated list"),
    (["--device", "cuda", "--devices", "cpu,cpu"], "--devices cpu,cpu: expected cuda devices (--device cuda), found "
                                                   "cpu devices"),
])
def test_generate_split_errors_are_one_line(tiny_path, extra, msg):
    r = _cli("generate", tiny_path, "--prompt-ids", "1,2", "--max-new-tokens", "2", *extra)
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ds4c: error: ") and msg in lines[0], r.stderr


def test_model_api_takes_a_split(tiny_path):
    from ds4c.api import Model
    from ds4c.reference.sharded import ShardedReference

    whole = Model(tiny_path, max_ctx=64)
    split = Model(tiny_path, max_ctx=64, devices=["cpu", "cpu"], layer_split=[4, 2])
    assert isinstance(split.stepper, ShardedReference) and split.stepper.plan.layers == (4, 2)
    from ds4c.drafters.oracle import OracleDrafter

    a = whole.generate([3, 1, 4, 1, 5], max_new_tokens=10).result.tokens
    b = split.generate([3, 1, 4, 1, 5], max_new_tokens=10).result.tokens
    assert a == b
    c = split.generate([3, 1, 4, 1, 5], max_new_tokens=10, draft=OracleDrafter(0.7, 512, seed=1), spec_width=4)
    assert c.result.tokens == a and c.result.speculative["steps"] < 10


@pytest.mark.parametrize("kw,msg", [
    (dict(devices=5), "devices 5: expected a comma-separated string or a list of device strings"),
    (dict(devices=[]), "expected a comma-separated list"),
    (dict(devices=[None, None]), "expected a comma-separated string or a list of device strings"),
    (dict(layer_split=5), "layer_split 5: expected a comma-separated string or a list of layer counts"),
    (dict(layer_split=[]), "layer_split []: expected at least one layer count"),
    (dict(layer_split=[2.5, 3.5]), "expected integer layer counts, found 2.5"),
    (dict(layer_split=[True, 5]), "expected integer layer counts, found True"),
    (dict(layer_split={4, 2}), "expected a comma-separated string or a list of layer counts"),
    (dict(devices="cuda:0,cuda:0"), "expected cpu devices (--device cpu)"),
])
def test_model_api_rejects_bad_split_arguments_in_one_line(tiny_path, kw, msg):
    from ds4c.api import Model

    with pytest.raises(ShardPlanError) as e:
        Model(tiny_path, max_ctx=64, **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)
