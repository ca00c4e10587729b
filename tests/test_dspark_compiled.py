"""The DSpark drafter compiled (issue 13, deliverable 2; spec ds4-flash.md section 7) on the tiny preset.

CPU:
* the IR graphs (ds4c/ir/dspark.py) run by the interpreter equal the reference drafter
  (:class:`~ds4c.drafters.dspark_model.DSparkModel`) bit for bit, before and after the passes: rings after commits of
  5, 5, 4, 3, 2 rows (19 positions > the 16-row window), then the draft's head logits, Markov logits, drafts and
  confidence; a draft graph writes no state;
* the verifier rejects ill-typed new ops, the builders reject bad sizes (one line);
* the kernel plan: the commit graph is two kernels (fc GEMV; the stages' wkv GEMV whose row chains also write the
  rings), the draft graph has no rollback kernel, the HC head exports the pre-norm ``hx``;
* the new kernels render and compile for sm_90 and gfx942 without spills, and run on the CPU emulator
  (tests/emulators/dspark_emu.py) against the reference: the Markov head (drafts equal, logits and confidence to fp32
  tolerance, NaN-poisoned outputs all written) and the dspark attention list (bf16 tolerance);
* a rejected verify changes no drafter state (the reference drafter; the compiled one on the GPU).

GPU (``gpu`` mark, skipped without CUDA): the compiled drafter against the reference drafter, a greedy speculative
generation on the compiled target equal to autoregressive decoding, and one propose timed.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ds4c.drafters.dspark_sources import open_dspark
from ds4c.drafters.dspark_model import DSparkModel
from ds4c.drafters.dspark_synth import make_dspark
from ds4c.errors import StepError
from ds4c.ir.dspark import COMMIT_PIPELINE, build_dspark_commit, build_dspark_draft
from ds4c.ir.graph import Graph, Op, Value
from ds4c.ir.interpreter import Interpreter
from ds4c.ir.ops import SparseAttention, T
from ds4c.ir.verify import VerifyError, verify
from ds4c.passes.manager import run_pipeline
from ds4c.quant import GGMLType as G
from ds4c.reference import Reference
from ds4c.runtime.families import attention as A
from ds4c.runtime.families import dspark as D
from ds4c.runtime.families import hc as H
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.lowered import Arg
from ds4c.runtime.targets import target
from emulators import dspark_emu, experts_emu
from kernel_compile import assert_no_spills, compile_kernel
from numerics import BF16_ULP, fp32_order_bound

PROMPT = [5, 17, 301, 42, 7, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 19 > tiny's 16-row window
CHUNKS = (5, 5, 4, 3, 2)


def _one_line(ei) -> str:
    msg = str(ei.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def dspark4(tiny_path, tmp_path_factory) -> Path:
    """Block size 4 with a confidence bias (as tests/test_dspark.py's loop drafter)."""
    return make_dspark(tiny_path, tmp_path_factory.mktemp("dspark4c") / "tiny-dspark4.gguf", seed=3, block_size=4,
                       conf_bias=True)


@pytest.fixture(scope="module")
def tapped(tiny_weights, dspark4):
    """The reference drafter and a tapped reference that ran PROMPT (verify steps of 5)."""
    f = open_dspark(dspark4)
    ref = Reference(tiny_weights, max_ctx=64, taps=f.taps)
    for i in range(0, len(PROMPT), 5):
        ref.verify(PROMPT[i:i + 5], i)
    return f, DSparkModel(f, tiny_weights), ref.main_hidden(0, len(PROMPT))


def test_ir_graphs_equal_the_reference_bit_for_bit(tapped):
    f, m, mh = tapped
    cfg = m.cfg
    rings = {f"l{s}.ring": torch.zeros(cfg.window, cfg.head_dim, dtype=torch.bfloat16) for s in range(3)}
    start = 0
    m.reset()
    for n in CHUNKS:
        g = build_dspark_commit(cfg, len(f.taps), n)
        verify(g)
        ins = {"main_hidden": mh[start:start + n], "pos": torch.tensor(start), **rings}
        outs = [Interpreter(gg, m.weights).run(ins) for gg in (g, run_pipeline(g, COMMIT_PIPELINE).graph)]
        m.extend(start, mh[start:start + n])
        start += n
        for o in outs:
            assert all(torch.equal(o[f"l{s}.ring"], m.ring(s)) for s in range(3)), (n, start)
        rings = {k: outs[1][k] for k in rings}
    assert m.ring_pos == len(PROMPT) and bool(rings["l0.ring"].abs().sum(-1).gt(0).all())  # every slot written
    gd = build_dspark_draft(cfg, f.block_size, f.markov_rank, f.has_confidence, f.has_conf_bias)
    verify(gd)
    assert not any(k.endswith(".ring") for k in gd.outputs) and not any(op.kind == "ring_write" for op in gd.ops)
    for t0 in (300, 7):
        toks = torch.tensor([t0] + [f.noise_id] * (f.block_size - 1))
        ref = m.draft(t0)
        base, _hx = m.block(t0)
        for gg in (gd, run_pipeline(gd, "default", context=cfg.window).graph):
            o = Interpreter(gg, m.weights).run({"tokens": toks, "pos": torch.tensor(m.ring_pos), **rings})
            assert torch.equal(o["base"], base) and torch.equal(o["logits"], ref.logits)
            assert o["drafts"].tolist() == ref.tokens and torch.equal(o["confidence"], ref.confidence)


def test_new_ops_are_type_checked_and_builders_reject_bad_sizes(tapped):
    f, m, _ = tapped
    cfg = m.cfg

    def graph(kind: str, ins: list[Value], attrs: dict, outs: list) -> Graph:
        op = Op(kind, ins, [Value(t) for t in outs], attrs)
        for v in op.outputs:
            v.producer = op
        return Graph({f"i{k}": v for k, v in enumerate(dict.fromkeys(ins))}, [op], {"o": op.outputs[0]})

    base, tok = Value(T((4, 512), "f32")), Value(T((4,), "i64"))
    w1, w2 = Value(T((512, 64), "f32")), Value(T((512, 32), "f32"))
    with pytest.raises(VerifyError, match="markov_w1 rank 64 != markov_w2 rank 32"):
        verify(graph("markov_chain", [base, tok, w1, w2], {}, [T((4,), "i64"), T((4, 512), "f32")]))
    with pytest.raises(VerifyError, match=r"expected tokens i64 \[4\]"):
        verify(graph("markov_chain", [base, Value(T((3,), "i64")), w1, Value(T((512, 64), "f32"))], {},
                     [T((4,), "i64"), T((4, 512), "f32")]))
    hx, proj = Value(T((4, 256), "bf16")), Value(T((1, 300), "f32"))
    with pytest.raises(VerifyError, match=r"expected proj \[1, 256 \+ rank 64\]"):
        verify(graph("dspark_confidence", [hx, tok, tok, w1, proj], {}, [T((4,), "f32")]))
    q, ring, kv, sink = (Value(T((4, 4, 192), "bf16")), Value(T((16, 192), "bf16")), Value(T((4, 192), "bf16")),
                         Value(T((4,), "f32")))
    with pytest.raises(VerifyError, match="kind dspark takes 5 inputs"):
        verify(graph("sparse_attention", [q, ring, kv, tok, sink, ring], dict(kind="dspark", window=16, scale=0.1),
                     [q.type]))
    for build, bad, what in ((lambda: build_dspark_commit(cfg, 3, 6), "rows must be in 1..5", None),
                             (lambda: build_dspark_draft(cfg, 6, 64), "block size must be in 1..5", None),
                             (lambda: build_dspark_draft(cfg.replace(compress_ratios=(4, 0, 0)), 4, 64),
                              "ratio-0 score-routed", None)):
        with pytest.raises(StepError, match=bad) as ei:
            build()
        _one_line(ei)


def test_every_launch_argument_has_a_runtime_buffer(tapped):
    """What CompiledDSpark binds (runtime/dspark_exec.py check_bindings, run before binding on the GPU): every graph's
    launches read only step scalars, drafter / shared weights, the rings, main_hidden, constants and arena values."""
    from ds4c.runtime.dspark_exec import GRAPH_KEYS, build_graph, check_bindings

    f, m, _ = tapped
    types = {n: f.ggml_type(n) for n in f.specs}
    types.update({"token_embd.weight": G.BF16, "output.weight": G.Q8_0})
    rings = {f"l{s}.ring" for s in range(3)}
    for key in GRAPH_KEYS:
        g, kernels = build_graph(key, m.cfg, f, target("sm_90"), types)
        check_bindings(g, kernels, f, rings)
        weights = {a.name for k in kernels for la in k.launches for a in la.args if a.kind == "weight"}
        assert ("token_embd.weight" in weights) == (key == "draft") and ("fc.weight" in weights) != (key == "draft")
    g, kernels = build_graph("draft", m.cfg, f, target("sm_90"), types)
    la = kernels[0].launches[0]
    kernels[0].launches[0] = dataclasses.replace(la, args=la.args + (Arg("step", "live_r4"),))
    with pytest.raises(StepError, match="reads step 'live_r4', which the compiled drafter does not provide") as ei:
        check_bindings(g, kernels, f, rings)
    _one_line(ei)
    kernels[0].launches[0] = dataclasses.replace(la, args=la.args + (Arg("weight", "blk.0.attn_q_a.bias"),))
    with pytest.raises(StepError, match="reads weight 'blk.0.attn_q_a.bias'"):
        check_bindings(g, kernels, f, rings)
    with pytest.raises(StepError, match="no DSpark graph 'commit6'"):
        build_graph("commit6", m.cfg, f, target("sm_90"), types)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_kernel_plan(tapped, arch):
    f, m, _ = tapped
    cfg = m.cfg
    gc = run_pipeline(build_dspark_commit(cfg, 3, 5), COMMIT_PIPELINE).graph
    kc = lower_graph(gc, cfg, target(arch))
    assert [k.name for k in kc] == ["linear", "l2.multi_gemv"]  # fc; the stages' wkv + norm/RoPE/P3 + ring writes
    chains = [la for la in kc[1].launches if "_epi" in la.kernel.entry]
    assert [a.name for la in chains for a in la.args if a.name.endswith(".ring")] == ["l0.ring", "l1.ring", "l2.ring"]
    gd = run_pipeline(build_dspark_draft(cfg, 4, f.markov_rank, True, True), "default", context=cfg.window).graph
    kd = lower_graph(gd, cfg, target(arch))
    assert "rollback" not in [k.name for k in kd] and [k.family for k in kd][-2:] == ["dspark", "dspark"]
    att = [k for k in kd if k.family == "attention"]
    assert len(att) == 3 and all("dspark" in k.launches[0].kernel.entry for k in att)
    head = next(k for k in kd if k.name == "hc_post_head")
    assert head.launches[-1].args[-1].name == "head.y"  # the pre-norm hx, the confidence's input
    markov = next(k for k in kd if k.name == "markov_chain")
    assert [a.value for la in markov.launches[:-1] for a in la.args if a.kind == "int"] == [0, 1, 2, 3]


def _official_kernels(arch: str) -> list:
    t = target(arch)
    srcs = list(D.render_markov(D.MarkovSpec(5, 129280, 256, 4096, True, True), t, "dspark_markov").values())
    srcs.append(D.render_markov(D.MarkovSpec(5, 129280, 256, 4096, sampled=True), t, "dspark_sampled")["depth"])
    srcs += A.render_attention(A.AttentionSpec("dspark", 5, 64, 512, 128), t, "dspark_attn")
    srcs += A.render_attention(A.AttentionSpec("dspark", 4, 4, 192, 16, splits=2), t, "dspark_attn_tiny")
    return srcs + H.render_hc(H.HcSpec("post_head", 5, 4096, 4, 4, head_out=True), t, "dspark_head")


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_new_kernels_compile_without_spills(arch, tmp_path):
    srcs = _official_kernels(arch)

    def one(k):
        i, s = k
        (tmp_path / str(i)).mkdir()
        c = compile_kernel(s, tmp_path / str(i))
        assert_no_spills(c.usage, s, c.log)
        return s.entry

    with ThreadPoolExecutor(2) as ex:  # the 2-core CI machine
        done = list(ex.map(one, enumerate(srcs)))
    assert len(done) == len(srcs)


def _emu():
    why = experts_emu.host_unavailable()
    if why:
        pytest.skip(f"CPU emulator: {why}")
    return dspark_emu


def test_markov_head_emulated_matches_the_reference(tmp_path):
    E = _emu()
    spec = D.MarkovSpec(4, 1000, 64, 256, True, True, threads=64, rows_per_block=96)  # 11 blocks, the last partial
    exe = E.build_markov(spec, tmp_path / "build")
    for seed, t0 in ((0, 17), (1, 999)):
        ins = E.markov_inputs(spec, t0, seed)
        (tmp_path / str(seed)).mkdir()
        got = E.run_markov(spec, ins, tmp_path / str(seed), exe)
        drafts, logits, conf = D.reference(ins["base"], t0, ins["w1"], ins["w2"], ins["hx"], ins["proj"], ins["bias"])
        assert got["drafts"].tolist() == drafts.tolist()
        assert bool(torch.isfinite(got["logits"]).all())  # every row written over the NaN poison
        # fp32 logits: rank-R dots summed in another order; the confidence: a hidden-D dot, then a sigmoid
        assert float((got["logits"] - logits).norm() / logits.norm()) <= fp32_order_bound(spec.rank)
        assert float((got["conf"] - conf).abs().max()) <= fp32_order_bound(spec.hidden) * float(conf.abs().max() + 1)


def test_sampled_markov_depths_emulated_read_the_drawn_ids(tmp_path):
    """The sampling chain's depth kernel reads out_i from drafts[i-1] (drawn on the device between launches) and
    writes each depth's logits: equal to the reference's logits for that chain."""
    E = _emu()
    spec = D.MarkovSpec(4, 1000, 64, 256, False, threads=64, rows_per_block=96, sampled=True)
    ins = E.markov_inputs(spec, 5, seed=2)
    ins["drafts"] = torch.tensor([811, 3, 640, 999], dtype=torch.int64)
    got = E.run_markov(spec, ins, tmp_path)
    w1, w2 = ins["w1"].float(), ins["w2"].float()
    prev = [5, 811, 3, 640]
    want = torch.stack([ins["base"][i] + w2 @ w1[p] for i, p in enumerate(prev)])
    assert got["drafts"].tolist() == [811, 3, 640, 999]
    assert bool(torch.isfinite(got["logits"]).all())
    assert float((got["logits"] - want).norm() / want.norm()) <= fp32_order_bound(spec.rank)  # rank-R fp32 dots


def test_dspark_attention_emulated_matches_the_reference(tmp_path):
    E = _emu()
    g = torch.Generator().manual_seed(0)
    exes = {}
    for pos, splits in ((0, 1), (3, 1), (16, 1), (100, 2)):
        spec = A.AttentionSpec("dspark", 4, 4, 192, 16, splits=splits)
        if splits not in exes:
            exes[splits] = E.build_attention(spec, tmp_path / f"build{splits}")
        (tmp_path / f"{pos}_{splits}").mkdir()
        ins = {"q": torch.randn(4, 4, 192, generator=g).to(torch.bfloat16),
               "ring": torch.randn(16, 192, generator=g).to(torch.bfloat16),
               "kv_new": torch.randn(4, 192, generator=g).to(torch.bfloat16), "sink": torch.randn(4, generator=g),
               "pos": torch.tensor([pos])}
        got = E.run_attention(spec, ins, tmp_path / f"{pos}_{splits}", exes[splits])
        want = A.reference(spec, ins["q"], ins["ring"], ins["kv_new"], None, None, ins["sink"], pos, 0)
        positions = torch.arange(pos, pos + spec.q)
        ir = SparseAttention.run(None, [ins["q"], ins["ring"], ins["kv_new"], positions, ins["sink"]],
                                 {"kind": "dspark", "window": 16, "scale": spec.scale_value})[0]
        assert torch.equal(ir, want)  # the family's reference is the IR op's
        # bf16 probabilities rounded per split against its own running max, and the output's rounding: 2 u_bf16
        assert float((got.float() - want.float()).norm() / want.float().norm()) <= BF16_ULP, (pos, splits)
        # the ring rows count: another ring changes the result exactly when rows are committed (pos > 0)
        ins2 = dict(ins, ring=torch.randn(16, 192, generator=g).to(torch.bfloat16))
        other = A.reference(spec, ins2["q"], ins2["ring"], ins2["kv_new"], None, None, ins2["sink"], pos, 0)
        assert torch.equal(other, want) == (pos == 0)


def test_a_rejected_verify_changes_no_drafter_state(dspark4, tiny_weights):
    """The reference drafter (the design the compiled one shares: commit only what was accepted, at the next
    proposal): after a proposal, a verify whose drafts are all rejected and its rollback, the rings are those of the
    committed positions only, and the next proposal commits exactly the one position the verify kept."""
    from ds4c.drafters.dspark import DSparkDrafter

    d = DSparkDrafter(dspark4)
    ref = Reference(tiny_weights, max_ctx=64)
    d.prepare(ref, PROMPT[:6], 8)
    ref.verify(PROMPT[:5], 0)
    ref.verify(PROMPT[5:6], 5)
    drafts, _ = d.propose(PROMPT[:6] + [300], 3)
    rings = [d.model.ring(s).clone() for s in range(3)]
    wrong = [(t + 1) % 512 for t in drafts]
    ref.verify([300] + wrong, 6)
    ref.rollback(1)
    assert all(torch.equal(d.model.ring(s), rings[s]) for s in range(3)) and d.model.ring_pos == 6
    d.propose(PROMPT[:6] + [300, 11], 3)
    assert d.last_written == [6] and d.model.ring_pos == 7
