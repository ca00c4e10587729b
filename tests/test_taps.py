"""The DSpark taps of the compiled target step (spec ds4-flash.md 5.2(q); issue 13, speculative decoding part 2).

* IR: ``build_step(..., taps=...)`` adds one ``dspark_tap`` op and the ``tap_ring`` state (nothing without taps;
  a shard only its own tap layers); the verifier and every pass keep it; ``inspect-ir --taps`` prints it.
* Interpreter == reference, bit for bit: the tap ring rows of the last ``window`` positions equal
  ``Reference.main_hidden`` at decode and verify widths, on the raw graph and after the default pipeline, in a
  padded prefill chunk, and over a layer split (``run_split_step``, ``ShardedReference.main_hidden``).
* The tap kernel (runtime/families/tap.py): lowering and arguments, render / compile for sm_90 and gfx942, and
  its body run on the CPU emulation of tests/test_compressor_family.py (waves of 32 and 64) bit for bit against
  the reference's bf16 mean on a NaN-poisoned ring; the HC head's ``streams`` variant (the last layer's streams,
  which the tap reads) likewise.

The compiled step itself (CompiledStep / ShardedStep with taps on a GPU) is in tests/test_compiled_taps.py; the
artifacts' taps in tests/test_artifact.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.ir import Interpreter, VerifyError, build_step, print_graph, run_split_step, run_step, verify
from ds4c.ir.builder import TAP_RING, tap_ring_type
from ds4c.ir.ops import OPS
from ds4c.passes.manager import run_pipeline
from ds4c.reference import Reference
from ds4c.reference.state import SequenceState
from ds4c.runtime.families import hc as H
from ds4c.runtime.families import tap as TP
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from gpu_checks import FAMILIES
from gpu_checks import tap as G

TINY = preset("tiny")
TAPS = (3, 4, 5)  # tiny's default_taps: its last three layers (HCA, CSA, HCA; 5 is the last: the head's streams)
MAX_CTX = 64
BF16 = torch.bfloat16


def _poisoned_ring(cfg=TINY, n=len(TAPS)) -> torch.Tensor:
    t = tap_ring_type(cfg, n)
    return torch.full(tuple(t.shape), float("nan"), dtype=BF16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _check_ring(ring: torch.Tensor, ref, end: int, what: str) -> int:
    """Ring rows of positions max(0, end - window) .. end - 1 equal ``ref.main_hidden`` bit for bit (NaN-free);
    returns the rows checked."""
    lo = max(0, end - TINY.window)
    for t in range(lo, end):
        want = ref.main_hidden(t, t + 1)[0]
        got = ring[t % TINY.window]
        assert not torch.isnan(got.float()).any(), f"{what}: ring row of position {t} not written"
        assert torch.equal(_bits(got), _bits(want)), f"{what}: position {t} differs"
    return end - lo


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1313)
    return torch.randint(1, TINY.vocab_size, (48,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------------ IR
@pytest.mark.parametrize("q", [1, 5])
def test_build_step_adds_one_tap_op_and_the_tap_ring(q):
    g = build_step(TINY, q, max_ctx=MAX_CTX, taps=TAPS)
    verify(g)
    taps = [op for op in g.ops if op.kind == "dspark_tap"]
    assert len(taps) == 1 and taps[0].layer == 5 and taps[0].attrs == {"slots": (0, 1, 2), "window": TINY.window}
    xs = taps[0].inputs[2:]
    assert [x.producer.kind for x in xs] == ["hc_post"] * 3 and [x.producer.layer for x in xs] == list(TAPS)
    assert g.inputs[TAP_RING].type == tap_ring_type(TINY, 3) and g.outputs[TAP_RING] is taps[0].outputs[0]
    assert g.meta["taps"] == list(TAPS)
    # without taps nothing changes: the same text as a graph built without the argument
    plain = build_step(TINY, q, max_ctx=MAX_CTX)
    assert print_graph(build_step(TINY, q, max_ctx=MAX_CTX, taps=())) == print_graph(plain)
    assert TAP_RING not in build_step(TINY, q, max_ctx=MAX_CTX).inputs
    # the taps' order is main_hidden's: slots follow it, not the layer order
    g2 = build_step(TINY, q, max_ctx=MAX_CTX, taps=(5, 1))
    (t2,) = [op for op in g2.ops if op.kind == "dspark_tap"]
    assert t2.attrs["slots"] == (1, 0) and [x.producer.layer for x in t2.inputs[2:]] == [1, 5]


def test_a_shard_records_only_its_tap_layers():
    g = build_step(TINY, 2, max_ctx=MAX_CTX, layers=(0, 4), taps=TAPS)
    (t,) = [op for op in g.ops if op.kind == "dspark_tap"]
    assert t.attrs["slots"] == (0,) and t.inputs[2].producer.layer == 3
    assert g.inputs[TAP_RING].type == tap_ring_type(TINY, 3)  # full width: the columns of its slots are its own
    g = build_step(TINY, 2, max_ctx=MAX_CTX, layers=(0, 3), taps=TAPS)
    assert TAP_RING not in g.inputs and "taps" not in g.meta
    assert print_graph(g) == print_graph(build_step(TINY, 2, max_ctx=MAX_CTX, layers=(0, 3)))


@pytest.mark.parametrize("bad", [(3, 3), (6,), (-1,), (True,), ("3",), 5, ([3],)])
def test_bad_taps_are_one_line_errors(bad):
    with pytest.raises(StepError, match=r"taps: expected distinct layer ids in 0\.\.5, found"):
        build_step(TINY, 1, max_ctx=MAX_CTX, taps=bad)


def test_the_verifier_checks_the_tap_op():
    g = build_step(TINY, 1, max_ctx=MAX_CTX, taps=TAPS)
    (t,) = [op for op in g.ops if op.kind == "dspark_tap"]
    t.attrs = {**t.attrs, "slots": (0, 1, 3)}
    with pytest.raises(VerifyError, match=r"slots \[0, 1, 3\] must be distinct in 0\.\.2"):
        verify(g)
    t.attrs = {**t.attrs, "slots": (0, 1)}
    with pytest.raises(VerifyError, match="expected ring, positions, 2 HC states"):
        verify(g)
    t.attrs = {**t.attrs, "slots": (0, 1, 2), "window": 8}
    with pytest.raises(VerifyError, match=r"ring must be bf16 \[8, n_taps\*D\]"):
        verify(g)


def test_every_pass_keeps_the_tap_op_and_inspect_ir_prints_it():
    res = run_pipeline(build_step(TINY, 3, max_ctx=MAX_CTX, taps=TAPS), "default", context=MAX_CTX, print_after="all")
    for name, snap in res.snapshots.items():
        leaves = [op for op in snap.leaf_ops() if op.kind == "dspark_tap"]
        assert len(leaves) == 1 and snap.outputs[TAP_RING] is leaves[0].outputs[0], name
    g = res.graph
    (k,) = [op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "dspark_tap"]
    # the head's fused HC boundary exports the last layer's streams for it; the memory plan gives them a slot
    (head,) = [op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "hc_post_head"]
    assert k.inputs[4] in head.outputs and "l5.x" in g.meta["memory"]["slots"]
    assert TAP_RING not in g.meta["memory"]["slots"] and "taps" not in g.meta["memory"]["slots"]
    from click.testing import CliRunner

    from ds4c.cli import main

    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--width", "2", "--max-ctx", "64", "--taps",
                                  "3,4,5", "--after", "partition", "--layers", "5"])
    assert r.exit_code == 0, r.output
    assert re.search(r"fused\[dspark_tap\]\(%tap_ring, %positions, %l3\.x, %l4\.x, %l5\.x\)", r.output), r.output
    assert "slots=(0,1,2), window=16" in r.output and "dspark_tap(" in r.output
    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--taps", "3,9"])
    assert r.exit_code == 2 and "expected distinct layer ids in 0..5" in r.output


# ----------------------------------------------------------------------------------- interpreter vs reference
@pytest.mark.parametrize("q,passes,n_pos", [(1, None, 20), (2, "default", 24), (5, "default", 40)],
                         ids=["decode-raw", "verify2-default", "verify5-default"])
def test_interpreter_tap_ring_equals_reference_main_hidden(tiny_weights, tokens, q, passes, n_pos):
    """Steps of width q from position 0 past the window (16; 40 positions wrap it twice): after every step the ring
    rows of the last window positions are the reference's main_hidden bit for bit, and the logits too."""
    g = build_step(TINY, q, max_ctx=MAX_CTX, taps=TAPS)
    if passes:
        g = run_pipeline(g, passes, context=MAX_CTX).graph
    ip = Interpreter(g, tiny_weights)
    ref = Reference(tiny_weights, max_ctx=MAX_CTX, taps=TAPS)
    state = SequenceState.new(TINY, MAX_CTX)
    ring = _poisoned_ring()
    checked = 0
    for p in range(0, n_pos, q):
        want = ref.verify(tokens[p:p + q], p)
        got = run_step(ip, state, tokens[p:p + q], p, ring)
        assert torch.equal(got, want), f"q={q} p={p}: logits differ"
        checked += _check_ring(ring, ref, p + q, f"q={q} p={p}")
    assert checked > n_pos and ring.float().abs().sum() > 0


def test_interpreter_needs_the_tap_ring_exactly_when_the_graph_has_taps(tiny_weights, tokens):
    ip = Interpreter(build_step(TINY, 1, max_ctx=MAX_CTX, taps=TAPS), tiny_weights)
    with pytest.raises(StepError, match=r"expected a tap_ring bf16\[16,768\], found none"):
        run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0)
    ip0 = Interpreter(build_step(TINY, 1, max_ctx=MAX_CTX), tiny_weights)
    with pytest.raises(StepError, match="no graph records the DSpark taps"):
        run_step(ip0, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0, _poisoned_ring())
    with pytest.raises(StepError, match="tap_ring"):
        run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0, _poisoned_ring(n=2))


def test_prefill_chunk_taps_skip_the_padded_rows(tiny_weights, tokens):
    """A padded prefill chunk graph (24 rows) with taps: the valid rows' ring rows equal token-wise decoding's
    main_hidden, bit for bit; the padded rows write nothing (their slots keep the poison)."""
    g = build_step(TINY, 24, max_ctx=MAX_CTX, prefill=True, taps=TAPS)
    ip = Interpreter(g, tiny_weights)
    ref = Reference(tiny_weights, max_ctx=MAX_CTX, taps=TAPS)
    for p in range(30):
        ref.decode(tokens[p], p)
    state, ring = SequenceState.new(TINY, MAX_CTX), _poisoned_ring()
    run_step(ip, state, tokens[:24], 0, ring)
    run_step(ip, state, tokens[24:30], 24, ring)  # 6 valid rows, 18 padded (positions 30..47: slots 14..15, 0..15)
    _check_ring(ring, ref, 30, "prefill")
    ring2 = _poisoned_ring()
    run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:5], 0, ring2)
    assert not torch.isnan(ring2[:5].float()).any() and torch.isnan(ring2[5:].float()).all()


def test_layer_split_taps_equal_the_unsplit_ones(tiny_weights, tiny_path, tokens):
    """The shards' graphs (layers [0,4) with tap 3, [4,6) with taps 4, 5) write one ring as the unsplit graph does,
    bit for bit; ShardedReference.main_hidden gathers the shards' taps into the unsplit reference's."""
    from ds4c.sources import open_model
    from ds4c.reference.sharded import ShardedReference
    from ds4c.shard_plan import parse_plan

    ips = [Interpreter(run_pipeline(build_step(TINY, 3, max_ctx=MAX_CTX, layers=r, taps=TAPS), "default",
                                    context=MAX_CTX).graph, tiny_weights) for r in ((0, 4), (4, 6))]
    ref = Reference(tiny_weights, max_ctx=MAX_CTX, taps=TAPS)
    state, ring = SequenceState.new(TINY, MAX_CTX), _poisoned_ring()
    for p in range(0, 21, 3):
        want = ref.verify(tokens[p:p + 3], p)
        assert torch.equal(run_split_step(ips, state, tokens[p:p + 3], p, ring), want)
        _check_ring(ring, ref, p + 3, f"split p={p}")
    sharded = ShardedReference.load(open_model(tiny_path), parse_plan("cpu,cpu", "4,2", TINY.n_layers), max_ctx=MAX_CTX)
    sharded.set_taps(TAPS)
    assert [s.taps for s in sharded.shards] == [(3,), (4, 5)]
    for p in range(0, 21, 3):
        sharded.verify(tokens[p:p + 3], p)
    assert torch.equal(_bits(sharded.main_hidden(0, 21)), _bits(ref.main_hidden(0, 21)))
    with pytest.raises(StepError, match="not all committed"):
        sharded.main_hidden(20, 22)
    sharded.set_taps(())
    with pytest.raises(StepError, match="records no taps"):
        sharded.main_hidden(0, 1)


# ------------------------------------------------------------------------------------------------ the kernel
def _lowered(q: int, taps=TAPS, layers=None, arch="sm_90"):
    g = run_pipeline(build_step(TINY, q, max_ctx=MAX_CTX, layers=layers, taps=taps), "default", context=MAX_CTX).graph
    return lower_graph(g, TINY, target(arch))


@pytest.mark.parametrize("q", [1, 5])
def test_lowering_adds_the_tap_kernel_and_the_head_streams(q):
    with_taps, without = _lowered(q), _lowered(q, taps=())
    names = [k.name for k in with_taps]
    assert [n for n in names if n != "l5.dspark_tap"] == [k.name for k in without]
    assert names[names.index("hc_post_head") + 1] == "l5.dspark_tap"  # right after the last tapped streams exist
    (k,) = [k for k in with_taps if k.family == "tap"]
    (la,) = k.launches
    assert [(a.kind, a.name) for a in la.args] == [("step", "pos"), ("value", "l3.x"), ("value", "l4.x"),
                                                  ("value", "l5.x"), ("value", TAP_RING)]
    assert la.grid == (q * 3, 1, 1) and la.block == (64, 1, 1) and la.kernel.entry == "ds4c_dspark_tap"
    head = next(k for k in with_taps if k.name == "hc_post_head")
    assert [la.kernel.entry for la in head.launches] == ["ds4c_post_head_streams_mix", "ds4c_post_head_streams_norm"]
    assert ("value", "l5.x") in [(a.kind, a.name) for a in head.launches[0].args]
    head0 = next(k for k in without if k.name == "hc_post_head")
    assert [la.kernel.entry for la in head0.launches] == ["ds4c_post_head_mix", "ds4c_post_head_norm"]
    assert not any(k.family == "tap" for k in without)
    # a shard holding tap 3 only: its slot, and no head
    (ks,) = [k for k in _lowered(q, layers=(0, 4)) if k.family == "tap"]
    assert ks.name == "l3.dspark_tap" and "TP_NX 1" in ks.launches[0].kernel.source
    assert [(a.kind, a.name) for a in ks.launches[0].args] == [("step", "pos"), ("value", "hc_out"),
                                                               ("value", TAP_RING)]


def test_tap_spec_validation():
    TP.TapSpec(5, 4096, 4, 128, 3, (0, 1, 2))
    for kw, what in (({"q": 17}, "q 17"), ({"hc": 3}, "hc 3"), ({"slots": (0, 3)}, "slots"),
                     ({"slots": (1, 1)}, "slots"), ({"layers": (1,)}, "layers")):
        args = {"q": 5, "hidden": 256, "hc": 4, "window": 16, "n_taps": 3, "slots": (0, 1, 2), **kw}
        with pytest.raises(RenderError, match=re.escape(what)):
            TP.TapSpec(**args)
    with pytest.raises(RenderError, match="streams with variant 'post_pre'"):
        H.HcSpec("post_pre", 1, 256, streams=True)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
@pytest.mark.parametrize("hidden,q", [(256, 5), (4096, 1), (4096, 5)])
def test_tap_kernel_renders_and_compiles(arch, hidden, q, tmp_path):
    from kernel_compile import compile_kernel, toolchain_or_skip

    spec = TP.TapSpec(q, hidden, 4, 128 if hidden == 4096 else 16, 3, (0, 1, 2), (40, 41, 42))
    src = TP.render_tap(spec, target(arch), f"tap_{hidden}_q{q}")
    assert src.family == "tap" and not re.search(r"^\s*#include", src.source, re.M)
    sig = re.search(r"DS4C_GLOBAL void DS4C_LAUNCH_BOUNDS\(TP_T\) \w+\((.*?)\)\s*\{",
                    re.sub(r"//[^\n]*", "", src.source), re.S).group(1)
    assert [re.findall(r"\w+", p)[-1] for p in sig.split(",")] == TP.arg_names(spec)
    assert "DS4C_PDL_ENTRY();" in src.source and "layer 42 output, slot 2" in src.source
    assert TP.launch_shape(spec).grid == (q * 3 * (1 if hidden == 256 else 8), 1, 1)
    if not (arch == "sm_90" or arch == "gfx942" and (hidden, q) == (4096, 5)):
        return  # render only: every shape compiles on sm_90, the official q = 5 one on gfx942
    toolchain_or_skip(arch)
    c = compile_kernel(src, tmp_path)
    assert not c.usage.get("spills"), c.usage


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"], ids=["wave32", "wave64"])
@pytest.mark.parametrize("case", ["tiny-q5-all", "official-q5-wrap", "official-q1-one-slot"])
def test_tap_kernel_emulated_on_cpu_equals_the_reference_mean(arch, case, tmp_path):
    """The kernel body on the CPU (one thread per GPU thread): every written element is the reference's
    ``x.mean(-2)`` bit for bit (streams with exponents spread over ~2^40, so the fp32 sums round), every other
    element of the NaN-poisoned ring is untouched; rows wrap the window at position 126."""
    from test_compressor_family import emulate_kernel

    hidden, window, q, pos, slots = {"tiny-q5-all": (256, 16, 5, 13, (0, 1, 2)),
                                     "official-q5-wrap": (4096, 128, 5, 126, (2, 0, 1)),
                                     "official-q1-one-slot": (4096, 128, 1, 7, (1,))}[case]
    spec = TP.TapSpec(q, hidden, 4, window, 3, slots)
    src = TP.render_tap(spec, target(arch), "emu_tap_" + case.replace("-", "_"))
    casts = {"pos": "const i64*", "x": "const u16*", "ring": "u16*"}
    la = TP.launch_shape(spec)
    launch = emulate_kernel(src, TP.arg_names(spec), casts, la.grid[0], la.block[0], tmp_path)
    g = torch.Generator().manual_seed(hash(case) % 1000)
    xs = [(torch.randn(q, 4, hidden, generator=g) * torch.exp2(torch.randint(-20, 20, (q, 4, hidden), generator=g)))
          .to(BF16) for _ in slots]
    planted = torch.tensor([1.0, 1.5 * 2 ** -24, 1.5 * 2 ** -24, -1.0])  # fp32 sums round: the order decides
    for x in xs:
        for d in range(3, hidden, 16):
            for r in range(q):
                perm = torch.randperm(4, generator=g)
                x[r, :, d] = (planted[perm] * 2.0 ** int(torch.randint(-10, 10, (1,), generator=g))).to(BF16)
    ring = torch.full((window, 3 * hidden), float("nan"), dtype=BF16)
    want = TP.reference(spec, pos, xs, ring)
    work = ring.clone()
    launch([torch.tensor([pos], dtype=torch.int64), *xs, work])
    assert torch.equal(_bits(work), _bits(want))
    # the reference is the IR op's arithmetic
    (op_out,) = OPS["dspark_tap"].run(None, [ring, torch.arange(pos, pos + q), *xs], {"slots": slots, "window": window})
    assert torch.equal(_bits(op_out), _bits(want))
    written = torch.zeros_like(ring, dtype=torch.bool)
    for r in range(q):
        for s in slots:
            written[(pos + r) % window, s * hidden:(s + 1) * hidden] = True
    assert not torch.isnan(work[written].float()).any() and torch.isnan(work[~written].float()).all()
    # on this data the fp32 rounding of the sum shows: the exact mean differs from torch's (and the kernel's)
    assert sum((x.double().sum(1) / 4).to(BF16).ne(x.mean(1)).sum().item() for x in xs) >= q * len(xs)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"], ids=["wave32", "wave64"])
def test_hc_head_streams_emulated_on_cpu(arch, tmp_path):
    """The HC head's ``streams`` variant (stage mix also writes the last layer's new streams, which the tap reads):
    on the CPU emulation its x_new equals the reference HC post (primitives.hc_post) bit for bit, and its
    partial sums equal those of the variant without streams."""
    from test_compressor_family import emulate_kernel

    from ds4c.reference import primitives as P

    spec = H.HcSpec("post_head", 3, 256, n_mix=4, streams=True)
    plain = H.HcSpec("post_head", 3, 256, n_mix=4)
    assert H.arg_names(spec)["mix"] == ["out", "x", "post", "comb", "fn", "x_new", "ws"]
    assert H.output_names(spec) == ["x_new", "y"] and H.arg_names(spec)["norm"] == H.arg_names(plain)["norm"]
    casts = {"out": "const u16*", "x": "const u16*", "post": "const float*", "comb": "const float*",
             "fn": "const float*", "x_new": "u16*", "ws": "float*"}
    inp = H.random_inputs(spec, torch.Generator().manual_seed(5))
    ws_len = H.workspace_floats(spec)
    outs = {}
    for s in (spec, plain):
        (la, _) = H.launch_shapes(s)
        src = H.render_hc(s, target(arch), "emu_head" + ("_streams" if s.streams else ""))[0]
        launch = emulate_kernel(src, H.arg_names(s)["mix"], casts, la.grid[0], la.block[0], tmp_path)
        x_new = torch.full((3, 4, 256), float("nan"), dtype=BF16)
        ws = torch.full((ws_len,), float("nan"))
        args = {**inp, "x_new": x_new, "ws": ws}
        launch([args[n].contiguous() for n in H.arg_names(s)["mix"]])
        outs[s.streams] = (x_new, ws)
    want = P.hc_post(inp["out"], inp["x"], inp["post"], inp["comb"])
    assert torch.equal(_bits(outs[True][0]), _bits(want))
    assert torch.isnan(outs[False][0].float()).all()  # without streams nothing is written
    assert torch.equal(outs[True][1], outs[False][1]) and not torch.isnan(outs[True][1]).any()
    ref = H.reference(spec, **inp)
    assert torch.equal(_bits(ref["x_new"]), _bits(want)) and torch.equal(ref["y"], H.reference(plain, **inp)["y"])


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_hc_head_streams_compiles_without_spills(arch, tmp_path):
    from kernel_compile import compile_kernel, toolchain_or_skip

    toolchain_or_skip(arch)
    spec = H.HcSpec("post_head", 5, 4096, n_mix=4, streams=True)
    mix, norm = H.render_hc(spec, target(arch), "hc_head_streams")
    sig = re.search(r"DS4C_GLOBAL void \w+\((.*?)\)\s*\{", re.sub(r"//[^\n]*", "", mix.source), re.S).group(1)
    assert [re.findall(r"\w+", p)[-1] for p in sig.split(",")] == H.arg_names(spec)["mix"]
    for src in (mix, norm):
        c = compile_kernel(src, tmp_path)
        assert not c.usage.get("spills"), c.usage


def test_the_gpu_check_covers_the_family():
    """tests/gpu_checks/tap.py (run by tests/test_gpu_kernels.py on a GPU): its cases render here, cover q = 1 and 5,
    a one-slot shard and a window wrap, and match their references' shapes."""
    assert "tap" in FAMILIES
    specs = [spec for _, spec, _ in G.CASES]
    assert {s.q for s in specs} == {1, 5} and any(len(s.slots) < s.n_taps for s in specs)
    assert any(pos + s.q > s.window for _, s, pos in G.CASES)
    for i, s in enumerate(specs):
        assert TP.render_tap(s, target("sm_90"), f"tap_{i}").entry == f"tap_{i}"


# ------------------------------------------------------------------- prefill chunks: TapSpec.valid (issue 12)
@pytest.mark.parametrize("arch", ["sm_90", "gfx1151"])
@pytest.mark.parametrize("copy", [False, True], ids=["mean", "copy"])
def test_valid_off_renders_the_decode_kernel_and_on_adds_n_valid(arch, copy):
    """valid=False is the decode / verify kernel byte for byte; valid=True takes n_valid after pos, drops the
    static assert on Q <= WINDOW (any C) and covers min(C, window) rows of the grid."""
    kw = dict(n_taps=1, slots=(0,), copy=True) if copy else dict(n_taps=3, slots=(0, 1, 2))
    for q, hidden, window in ((5, 256, 16), (1, 4096, 128)):
        a = TP.TapSpec(q, hidden, 4, window, **kw)
        b = TP.TapSpec(q, hidden, 4, window, **kw, valid=False)
        assert TP.render_tap(a, target(arch), "t").source == TP.render_tap(b, target(arch), "t").source
        assert "n_valid" not in TP.render_tap(a, target(arch), "t").source
    with pytest.raises(RenderError, match="q 64"):
        TP.TapSpec(64, 256, 4, 16, **kw)
    for q, window, rows in ((64, 16, 16), (64, 21, 21), (8, 16, 8), (2048, 128, 128)):
        s = TP.TapSpec(q, 256, 4, window, **kw, valid=True)
        src = TP.render_tap(s, target(arch), "t").source
        assert TP.arg_names(s)[:2] == ["pos", "n_valid"] and s.grid_rows == rows
        assert TP.launch_shape(s).grid == (rows * len(s.slots) * s.chunks, 1, 1)
        assert "TP_Q <= TP_WIN" not in src and f"#define TP_QG {rows}" in src
        assert "const int r = (int)(n_valid[0] - TP_QG) + b / (TP_NCH * TP_NX);" in src
        assert "if (r < 0 || r >= TP_Q) return;" in src


@pytest.mark.parametrize("arch,tool", [("sm_90", "nvcc"), ("gfx1151", "clang-19")])
@pytest.mark.parametrize("copy", [False, True], ids=["mean", "copy"])
@pytest.mark.parametrize("hidden,q,window", [(256, 64, 16), (4096, 2048, 128)])
def test_valid_kernel_compiles_without_spills(arch, tool, copy, hidden, q, window, tmp_path):
    import shutil

    from kernel_compile import compile_kernel, toolchain_or_skip

    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")
    kw = dict(n_taps=1, slots=(0,), copy=True) if copy else dict(n_taps=3, slots=(0, 1, 2))
    rows = window + 5 if copy else window  # record_hc's ring: window + MAX_WIDTH rows
    spec = TP.TapSpec(q, hidden, 4, rows, **kw, valid=True)
    src = TP.render_tap(spec, target(arch), f"tap_valid_{hidden}_{'copy' if copy else 'mean'}")
    toolchain_or_skip(arch)
    c = compile_kernel(src, tmp_path)
    assert not c.usage.get("spills"), c.usage
