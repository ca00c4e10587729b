"""The PyTorch reference (spec ds4-flash.md sections 3-6): primitives, verify == sequential decode at every
boundary, exact rollback, determinism, compressor flush positions, bad inputs.

The tiny preset has window 16, CSA ratio 4, HCA ratio 16 and indexer top-k 8, so the boundaries of the
official model (window 128, ratio 4, ratio 128, top-k 512) all occur within 64 positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from ds4c.config import preset
from ds4c.errors import StepError
from ds4c.generate import generate
from ds4c.sources import open_model
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference import primitives as P
from ds4c.synth import RESIDUAL_RMS_BAND, make_model

N_TOKENS = 72


@pytest.fixture(scope="module")
def weights(tiny_weights):
    return tiny_weights


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, 512, (N_TOKENS,), generator=g).tolist()


@pytest.fixture(scope="module")
def sequential(weights, tokens):
    """Logits of N_TOKENS sequential decodes, and the state snapshot before each position."""
    ref = Reference(weights, max_ctx=128)
    logits, snaps = [], []
    for p, t in enumerate(tokens):
        snaps.append(ref.snapshot())
        logits.append(ref.decode(t, p))
    snaps.append(ref.snapshot())
    return torch.cat(logits), snaps


# ------------------------------------------------------------------------------------------------ primitives

def test_sinkhorn_rows_and_columns_sum_to_one(weights):
    """With the synthetic model's HC parameters (every layer, both sub-blocks) and mixing logits of
    1.5 sigma, 20 iterations give a doubly-stochastic comb within 1e-5."""
    g = torch.Generator().manual_seed(0)
    for lw in weights.layers:
        for fn, scale, base in (lw.hc_attn, lw.hc_ffn):
            m = torch.randn(256, 24, generator=g) * 1.5
            pre, post, comb = P.sinkhorn_split(m, scale, base, 4, 20, 1e-6)
            assert (comb.sum(-1) - 1).abs().max() < 1e-5
            assert (comb.sum(-2) - 1).abs().max() < 1e-5
            assert (pre > 0).all() and (pre < 1 + 1e-5).all()
            assert (post > 0).all() and (post < 2).all()
            assert comb.std() > 0.05  # not trivially uniform: the logits matter


def test_sinkhorn_ends_on_a_column_normalisation_and_converges():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(64, 24, generator=g) * 3  # badly conditioned on purpose
    scale, base = torch.ones(3), torch.randn(24, generator=g)
    row_err = []
    for iters in (2, 5, 20):
        _, _, comb = P.sinkhorn_split(m, scale, base, 4, iters, 1e-6)
        assert (comb.sum(-2) - 1).abs().max() < 1e-5  # the last step normalises columns
        row_err.append((comb.sum(-1) - 1).abs().max().item())
    assert row_err[0] > row_err[1] > row_err[2]


def test_hadamard_is_orthonormal_sylvester():
    n = 128
    h = torch.tensor([[1.0]])
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = (x.float() @ h.T * n ** -0.5).to(torch.bfloat16)
    got = P.hadamard(x)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    back = P.hadamard(got)
    assert torch.allclose(back.float(), x.float(), rtol=2e-2, atol=2e-2)


def test_rope_rotates_last_dims_interleaved_and_inverts():
    cfg = preset("flash")
    f = P.rope_freqs(64, cfg.compress_rope_theta, True, 16, 65536, 32, 1)
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 1000])
    y = P.apply_rope(x, pos, f)
    assert torch.equal(y[..., :64], x[..., :64])  # non-rope dims untouched
    assert torch.equal(y[0], x[0])  # position 0 is the identity
    # pair norms preserved (interleaved pairs 2i, 2i+1)
    nx = x[..., 64:].float().view(3, 2, 32, 2).norm(dim=-1)
    ny = y[..., 64:].float().view(3, 2, 32, 2).norm(dim=-1)
    assert torch.allclose(nx, ny, rtol=1e-2, atol=1e-2)
    back = P.apply_rope(y, pos, f, inverse=True)
    assert torch.allclose(back.float(), x.float(), rtol=2e-2, atol=2e-2)
    # first pair rotates by pos * f_0 = pos radians
    a, b = x[2, 0, 64].float(), x[2, 0, 65].float()
    c, s = math.cos(1000.0), math.sin(1000.0)
    assert abs(y[2, 0, 64].float() - (a * c - b * s)) < 2e-2 * (abs(a) + abs(b))


def test_sparse_attention_matches_softmax_with_sink_in_denominator():
    g = torch.Generator().manual_seed(3)
    H, hd, L = 4, 192, 150
    q = torch.randn(H, hd, generator=g).to(torch.bfloat16)
    kv = torch.randn(L, hd, generator=g).to(torch.bfloat16)
    valid = torch.rand(L, generator=g) > 0.2
    sink = torch.randn(H, generator=g)
    out = P.sparse_attention(q, kv, valid, sink, hd ** -0.5)
    s = (q.double() @ kv.double().T) * hd ** -0.5
    s[:, ~valid] = float("-inf")
    m = s.max(-1, keepdim=True).values
    e = torch.exp(s - m)
    ref = (e @ kv.double()) / (e.sum(-1, keepdim=True) + torch.exp(sink.double().unsqueeze(-1) - m))
    rel = (out.double() - ref).norm() / ref.norm()
    assert rel < 1e-2
    # masked entries' contents do not matter
    kv2 = kv.clone()
    kv2[~valid] = 1e4
    assert torch.equal(P.sparse_attention(q, kv2, valid, sink, hd ** -0.5), out)
    # a huge sink takes the whole denominator: output goes to zero
    big = P.sparse_attention(q, kv, valid, torch.full((H,), 80.0), hd ** -0.5)
    assert big.float().abs().max() < 1e-6


def test_topk_ties_go_to_lower_index():
    s = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0, 0.5])
    assert P.topk_lower_index(s, 4).tolist() == [1, 2, 4, 3]


def test_head_rms_normalises_each_head():
    q = (torch.randn(3, 4, 512, generator=torch.Generator().manual_seed(4)) * 7).to(torch.bfloat16)
    y = P.head_rms(q, 1e-6)
    rms = y.float().pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones_like(rms), atol=2e-2)


def test_clamped_swiglu_is_asymmetric():
    g = torch.tensor([20.0, -20.0, 1.0])
    u = torch.tensor([30.0, -30.0, -30.0])
    h = P.clamped_swiglu(g, u, 10.0)
    assert torch.allclose(h, torch.stack([torch.nn.functional.silu(torch.tensor(10.0)) * 10,
                                          torch.nn.functional.silu(torch.tensor(-20.0)) * -10,
                                          torch.nn.functional.silu(torch.tensor(1.0)) * -10]))


def test_sample_greedy_and_seeded():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(5))
    assert P.sample(logits, 0.0, None).item() == int(logits.argmax())
    a = [P.sample(logits, 1.0, torch.Generator().manual_seed(9)).item() for _ in range(3)]
    assert len(set(a)) == 1
    draws = {P.sample(logits, 1.0, torch.Generator().manual_seed(s)).item() for s in range(20)}
    assert len(draws) > 1


# ------------------------------------------------------------------------------------------------ the step

# (start position, what the rows of a width-5 step cross) for tiny: window 16, ratios 4 and 16, top-k 8
BOUNDARIES = [0, 3, 12, 14, 29, 44, 59]


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("p0", BOUNDARIES)
def test_verify_equals_sequential_decodes(weights, tokens, sequential, q, p0):
    """Rows p0..p0+q-1 cross: 3 and 7 (two ratio-4 flushes in one step, p0=3), 15 (ratio-16 flush) and 16
    (window wrap) for p0=12/14, 31 (ratio-16 flush) for p0=29, 47 (top-k selecting 8 of 11 blocks) for
    p0=44, 59 and 63 (two ratio-4 flushes and a ratio-16 flush) for p0=59."""
    logits, snaps = sequential
    ref = Reference(weights, max_ctx=128)
    ref.restore(snaps[p0])
    out = ref.verify(tokens[p0:p0 + q], p0)
    assert out.shape == (q, 512) and out.dtype == torch.float32
    assert torch.equal(out, logits[p0:p0 + q])
    assert ref.state.equal(snaps[p0 + q])


@pytest.mark.parametrize("p0", [3, 12, 59])
def test_rollback_leaves_the_state_of_the_accepted_prefix(weights, tokens, sequential, p0):
    logits, snaps = sequential
    ref = Reference(weights, max_ctx=128)
    for accepted in range(6):
        ref.restore(snaps[p0])
        ref.verify(tokens[p0:p0 + 5], p0)
        ref.rollback(accepted)
        assert ref.state.pos == p0 + accepted
        assert ref.state.equal(snaps[p0 + accepted]), f"accepted={accepted}"
        nxt = p0 + accepted
        assert torch.equal(ref.decode(tokens[nxt], nxt), logits[nxt:nxt + 1])


def test_compressor_flush_positions(sequential):
    """Compressed row j of a ratio-r layer appears at position r*j + r - 1 (its block's last token)."""
    _, snaps = sequential
    cfg = preset("tiny")
    for p in range(N_TOKENS):
        after = snaps[p + 1]
        for i in range(cfg.n_layers):
            r = cfg.ratio(i)
            if not r:
                continue
            ls = after.layers[i]
            written = (ls.comp != 0).any(-1).nonzero().flatten().tolist()
            assert written == list(range((p + 1) // r)), (i, p)
            if r == 4:
                keys = (ls.idx_keys != 0).any(-1).nonzero().flatten().tolist()
                assert keys == list(range((p + 1) // 4)), (i, p)


def test_window_ring_holds_the_last_window_positions(weights, tokens, sequential):
    """Ring slot t mod 16 holds position t's KV: rerunning from a snapshot shows the slot change."""
    _, snaps = sequential
    for p in (5, 20, 40):
        before, after = snaps[p].layers[0].ring, snaps[p + 1].layers[0].ring
        changed = (before != after).any(-1).nonzero().flatten().tolist()
        assert changed == [p % 16]


def test_generate_is_deterministic_and_requests_do_not_leak(weights):
    ref = Reference(weights, max_ctx=96)
    prompt = [5, 17, 301, 42, 7, 99, 250]
    a = generate(ref, prompt, 24).tokens
    other = generate(ref, [1, 2, 3], 10).tokens  # an unrelated request in between
    b = generate(ref, prompt, 24).tokens
    ref2 = Reference(weights, max_ctx=96)
    c = generate(ref2, prompt, 24).tokens
    assert a == b == c
    assert other != a[:10]
    assert len(set(a)) > 3  # not a degenerate constant stream
    s1 = generate(ref, prompt, 16, temperature=0.9, seed=3).tokens
    s2 = generate(ref, prompt, 16, temperature=0.9, seed=3).tokens
    s3 = generate(ref, prompt, 16, temperature=0.9, seed=4).tokens
    assert s1 == s2 and s1 != s3


def test_prefill_width_does_not_change_tokens(weights):
    ref = Reference(weights, max_ctx=96)
    prompt = list(range(30, 53))
    outs = {w: generate(ref, prompt, 8, width=w).tokens for w in (1, 2, 5)}
    assert outs[1] == outs[2] == outs[5]


def test_quant_emulation_switch_changes_numerics_only_slightly(tiny_path, tokens):
    mf = open_model(tiny_path)
    w_on = ReferenceWeights.load(mf)
    w_off = ReferenceWeights.load(mf)
    w_off.config = w_off.config.replace(quant_emulation=False)
    on = Reference(w_on, max_ctx=64).verify(tokens[:5], 0)
    off = Reference(w_off, max_ctx=64).verify(tokens[:5], 0)
    rel = ((on - off).norm() / on.norm()).item()
    assert 0 < rel < 0.3


@pytest.fixture(scope="module")
def weights_no_emulation(tiny_path):
    out = {}
    for df in ("bf16", "fp32"):
        out[df] = ReferenceWeights.load(open_model(tiny_path), dataflow=df)
        out[df].config = out[df].config.replace(quant_emulation=False)
    return out


def test_fp32_dataflow_differs_by_bf16_rounding_only(weights_no_emulation, tokens):
    """The fp32 dataflow keeps activations and KV in fp32; the bf16 one (the spec) differs from it by rounding:
    well below 5% relative L2 per logits row on the tiny model, but not zero."""
    ref32 = Reference(weights_no_emulation["fp32"], max_ctx=64)
    ref16 = Reference(weights_no_emulation["bf16"], max_ctx=64)
    assert ref32.dataflow == "fp32" and ref16.dataflow == "bf16"
    wo_a = "blk.1.attn_output_a.weight"
    w32, w16 = weights_no_emulation["fp32"].by_name[wo_a], weights_no_emulation["bf16"].by_name[wo_a]
    assert torch.equal(w16, w32.to(torch.bfloat16).float()) and not torch.equal(w16, w32)
    assert ref32.state.layers[0].ring.dtype == torch.float32 and ref16.state.layers[0].ring.dtype == torch.bfloat16
    assert ref32.state.layers[2].idx_keys.dtype == torch.float32
    a = torch.cat([ref32.verify(tokens[p:p + 5], p) for p in range(0, 40, 5)])
    b = torch.cat([ref16.verify(tokens[p:p + 5], p) for p in range(0, 40, 5)])
    rel = (a - b).norm(dim=1) / b.norm(dim=1)
    assert float(rel.min()) > 0 and float(rel.median()) < 0.05, rel
    assert P.act_dtype() == torch.bfloat16  # the step's dataflow does not leak


def test_fp32_dataflow_verify_equals_sequential_decodes(weights_no_emulation, tokens):
    """Within fp32 roundoff: the bf16 dataflow is bit-identical (its roundings hide the last-ulp differences of
    row-batched fp32 sums), the fp32 one agrees to ~1e-6."""
    ref = Reference(weights_no_emulation["fp32"], max_ctx=64)
    seq = torch.cat([ref.decode(t, p) for p, t in enumerate(tokens[:20])])
    ref.reset()
    ver = torch.cat([ref.verify(tokens[p:p + 5], p) for p in range(0, 20, 5)])
    rel = (seq - ver).norm(dim=1) / seq.norm(dim=1)
    assert float(rel.max()) < 1e-5, rel


def test_dataflow_is_restored_after_an_error(weights, weights_no_emulation):
    ref = Reference(weights_no_emulation["fp32"], max_ctx=8)
    with pytest.raises(StepError):
        ref.verify([1, 2, 3], 7)  # past max_ctx: rejected before the step
    with pytest.raises(RuntimeError):
        with P.dataflow("fp32"):
            assert P.act_dtype() == torch.float32
            raise RuntimeError("boom")
    assert P.act_dtype() == torch.bfloat16
    with pytest.raises(StepError, match="dataflow must be one of"):
        Reference(weights, max_ctx=8, dataflow="fp16")
    with pytest.raises(StepError, match=r"needs weights loaded with .*dataflow='fp32'"):
        Reference(weights, max_ctx=8, dataflow="fp32")


def test_step_bad_inputs(weights):
    ref = Reference(weights, max_ctx=8)
    with pytest.raises(StepError, match="next position is 0"):
        ref.decode(1, 3)
    with pytest.raises(StepError, match="width must be in 1..5"):
        ref.verify([], 0)
    with pytest.raises(StepError, match="width must be in 1..5"):
        ref.verify([1] * 6, 0)
    with pytest.raises(StepError, match="token ids must be in 0..511"):
        ref.verify([1, 512], 0)
    with pytest.raises(StepError, match="token ids must be in 0..511"):
        ref.decode(-1, 0)
    with pytest.raises(StepError, match="no verify step"):
        ref.rollback(0)
    ref.verify([1, 2, 3, 4, 5], 0)
    with pytest.raises(StepError, match="accepted must be in 0..5"):
        ref.rollback(6)
    ref.rollback(5)
    with pytest.raises(StepError, match="exceed max_ctx=8"):
        ref.verify([1, 2, 3, 4], 5)
    with pytest.raises(StepError, match="max_new_tokens"):
        generate(ref, [1, 2], 7)
    with pytest.raises(StepError, match="at least one token"):
        generate(ref, [], 1)


def test_residual_rms_stays_in_band_over_43_layers(tmp_path):
    """Synthetic weights keep every HC stream's RMS inside RESIDUAL_RMS_BAND through 43 layers (tiny
    widths, the official layer pattern)."""
    cfg = preset("tiny").replace(n_layers=43, compress_ratios=(0, 0) + (4, 16) * 20 + (4,), name="tiny-43")
    path = make_model(cfg, tmp_path / "t43.gguf", seed=3)
    ref = Reference(ReferenceWeights.load(open_model(path)), max_ctx=32)
    seen: list[torch.Tensor] = []
    layer = Reference._layer

    def spy(self, *args):
        x = layer(self, *args)
        seen.append(x.float().pow(2).mean(-1).sqrt())
        return x

    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, 512, (20,), generator=g).tolist()
    ref._layer = spy.__get__(ref)  # instance-level spy, class untouched
    for p in range(0, 20, 5):
        logits = ref.verify(toks[p:p + 5], p)
    rms = torch.stack(seen)
    lo, hi = RESIDUAL_RMS_BAND
    assert rms.shape[0] == 43 * 4
    assert lo <= rms.min() and rms.max() <= hi, (rms.min(), rms.max())
    assert torch.isfinite(logits).all() and 0.1 < logits.std() < 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (reference on cuda vs cpu)")
@pytest.mark.parametrize("emulate", [False, True])
def test_reference_on_cuda_matches_cpu_step_by_step(tiny_path, tokens, emulate):
    """From the same state, one verify step on cuda equals the cpu step within bf16 tolerance for most
    rows. GPU and CPU BLAS round differently; a flipped bf16 rounding occasionally moves a router score
    across a near-tie and selects another expert (measured on the H200: up to 0.12 relative on such a row),
    so the check is on the distribution of per-row errors, teacher-forced (docs/gpu-validation.md)."""
    mf = open_model(tiny_path)
    refs = {}
    for dev in ("cpu", "cuda"):
        w = ReferenceWeights.load(mf, dev)
        w.config = w.config.replace(quant_emulation=emulate)
        refs[dev] = Reference(w, max_ctx=64)
    errs = []
    for p in range(0, 40, 5):
        refs["cuda"].state = refs["cpu"].state.to("cuda")
        a = refs["cpu"].verify(tokens[p:p + 5], p)
        b = refs["cuda"].verify(tokens[p:p + 5], p).cpu()
        assert torch.isfinite(b).all()
        errs.append((a - b).norm(dim=-1) / a.norm(dim=-1))
    e = torch.cat(errs)
    assert e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2 and e.max() < 0.25, e
