"""The final HC state the compiled target step records for the MTP drafter (spec ds4-flash.md 7.5's ``X_main``: the
HC streams after the last layer, before the HC head).

* IR: ``build_step(..., record_hc=True)`` adds one ``record_hc`` op after the last layer and the ``final_hc_ring``
  state (nothing without it; nothing in a shard that does not hold the last layer); the verifier checks the op.
* Interpreter == reference, bit for bit: after a prompt and verify steps with rejections (the reference rolled back,
  the interpreter's state set to the reference's, its ring not touched, as the compiled step's rollback leaves it),
  the ring rows of the newest ``window`` committed positions equal ``Reference.final_hc`` (``record_final_hc(True)``);
  a padded prefill chunk writes its valid rows only; over a layer split the last shard writes the ring.
* The kernel: the tap family's copy mode (runtime/families/tap.py): lowering and arguments, render / compile for
  sm_90 (no spills) and gfx942, and its body on the CPU emulation of tests/test_compressor_family.py equal to the IR
  op and to the reference rows bit for bit on a NaN-poisoned ring.

The compiled step's ``final_hc`` and the MTP drafter on it (GPU) are in tests/test_compiled_mtp.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from ds4c.config import MAX_WIDTH, preset
from ds4c.errors import StepError
from ds4c.ir import Interpreter, VerifyError, build_step, run_split_step, run_step, verify
from ds4c.ir.builder import FINAL_HC_RING, final_hc_ring_type
from ds4c.ir.ops import OPS
from ds4c.passes.manager import run_pipeline
from ds4c.reference import Reference
from ds4c.reference.state import SequenceState
from ds4c.runtime.families import tap as TP
from ds4c.runtime.lower import lower_graph
from ds4c.runtime.render import RenderError
from ds4c.runtime.targets import target
from gpu_checks import tap as G

TINY = preset("tiny")
MAX_CTX = 96
ROWS = TINY.window + MAX_WIDTH
BF16 = torch.bfloat16


def _poisoned_ring(cfg=TINY) -> torch.Tensor:
    return torch.full(tuple(final_hc_ring_type(cfg).shape), float("nan"), dtype=BF16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _check_ring(ring: torch.Tensor, ref: Reference, what: str) -> int:
    """Ring rows of the newest ``window`` committed positions of ``ref`` equal ``ref.final_hc`` bit for bit
    (NaN-free); returns the rows checked."""
    pos = ref.state.pos
    lo = max(0, pos - TINY.window)
    want = ref.final_hc(lo, pos)
    for t in range(lo, pos):
        got = ring[t % ROWS]
        assert not torch.isnan(got.float()).any(), f"{what}: ring row of position {t} not written"
        assert torch.equal(_bits(got), _bits(want[t - lo])), f"{what}: position {t} differs"
    return pos - lo


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(7575)
    return torch.randint(1, TINY.vocab_size, (MAX_CTX,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------------ IR
@pytest.mark.parametrize("q", [1, 5])
def test_build_step_adds_one_record_op_and_the_ring(q):
    g = build_step(TINY, q, max_ctx=MAX_CTX, record_hc=True)
    verify(g)
    (op,) = [op for op in g.ops if op.kind == "record_hc"]
    assert op.layer == TINY.n_layers - 1 and op.attrs == {"rows": ROWS} and g.meta["record_hc"] is True
    x = op.inputs[2]
    assert x.producer.kind == "hc_post" and x.producer.layer == TINY.n_layers - 1
    head = next(o for o in g.ops if o.kind == "hc_mix" and o.layer == -1)  # the HC head reads the same streams
    assert head.inputs[0] is x and g.ops.index(op) < g.ops.index(head)
    assert g.inputs[FINAL_HC_RING].type == final_hc_ring_type(TINY) and g.outputs[FINAL_HC_RING] is op.outputs[0]
    assert str(final_hc_ring_type(TINY)) == f"bf16[{ROWS},4,256]"
    plain = build_step(TINY, q, max_ctx=MAX_CTX)
    assert FINAL_HC_RING not in plain.inputs and "record_hc" not in plain.meta
    assert len(g.ops) == len(plain.ops) + 1


def test_only_the_shard_holding_the_last_layer_records():
    first = build_step(TINY, 2, max_ctx=MAX_CTX, layers=(0, 4), record_hc=True)
    last = build_step(TINY, 2, max_ctx=MAX_CTX, layers=(4, 6), record_hc=True, taps=(3, 4, 5))
    assert FINAL_HC_RING not in first.inputs and not any(op.kind == "record_hc" for op in first.ops)
    assert FINAL_HC_RING in last.inputs and [op.kind for op in last.ops].count("record_hc") == 1
    verify(last)


def test_the_verifier_and_the_op_check_the_record_op():
    g = build_step(TINY, 1, max_ctx=MAX_CTX, record_hc=True)
    op = next(op for op in g.ops if op.kind == "record_hc")
    op.attrs = {"rows": ROWS + 1}
    with pytest.raises(VerifyError, match=r"record_hc: ring must be bf16 \[22, hc, D\]"):
        verify(g)
    ring, x = final_hc_ring_type(TINY), op.inputs[2].type
    from ds4c.ir.graph import TensorType

    with pytest.raises(ValueError, match="the HC state must be bf16"):
        OPS["record_hc"].infer([ring, TensorType((1,), "i64"), TensorType((1, 4, 128), "bf16")], {"rows": ROWS})
    with pytest.raises(ValueError, match="optional i64 n_valid"):
        OPS["record_hc"].infer([ring, TensorType((1,), "i64"), x, TensorType((1,), "i64")], {"rows": ROWS})


def test_every_pass_keeps_the_record_op_and_inspect_ir_prints_it():
    res = run_pipeline(build_step(TINY, 3, max_ctx=MAX_CTX, record_hc=True), "default", context=MAX_CTX,
                       print_after="all")
    for name, snap in res.snapshots.items():
        leaves = [op for op in snap.leaf_ops() if op.kind == "record_hc"]
        assert len(leaves) == 1 and snap.outputs[FINAL_HC_RING] is leaves[0].outputs[0], name
    g = res.graph
    verify(g)
    (k,) = [op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "record_hc"]
    # the head's fused HC boundary exports the last layer's streams for it; the memory plan gives them a slot
    (head,) = [op for op in g.ops if op.kind == "fused" and op.attrs["pattern"] == "hc_post_head"]
    assert k.inputs[2] in head.outputs and "l5.x" in g.meta["memory"]["slots"]
    assert FINAL_HC_RING not in g.meta["memory"]["slots"]
    from click.testing import CliRunner

    from ds4c.cli import main

    r = CliRunner().invoke(main, ["inspect-ir", "--preset", "tiny", "--width", "2", "--max-ctx", "64", "--record-hc",
                                  "--after", "partition", "--layers", "5"])
    assert r.exit_code == 0, r.output
    assert re.search(r"fused\[record_hc\]\(%final_hc_ring, %positions, %l5\.x\)", r.output), r.output
    assert "rows=21" in r.output and "record_hc(" in r.output


# ----------------------------------------------------------------------------------- interpreter vs reference
def _interps(tiny_weights, widths=(1, 2, 3, 4, 5)):
    return {q: Interpreter(run_pipeline(build_step(TINY, q, max_ctx=MAX_CTX, record_hc=True), "default",
                                        context=MAX_CTX).graph, tiny_weights) for q in widths}


def test_interpreter_ring_equals_reference_final_hc_with_rejections(tiny_weights, tokens):
    """A 23-token prompt (q = 5 steps, then 3), then verify steps of widths 2..5 with random accepted counts (1..q,
    several rejections), wrapping the 21-row ring about three times: after every step the ring rows of the newest
    window committed positions are the reference's final_hc bit for bit, and the logits too. The interpreter's state
    is set to the reference's after each rollback; the ring is not touched (the rejected rows stay, overwritten by
    later steps), as the compiled step's rollback kernel leaves it."""
    ips = _interps(tiny_weights)
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    ref.record_final_hc(True)
    state, ring = SequenceState.new(TINY, MAX_CTX), _poisoned_ring()
    g = torch.Generator().manual_seed(11)
    pos, checked, rejected = 0, 0, 0
    for q in (5, 5, 5, 5, 3):  # the prompt
        want = ref.verify(tokens[pos:pos + q], pos)
        assert torch.equal(run_step(ips[q], state, tokens[pos:pos + q], pos, final_hc_ring=ring), want)
        pos += q
        checked += _check_ring(ring, ref, f"prompt p={pos}")
    while pos + MAX_WIDTH <= 80:
        q = int(torch.randint(2, MAX_WIDTH + 1, (1,), generator=g))
        acc = int(torch.randint(1, q + 1, (1,), generator=g))
        want = ref.verify(tokens[pos:pos + q], pos)
        assert torch.equal(run_step(ips[q], state, tokens[pos:pos + q], pos, final_hc_ring=ring), want)
        ref.rollback(acc)
        state.restore(ref.state)
        rejected += q - acc
        pos += acc
        checked += _check_ring(ring, ref, f"verify q={q} accepted={acc} -> p={pos}")
    assert rejected >= 10 and pos > 3 * ROWS and checked > pos


def test_interpreter_needs_the_ring_exactly_when_the_graph_records(tiny_weights, tokens):
    ip = Interpreter(build_step(TINY, 1, max_ctx=MAX_CTX, record_hc=True), tiny_weights)
    with pytest.raises(StepError, match=re.escape(f"expected a final_hc_ring bf16[{ROWS},4,256], found none")):
        run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0)
    ip0 = Interpreter(build_step(TINY, 1, max_ctx=MAX_CTX), tiny_weights)
    with pytest.raises(StepError, match="no graph records the final HC state"):
        run_step(ip0, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0, final_hc_ring=_poisoned_ring())
    with pytest.raises(StepError, match=r"final_hc_ring: expected bf16\[21,4,256\], found torch.bfloat16 \[16, 4, 256\]"):
        run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:1], 0, final_hc_ring=_poisoned_ring()[:16])


def test_prefill_chunk_records_the_valid_rows_only(tiny_weights, tokens):
    """A padded prefill chunk graph (24 rows) with record_hc: the valid rows' ring rows equal token-wise decoding's
    final_hc bit for bit; the padded rows write nothing."""
    ip = Interpreter(build_step(TINY, 24, max_ctx=MAX_CTX, prefill=True, record_hc=True), tiny_weights)
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    ref.record_final_hc(True)
    for p in range(30):
        ref.decode(tokens[p], p)
    state, ring = SequenceState.new(TINY, MAX_CTX), _poisoned_ring()
    run_step(ip, state, tokens[:24], 0, final_hc_ring=ring)
    run_step(ip, state, tokens[24:30], 24, final_hc_ring=ring)
    assert _check_ring(ring, ref, "prefill") == TINY.window
    ring2 = _poisoned_ring()
    run_step(ip, SequenceState.new(TINY, MAX_CTX), tokens[:5], 0, final_hc_ring=ring2)
    assert not torch.isnan(ring2[:5].float()).any() and torch.isnan(ring2[5:].float()).all()


def test_layer_split_last_shard_records(tiny_weights, tokens):
    ips = [Interpreter(run_pipeline(build_step(TINY, 3, max_ctx=MAX_CTX, layers=r, record_hc=True), "default",
                                    context=MAX_CTX).graph, tiny_weights) for r in ((0, 4), (4, 6))]
    ref = Reference(tiny_weights, max_ctx=MAX_CTX)
    ref.record_final_hc(True)
    state, ring = SequenceState.new(TINY, MAX_CTX), _poisoned_ring()
    for p in range(0, 27, 3):
        want = ref.verify(tokens[p:p + 3], p)
        assert torch.equal(run_split_step(ips, state, tokens[p:p + 3], p, final_hc_ring=ring), want)
        _check_ring(ring, ref, f"split p={p}")


# ------------------------------------------------------------------------------------------------ the kernel
@pytest.mark.parametrize("q", [1, 5])
def test_lowering_adds_the_copy_kernel_and_the_head_streams(q):
    def lowered(rec, layers=None):
        g = run_pipeline(build_step(TINY, q, max_ctx=MAX_CTX, layers=layers, record_hc=rec), "default",
                         context=MAX_CTX).graph
        return lower_graph(g, TINY, target("sm_90"))

    with_rec, without = lowered(True), lowered(False)
    names = [k.name for k in with_rec]
    assert [n for n in names if n != "l5.record_hc"] == [k.name for k in without]
    assert names[names.index("hc_post_head") + 1] == "l5.record_hc"
    (k,) = [k for k in with_rec if k.family == "tap"]
    (la,) = k.launches
    assert [(a.kind, a.name) for a in la.args] == [("step", "pos"), ("value", "l5.x"), ("value", FINAL_HC_RING)]
    assert la.grid == (q * 2, 1, 1) and la.block == (64, 1, 1) and la.kernel.entry == "ds4c_record_hc"
    assert "COPY MODE" in la.kernel.source and "TP_HC 1" in la.kernel.source and "TP_D 1024" in la.kernel.source
    head = next(k for k in with_rec if k.name == "hc_post_head")
    assert [la.kernel.entry for la in head.launches] == ["ds4c_post_head_streams_mix", "ds4c_post_head_streams_norm"]
    assert not any(k.family == "tap" for k in lowered(True, layers=(0, 4)))


def test_copy_spec_validation():
    s = TP.TapSpec(5, 4096, 4, 133, 1, (0,), copy=True)
    assert (s.row, s.vec, s.chunks) == (16384, 8, 32) and TP.launch_shape(s).grid == (160, 1, 1)
    with pytest.raises(RenderError, match="copy mode with n_taps 3"):
        TP.TapSpec(5, 4096, 4, 133, 3, (0, 1, 2), copy=True)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
@pytest.mark.parametrize("hidden,q,rows", [(256, 5, 21), (4096, 1, 133), (4096, 5, 133)])
def test_copy_kernel_compiles_without_spills(arch, hidden, q, rows, tmp_path):
    from kernel_compile import compile_kernel, toolchain_or_skip

    spec = TP.TapSpec(q, hidden, 4, rows, 1, (0,), (42,), copy=True)
    src = TP.render_tap(spec, target(arch), f"record_hc_{hidden}_q{q}")
    sig = re.search(r"DS4C_GLOBAL void DS4C_LAUNCH_BOUNDS\(TP_T\) \w+\((.*?)\)\s*\{",
                    re.sub(r"//[^\n]*", "", src.source), re.S).group(1)
    assert [re.findall(r"\w+", p)[-1] for p in sig.split(",")] == TP.arg_names(spec) == ["pos", "x0", "ring"]
    assert "ds4c_f32_to_bf16(s[e]" not in src.source.split("COPY MODE")[1]  # no arithmetic in copy mode
    toolchain_or_skip(arch)
    c = compile_kernel(src, tmp_path)
    assert not c.usage.get("spills"), c.usage


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"], ids=["wave32", "wave64"])
@pytest.mark.parametrize("case", ["tiny-q5", "official-q5-wrap", "official-q1"])
def test_copy_kernel_emulated_on_cpu_equals_the_op(arch, case, tmp_path):
    """The copy kernel's body on the CPU: every written row is the step row's HC state bit for bit (random bf16 with
    spread exponents, NaN and -0 included: a copy, no arithmetic), every other row of the NaN-poisoned ring is
    untouched; rows wrap the ring at its end."""
    from test_compressor_family import emulate_kernel

    hidden, rows, q, pos = {"tiny-q5": (256, 21, 5, 13), "official-q5-wrap": (4096, 133, 5, 131),
                            "official-q1": (4096, 133, 1, 7)}[case]
    spec = TP.TapSpec(q, hidden, 4, rows, 1, (0,), copy=True)
    src = TP.render_tap(spec, target(arch), "emu_record_hc_" + case.replace("-", "_"))
    la = TP.launch_shape(spec)
    launch = emulate_kernel(src, TP.arg_names(spec), {"pos": "const i64*", "x": "const u16*", "ring": "u16*"},
                            la.grid[0], la.block[0], tmp_path)
    g = torch.Generator().manual_seed(len(case) * 31 + q)
    x = (torch.randn(q, 4, hidden, generator=g) * torch.exp2(torch.randint(-30, 30, (q, 4, hidden), generator=g))
         ).to(BF16)
    x[0, 1, 5], x[q - 1, 3, 7] = float("nan"), -0.0
    ring = torch.full((rows, 4 * hidden), float("nan"), dtype=BF16)
    work = ring.clone()
    launch([torch.tensor([pos], dtype=torch.int64), x, work])
    want = TP.reference(spec, pos, [x], ring)
    assert torch.equal(_bits(work), _bits(want))
    (op_out,) = OPS["record_hc"].run(None, [ring.view(rows, 4, hidden), torch.arange(pos, pos + q), x], {"rows": rows})
    assert torch.equal(_bits(op_out.flatten(1)), _bits(want))
    written = [(pos + r) % rows for r in range(q)]
    for r, row in enumerate(written):
        assert torch.equal(_bits(work[row]), _bits(x[r].flatten()))
    others = [i for i in range(rows) if i not in written]
    assert torch.isnan(work[others].float()).all()


# ------------------------------------------------------------------------------------ the drafter's side
class _CompiledLike:
    """A stepper with the compiled step's interface to the MTP drafter (``pos``, ``mf``; recording fixed when built,
    ``taps`` and ``record_hc``: :class:`ds4c.engine_protocol.BuiltRecording`; ``records_final_hc``,
    ``final_hc_rows``, ``record_final_hc``, ``final_hc``: :class:`ds4c.engine_protocol.FinalHCReader`; no ``w``, no
    ``state``), its rows from a reference: so the drafter's compiled path (the target's embedding and head from the
    model file) runs on the CPU."""

    def __init__(self, ref: Reference, mf, record_hc: bool = True):
        self._ref, self.mf, self.record_hc, self.taps = ref, mf, record_hc, ()
        self.records_final_hc = record_hc
        self.final_hc_rows = ref.final_hc_rows if record_hc else None

    @property
    def pos(self) -> int:
        return self._ref.state.pos

    def record_final_hc(self, on: bool = True) -> None:
        raise AssertionError("the drafter must not switch a compiled step's recording")

    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        return self._ref.final_hc(start, stop)


def test_the_drafter_on_a_compiled_stepper_reads_the_file_target(tiny_weights, tiny_path, tmp_path):
    """MTPDrafter.prepare on a stepper without reference weights (the compiled step's interface) builds the block on
    a FileTarget of the model file: the same drafts and logits, bit for bit, as on the reference; the embedding /
    head are read once per stepper. A compiled step built without record_hc is refused in one line naming how."""
    from ds4c.drafters.mtp import FileTarget, MTPDrafter
    from ds4c.drafters.mtp_synth import make_mtp
    from ds4c.sources import open_model

    mtp = make_mtp(TINY, tmp_path / "tiny-mtp.gguf", seed=0)
    prompt = [5, 17, 301, 42, 7, 99, 3, 250, 11, 64, 128, 9, 33, 77, 401, 2, 18, 260, 95]  # past the window
    ref_a, ref_b = Reference(tiny_weights, max_ctx=64), Reference(tiny_weights, max_ctx=64)
    a, b = MTPDrafter(mtp), MTPDrafter(mtp)
    a.prepare(ref_a, prompt, 8)
    ref_b.record_final_hc(True)
    like = _CompiledLike(ref_b, open_model(tiny_path))
    b.prepare(like, prompt, 8)
    assert isinstance(b._weights, FileTarget) and b._weights.device == torch.device("cpu")
    for ref in (ref_a, ref_b):
        for s in range(0, len(prompt), 5):
            ref.verify(prompt[s:s + 5], s)
    ctx = prompt + [300]
    da, db = a.propose(ctx, 4), b.propose(ctx, 4)
    assert da == db and torch.equal(a.last_logits, b.last_logits) and torch.equal(a.model.ring, b.model.ring)
    assert torch.equal(b._weights.head, tiny_weights.head) and torch.equal(b._weights.embed, tiny_weights.embed)
    target = b._weights
    b.prepare(like, prompt, 8)  # the next request: the same block, the same file target
    c = MTPDrafter(mtp)
    c.prepare(like, prompt, 8)  # another drafter on the same stepper: the same file target (one per stepper)
    assert b._weights is target and c._weights is target
    off = _CompiledLike(Reference(tiny_weights, max_ctx=64), open_model(tiny_path), record_hc=False)
    with pytest.raises(StepError, match=r"which this _CompiledLike does not record: open the compiled step with "
                                        r"record_hc=True \(ds4c generate --draft mtp does") as ei:
        MTPDrafter(mtp).prepare(off, prompt, 8)
    assert "\n" not in str(ei.value)


def test_the_gpu_check_covers_the_copy_mode():
    """tests/gpu_checks/tap.py (run by tests/test_gpu_kernels.py on a GPU) has copy-mode cases at the official shape
    (rows wrapping the window + 5 ring) and the tiny one, and they render."""
    copies = [(spec, pos) for _, spec, pos in G.CASES if spec.copy]
    assert {s.hidden for s, _ in copies} == {256, 4096} and any(pos + s.q > s.window for s, pos in copies)
    for i, (s, _) in enumerate(copies):
        assert "COPY MODE" in TP.render_tap(s, target("sm_90"), f"copy_{i}").source
