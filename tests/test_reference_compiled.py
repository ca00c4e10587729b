"""torch.compile of the reference (``ds4c.reference.compiled``): logits equal the eager reference's within
rounding, the state and its undo journal stay right, and a new position or new tokens never recompile.

Most tests capture the step with dynamo but skip code generation (``backend="eager"``: seconds per graph);
that checks the compile-friendly rewrite of the step (tensor positions, masks instead of branches, functional
graphs + journaled writes) on the whole tiny model. One test runs real inductor code generation on a one-layer
CSA model (the richest layer kind; about 30 s with a cold inductor cache on 2 cores, a few seconds warm), through
:func:`try_modes`, which must also report a failing mode instead of raising.

Positions cover the tiny model's boundaries (window 16, ratios 4 and 16, top-k 8): flushes at 3, 7, 15, 31, 47,
59, 63; the window wrap at 16; top-k selecting 8 of 11+ blocks from 44 on.
"""

from __future__ import annotations

import os

import pytest
import torch

from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.generate import generate
from ds4c.sources import open_model
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference.compiled import (CompiledReference, ModeResult, chunked_attention, compile_reference,
                                     rel_err_rows, try_modes)
from ds4c.reference import primitives as P
from ds4c.synth import make_model
from numerics import BF16_ULP, UNIT

N_TOKENS = 72
# (p0, q) steps, teacher-forced from the eager state at p0: widths 1 and 5 only (each width compiles its graphs)
STEPS = [(0, 5), (3, 5), (8, 1), (12, 5), (15, 1), (29, 5), (44, 5), (47, 1), (59, 5), (63, 1), (64, 5)]


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 512, (N_TOKENS,), generator=g).tolist()


@pytest.fixture(scope="module")
def snaps(tiny_weights, tokens):
    """Eager logits of 70 sequential decodes and the state snapshot before each position."""
    ref = Reference(tiny_weights, max_ctx=128)
    logits, out = [], []
    for p, t in enumerate(tokens[:70]):
        out.append(ref.snapshot())
        logits.append(ref.decode(t, p))
    out.append(ref.snapshot())
    return torch.cat(logits), out


@pytest.fixture(scope="module")
def rowwise(tiny_weights):
    """Captured (backend eager) with the oracle's row-by-row products: equal to the reference but for the
    attention's chunk combination."""
    return compile_reference(Reference(tiny_weights, max_ctx=128), backend="eager", span_bucket=4,
                             batch_rows=False)


@pytest.fixture(scope="module")
def batched(tiny_weights):
    """Captured (backend eager) with batched products: what the benchmark compiles."""
    return compile_reference(Reference(tiny_weights, max_ctx=128), backend="eager", span_bucket=4)


def state_diff(a, b) -> float:
    """Largest relative L2 difference ``|x - y| / |x|`` over the two states' tensors (compressor scores
    start at -inf: infinities must match exactly). An FP4/FP8 code flip moves one element by a whole
    quantization step, so an element-wise bound would be too strict."""
    assert a.pos == b.pos
    worst = 0.0
    for la, lb in zip(a.layers, b.layers):
        for x, y in zip(la.tensors(), lb.tensors()):
            x, y = x.float(), y.float()
            fin = torch.isfinite(x)
            assert torch.equal(fin, torch.isfinite(y)) and torch.equal(x[~fin], y[~fin])
            if fin.any():
                worst = max(worst, float((x[fin] - y[fin]).norm() / x[fin].norm().clamp_min(1e-30)))
    return worst


# ------------------------------------------------------------------------------------------------ semantics

def test_rowwise_capture_equals_the_eager_reference(rowwise, snaps, tokens):
    """Row-by-row products: the rewrite (tensor positions, masked lists, functional compressors, one-shot
    chunked attention) gives the reference's logits and state up to the attention's chunk reassociation."""
    logits, sn = snaps
    worst = 0.0
    for p0, q in STEPS:
        rowwise.restore(sn[p0])
        out = rowwise.verify(tokens[p0:p0 + q], p0)
        assert out.shape == (q, 512) and out.dtype == torch.float32
        worst = max(worst, float(rel_err_rows(logits[p0:p0 + q], out).max()))
        assert state_diff(sn[p0 + q], rowwise.state) < 1e-2, (p0, q)  # measured: 0
    assert worst < 5e-3, worst  # measured: 1.0e-3 on one row, 0 elsewhere


@pytest.mark.parametrize("p0", [3, 12, 59])
def test_rollback_through_the_journal(rowwise, snaps, tokens, p0):
    """The graph's writes go through SequenceState.write: rollback(k) leaves the state of the accepted
    prefix (as sequential decodes left it), and the next decode continues from there."""
    logits, sn = snaps
    for accepted in (0, 2, 5):
        rowwise.restore(sn[p0])
        rowwise.verify(tokens[p0:p0 + 5], p0)
        rowwise.rollback(accepted)
        assert rowwise.state.pos == p0 + accepted
        assert state_diff(sn[p0 + accepted], rowwise.state) < 1e-2, accepted
        nxt = p0 + accepted
        assert rel_err_rows(logits[nxt:nxt + 1], rowwise.decode(tokens[nxt], nxt)).max() < 5e-3


def test_batched_capture_within_tolerance_and_no_recompile_per_position(batched, snaps, tokens):
    """Batched products round differently from row-by-row ones (rows after the first of a q-row matmul differ
    in the last fp32 bit, and how depends on the CPU's SIMD path; bf16 and FP8 roundings amplify that, and a
    flip can move a router near-tie to another expert), so the check is on the distribution of per-row errors,
    in units of the roundings that amplify them: the median row flips nothing (below one bf16 ulp, 2^-7); 90%
    of the rows stay within one e4m3 rounding of the activations (2^-4 relative: a flipped FP8 code moves its
    element by up to that, and the tiny model's rows carry few of them); the worst row, where a router picks
    another expert, below 0.25. Measured on CPU: median 1e-7 everywhere; 90% 2.2e-2 (AVX-512) and 4.1e-2
    (MKL's AVX2 path); max 0.11; state 3.3e-2. After the first step of each width no step compiles anything,
    although spans (4-row buckets) and positions change."""
    logits, sn = snaps
    errs, sdiff, warm = [], [], None
    for n, (p0, q) in enumerate(STEPS + [(p, 1) for p in range(30, 45, 3)] + [(p, 5) for p in (20, 36, 50)]):
        batched.restore(sn[p0])
        out = batched.verify(tokens[p0:p0 + q], p0)
        errs.append(rel_err_rows(logits[p0:p0 + q], out))
        sdiff.append(state_diff(sn[p0 + q], batched.state))
        if n == 2:  # widths 5 and 1 compiled
            warm = batched.graphs
    e = torch.cat(errs)
    print(f"median {float(e.median()):.3g} 90% {float(torch.quantile(e, 0.9)):.3g} max {float(e.max()):.3g} "
          f"state {max(sdiff):.3g}")
    assert e.median() < BF16_ULP and torch.quantile(e, 0.9) < UNIT[torch.float8_e4m3fn] and e.max() < 0.25, e
    assert max(sdiff) < 0.1, sdiff
    assert batched.graphs == warm, f"recompiled after warm-up: {warm} -> {batched.graphs} graphs"


def test_generate_runs_on_the_compiled_stepper(rowwise, tiny_weights):
    """generate() drives the stepper like the reference (prefill widths 5, decodes q=1); greedy tokens equal."""
    prompt = [5, 17, 301, 42, 7, 99, 250, 3, 11, 8]
    want = generate(Reference(tiny_weights, max_ctx=128), prompt, 8).tokens
    assert generate(rowwise, prompt, 8).tokens == want
    assert rowwise.state.pos == len(prompt) + 7


def test_step_errors_are_the_references(tiny_weights):
    cref = compile_reference(tiny_weights, backend="eager", max_ctx=8)
    with pytest.raises(StepError, match="next position is 0"):
        cref.decode(1, 3)
    with pytest.raises(StepError, match="width must be in 1..5"):
        cref.verify([1] * 6, 0)
    with pytest.raises(StepError, match="token ids must be in 0..511"):
        cref.verify([1, 512], 0)
    with pytest.raises(StepError, match="no verify step"):
        cref.rollback(0)
    with pytest.raises(StepError, match="span_bucket"):
        compile_reference(tiny_weights, span_bucket=0)
    with pytest.raises(StepError, match="backend must be"):
        compile_reference(tiny_weights, backend="nope")
    assert cref.graphs == 0  # nothing compiled: every error was raised before the step


def test_chunked_attention_equals_sparse_attention_row_by_row():
    """Several chunks, masked tails and whole masked chunks (the reference skips them)."""
    g = torch.Generator().manual_seed(3)
    R, H, hd, L = 3, 4, 192, 200
    q = torch.randn(R, H, hd, generator=g).to(torch.bfloat16)
    kv = torch.randn(R, L, hd, generator=g).to(torch.bfloat16)
    ok = torch.rand(R, L, generator=g) > 0.3
    ok[:, 0] = True
    ok[1, 64:128] = False  # a fully masked chunk in the middle
    ok[2, 40:] = False  # only the first chunk live
    sink = torch.randn(H, generator=g)
    got = chunked_attention(q, kv, ok, sink, hd ** -0.5)
    for r in range(R):
        want = P.sparse_attention(q[r], kv[r], ok[r], sink, hd ** -0.5)
        assert (got[r].float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()


# ------------------------------------------------------------------------------------------------ inductor

@pytest.fixture(scope="module")
def csa1(tmp_path_factory):
    """A one-layer model whose layer is CSA with a scored router (top-k 8 of up to 5 blocks: all live)."""
    cfg = preset("tiny").replace(n_layers=1, compress_ratios=(4,), n_hash_layers=0, name="tiny-csa1")
    path = make_model(cfg, tmp_path_factory.mktemp("csa1") / "csa1.gguf", seed=2)
    return ReferenceWeights.load(open_model(path))


def test_inductor_step_and_try_modes(csa1):
    """Real inductor code generation (mode "default"): try_modes compiles the decode step, reports a bad
    mode instead of raising, and hands back a warm stepper whose decodes across flushes and the window wrap
    match the eager reference without compiling again."""
    if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "default":
        # torch 2.13's inductor picks its vector ISA from the CPU but, with ATEN's capability forced to
        # "default", its precompiled header declares no at::vec: g++ fails on the generated kernel (a torch
        # limitation of that forced setting, not of the step; the eager and batched tests above still run)
        pytest.skip("inductor's C++ codegen does not compile under ATEN_CPU_CAPABILITY=default (torch 2.13)")
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, 512, (24,), generator=g).tolist()
    ref = Reference(csa1, max_ctx=64)
    res = try_modes(ref, toks[:1], 0, modes=("default", "no-such-mode"))
    assert set(res) == {"default", "no-such-mode"}
    bad = res["no-such-mode"]
    assert isinstance(bad, ModeResult) and not bad.ok and "no-such-mode" in bad.error and bad.stepper is None
    ok, err, compile_s = res["default"]
    assert ok and err is None and compile_s > 0, res["default"]
    cref = res["default"].stepper
    assert isinstance(cref, CompiledReference) and res["default"].rel_err < 1e-2
    assert ref.state.pos == 0  # try_modes leaves the reference's state as it found it
    warm, errs = cref.graphs, []
    for p, t in enumerate(toks[:20]):  # flushes at 3, 7, 11, 15, 19; window wrap at 16
        cref.restore(ref.snapshot())
        want = ref.decode(t, p)
        got = cref.decode(t, p)
        errs.append(rel_err_rows(want, got))
        assert state_diff(ref.state, cref.state) < 0.1, p
    e = torch.cat(errs)
    # the bounds of test_batched_capture_within_tolerance_and_no_recompile_per_position, for the same reasons
    assert e.median() < BF16_ULP and torch.quantile(e, 0.9) < UNIT[torch.float8_e4m3fn] and e.max() < 0.25, e
    assert cref.graphs == warm, "decodes at new positions recompiled"
