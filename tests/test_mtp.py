"""The MTP (nextn) drafter (ds4c/drafters/mtp*.py, spec ds4-flash.md 7.5) on the tiny preset.

* The file: ``make_mtp`` writes the converter's ``--mtp`` layout (names, types, keys; the trunk's embedding / norm /
  head, the MTP's own HC head), cross-checked against the peer converter and graph when the tarball is there.
* The final-HC hook of the reference: the rows are the state the HC head reads (its logits reproduced), recording
  changes nothing, rolled-back rows are recomputed.
* The math: the drafter's ring and chained logits against a plain fp32 implementation of 7.5 written here from the
  spec equations (embedding / hnorm / eh_proj input, one block with a window over the block's own rows, HC head,
  shared head), bf16 within a bf16 tolerance.
* The loop: greedy speculative decoding with the MTP drafter equals greedy autoregressive decoding token for token
  at widths 2..5 (steered drafts so verify steps accept several tokens); the ring then equals the ring built by
  committing the accepted tokens one at a time; a rejected draft leaves the state as if the drafter had never
  drafted; sampling returns q rows that sum to 1 and drafts drawn from them.
* Sources and errors: ``--draft mtp`` (the target's own block) and ``mtp:PATH``; one-line errors for a target
  without a block, a mismatched file, an engine that records no final HC state; the CLI end to end.
"""

from __future__ import annotations

import json
import random
import tarfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ds4c.cli import main
from ds4c.config import preset
from ds4c.drafters.mtp import MTPDrafter
from ds4c.drafters.mtp_file import mtp_of_target, open_mtp
from ds4c.drafters.mtp_model import MTPModel
from ds4c.drafters.mtp_synth import make_mtp, mtp_seed
from ds4c.errors import ModelFileError, StepError
from ds4c.generate import filter_logits, generate
from ds4c.sources import open_model
from ds4c.quant import GGMLType as G
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference.compiled import CompiledReference
from ds4c.drafters.factory import make_drafter

TINY = preset("tiny")
N = TINY.n_layers  # the MTP block is blk.6
PROMPT = [5, 17, 301, 42, 7, 99]
LONG = PROMPT + list(range(30, 50))  # 26 tokens: longer than tiny's 16-row window
PEER_TARBALL = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama.cpp-src.tar.xz"
F32 = torch.float32


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> Path:
    """The MTP-only file of the tiny seed-0 target (``tiny_path``)."""
    return make_mtp(TINY, tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf", seed=0)


@pytest.fixture(scope="module")
def target(tiny_path):
    return open_model(tiny_path)


def _prefill(ref: Reference, toks: list[int]) -> None:
    for s in range(0, len(toks), 5):
        ref.verify(toks[s:s + 5], s)


# ------------------------------------------------------------------------------------------------ the file

def test_file_layout_is_the_converters(mtp_path, target, tmp_path):
    mf = open_model(mtp_path, allow_mtp_only=True)
    assert mf.mtp_only and mf.nextn_blocks == [N] and mf.config.model_dict() == TINY.model_dict()
    m = mf.metadata
    assert m["deepseek4.block_count"] == N + 1 and m["deepseek4.nextn_predict_layers"] == 1
    assert m["deepseek4.attention.compress_ratios"] == list(TINY.compress_ratios) + [0]
    assert m["deepseek4.swiglu_clamp_exp"] == [10.0] * (N + 1) and m["general.file_type"] == 38
    assert all(m[k] == v for k, v in target.metadata.items() if k.startswith("tokenizer."))
    roots = {"token_embd.weight", "output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight",
             "output_norm.weight", "output.weight"}
    assert set(mf.specs) == roots and mf.extra_tensors == []
    assert {f"blk.{N}.nextn.{k}.weight" for k in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= set(mf.mtp_specs)
    assert not any(n.startswith("blk.") and not n.startswith(f"blk.{N}.") for n in mf.mtp_specs)
    assert f"blk.{N}.exp_probs_b.bias" in mf.mtp_specs and f"blk.{N}.ffn_gate_tid2eid.weight" not in mf.mtp_specs
    assert mf.ggml_type(f"blk.{N}.nextn.eh_proj.weight") == G.Q8_0  # the converter forces Q8_0
    assert mf.ggml_type(f"blk.{N}.ffn_up_exps.weight") == G.MXFP4
    assert mf.specs["output_hc_fn.weight"].shape == (4, 4 * 256)
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):  # the trunk's, byte for byte
        assert bytes(mf.stored(name).numpy()) == bytes(target.stored(name).numpy()), name
    assert not torch.equal(mf.tensor("output_hc_fn.weight"), target.tensor("output_hc_fn.weight"))  # the MTP's own
    again = make_mtp(TINY, tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == mtp_path.read_bytes()
    assert make_mtp(TINY, tmp_path / "other.gguf", seed=1).read_bytes() != mtp_path.read_bytes()
    assert mtp_seed(0) != 0


def test_layout_and_math_choices_are_llama_cpps():
    """What the docs say of llama.cpp, against its sources: the converter's --mtp renames (hc_head_* to the root,
    norm to nextn.shared_head_norm, eh_proj = cat(e_proj, h_proj), Q8_0; only embed / norm / head of the trunk kept),
    the MTP graph (concat [enorm(e); hnorm(h)] then eh_proj, the file's root hc_head), the draft loop (row j at
    pos0 + j with the block's own state)."""
    if not PEER_TARBALL.exists():
        pytest.skip(f"no llama.cpp source tarball at {PEER_TARBALL}")
    with tarfile.open(PEER_TARBALL) as tf:
        def text(suffix):
            m = next(m for m in tf.getmembers() if m.name.endswith(suffix))
            return " ".join(tf.extractfile(m).read().decode().split())
        conv, graph, spec = text("conversion/deepseek.py"), text("src/models/deepseek4.cpp"), \
            text("common/speculative.cpp")
    assert 'root_hc_head = { "hc_head_fn", "hc_head_base", "hc_head_scale", } if suffix in root_hc_head: name = ' \
           'suffix' in conv
    assert 'elif suffix == "norm.weight": name = f"layers.{bid}.nextn.shared_head_norm.weight"' in conv
    assert 'keep = name in ( "embed.weight", "norm.weight", "head.weight", "head.scale", )' in conv
    assert 'torch.cat((e_proj, h_proj), dim=1)' in conv
    assert 'if new_name.endswith(".nextn.eh_proj.weight"): return gguf.GGMLQuantizationType.Q8_0' in conv
    mtp = graph.split("graph_mtp::graph_mtp", 1)[1]
    assert "ggml_concat(ctx0, e_norm, h_norm, 0)" in mtp and "build_lora_mm(layer.nextn.eh_proj, concat" in mtp
    assert "build_norm(h_state, layer.nextn.hnorm" in mtp and "build_hc_head(inpL, model.hc_head_fn" in mtp
    assert "layer.nextn.shared_head_norm ? layer.nextn.shared_head_norm : model.output_norm" in mtp
    assert "batch.add(id, dp.pos0 + i + 1, seq_id, true); batch.set_embd(idx, { h_row" in spec
    assert "h_tgt + (size_t) (k - 1) * n_embd" in spec  # committed rows: token t with the target's state of t - 1


# ------------------------------------------------------------------------------------------------ the hook

def test_final_hc_is_the_state_the_head_reads(tiny_weights):
    """Recording is off by default and changes no logit; a row is the HC state hc_head turns into that row's logits
    (bit for bit); a rolled-back row is recomputed; reads outside the newest window are refused in one line."""
    ref, plain = Reference(tiny_weights, max_ctx=64), Reference(tiny_weights, max_ctx=64)
    with pytest.raises(StepError, match="records no final HC state") as ei:
        ref.final_hc(0, 1)
    _one_line(ei)
    ref.record_final_hc(True)
    w, cfg = tiny_weights, TINY
    from ds4c.reference import primitives as P

    def head(x):
        return P.linear_f32(P.rms_norm(P.hc_head(x, *w.hc_head, cfg.hc_eps, cfg.norm_eps), w.out_norm, 1e-6), w.head)

    toks = LONG[:22]
    logits = []
    for s in range(0, 22, 5):
        a = ref.verify(toks[s:s + 5], s)
        assert torch.equal(a, plain.verify(toks[s:s + 5], s))
        logits.append(a)
    logits = torch.cat(logits)
    x = ref.final_hc(6, 22)
    assert x.dtype == torch.bfloat16 and x.shape == (16, 4, 256)
    assert torch.equal(head(x), logits[6:22])
    with pytest.raises(StepError, match=r"inside the newest committed 6..21, found 5..21") as ei:
        ref.final_hc(5, 22)
    _one_line(ei)
    good = ref.final_hc(6, 22).clone()
    out = ref.verify([9, 1, 2, 3, 4], 22)  # five rows, keep one: rows 23..26 are rolled back
    ref.rollback(1)
    assert torch.equal(ref.final_hc(7, 22), good[1:]) and torch.equal(head(ref.final_hc(22, 23)), out[:1])
    out = ref.verify([4], 23)
    assert torch.equal(head(ref.final_hc(23, 24)), out)
    ref.record_final_hc(False)
    assert ref.final_hc_rows is None
    assert CompiledReference.records_final_hc is False and Reference.records_final_hc is True


# ------------------------------------------------------------------------------------------------ the math
class PlainMTP:
    """Spec 7.5 in fp32 without quantization emulation, written from the equations (spec 5.2, P1, P2, P6-P11):
    reads its weights from the files by name."""

    def __init__(self, mtp_file, target_file, cfg=TINY):
        self.f, self.cfg, b = mtp_file, cfg, f"blk.{cfg.n_layers}."
        self.t = lambda short: mtp_file.tensor(b + short)
        self.expert = lambda short, e: mtp_file.expert(b + short, e)
        self.embed, self.head = target_file.tensor("token_embd.weight"), target_file.tensor("output.weight")
        i = torch.arange(cfg.rope_dim // 2, dtype=F32)
        self.freqs = cfg.rope_theta ** (-2 * i / cfg.rope_dim)  # P6: theta 10000, no YaRN
        self.kv: dict[int, torch.Tensor] = {}

    def rms(self, x, w):  # P1
        return w * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.cfg.norm_eps)

    def rope(self, x, p, sign=1.0):  # P7: interleaved pairs of the last rope_dim dims
        ang = p * self.freqs * sign
        y = x.clone()
        a, b = x[..., -self.cfg.rope_dim::2], x[..., -self.cfg.rope_dim + 1::2]
        y[..., -self.cfg.rope_dim::2] = a * torch.cos(ang) - b * torch.sin(ang)
        y[..., -self.cfg.rope_dim + 1::2] = a * torch.sin(ang) + b * torch.cos(ang)
        return y

    def hc_pre(self, X, which):  # 5.2(a) with P8
        c = self.cfg
        hc = c.hc_mult
        fn, scale, base = (self.t(f"hc_{which}_{k}.weight") for k in ("fn", "scale", "base"))
        xf = X.flatten()
        m = (fn @ xf) * torch.rsqrt(xf.square().mean() + c.norm_eps)
        pre = torch.sigmoid(m[:hc] * scale[0] + base[:hc]) + c.hc_eps
        post = 2 * torch.sigmoid(m[hc:2 * hc] * scale[1] + base[hc:2 * hc])
        C = torch.softmax((m[2 * hc:] * scale[2] + base[2 * hc:]).view(hc, hc), dim=1) + c.hc_eps
        C = C / (C.sum(0, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            C = C / (C.sum(1, keepdim=True) + c.hc_eps)
            C = C / (C.sum(0, keepdim=True) + c.hc_eps)
        return (pre[:, None] * X).sum(0), post, C

    @staticmethod
    def hc_post(out, X, post, C):  # 5.2(l): X'_k = post_k out + sum_j C[j, k] X_j
        return post[:, None] * out + C.T @ X

    def block_input(self, tok, h):  # 7.5: e_proj(enorm(embed)) + h_proj(hnorm(h_c)) per stream, eh_proj = [e | h]
        e = self.rms(self.embed[tok], self.t("nextn.enorm.weight"))
        g = self.rms(h, self.t("nextn.hnorm.weight"))
        W = self.t("nextn.eh_proj.weight")
        D = self.cfg.hidden_size
        return e @ W[:, :D].T + g @ W[:, D:].T

    def kv_row(self, X, p):  # 5.2(a), (b), (d)
        y, _, _ = self.hc_pre(X, "attn")
        a = self.rms(y, self.t("attn_norm.weight"))
        return a, self.rope(self.rms(self.t("attn_kv.weight") @ a, self.t("attn_kv_a_norm.weight")), p)

    def commit(self, p, tok, h):
        self.kv[p] = self.kv_row(self.block_input(tok, h), p)[1]

    def block(self, X, p):  # one row at position p; its window = the block's rows of p - window + 1 .. p
        c = self.cfg
        a, kv = self.kv_row(X, p)
        self.kv[p] = kv
        H, hd = c.n_heads, c.head_dim
        qr = self.rms(self.t("attn_q_a.weight") @ a, self.t("attn_q_a_norm.weight"))
        q = (self.t("attn_q_b.weight") @ qr).view(H, hd)
        q = self.rope(q * torch.rsqrt(q.square().mean(-1, keepdim=True) + c.norm_eps), p)  # P2 then RoPE
        rows = torch.stack([self.kv[t] for t in range(max(0, p - c.window + 1), p + 1)])
        s = q @ rows.T * hd ** -0.5
        sink = self.t("attn_sinks.weight")
        mx = torch.maximum(s.max(-1).values, sink)
        e = torch.exp(s - mx[:, None])
        o = (e @ rows) / (e.sum(-1) + torch.exp(sink - mx))[:, None]  # P9: the sink in the denominator only
        o = self.rope(o, p, -1.0)  # 5.2(j)
        G = c.o_groups
        woa = self.t("attn_output_a.weight").view(G, c.o_lora_rank, -1)
        z = torch.stack([woa[g] @ o.reshape(G, -1)[g] for g in range(G)]).flatten()  # 5.2(k)
        y_pre, post, C = self.hc_pre(X, "attn")
        X = self.hc_post(self.t("attn_output_b.weight") @ z, X, post, C)
        y, post, C = self.hc_pre(X, "ffn")
        b = self.rms(y, self.t("ffn_norm.weight"))
        sc = torch.sqrt(torch.nn.functional.softplus(self.t("ffn_gate_inp.weight") @ b))  # P10, scored routing
        ids = torch.topk(sc + self.t("exp_probs_b.bias"), c.n_active_experts).indices
        wts = sc[ids] / sc[ids].sum() * c.route_scale

        def ffn(w1, w3, w2, wt):  # P11, the weight on the intermediate
            g, u = w1 @ b, w3 @ b
            return w2 @ (wt * torch.nn.functional.silu(torch.clamp(g, max=c.swiglu_limit))
                         * torch.clamp(u, -c.swiglu_limit, c.swiglu_limit))

        moe = sum(ffn(self.expert("ffn_gate_exps.weight", int(e)), self.expert("ffn_up_exps.weight", int(e)),
                      self.expert("ffn_down_exps.weight", int(e)), w) for e, w in zip(ids, wts))
        moe = moe + ffn(self.t("ffn_gate_shexp.weight"), self.t("ffn_up_shexp.weight"),
                        self.t("ffn_down_shexp.weight"), 1.0)
        return self.hc_post(moe, X, post, C)

    def logits(self, X):  # 5.4 with the file's output_hc_*, nextn.shared_head_norm, the target's head
        c = self.cfg
        fn, scale, base = (self.f.tensor(f"output_hc_{k}.weight") for k in ("fn", "scale", "base"))
        xf = X.flatten()
        pre = torch.sigmoid((fn @ xf) * torch.rsqrt(xf.square().mean() + c.norm_eps) * scale[0] + base) + c.hc_eps
        return self.head @ self.rms((pre[:, None] * X).sum(0), self.t("nextn.shared_head_norm.weight"))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dataflow,tol", [("fp32", 2e-5), ("bf16", 1.5e-2)])
def test_drafter_math_against_a_plain_implementation(mtp_path, target, tiny_path, dataflow, tol):
    """Ring rows and the logits of a 4-draft chain after LONG (wider than the window: the ring wraps) and again after
    three more committed tokens, against :class:`PlainMTP` fed the drafter's drafts (teacher forcing) and the
    target's final HC states; quantization emulation off on both (the plain one has none)."""
    w = ReferenceWeights.load(target, dataflow=dataflow)
    w.config = w.config.replace(quant_emulation=False)
    ref = Reference(w, max_ctx=64, dataflow=dataflow)
    d = MTPDrafter(mtp_path, target=TINY, target_file=target)
    d.prepare(ref, LONG, 8)
    plain = PlainMTP(open_model(mtp_path, allow_mtp_only=True), target)
    ctx = list(LONG)
    _prefill(ref, ctx)
    for anchor, extra in ((300, [7, 8]), (211, None)):
        ctx.append(anchor)
        n = len(ctx) - 1
        drafts, q = d.propose(ctx, 4)
        assert q is None and len(drafts) == 4 and d.model.ring_pos == n + 1
        xm = ref.final_hc(n - 16, n).float()  # X_main of positions n-16 .. n-1
        for t in range(n - 15, n + 1):
            plain.commit(t, ctx[t], xm[t - 1 - (n - 16)])
        for t in range(n - 15, n + 1):  # the ring: the committed rows, slot t mod 16
            assert _rel(d.model.ring[t % 16], plain.kv[t]) < tol, t
        X, h = None, xm[-1]
        want = []
        for j in range(4):
            X = plain.block(plain.block_input(ctx[n] if j == 0 else drafts[j - 1], h if j == 0 else X), n + j)
            want.append(plain.logits(X))
        want = torch.stack(want)
        assert _rel(d.last_logits, want) < tol
        if dataflow == "fp32":
            assert drafts == want.argmax(-1).tolist()
        if extra:
            ref.verify([anchor] + extra, n)  # the target commits the anchor and two more
            ctx += extra


# ------------------------------------------------------------------------------------------------ the loop
@pytest.fixture(scope="module")
def ar(tiny_weights):
    """Greedy autoregressive decoding on the reference, step by step, keeping every final HC state:
    ``{prompt name: (prompt, tokens, X_main rows bf16 [positions, 4, D])}``."""
    out = {}
    for name, prompt, n_new in (("short", PROMPT, 26), ("long", LONG, 24)):
        ref = Reference(tiny_weights, max_ctx=128)
        ref.record_final_hc(True)
        ctx, xs = list(prompt), []
        for s in range(0, len(ctx), 5):
            lg = ref.verify(ctx[s:s + 5], s)
            xs.append(ref.final_hc(s, s + lg.shape[0]))
        toks = []
        for _ in range(n_new):
            toks.append(int(torch.argmax(lg[-1])))
            if len(toks) == n_new:
                break
            lg = ref.decode(toks[-1], len(ctx))
            xs.append(ref.final_hc(len(ctx), len(ctx) + 1))
            ctx.append(toks[-1])
        out[name] = (prompt, toks, torch.cat(xs))
    return out


class _Steered(MTPDrafter):
    """The MTP drafter with each draft replaced by the target's greedy continuation with probability ``steer``, so
    verify steps accept several tokens; logs ``(ring_pos before, n, committed positions)`` per proposal."""

    def __init__(self, path, prompt, continuation, steer, seed=0):
        super().__init__(path)
        self.prompt, self.cont, self.steer, self.rng, self.log = prompt, continuation, steer, random.Random(seed), []

    def propose(self, context, k):
        before = self.model.ring_pos
        drafts, q = super().propose(context, k)
        self.log.append((before, len(context) - 1, self.last_committed))
        at = len(context) - len(self.prompt)
        return [self.cont[at + i] if self.rng.random() < self.steer else t for i, t in enumerate(drafts)], q


@pytest.mark.parametrize("name,width,steer", [("short", 2, 0.0), ("long", 3, 0.7), ("short", 4, 0.7),
                                              ("long", 5, 0.5)])
def test_greedy_speculative_with_mtp_equals_autoregressive(mtp_path, tiny_weights, ar, name, width, steer):
    prompt, tokens, xm = ar[name]
    ref = Reference(tiny_weights, max_ctx=128)  # the drafter turns the recording on
    d = _Steered(mtp_path, prompt, tokens, steer, seed=width)
    res = generate(ref, prompt, len(tokens), draft=d, spec_width=width)
    assert res.tokens == tokens and ref.final_hc_rows is not None
    sp = res.speculative
    assert sp["drafter"] == "mtp:tiny-mtp.gguf" and sp["tokens"] == len(tokens) - 1
    first = d.log[0]  # the drafter's prefill: the newest window of prompt positions and the anchor
    L = len(prompt)
    assert first[0] == 0 and first[1] == L and first[2] == list(range(max(0, L - 15), L + 1))
    for (_, n0, _), (b1, n1, c1) in zip(d.log, d.log[1:]):  # then exactly the positions accepted since
        assert b1 == n0 + 1 and c1 == list(range(n0 + 1, n1 + 1)) and 1 <= n1 - n0 <= width
    if steer:
        steps = [n1 - n0 for (_, n0, _), (_, n1, _) in zip(d.log, d.log[1:])]
        assert max(steps) >= 3 and sum(s > 1 for s in steps) >= 3  # multi-token accepts happened
    R = d.model.ring_pos
    assert d.model.rows_written == min(16, L + 1) + R - (L + 1)
    # the ring equals committing the accepted tokens one position at a time from the autoregressive run's states
    ctx = prompt + tokens
    fresh = MTPModel(d.source, tiny_weights)
    zero = torch.zeros(1, 4, 256, dtype=torch.bfloat16)
    for t in range(R):
        fresh.commit(t, torch.tensor([ctx[t]]), zero if t == 0 else xm[t - 1:t])
    assert fresh.ring_pos == R and torch.equal(fresh.ring, d.model.ring)


def test_a_rejected_draft_leaves_the_state_as_if_never_drafted(mtp_path, tiny_weights):
    ref = Reference(tiny_weights, max_ctx=64)
    a, b = MTPDrafter(mtp_path), MTPDrafter(mtp_path)
    a.prepare(ref, LONG, 8)
    _prefill(ref, LONG)
    b.prepare(ref, LONG, 8)  # b: the same request, but b only commits (k = 0 proposals)
    t0 = 77
    drafts, _ = a.propose(LONG + [t0], 4)
    assert b.propose(LONG + [t0], 0) == ([], None)
    assert a.model.ring_pos == b.model.ring_pos == len(LONG) + 1 and torch.equal(a.model.ring, b.model.ring)
    logits = ref.verify([t0] + [(x + 1) % 512 for x in drafts], len(LONG))  # drafts the target rejects
    ref.rollback(1)
    y = int(torch.argmax(logits[0]))
    ctx = LONG + [t0, y]
    da, db = a.propose(ctx, 4), b.propose(ctx, 4)
    assert da == db and torch.equal(a.last_logits, b.last_logits) and torch.equal(a.model.ring, b.model.ring)
    again = a.propose(ctx, 3)  # proposing twice from one context: the same chain, nothing committed twice
    assert again[0] == da[0][:3] and a.model.ring_pos == len(ctx) and torch.equal(a.model.ring, b.model.ring)


def test_sampling_returns_q_and_drafts_drawn_from_it(mtp_path, tiny_weights):
    ref = Reference(tiny_weights, max_ctx=64)
    d = MTPDrafter(mtp_path, seed=5)
    d.prepare(ref, PROMPT, 8)
    _prefill(ref, PROMPT)
    d.configure_sampling(0.8, top_k=40, top_p=0.95, generator=torch.Generator().manual_seed(3))
    drafts, q = d.propose(PROMPT + [300], 4)
    assert q is not None and q.shape == (4, 512) and q.dtype == F32
    assert torch.allclose(q.sum(-1), torch.ones(4), atol=1e-5)
    want = torch.softmax(filter_logits(d.last_logits.float(), 0.8, 40, 0.95) / 0.8, dim=-1)
    assert torch.allclose(q, want, atol=1e-6) and int((q > 0).sum(-1).max()) <= 40
    g = torch.Generator().manual_seed(3)  # the drafts are the draws from q in order
    assert drafts == [int(torch.multinomial(q[i], 1, generator=g)) for i in range(4)]
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, spec_width=4, draft=d)
    r1, r2, r3 = (generate(ref, PROMPT, 6, seed=s, **kw) for s in (1, 1, 2))
    assert r1.tokens == r2.tokens and r1.tokens != r3.tokens and r1.speculative["steps"] > 0
    greedy = generate(ref, PROMPT, 3, draft=d, spec_width=3)  # the next request is greedy again
    assert d.temperature == 0 and d.last_logits is not None and greedy.tokens == generate(ref, PROMPT, 3).tokens


# ------------------------------------------------------------------------------------------------ sources, errors
def test_the_targets_own_block_and_one_line_errors(mtp_path, tiny_path, target, tmp_path):
    merged = open_model(make_mtp(TINY, tmp_path / "merged.gguf", seed=0, merged=True))
    assert merged.nextn_blocks == [N] and not merged.mtp_only
    d = make_drafter("mtp", 512, config=merged.config, target_file=merged)
    assert isinstance(d, MTPDrafter) and d.name == "mtp" and d.source.file is merged
    from ds4c.api import Model

    m = Model(merged, engine="reference", max_ctx=32)
    spec = m.generate(PROMPT, 6, draft="mtp", spec_width=3).result
    assert spec.tokens == m.generate(PROMPT, 6).result.tokens and spec.speculative["drafter"] == "mtp"
    ok = make_drafter(f"mtp:{mtp_path}", 512, config=TINY, target_file=target)
    assert ok.name == "mtp:tiny-mtp.gguf" and ok.source.mtp_only
    synthetic = open_model("synthetic:tiny")  # the same model without a file: its rows are generated, not read
    assert torch.equal(synthetic.rows("output.weight", 7, 9), target.tensor("output.weight")[7:9])
    assert torch.equal(target.rows("token_embd.weight", 511, 512), target.tensor("token_embd.weight")[511:])
    assert make_drafter(f"mtp:{mtp_path}", 512, config=synthetic.config, target_file=synthetic).source.mtp_only
    cases = [
        (lambda: make_drafter("mtp", 512, config=TINY, target_file=target), ModelFileError,
         r"--draft mtp: .* holds no MTP \(nextn\) block .*give --draft mtp:PATH"),
        (lambda: mtp_of_target(target), ModelFileError, "holds no MTP"),
        (lambda: make_drafter("mtp", 512), StepError, "expected the target's model file"),
        (lambda: make_drafter("mtp:", 512), StepError, "expected mtp .* or mtp:PATH, found an empty path"),
        (lambda: make_drafter("mtpx", 512), StepError, "unknown drafter 'mtpx'.*mtp:PATH"),
        (lambda: make_drafter(f"mtp:{tmp_path / 'none.gguf'}", 512), ModelFileError, "no such model file"),
        (lambda: make_drafter(f"mtp:{tiny_path}", 512), ModelFileError, r"expected a file with an MTP \(nextn\) block"),
        (lambda: open_mtp(make_mtp(preset("tiny-128"), tmp_path / "t128.gguf"), TINY), ModelFileError,
         r"does not fit the target 'tiny': expected index_n_heads = 4 \(the target's\), found 16"),
        (lambda: open_mtp(mtp_path, TINY.replace(window=32)), ModelFileError, "expected window = 32"),
        (lambda: target.rows("output.weight", 510, 513), ModelFileError, r"rows of a 2-D tensor 'output.weight'"),
        (lambda: open_mtp(make_mtp(TINY, tmp_path / "s1.gguf", seed=1), TINY, target), ModelFileError,
         r"token_embd.weight differs from the target's"),
    ]
    for fn, exc, pattern in cases:
        with pytest.raises(exc, match=pattern) as ei:
            fn()
        _one_line(ei)


def test_drafter_errors_are_one_line(mtp_path, tiny_weights):
    d = MTPDrafter(mtp_path, target=TINY)
    checks = [(lambda: d.propose(PROMPT, 2), "propose before prepare"),
              (lambda: d.prepare(object(), PROMPT, 4),
               "which this object does not record: run the unsplit reference engine")]
    for fn, pattern in checks:
        with pytest.raises(StepError, match=pattern) as ei:
            fn()
        _one_line(ei)
    ref = Reference(tiny_weights, max_ctx=64)
    d.prepare(ref, PROMPT, 4)
    _prefill(ref, PROMPT)
    for ctx, k, pattern in ((PROMPT + [3], 5, r"drafts 0..4 tokens per step, asked for 5"),
                            (PROMPT + [3, 4], 2, "the target is at position 6, the context asks for 7")):
        with pytest.raises(StepError, match=pattern) as ei:
            d.propose(ctx, k)
        _one_line(ei)
    with pytest.raises(StepError, match="expected the rows of positions from 7 on") as ei:
        d.propose(PROMPT + [3], 2)
        d.model.commit(3, torch.tensor([1]), torch.zeros(1, 4, 256, dtype=torch.bfloat16))
    _one_line(ei)


def test_cli_make_info_and_generate_with_an_mtp_file(tmp_path):
    """``make-model --drafter mtp`` writes the MTP-only file of the (preset, seed) model; ``info`` lists it;
    ``generate --draft mtp:FILE`` on the reference gives the plain greedy tokens; ``--draft mtp`` on a target without a
    block, or the drafter with a layer split, is a one-line error."""
    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(tmp_path)})

    model, drafter = tmp_path / "t.gguf", tmp_path / "m.gguf"
    assert run("make-model", "--preset", "tiny", "--seed", "3", "-o", model).exit_code == 0
    r = run("make-model", "--preset", "tiny", "--seed", "3", "--drafter", "mtp", "-o", drafter)
    assert r.exit_code == 0 and "MTP-only file of preset tiny seed 3" in r.output, r.output
    info = run("info", drafter)
    assert info.exit_code == 0 and "MTP-only file" in info.output and "blk.6 nextn" in info.output, info.output
    rec = json.loads(run("info", drafter, "--json").output)
    assert rec["mtp"]["mtp_only"] is True and rec["mtp"]["blocks"][0]["compress_ratio"] == 0
    base = ["generate", model, "--prompt-ids", "5,17,301,42", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    plain = json.loads(run(*base).output.strip().splitlines()[-1])
    r = run(*base, "--draft", f"mtp:{drafter}", "--spec-width", "3")
    assert r.exit_code == 0, r.output
    spec = json.loads(r.output.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"] == "mtp:m.gguf"
    for args, pattern in ((("--draft", "mtp"), "holds no MTP (nextn) block"),
                          (("--draft", f"mtp:{drafter}", "--layer-split", "3,3"),
                           "final HC state, which the reference engine records unsplit only"),
                          (("--draft", f"mtp:{model}"), "expected a file with an MTP (nextn) block")):
        bad = run(*base, *args)
        assert bad.exit_code == 2 and pattern in bad.output and "Traceback" not in bad.output, bad.output
        assert len([ln for ln in bad.output.splitlines() if ln.startswith("ds4c: error")]) == 1
