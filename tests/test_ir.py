"""The step IR (ds4c.ir): builder coverage of every config and width, printer stability, the verifier's
checks, networkx/dot export, and the interpreter == the PyTorch reference bit for bit (logits and state).

The tiny preset (window 16, CSA ratio 4, HCA ratio 16, top-k 8) crosses every state boundary of the official
model within 40 positions: ring wrap at 16 and 32, CSA/indexer flushes every 4, HCA flushes at 15 and 31.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx
import pytest
import torch

from ds4c.config import MAX_WIDTH, preset
from ds4c.errors import Ds4cError, StepError
from ds4c.sources import open_model
from ds4c.ir import (Interpreter, Sym, TensorType, Value, VerifyError, build_step, graph_hash, print_graph, run_step,
                     verify)
from ds4c.ir.builder import state_inputs
from ds4c.ir.export import to_dot, to_networkx
from ds4c.ir.graph import Op
from ds4c.ir.interpreter import InterpreterError, step_inputs
from ds4c.ir.ops import OPS
from ds4c.passes.manager import run_pipeline
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference import primitives as P
from ds4c.reference.state import SequenceState
from ds4c.tensors import tensor_specs

TINY = preset("tiny")
CONFIGS = ("tiny", "flash-l4", "flash")
N_POS = 40  # positions compared with the reference (crosses window 16, ratios 4 and 16 twice)
MAX_CTX = 128


@pytest.fixture(scope="module")
def weights(tiny_weights):
    return tiny_weights


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(8101)
    return torch.randint(1, TINY.vocab_size, (N_POS + MAX_WIDTH,), generator=g).tolist()


def expected_state_names(cfg) -> set[str]:
    out = set()
    for i in range(cfg.n_layers):
        out.add(f"l{i}.ring")
        if cfg.ratio(i):
            out |= {f"l{i}.comp", f"l{i}.comp_kv", f"l{i}.comp_score"}
        if cfg.ratio(i) == 4:
            out |= {f"l{i}.idx_keys", f"l{i}.idx_kv", f"l{i}.idx_score"}
    return out


# ------------------------------------------------------------------------------------------------ builder

@pytest.mark.parametrize("name", CONFIGS)
def test_build_step_verifies_at_every_width_with_every_layer_kind_and_state(name):
    cfg = preset(name)
    want_state = expected_state_names(cfg)
    for q in range(1, MAX_WIDTH + 1):
        g = build_step(cfg, q, max_ctx=512)
        verify(g)
        assert g.meta["width"] == q and g.meta["config"] == cfg.name and g.meta["max_ctx"] == 512
        assert g.meta["config_hash"] == cfg.hash()
        assert g.inputs["tokens"].type == TensorType((Sym("q"),), "i64")
        assert g.inputs["pos"].type == TensorType((), "i64")
        assert g.outputs["logits"].type == TensorType((Sym("q"), cfg.vocab_size), "f32")
        # one sparse attention per layer, of the layer's kind; all three kinds occur in these configs
        att = {}
        for op in g.ops:
            if op.kind == "sparse_attention":
                assert op.layer not in att, f"two attentions in layer {op.layer}"
                att[op.layer] = op.attrs["kind"]
        assert att == {i: cfg.layer_kind(i) for i in range(cfg.n_layers)}
        assert set(att.values()) == {"swa", "csa", "hca"}
        # extra attention operands: none (swa), span + selection (csa), span + mask (hca)
        for op in g.ops:
            if op.kind == "sparse_attention":
                n_extra = len(op.inputs) - 5
                assert n_extra == (0 if op.attrs["kind"] == "swa" else 2)
        # state buffers: exactly the right names, updated values of the same type as the inputs
        assert set(g.inputs) - {"tokens", "pos"} == want_state
        assert set(g.outputs) == want_state | {"logits"}
        assert set(state_inputs(cfg, 512)) == want_state
        for k in want_state:
            assert g.outputs[k].type == g.inputs[k].type, k
            assert g.outputs[k] is not g.inputs[k], f"{k} is returned unchanged"
        for i in range(cfg.n_layers):
            r = cfg.ratio(i)
            assert g.inputs[f"l{i}.ring"].type == TensorType((cfg.window, cfg.head_dim), "bf16")
            if r:
                assert g.inputs[f"l{i}.comp"].type.shape == (512 // r, cfg.head_dim)
            if r == 4:
                assert g.inputs[f"l{i}.idx_keys"].type.shape == (512 // 4, cfg.index_head_dim)
        # every op is tagged with a layer in -1..n_layers-1 and every layer has ops
        assert {op.layer for op in g.ops} == set(range(-1, cfg.n_layers))


def test_build_step_reads_every_model_tensor_once():
    g = build_step(TINY, 2, max_ctx=MAX_CTX)
    params = Counter(op.attrs["weight"] for op in g.ops if op.kind == "param")
    assert set(params.values()) == {1}
    specs = {s.name for s in tensor_specs(TINY)}
    experts = {n for n in specs if "_exps." in n}
    assert set(params) == (specs - experts) | {f"blk.{i}.experts" for i in range(TINY.n_layers)}
    # hash layers route by tid2eid, the others by the selection bias
    for i in range(TINY.n_layers):
        assert (f"blk.{i}.ffn_gate_tid2eid.weight" in params) == TINY.is_hash_layer(i)
        assert (f"blk.{i}.exp_probs_b.bias" in params) == (not TINY.is_hash_layer(i))


@pytest.mark.parametrize("width", [0, 6, -1])
def test_build_step_rejects_bad_width(width):
    with pytest.raises(StepError, match=r"width must be in 1\.\.5"):
        build_step(TINY, width, max_ctx=MAX_CTX)


def test_build_step_rejects_bad_max_ctx():
    with pytest.raises(StepError, match="max_ctx"):
        build_step(TINY, 1, max_ctx=0)


# ------------------------------------------------------------------------------------------------ printer

def test_printer_is_stable_and_distinguishes_graphs():
    g = build_step(TINY, 3, max_ctx=MAX_CTX)
    text = print_graph(g)
    assert print_graph(g) == text
    assert text.startswith("graph step(") and text.endswith("}\n")
    # every top-level op is one line (no fused ops yet); every op kind is named
    body = [ln for ln in text.splitlines() if " = " in ln and not ln.lstrip().startswith("output")]
    assert len(body) == len(g.ops)
    for kind in {op.kind for op in g.ops}:
        assert f"= {kind}(" in text
    # an unrelated build in between (value ids move on) does not change the text
    build_step(preset("flash-l4"), 2, max_ctx=256)
    again = build_step(TINY, 3, max_ctx=MAX_CTX)
    assert print_graph(again) == text
    assert graph_hash(again) == graph_hash(g)
    assert len(graph_hash(g)) == 64
    others = [build_step(TINY, 4, max_ctx=MAX_CTX), build_step(preset("flash-l4"), 3, max_ctx=MAX_CTX),
              build_step(TINY, 3, max_ctx=2 * MAX_CTX)]
    hashes = {graph_hash(g)} | {graph_hash(o) for o in others}
    assert len(hashes) == 4
    for o in others:
        assert print_graph(o) != text
    # a one-attribute change is visible
    mod = build_step(TINY, 3, max_ctx=MAX_CTX)
    next(op for op in mod.ops if op.kind == "rms_norm").attrs["eps"] = 1e-5
    assert print_graph(mod) != text and graph_hash(mod) != graph_hash(g)


def test_printer_is_stable_after_passes_and_filters_layers():
    def compiled():
        return run_pipeline(build_step(TINY, 2, max_ctx=MAX_CTX), "default", context=MAX_CTX).graph

    a, b = compiled(), compiled()
    ta = print_graph(a)
    assert ta == print_graph(b) and graph_hash(a) == graph_hash(b)
    assert "fused[hc_post_pre]" in ta and "<float32[32] " in ta  # fused ops and folded RoPE tables
    l2 = print_graph(a, layers={2})
    top = [ln for ln in l2.splitlines() if ln.startswith("  %")]  # top-level ops (bodies are indented more)
    assert top and all("# l2" in ln for ln in top)
    assert sum(1 for op in a.ops if op.layer == 2) == len(top)
    assert len(l2) < len(ta)


# ------------------------------------------------------------------------------------------------ verifier

def _graph():
    g = build_step(TINY, 2, max_ctx=MAX_CTX)
    verify(g)
    return g


def _first(g, kind, layer=None):
    return next(op for op in g.ops if op.kind == kind and (layer is None or op.layer == layer))


def _use_before_def(g):
    op = _first(g, "sinkhorn", 1)
    g.ops.remove(op)
    g.ops.insert(g.ops.index(op.inputs[0].producer), op)  # before the hc_mix that defines its input


def _defined_twice(g):
    op = _first(g, "rms_norm", 2)
    dup = Op(op.kind, list(op.inputs), op.outputs, dict(op.attrs), op.layer)
    g.ops.insert(g.ops.index(op) + 1, dup)


def _input_redefined(g):
    op = _first(g, "ring_write", 3)
    op.outputs[0] = g.inputs["l3.ring"]


def _wrong_type(g):
    v = _first(g, "rms_norm", 1).outputs[0]
    v.type = TensorType(v.type.shape, "f32")  # the norm keeps its bf16 input dtype


def _wrong_shape(g):
    v = _first(g, "grouped_linear", 4).outputs[0]
    v.type = TensorType(v.type.shape[:-1] + (v.type.shape[-1] + 1,), v.type.dtype)


def _unknown_kind(g):
    _first(g, "head_rms", 0).kind = "frobnicate"


def _missing_attr(g):
    del _first(g, "kv_fake_quant", 5).attrs["nope"]


def _undefined_output(g):
    v = g.outputs["logits"]
    g.outputs["logits"] = Value(v.type, "logits")


def _inference_fails(g):
    op = _first(g, "linear", 2)
    op.inputs[1] = g.inputs["l2.ring"]  # a [16, 192] "weight" for a 256-wide input


def _output_count(g):
    op = _first(g, "sinkhorn", 0)
    op.outputs.pop()


def _body_on_plain_op(g):
    op = _first(g, "hadamard", 2)
    op.body = [op]


@pytest.mark.parametrize("mutate, pattern", [
    (_use_before_def, r"sinkhorn \(layer 1\) input 0 .*l1\.attn\.mix.* used before it is defined"),
    (_defined_twice, r"value .*l2\.attn\.normed.* defined twice"),
    (_input_redefined, r"value .*l3\.ring.* defined twice"),
    (_wrong_type, r"rms_norm \(layer 1\) output .* has type f32\[q,256\], inferred bf16\[q,256\]"),
    (_wrong_shape, r"grouped_linear \(layer 4\) output .* has type bf16\[q,2,65\], inferred bf16\[q,2,64\]"),
    (_unknown_kind, r"unknown op kind 'frobnicate'"),
    (_missing_attr, r"kv_fake_quant \(layer 5\) misses attributes \['nope'\]"),
    (_undefined_output, r"graph output 'logits' is not defined"),
    (_inference_fails, r"linear \(layer 2\): type inference failed"),
    (_output_count, r"sinkhorn \(layer 0\) has 2 outputs, expected 3"),
    (_body_on_plain_op, r"op hadamard has a body"),
])
def test_verifier_catches(mutate, pattern):
    g = _graph()
    mutate(g)
    with pytest.raises(VerifyError, match=pattern) as e:
        verify(g)
    assert isinstance(e.value, Ds4cError)


def _fused_graph():
    return run_pipeline(build_step(TINY, 1, max_ctx=MAX_CTX), ["fix_verify_width", "fuse_hc"]).graph


def test_verifier_checks_fused_ops():
    g = _fused_graph()
    verify(g)
    f = next(op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "hc_post_pre")
    internal = [v for leaf in f.walk() for v in leaf.outputs if v not in f.outputs]
    assert internal
    # a later op reading a body value the fused op does not export: it lives in the kernel only
    leak = Value(internal[0].type, "leak")
    reader = Op("cast", [internal[0]], [leak], {"dtype": internal[0].type.dtype}, f.layer)
    leak.producer = reader
    g.ops.insert(g.ops.index(f) + 1, reader)
    with pytest.raises(VerifyError, match="not visible"):
        verify(g)
    # a graph output defined inside a body but not exported
    g = _fused_graph()
    f = next(op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "hc_post_pre")
    internal = [v for leaf in f.walk() for v in leaf.outputs if v not in f.outputs]
    g.outputs["extra"] = internal[0]
    with pytest.raises(VerifyError, match="graph output 'extra'.*fused op"):
        verify(g)
    # a fused output that its body does not produce
    g = _fused_graph()
    f = next(op for op in g.ops if op.kind == "fused")
    f.outputs.append(Value(TensorType((1,), "f32"), "ghost"))
    with pytest.raises(VerifyError, match="ghost.* not produced by its body"):
        verify(g)
    # a body op reading a value from outside that is not an input of the fused op
    g = _fused_graph()
    f = next(op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "hc_post_pre")
    f.inputs.pop(0)
    with pytest.raises(VerifyError, match="hc_post \\(layer"):
        verify(g)
    # an empty fused op
    g = _fused_graph()
    f = next(op for op in g.ops if op.kind == "fused")
    f.body = []
    with pytest.raises(VerifyError, match="non-empty 'fused'"):
        verify(g)


# ------------------------------------------------------------------------------------------------ export

def _check_networkx(g):
    G = to_networkx(g)
    assert G.number_of_nodes() == len(g.ops) + len(g.inputs) + len(g.outputs)
    assert nx.is_directed_acyclic_graph(G)
    assert G.number_of_edges() == sum(len(op.inputs) for op in g.ops) + len(g.outputs)
    kinds = Counter(d["kind"] for n, d in G.nodes(data=True) if n.startswith("op"))
    assert kinds == Counter(op.kind for op in g.ops)
    for k, op in enumerate(g.ops):
        node = G.nodes[f"op{k}"]
        assert node["layer"] == op.layer and node["n_leaf"] == sum(1 for _ in op.walk())
        got = Counter(d["type"] for _, _, d in G.in_edges(f"op{k}", data=True))
        assert got == Counter(str(v.type) for v in op.inputs)
    for name, v in g.outputs.items():
        ((_, _, d),) = G.in_edges(f"out:{name}", data=True)
        assert d["type"] == str(v.type)
    # sources are exactly the inputs and the input-free ops; sinks the outputs (no dead ops in the build)
    sources = {n for n in G.nodes if G.in_degree(n) == 0}
    assert {n for n in sources if not n.startswith("in:")} == {f"op{k}" for k, op in enumerate(g.ops)
                                                             if not op.inputs}
    assert {n for n in G.nodes if G.out_degree(n) == 0} == {f"out:{k}" for k in g.outputs}
    return G


def test_networkx_and_dot_export():
    g = build_step(TINY, 2, max_ctx=MAX_CTX)
    G = _check_networkx(g)
    # the topological order of the graph is a topological order of the export
    order = {f"op{k}": k for k in range(len(g.ops))}
    for a, b in G.edges():
        if a in order and b in order:
            assert order[a] < order[b]
    dot = to_dot(g)
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    assert "sparse_attention" in dot and "rope_freqs" not in dot and '"in:tokens"' in dot
    assert dot.count("->") == sum(1 for a, b in G.edges() if G.nodes[a]["kind"] not in ("param", "const", "rope_freqs"))
    # after the default pipeline: one node per top-level (fused) op
    c = run_pipeline(g, "default", context=MAX_CTX).graph
    Gc = _check_networkx(c)
    assert Gc.number_of_nodes() < G.number_of_nodes()
    assert sum(d["n_leaf"] for n, d in Gc.nodes(data=True) if n.startswith("op")) == sum(1 for _ in c.leaf_ops())
    dc = to_dot(c)
    assert dc.startswith("digraph") and "fused[sparse_attention]" in dc and "fused[hc_post_pre]" in dc


# ------------------------------------------------------------------------------------------------ interpreter

@pytest.mark.parametrize("q", range(1, MAX_WIDTH + 1))
def test_interpreter_equals_reference_bit_for_bit(weights, tokens, q):
    """The uncompiled IR of width q, step by step over 40 positions, on a reference state: the logits and
    every state buffer equal the reference's verify steps exactly."""
    ip = Interpreter(build_step(TINY, q, max_ctx=MAX_CTX), weights)
    ref = Reference(weights, max_ctx=MAX_CTX)
    state = SequenceState.new(TINY, MAX_CTX)
    steps = 0
    for p in range(0, N_POS, q):
        toks = tokens[p:p + q]
        want = ref.verify(toks, p)
        got = run_step(ip, state, toks, p)
        assert got.dtype == torch.float32 and got.shape == (q, TINY.vocab_size)
        assert torch.equal(got, want), f"q={q} p={p}: max diff {(got - want).abs().max().item()}"
        assert state.equal(ref.state), f"q={q} p={p}: state differs"
        assert state.pos == p + q
        steps += 1
    assert steps == -(-N_POS // q)
    assert torch.isfinite(want).all() and want.std() > 0
    # the state really moved: ring rows, compressed rows and indexer keys are written
    assert state.layers[0].ring.abs().sum() > 0
    assert state.layers[3].comp[: N_POS // 16].abs().sum() > 0
    assert state.layers[2].idx_keys[: N_POS // 4].abs().sum() > 0


@pytest.mark.parametrize("emulate", [True, False])
def test_interpreter_equals_reference_bit_for_bit_in_the_fp32_dataflow(tiny_path, tokens, emulate):
    """Interpreter(dataflow="fp32"): activations and state held in fp32, nothing rounded to bf16, as the
    reference's fp32 dataflow computes them; logits and state equal the reference's exactly over 40 positions."""
    w = ReferenceWeights.load(open_model(tiny_path), dataflow="fp32")
    w.config = w.config.replace(quant_emulation=emulate)
    ip = Interpreter(build_step(w.config, 3, max_ctx=MAX_CTX), w)
    assert ip.dataflow == "fp32"
    ref = Reference(w, max_ctx=MAX_CTX)
    with P.dataflow("fp32"):
        state = SequenceState.new(w.config, MAX_CTX)
    for p in range(0, N_POS - 2, 3):
        want = ref.verify(tokens[p:p + 3], p)
        got = run_step(ip, state, tokens[p:p + 3], p)
        assert torch.equal(got, want), f"p={p}: max diff {(got - want).abs().max().item()}"
        assert state.equal(ref.state), f"p={p}: state differs"
    assert state.layers[2].idx_keys.dtype == torch.float32 and state.layers[2].idx_keys.abs().sum() > 0


def test_interpreter_refuses_a_dataflow_its_weights_were_not_loaded_for(weights):
    g = build_step(TINY, 1, max_ctx=MAX_CTX)
    with pytest.raises(InterpreterError, match=r"dataflow 'fp32' needs weights loaded with ReferenceWeights\.load"
                                               r"\(\.\.\., dataflow='fp32'\); these were loaded for 'bf16'"):
        Interpreter(g, weights, dataflow="fp32")
    with pytest.raises(InterpreterError, match=r"dataflow must be one of \['bf16', 'fp32'\], found 'fp16'"):
        Interpreter(g, weights, dataflow="fp16")


@pytest.fixture
def step_setup(weights, tokens):
    g = build_step(TINY, 2, max_ctx=MAX_CTX)
    ip = Interpreter(g, weights)
    state = SequenceState.new(TINY, MAX_CTX)
    run_step(ip, state, tokens[:2], 0)
    return ip, state, step_inputs(g, state, tokens[2:4], 2)


def test_interpreter_rejects_missing_input(step_setup):
    ip, _, ins = step_setup
    del ins["l2.idx_keys"]
    with pytest.raises(InterpreterError, match=r"missing graph input 'l2\.idx_keys' \(bf16\[32,128\]\)"):
        ip.run(ins)


@pytest.mark.parametrize("name, bad, pattern", [
    ("l0.ring", lambda t: torch.randn(t.shape[0] + 1, t.shape[1],
                                      generator=torch.Generator().manual_seed(5)).to(t.dtype),
     r"l0\.ring expected bf16\[16,192\], found \[17, 192\]"),
    ("l0.ring", lambda t: t[:, :-1].contiguous(), r"l0\.ring expected bf16\[16,192\], found \[16, 191\]"),
    ("l3.comp", lambda t: t.float(), r"l3\.comp expected bf16\[8,192\], found torch\.float32"),
    ("l4.comp_kv", lambda t: t.unsqueeze(0), r"l4\.comp_kv expected f32"),
    ("tokens", lambda t: t.to(torch.int32), r"tokens expected i64\[q\]"),
    ("pos", lambda t: t.reshape(1), r"pos expected i64\[\]"),
])
def test_interpreter_rejects_wrong_inputs(step_setup, name, bad, pattern):
    ip, _, ins = step_setup
    ins[name] = bad(ins[name])
    with pytest.raises(InterpreterError, match=pattern) as e:
        ip.run(ins)
    assert isinstance(e.value, StepError)


def test_interpreter_rejects_a_produced_tensor_of_the_wrong_type(step_setup):
    ip, _, ins = step_setup
    v = next(op for op in ip.graph.ops if op.kind == "embed").outputs[0]
    v.type = TensorType(v.type.shape, "f32")
    with pytest.raises(InterpreterError, match=r"embed \(layer -1\): value %embed expected f32\[q,256\]"):
        ip.run(ins)


def test_interpreter_binds_symbols_consistently(step_setup):
    """A symbolic dim binds on first sight (q from the token ids) and must agree afterwards."""
    ip, _, ins = step_setup
    ip.graph.inputs["l0.ring"].type = TensorType((Sym("q"), TINY.head_dim), "bf16")
    with pytest.raises(InterpreterError, match=r"l0\.ring binds q=16, but q=2 elsewhere"):
        ip.run(ins)


def test_fixed_width_graph_rejects_another_token_count(step_setup):
    ip, _, ins = step_setup
    fixed = Interpreter(run_pipeline(ip.graph, ["fix_verify_width"]).graph, ip.w)
    ins["tokens"] = torch.tensor([5, 6, 7])
    with pytest.raises(InterpreterError, match=r"tokens expected i64\[2\], found \[3\]"):
        fixed.run(ins)


def test_interpreter_rejects_a_state_of_another_max_ctx(weights, tokens):
    ip = Interpreter(build_step(TINY, 1, max_ctx=MAX_CTX), weights)
    state = SequenceState.new(TINY, MAX_CTX // 2)
    with pytest.raises(InterpreterError, match=r"l2\.comp expected bf16\[32,192\], found \[16, 192\]"):
        run_step(ip, state, tokens[:1], 0)
    assert state.pos == 0


def test_run_step_rejects_wrong_position_or_width(step_setup, tokens):
    ip, state, _ = step_setup
    snap = state.snapshot()
    with pytest.raises(StepError, match="next position is 2"):
        run_step(ip, state, tokens[:2], 3)
    with pytest.raises(StepError, match="width 2, got 3"):
        run_step(ip, state, tokens[:3], 2)
    assert state.equal(snap)


def test_op_registry_is_documented():
    for kind, d in OPS.items():
        assert d.kind == kind and d.doc, kind
        assert d.outputs, kind
