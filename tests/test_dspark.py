"""The DSpark drafter (ds4c/drafters, spec ds4-flash.md section 7; taps 5.2(q)) on the tiny preset.

* The drafter file: names, keys and value types as llama.cpp's converter (``DeepseekV4DSparkModel``) and
  ``gguf-py/gguf/constants.py`` spell them (cross-checked against the peer tarball when it is there), determinism,
  the bf16 / f32 variants, one-line errors for a wrong target and for damaged files.
* The reference: taps equal the mean over the HC streams after the tap layers (a spied forward), block shapes,
  determinism, the non-causal block attention (row 0 sees the noise rows; causally it would not), the Markov chain
  and confidence by hand.
* The loop: greedy speculative decoding with the DSpark drafter equals greedy autoregressive decoding over 60
  tokens at several widths; the rings get exactly one row per committed position, equal to rings built from the
  autoregressive run's taps; sampling runs, is seeded and drafts from the returned ``q``.
"""

from __future__ import annotations

import random
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType

from ds4c.config import preset
from ds4c.drafters.dspark import DSparkDrafter
from ds4c.drafters.dspark_file import (ARCH, KEY_BLOCK_SIZE, KEY_MASK_ID, KEY_TARGET_LAYERS, dspark_metadata,
                                       dspark_tensor_specs, stage_config)
from ds4c.drafters.dspark_sources import open_dspark
from ds4c.drafters.dspark_model import DSparkModel
from ds4c.drafters.dspark_synth import drafter_seed, dspark_producer, make_dspark
from ds4c.errors import ConfigError, ModelFileError, StepError
from ds4c.generate import generate
from ds4c.gguf_file import write_model
from ds4c.sources import open_model
from ds4c.quant import GGMLType as G
from ds4c.reference import Reference
from ds4c.reference import primitives as P
from ds4c.drafters.factory import make_drafter
from ds4c.drafters.oracle import OracleDrafter
from ds4c.tensors import FORMATS

TINY = preset("tiny")
TAPS = (3, 4, 5)  # the default: the last three of tiny's 6 layers (official 40, 41, 42 of 43)
PROMPT = [5, 17, 301, 42, 7, 99]
LONG = PROMPT + list(range(30, 50))  # 26 tokens: longer than tiny's 16-row window (the drafter's prefill keeps 16)
N_NEW = 60  # 26 + 60 positions: the 16-row rings wrap 5 times
PEER_TARBALL = Path(__file__).resolve().parents[2] / "shared" / "peers" / "llama.cpp-src.tar.xz"

# names as llama.cpp writes them: MODEL_TENSOR -> TENSOR_NAMES (gguf-py/gguf/constants.py l. 1428-2001), root names
# from DeepseekV4DSparkModel._DSPARK_ROOT_MAP / root_names and _map_dsv4_tensor_name (conversion/deepseek.py)
ROOT = {"fc": "FC", "enc.output_norm": "ENC_OUTPUT_NORM", "markov_w1": "DSPARK_MARKOV_W1",
        "markov_w2": "DSPARK_MARKOV_W2", "conf_proj": "DSPARK_CONF_PROJ", "output_norm": "OUTPUT_NORM",
        "output_hc_fn": "HC_HEAD_FN", "output_hc_base": "HC_HEAD_BASE", "output_hc_scale": "HC_HEAD_SCALE"}
BLOCK = {"attn_norm": "ATTN_NORM", "attn_sinks": "ATTN_SINKS", "attn_q_a": "ATTN_Q_A", "attn_q_a_norm": "ATTN_Q_A_NORM",
         "attn_q_b": "ATTN_Q_B", "attn_kv": "ATTN_KV", "attn_kv_a_norm": "ATTN_KV_NORM", "attn_output_a": "ATTN_OUT_A",
         "attn_output_b": "ATTN_OUT_B", "hc_attn_fn": "HC_ATTN_FN", "hc_attn_base": "HC_ATTN_BASE",
         "hc_attn_scale": "HC_ATTN_SCALE", "hc_ffn_fn": "HC_FFN_FN", "hc_ffn_base": "HC_FFN_BASE",
         "hc_ffn_scale": "HC_FFN_SCALE", "ffn_norm": "FFN_NORM", "ffn_gate_inp": "FFN_GATE_INP",
         "exp_probs_b": "FFN_EXP_PROBS_B", "ffn_gate_exps": "FFN_GATE_EXP", "ffn_down_exps": "FFN_DOWN_EXP",
         "ffn_up_exps": "FFN_UP_EXP", "ffn_gate_shexp": "FFN_GATE_SHEXP", "ffn_down_shexp": "FFN_DOWN_SHEXP",
         "ffn_up_shexp": "FFN_UP_SHEXP"}
# official storage (tensor_force_quant: dequantized FP8 -> Q8_0, 2-D BF16 -> BF16, F32 and 1-D -> F32; MXFP4 experts)
Q8 = {"attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b", "ffn_gate_shexp", "ffn_up_shexp",
      "ffn_down_shexp", "fc"}
BF = {"ffn_gate_inp", "markov_w1", "markov_w2", "conf_proj"}
MX = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def target(tiny_path):
    return open_model(tiny_path)


@pytest.fixture(scope="module")
def dspark5(tiny_path, tmp_path_factory) -> Path:
    """The default drafter of the tiny target (official formats, block 5)."""
    return make_dspark(tiny_path, tmp_path_factory.mktemp("dspark") / "tiny-dspark.gguf", seed=0)


@pytest.fixture(scope="module")
def dspark4(tiny_path, tmp_path_factory) -> Path:
    """Block size 4 (the widest verify step, 5 rows, carries 4 drafts) and a confidence bias: the loop tests'."""
    return make_dspark(tiny_path, tmp_path_factory.mktemp("dspark4") / "tiny-dspark4.gguf", seed=3, block_size=4,
                       conf_bias=True)


# ------------------------------------------------------------------------------------------------ the file

def test_file_layout_is_the_converters(dspark5, target):
    f = open_dspark(dspark5, TINY)
    names = set(f.tensor_names)
    want = {f"{n}.weight" for n in ROOT} | {f"blk.{s}.{n}.{'bias' if n == 'exp_probs_b' else 'weight'}"
                                            for s in range(3) for n in BLOCK}
    assert names == want  # no token_embd / output (the target's), no tid2eid, no compressor or indexer
    for name in names:
        short = re.sub(r"^blk\.\d\.", "", name).rsplit(".", 1)[0]
        t = f.ggml_type(name)
        assert t == (G.Q8_0 if short in Q8 else G.BF16 if short in BF else G.MXFP4 if short in MX else G.F32), name
    D, r = TINY.hidden_size, f.markov_rank
    assert r == 64 and f.specs["fc.weight"].shape == (D, 3 * D) and f.specs["conf_proj.weight"].shape == (1, D + r)
    assert f.specs["markov_w1.weight"].shape == f.specs["markov_w2.weight"].shape == (TINY.vocab_size, r)
    rd = GGUFReader(dspark5)
    fields = rd.fields

    def typed(key):
        fl = fields[key]
        return f.metadata[key], [GGUFValueType(t) for t in fl.types]

    assert typed("general.architecture") == ("dflash", [GGUFValueType.STRING])
    assert typed(KEY_BLOCK_SIZE) == (5, [GGUFValueType.UINT32])
    assert typed(KEY_TARGET_LAYERS) == ([4, 5, 6], [GGUFValueType.ARRAY, GGUFValueType.INT32])  # layer + 1
    assert typed(KEY_MASK_ID) == (TINY.vocab_size - 1, [GGUFValueType.UINT32])
    assert f.taps == TAPS and f.noise_id == TINY.vocab_size - 1 and f.block_size == 5
    m = f.metadata
    assert m["dflash.block_count"] == 3 and m["dflash.attention.compress_ratios"] == [0, 0, 0]
    assert m["dflash.hash_layer_count"] == 0 and m["dflash.attention.sliding_window"] == TINY.window
    assert m["dflash.hyper_connection.count"] == 4 and m["dflash.expert_gating_func"] == 4
    assert m["dflash.swiglu_clamp_exp"] == [10.0] * 3 and m["general.file_type"] == 38
    assert "dflash.embedding_length_out" not in m and not any(k.startswith("deepseek4.") for k in m)
    for k, v in target.metadata.items():  # the target's tokenizer, as the converter's set_vocab copies it
        if k.startswith("tokenizer."):
            assert m[k] == v, k
    assert f.config == stage_config(TINY) and f.config.n_layers == 3


def test_names_and_keys_are_llama_cpp_constants():
    """The tables above against the peer llama.cpp tree: TENSOR_NAMES, the DFLASH tensor list, the key strings,
    and the converter's DSpark root map."""
    if not PEER_TARBALL.exists():
        pytest.skip(f"no llama.cpp source tarball at {PEER_TARBALL}")
    with tarfile.open(PEER_TARBALL) as tf:
        def text(suffix):
            m = next(m for m in tf.getmembers() if m.name.endswith(suffix))
            return tf.extractfile(m).read().decode()
        consts, conv = text("gguf-py/gguf/constants.py"), text("conversion/deepseek.py")
    names = dict(re.findall(r"MODEL_TENSOR\.(\w+):\s*\"([^\"]+)\"", consts)[::-1])  # first occurrence wins
    assert re.search(r"MODEL_ARCH\.DFLASH:\s*\"dflash\"", consts)
    dflash = set(re.findall(r"MODEL_TENSOR\.(\w+)",
                            consts.split("MODEL_ARCH.DFLASH: [", 1)[1].split("],", 1)[0]))
    for name, key in list(ROOT.items()) + [(f"blk.{{bid}}.{n}", k) for n, k in BLOCK.items()]:
        assert names[key] == name and key in dflash, (name, key)
    for key in ('"{arch}.block_size"', '"{arch}.target_layers"', '"tokenizer.ggml.mask_token_id"'):
        assert key in consts
    root_map = dict(re.findall(r"\"([\w.]+)\": \(gguf\.MODEL_TENSOR\.(\w+), \"\.weight\"\)",
                               conv.split("_DSPARK_ROOT_MAP", 1)[1].split("}", 1)[0]))
    assert root_map == {"main_proj.weight": "FC", "main_norm.weight": "ENC_OUTPUT_NORM",
                        "markov_head.markov_w1.weight": "DSPARK_MARKOV_W1",
                        "markov_head.markov_w2.weight": "DSPARK_MARKOV_W2",
                        "confidence_head.proj.weight": "DSPARK_CONF_PROJ"}
    assert "add_target_layers([layer + 1 for layer in" in conv and "add_mask_token_id" in conv


def test_same_arguments_same_bytes_and_formats(dspark5, tiny_path, tmp_path):
    again = make_dspark(tiny_path, tmp_path / "again.gguf", seed=0)
    assert again.read_bytes() == dspark5.read_bytes()
    other = make_dspark(tiny_path, tmp_path / "other.gguf", seed=1)
    assert other.read_bytes() != dspark5.read_bytes()
    off = open_dspark(dspark5, TINY)
    f32 = open_dspark(make_dspark(tiny_path, tmp_path / "f32.gguf", seed=0, formats="f32"), TINY)
    bf = open_dspark(make_dspark(tiny_path, tmp_path / "bf16.gguf", seed=0, formats="bf16"), TINY)
    assert f32.ggml_type("fc.weight") == G.F32 and bf.ggml_type("fc.weight") == G.BF16
    assert bf.ggml_type("blk.1.ffn_up_exps.weight") == G.BF16
    for name in ("fc.weight", "blk.2.attn_q_b.weight", "markov_w1.weight", "conf_proj.weight", "output_hc_fn.weight"):
        assert torch.equal(off.tensor(name), f32.tensor(name)), name  # Q8_0 / BF16 values are exact in F32
    assert torch.equal(off.expert("blk.0.ffn_gate_exps.weight", 3), bf.expert("blk.0.ffn_gate_exps.weight", 3))
    assert drafter_seed(0) != 0  # the drafter's streams are not the target's
    assert not torch.equal(off.tensor("blk.0.attn_q_a.weight"), open_model(tiny_path).tensor("blk.0.attn_q_a.weight"))
    with pytest.raises(ConfigError, match="unknown formats") as ei:
        make_dspark(tiny_path, tmp_path / "x.gguf", formats="fp8")
    _one_line(ei)
    with pytest.raises(ConfigError, match=r"taps: expected distinct layer ids in 0..5, found \[4, 6\]"):
        make_dspark(tiny_path, tmp_path / "x.gguf", taps=(4, 6))


def _write(path: Path, specs=None, meta=None, stage=None):
    """A drafter file written by write_model with a changed inventory or metadata (no tokenizer keys: the vocabulary
    comes from markov_w1)."""
    stage = stage or stage_config(TINY)
    sp = dspark_tensor_specs(stage, 3, 64)
    md = dspark_metadata(stage, TAPS, 4, 7)
    synth = dspark_producer(stage, 1)

    def produce(spec, t):
        yield from ([np.ones(spec.shape, np.float32)] if spec.name == "fc.scale" else synth(spec, t))

    return write_model(path, stage, FORMATS["official"], produce, arch=ARCH, specs=specs(sp) if specs else sp,
                       metadata=meta(md) if meta else md)


def _set(md, key, value, kind):
    return [e for e in md if e[0] != key] + ([(key, value, kind)] if value is not None else [])


@pytest.mark.parametrize("change,expect", [
    (dict(specs=lambda sp: [s for s in sp if s.name != "markov_w2.weight"]), "missing tensor 'markov_w2.weight'"),
    (dict(specs=lambda sp: [s for s in sp if s.name != "blk.1.exp_probs_b.bias"]), "missing tensor 'blk.1.exp_probs_b"),
    (dict(specs=lambda sp: [s if s.name != "fc.weight" else type(s)(s.name, (256, 512), s.role) for s in sp]),
     r"tensor 'fc.weight' has shape \[256, 512\], expected \[256, 768\]"),
    (dict(meta=lambda md: _set(md, KEY_BLOCK_SIZE, None, "")), "expected dflash.block_size an int >= 1, found None"),
    (dict(meta=lambda md: _set(md, KEY_BLOCK_SIZE, 0, "u32")), "dflash.block_size an int >= 1, found 0"),
    (dict(meta=lambda md: _set(md, KEY_TARGET_LAYERS, [4, 4, 6], "arr_i32")), r"distinct ints >= 1.*\[4, 4, 6\]"),
    (dict(meta=lambda md: _set(md, KEY_TARGET_LAYERS, [0, 5, 6], "arr_i32")), "tap layer"),
    (dict(meta=lambda md: _set(md, KEY_MASK_ID, None, "")), "tokenizer.ggml.mask_token_id an int"),
    (dict(meta=lambda md: _set(md, KEY_MASK_ID, 512, "u32")), r"noise token\) in 0..511, found 512"),
    (dict(meta=lambda md: _set(md, "dflash.attention.compress_ratios", [0, 4, 0], "arr_i32")), "all 0"),
    (dict(meta=lambda md: _set(md, "dflash.hash_layer_count", 1, "u32")), "hash_layer_count = 0"),
    (dict(meta=lambda md: _set(md, "dflash.attention.q_lora_rank", None, "")), "'dflash.attention.q_lora_rank'"),
    (dict(specs=lambda sp: sp + [type(sp[0])("fc.scale", (1,), "f32")]), "'fc.scale' is a per-tensor weight scale"),
])
def test_bad_drafter_files_fail_in_one_line(tmp_path, change, expect):
    p = _write(tmp_path / "bad.gguf", **change)
    with pytest.raises(ModelFileError, match=expect) as ei:
        open_dspark(p)
    assert str(p) in _one_line(ei)


def test_damaged_files_and_wrong_targets(tmp_path, dspark5, tiny_path):
    data = dspark5.read_bytes()
    for cut, what in ((1, "truncated"), (len(data) - 3000, "truncated GGUF file: its header")):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:-cut])
        with pytest.raises(ModelFileError, match=what) as ei:
            open_dspark(p)
        _one_line(ei)
    for path, what in ((tiny_path, "expected general.architecture = 'dflash'.*found 'deepseek4' \\(a target model"),
                       (tmp_path / "none.gguf", "no such drafter file"), (tmp_path, "found a directory")):
        with pytest.raises(ModelFileError, match=what) as ei:
            open_dspark(path)
        _one_line(ei)
    f = open_dspark(dspark5)
    for cfg, what in ((TINY.replace(window=32), "expected window = 32 \\(the target's\\), found 16"),
                      (TINY.replace(vocab_size=1024), "expected vocabulary size = 1024 \\(the target's\\), found 512"),
                      (TINY.replace(hidden_size=384), "expected hidden_size = 384"),
                      (TINY.replace(n_layers=5, compress_ratios=(0, 0, 4, 16, 4)),
                       r"target_layers \[4, 5, 6\] is out of range for the target's 5 layers: expected values in "
                       r"1..5 \(layer \+ 1\), found \[6\]")):
        with pytest.raises(ModelFileError, match=what) as ei:
            f.check_target(cfg)
        _one_line(ei)
    with pytest.raises(ModelFileError, match="the drafter's vocabulary has 512 tokens, the target's 1024") as ei:
        make_drafter(str(dspark5), 1024)
    _one_line(ei)
    for spec in ("dspark", "dspark:"):
        with pytest.raises(StepError, match="expected dspark:PATH .* found an empty path") as ei:
            make_drafter(spec, 512)
        _one_line(ei)
    with pytest.raises(StepError, match=r"unknown drafter 'mtpx': expected oracle:ALPHA\[:SEP\], dspark:PATH") as ei:
        make_drafter("mtpx", 512)
    _one_line(ei)
    assert isinstance(make_drafter(f"dspark:{dspark5}", 512), DSparkDrafter)
    assert isinstance(make_drafter(str(dspark5), 512, config=TINY), DSparkDrafter)
    assert isinstance(make_drafter("oracle:0.5", 512), OracleDrafter)


# ------------------------------------------------------------------------------------------------ taps

def test_taps_are_the_mean_over_the_hc_streams(tiny_weights):
    """After layer l the tap is the bf16 mean of the HC streams (a forward spied on layer by layer); the taps do not
    change the logits; a rolled-back row is overwritten when its position is computed again."""
    taps = (1, 3, 5)
    ref = Reference(tiny_weights, max_ctx=64, taps=taps)
    plain = Reference(tiny_weights, max_ctx=64)
    seen: dict[int, list[torch.Tensor]] = {}
    layer = plain._layer

    def spy(i, lw, x, tok, pos, p0):
        out = layer(i, lw, x, tok, pos, p0)
        seen.setdefault(i, []).append(out.clone())
        return out

    plain._layer = spy
    toks = PROMPT + [3, 11]
    for s, e in ((0, 5), (5, 6), (6, 8)):
        assert torch.equal(ref.verify(toks[s:e], s), plain.verify(toks[s:e], s))
    for j, l in enumerate(taps):
        x = torch.cat(seen[l])  # bf16 [8, 4, D]
        assert x.dtype == torch.bfloat16 and x.shape[1] == 4
        want = (x.float().sum(1) / 4).to(torch.bfloat16)
        assert torch.equal(ref.tap_rows[:8, j], want)
        assert torch.equal(ref.main_hidden(2, 8)[:, j * 256:(j + 1) * 256], want[2:])
    assert not torch.equal(ref.tap_rows[:8, 0], ref.tap_rows[:8, 1])
    good = ref.main_hidden(0, 8).clone()
    ref.verify([9, 1, 2], 8)  # three rows at 8..10, then keep one
    ref.rollback(1)
    with pytest.raises(StepError, match="positions 0..9 are not all committed") as ei:
        ref.main_hidden(0, 10)
    _one_line(ei)
    assert torch.equal(ref.main_hidden(0, 8), good)
    ref.verify([4], 9)  # position 9 again with another token: its row is recomputed
    plain.verify([9, 4], 8)
    assert torch.equal(ref.tap_rows[9, 2], (seen[5][-1][1].float().sum(0) / 4).to(torch.bfloat16))
    for bad in ((6,), (2, 2), (True,)):
        with pytest.raises(StepError, match="taps: expected distinct layer ids in 0..5") as ei:
            ref.set_taps(bad)
        _one_line(ei)
    with pytest.raises(StepError, match="records no taps"):
        plain.main_hidden(0, 1)


# ------------------------------------------------------------------------------------------------ the model

@pytest.fixture(scope="module")
def tapped(tiny_weights):
    """A reference with the drafter's taps that ran PROMPT; its main_hidden of the prompt."""
    ref = Reference(tiny_weights, max_ctx=64, taps=TAPS)
    ref.verify(PROMPT[:5], 0)
    ref.verify(PROMPT[5:], 5)
    return ref


def test_block_shapes_determinism_and_non_causal_attention(dspark5, tiny_weights, tapped):
    m = DSparkModel(open_dspark(dspark5), tiny_weights)
    assert m.block_size == 5 and m.window == 16 and m.taps == TAPS
    assert m.extend(0, tapped.main_hidden(0, 6)) == 6 and m.ring_pos == 6
    assert all(bool(m.ring(s)[:6].abs().sum(-1).gt(0).all()) and not bool(m.ring(s)[6:].any()) for s in range(3))
    # 7.1 / 7.2.1 by hand: main_x once, per stage RMSNorm(wkv . main_x), RoPE at the row's own position (theta
    # 10000, no YaRN), FP8 fake-quant of the 128 nope dims; row of position t at slot t
    freqs = P.rope_freqs(64, 10000.0, False, 16.0, 65536, 32.0, 1.0)
    mx = P.rms_norm(P.linear_q(tapped.main_hidden(0, 6), m.main_proj), m.main_norm, 1e-6)
    assert torch.equal(m.main_x(tapped.main_hidden(0, 6)), mx) and mx.shape == (6, 256)
    for s, lw in enumerate(m.weights.layers):
        kv = P.apply_rope(P.rms_norm(P.linear_q(mx, lw.wkv), lw.kv_norm, 1e-6), torch.arange(6), freqs)
        assert torch.equal(m.ring(s)[:6], torch.cat((P.fp8_fake_quant(kv[:, :128], 64), kv[:, 128:]), -1)), s
    base, hx = m.block(300)
    assert base.dtype == torch.float32 and base.shape == (5, 512)
    assert hx.dtype == torch.bfloat16 and hx.shape == (5, 256)
    assert bool(torch.isfinite(base).all()) and not torch.equal(base[0], base[1])
    b2, h2 = m.block(300)
    assert torch.equal(base, b2) and torch.equal(hx, h2)
    saved = [m.ring(s).clone() for s in range(3)]
    for s in range(3):
        m.ring(s)[:6] = 0
    assert not torch.equal(m.block(300)[0], base)  # the ring rows are attended
    for s in range(3):
        m.ring(s).copy_(saved[s])
    causal = m.block(300, causal=True)[0]
    assert not torch.equal(causal, base)
    m.noise_id = 77  # other noise rows: non-causally row 0 sees them, causally it cannot
    other, other_causal = m.block(300)[0], m.block(300, causal=True)[0]
    assert not torch.equal(other[0], base[0]) and torch.equal(other_causal[0], causal[0])
    with pytest.raises(StepError, match="expected the rows of positions from 6 on, found 7") as ei:
        m.extend(7, tapped.main_hidden(0, 1))
    _one_line(ei)
    with pytest.raises(StepError, match="anchor token must be in 0..511"):
        m.block(512)


def test_markov_chain_and_confidence_by_hand(dspark4, tiny_weights, tapped):
    m = DSparkModel(open_dspark(dspark4), tiny_weights)
    m.extend(0, tapped.main_hidden(0, 6))
    t0 = 300
    base, hx = m.block(t0)
    d = m.markov(base, hx, t0)
    assert len(d.tokens) == 4 and d.q is None and d.logits.shape == (4, 512) and d.confidence.shape == (4,)
    prev = t0
    for i in range(4):
        emb = m.markov_w1[prev]
        li = base[i] + emb @ m.markov_w2.T
        torch.testing.assert_close(d.logits[i], li, rtol=1e-5, atol=1e-5)
        conf = m.conf_proj[0] @ torch.cat((hx[i].float(), emb)) + m.conf_bias[0]
        torch.testing.assert_close(d.confidence[i], conf, rtol=1e-4, atol=1e-5)
        prev = int(torch.argmax(li))
        assert d.tokens[i] == prev
    assert not torch.equal(d.logits, base)
    assert d.tokens != [int(t) for t in base.argmax(-1)]  # the Markov bias steers the chain
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    s1, s2 = m.markov(base, hx, t0, 0.9, 50, 0.95, g()), m.markov(base, hx, t0, 0.9, 50, 0.95, g())
    assert s1.tokens == s2.tokens and torch.equal(s1.q, s2.q) and s1.q.shape == (4, 512)
    torch.testing.assert_close(s1.q.sum(-1), torch.ones(4))
    assert all(float(s1.q[i, t]) > 0 for i, t in enumerate(s1.tokens)) and int((s1.q[0] > 0).sum()) <= 50
    assert m.draft(t0).tokens == d.tokens


# ------------------------------------------------------------------------------------------------ the loop

class _Logged(DSparkDrafter):
    """The DSpark drafter, logging per proposal (ring position before, committed positions, rows written), with each
    draft replaced by the target's greedy continuation with probability ``steer`` (0: the drafter's own drafts), so
    verify steps accept several tokens."""

    def __init__(self, path, continuation, steer, seed=0):
        super().__init__(path)
        self.cont, self.steer, self.rng, self.log = continuation, steer, random.Random(seed), []

    def propose(self, context, k):
        before = self.model.ring_pos
        drafts, q = super().propose(context, k)
        self.log.append((before, len(context) - 1, self.last_written))
        at = len(context) - len(LONG)
        return [self.cont[at + i] if self.rng.random() < self.steer else d for i, d in enumerate(drafts)], q


@pytest.fixture(scope="module")
def ar(tiny_weights):
    """Greedy autoregressive decoding of LONG on a reference that records the taps (kept for the ring check)."""
    ref = Reference(tiny_weights, max_ctx=256, taps=TAPS)
    return generate(ref, LONG, N_NEW).tokens, ref


@pytest.mark.parametrize("width,steer", [(3, 0.0), (5, 0.7)])
def test_greedy_speculative_with_dspark_equals_autoregressive(dspark4, tiny_weights, ar, width, steer):
    tokens, ar_ref = ar
    ref = Reference(tiny_weights, max_ctx=256)  # the drafter turns its taps on
    d = _Logged(dspark4, tokens, steer, seed=width)
    res = generate(ref, LONG, N_NEW, draft=d, spec_width=width)
    assert res.tokens == tokens and ref.taps == TAPS
    sp = res.speculative
    assert sp["drafter"] == "dspark:tiny-dspark4.gguf" and sp["tokens"] == N_NEW - 1
    assert len(sp["acceptance_by_depth"]) == width - 1
    # one ring row per committed position: each proposal writes exactly the positions committed since the last one
    first = d.log[0]
    assert first[0] == 0 and first[1] == len(LONG) and first[2] == list(range(len(LONG) - 16, len(LONG)))  # 7.4
    for (b0, n0, _), (b1, n1, w1) in zip(d.log, d.log[1:]):
        assert b1 == n0 and w1 == list(range(n0, n1)) and 1 <= n1 - n0 <= width
    steps = [n1 - n0 for (_, n0, _), (_, n1, _) in zip(d.log, d.log[1:])]
    if steer:
        assert max(steps) == width and sum(s > 1 for s in steps) > 5  # multi-token accepts happened
    n = d.model.ring_pos
    assert d.model.rows_written == 16 + n - len(LONG)
    # the taps of rolled-back rows were recomputed: they are the autoregressive run's, and so are the rings
    assert torch.equal(ref.main_hidden(0, n), ar_ref.main_hidden(0, n))
    fresh = DSparkModel(d.file, tiny_weights)
    fresh.extend(0, ar_ref.main_hidden(0, n))
    for s in range(3):
        assert torch.equal(d.model.ring(s), fresh.ring(s)), s
    assert len(d.confidence) == 4 and all(0 < c < 1 for c in d.confidence)


def test_speculative_sampling_with_dspark_runs_and_is_seeded(dspark4, tiny_weights):
    ref = Reference(tiny_weights, max_ctx=128)
    d = DSparkDrafter(dspark4)
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, spec_width=4, draft=d)
    a, b, c = (generate(ref, PROMPT, 12, seed=s, **kw) for s in (1, 1, 2))
    assert a.tokens == b.tokens and a.tokens != c.tokens and len(a.tokens) == 12
    assert all(0 <= t < 512 for t in a.tokens) and a.speculative["steps"] > 0
    q = d.last_draft.q  # drafts are sampled from the q the loop gets
    assert q is not None and q.shape == (4, 512) and d.temperature == 0.8
    assert all(float(q[i, t]) > 0 for i, t in enumerate(d.last_draft.tokens))
    greedy = generate(ref, PROMPT, 8, draft=d, spec_width=4)  # the next request is greedy again: q None
    assert d.temperature == 0 and d.last_draft.q is None and greedy.tokens == generate(ref, PROMPT, 8).tokens


def test_drafter_errors_are_one_line(dspark4, tiny_weights):
    d = DSparkDrafter(dspark4, target=TINY)
    with pytest.raises(StepError, match="propose before prepare") as ei:
        d.propose(PROMPT, 2)
    _one_line(ei)
    with pytest.raises(StepError, match="only the unsplit reference engine records.*found a object") as ei:
        d.prepare(object(), PROMPT, 4)
    _one_line(ei)
    ref = Reference(tiny_weights, max_ctx=64)
    d.prepare(ref, PROMPT, 4)
    ref.verify(PROMPT[:5], 0)
    ref.verify(PROMPT[5:], 5)
    with pytest.raises(StepError, match=r"drafts 0..4 tokens per step \(block_size\), asked for 5") as ei:
        d.propose(PROMPT + [3], 5)
    _one_line(ei)
    with pytest.raises(StepError, match="the target is at position 6, the context asks for 7") as ei:
        d.propose(PROMPT + [3, 4], 2)
    _one_line(ei)
    drafts, q = d.propose(PROMPT + [3], 2)
    assert len(drafts) == 2 and q is None and d.last_written == list(range(6))
    with pytest.raises(ModelFileError, match="expected window = 32"):
        DSparkDrafter(dspark4, target=TINY.replace(window=32))


# ------------------------------------------------------------------------------------------------ the CLI
def test_cli_make_info_and_generate_with_a_dspark_drafter(tmp_path):
    """``make-model --drafter dspark`` writes the drafter of the (preset, seed) model; ``info`` describes it;
    ``generate --draft FILE`` on the reference gives the plain greedy tokens; a model file given as the drafter
    or the drafter as the model is a one-line error."""
    import json as _json

    from click.testing import CliRunner

    from ds4c.cli import main

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(tmp_path)})

    model, drafter = tmp_path / "t.gguf", tmp_path / "d.gguf"
    assert run("make-model", "--preset", "tiny", "--seed", "3", "-o", model).exit_code == 0
    r = run("make-model", "--preset", "tiny", "--seed", "3", "--drafter", "dspark", "-o", drafter)
    assert r.exit_code == 0 and "DSpark drafter of preset tiny seed 3" in r.output, r.output
    info = run("info", drafter)
    assert info.exit_code == 0 and "DSpark drafter (arch dflash" in info.output and "block size 5" in info.output
    rec = _json.loads(run("info", drafter, "--json").output)
    assert rec["kind"] == "dspark drafter" and rec["stages"] == 3 and rec["taps"] == [3, 4, 5]
    base = ["generate", model, "--prompt-ids", "5,17,301,42", "--max-new-tokens", "20", "--ignore-eos", "--json"]
    plain = _json.loads(run(*base).output.strip().splitlines()[-1])
    r = run(*base, "--draft", drafter, "--spec-width", "4")
    assert r.exit_code == 0, r.output
    spec = _json.loads(r.output.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"].startswith("dspark")
    bad = run(*base, "--draft", model)  # a target model, not a drafter
    assert bad.exit_code == 2 and "expected general.architecture = 'dflash'" in bad.output
    bad = run("generate", drafter, "--prompt-ids", "1,2")  # the drafter as the model
    assert bad.exit_code == 2 and "a DSpark drafter: give it to --draft" in bad.output
    bad = run(*base, "--draft", drafter, "--layer-split", "3,3")
    assert bad.exit_code == 2 and "runs on an unsplit target" in bad.output
