"""ds4c reads the GGUF layout llama.cpp's DeepSeek-V4 converter writes, unchanged.

The files come from ``tests/llama_fixture.py``, which writes them with ``gguf.GGUFWriter`` by its own code path
(names, keys, value types, shapes and storage types as ``conversion/deepseek.py`` + ``conversion/base.py`` of
llama.cpp write them), not with ds4c's writer. These tests check that ds4c opens such a file, reads every
tensor and the tokenizer as written, and generates from it (API and CLI); the ``--mtp`` file is only checked
to be written as the converter writes it.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from llama_fixture import (ARCH, BOS, EOS, ROLE_TOKENS, THINK_TOKENS, TT_CONTROL, TT_NORMAL, TT_UNUSED,
                           TT_USER_DEFINED, write_llama_layout_model)

N_LAYERS = 6
RATIOS = (0, 0, 4, 128, 4, 128)
N_HASH = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_llama_layout_model(tmp_path_factory.mktemp("llama_layout") / "dsv4-llama-layout.gguf", seed=0)


@pytest.fixture(scope="module")
def written_mtp(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_llama_layout_model(tmp_path_factory.mktemp("llama_layout_mtp") / "mtp-dsv4.gguf", seed=0,
                                    mtp=True)


@pytest.fixture(scope="module")
def mf(written):
    from ds4c.sources import open_model

    return open_model(written["path"])


@pytest.fixture(scope="module")
def reader(written) -> GGUFReader:
    return GGUFReader(written["path"])


@pytest.fixture(scope="module")
def model(written):
    import ds4c

    return ds4c.Model(written["path"])


def _field(r: GGUFReader, key: str):
    f = r.fields[key]
    return f, f.contents()


# --------------------------------------------------------------------------------------------------
# the fixture itself: what llama.cpp's converter writes and its loader asks for

def _loader_shapes(hp: dict, bid: int, ratio: int) -> dict[str, list[int]]:
    """ggml shapes llama.cpp's loader creates (src/models/deepseek4.cpp load_arch_tensors, l. 100-186)."""
    d, nh, hd = hp["hidden_size"], hp["num_attention_heads"], hp["head_dim"]
    ql, ol, og = hp["q_lora_rank"], hp["o_lora_rank"], hp["o_groups"]
    ne, nu, fe, hc = hp["n_routed_experts"], hp["num_experts_per_tok"], hp["moe_intermediate_size"], hp["hc_mult"]
    ihd, inh, V = hp["index_head_dim"], hp["index_n_heads"], hp["vocab_size"]
    mix, b = (2 + hc) * hc, f"blk.{bid}."
    s = {
        b + "attn_norm.weight": [d], b + "attn_sinks.weight": [nh], b + "attn_q_a.weight": [d, ql],
        b + "attn_q_a_norm.weight": [ql], b + "attn_q_b.weight": [ql, nh * hd], b + "attn_kv.weight": [d, hd],
        b + "attn_kv_a_norm.weight": [hd],
        b + "attn_output_a.weight": [nh * hd // og, ol * og],  # loader views it as {.., o_lora_rank, o_groups}
        b + "attn_output_b.weight": [og * ol, d],
        b + "hc_attn_fn.weight": [hc * d, mix], b + "hc_attn_base.weight": [mix], b + "hc_attn_scale.weight": [3],
        b + "hc_ffn_fn.weight": [hc * d, mix], b + "hc_ffn_base.weight": [mix], b + "hc_ffn_scale.weight": [3],
        b + "ffn_gate_inp.weight": [d, ne], b + "ffn_norm.weight": [d],
        b + "ffn_gate_exps.weight": [d, fe, ne], b + "ffn_down_exps.weight": [fe, d, ne],
        b + "ffn_up_exps.weight": [d, fe, ne],
        b + "ffn_gate_shexp.weight": [d, fe], b + "ffn_down_shexp.weight": [fe, d], b + "ffn_up_shexp.weight": [d, fe],
    }
    if bid < hp["num_hash_layers"]:
        s[b + "ffn_gate_tid2eid.weight"] = [nu, V]
    else:
        s[b + "exp_probs_b.bias"] = [ne]
    if ratio:
        coff = 2 if ratio == 4 else 1
        s.update({b + "attn_compressor_kv.weight": [d, coff * hd], b + "attn_compressor_gate.weight": [d, coff * hd],
                  b + "attn_compressor_ape.weight": [coff * hd, ratio], b + "attn_compressor_norm.weight": [hd]})
        if ratio == 4:
            s.update({b + "indexer.proj.weight": [d, inh], b + "indexer.attn_q_b.weight": [ql, inh * ihd],
                      b + "indexer_compressor_kv.weight": [d, 2 * ihd],
                      b + "indexer_compressor_gate.weight": [d, 2 * ihd],
                      b + "indexer_compressor_ape.weight": [2 * ihd, ratio],
                      b + "indexer_compressor_norm.weight": [ihd]})
    return s


def _root_shapes(hp: dict) -> dict[str, list[int]]:
    d, hc, V = hp["hidden_size"], hp["hc_mult"], hp["vocab_size"]
    return {"token_embd.weight": [d, V], "output_norm.weight": [d], "output.weight": [d, V],
            "output_hc_fn.weight": [hc * d, hc], "output_hc_base.weight": [hc], "output_hc_scale.weight": [1]}


def _expected_type(name: str, n_dims: int) -> Q:
    """The converter's storage type rule (deepseek.py tensor_force_quant l. 894-906, generate_extra_tensors)."""
    if n_dims == 1 or re.search(r"(hc_(attn|ffn)_fn|output_hc_fn|_ape)\.weight$", name):
        return Q.F32
    if name.endswith("_exps.weight"):
        return Q.MXFP4
    if name.endswith("tid2eid.weight"):
        return Q.I32
    if re.search(r"(token_embd|output|compressor_kv|compressor_gate|ffn_gate_inp|indexer\.proj)\.weight$", name):
        return Q.BF16
    return Q.Q8_0   # attn_q_a/q_b/kv/output_a/output_b, indexer.attn_q_b, *_shexp, nextn.eh_proj


def test_fixture_matches_llama_loader_shapes_and_types(written, reader):
    hp = written["hparams"]
    want = _root_shapes(hp)
    for bid in range(N_LAYERS):
        want.update(_loader_shapes(hp, bid, RATIOS[bid]))
    got = {t.name: t for t in reader.tensors}
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert [int(x) for x in t.shape] == want[name], name
        assert Q(int(t.tensor_type)) == _expected_type(name, len(want[name])), name
    assert not any("exp_probs_b_vl" in n for n in got)   # the text checkpoint has no bias_vl


def test_fixture_metadata_value_types(written, reader):
    u32 = ["block_count", "context_length", "embedding_length", "embedding_length_out", "attention.head_count",
           "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
           "attention.q_lora_rank", "attention.sliding_window", "attention.output_group_count",
           "attention.output_lora_rank", "attention.indexer.head_count", "attention.indexer.key_length",
           "attention.indexer.top_k", "expert_count", "expert_used_count", "expert_shared_count",
           "expert_feed_forward_length", "expert_gating_func", "hash_layer_count", "hyper_connection.count",
           "hyper_connection.sinkhorn_iterations", "rope.scaling.original_context_length"]
    f32 = ["attention.layer_norm_rms_epsilon", "attention.compress_rope_freq_base", "rope.freq_base",
           "rope.scaling.factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
           "expert_weights_scale", "hyper_connection.epsilon"]
    for k in u32:
        assert reader.fields[f"{ARCH}.{k}"].types == [GGUFValueType.UINT32], k
    for k in f32:
        assert reader.fields[f"{ARCH}.{k}"].types == [GGUFValueType.FLOAT32], k
    assert reader.fields[f"{ARCH}.expert_weights_norm"].types == [GGUFValueType.BOOL]
    assert reader.fields[f"{ARCH}.rope.scaling.type"].contents() == "yarn"
    f, v = _field(reader, f"{ARCH}.attention.compress_ratios")
    assert f.types == [GGUFValueType.ARRAY, GGUFValueType.INT32] and v == [0, 0, 4, 128, 4, 128, 0]
    f, v = _field(reader, f"{ARCH}.swiglu_clamp_exp")
    assert f.types == [GGUFValueType.ARRAY, GGUFValueType.FLOAT32] and v == [10.0] * N_LAYERS
    assert reader.fields[f"{ARCH}.expert_gating_func"].contents() == 4
    assert reader.fields["general.file_type"].contents() == 38
    assert f"{ARCH}.vocab_size" not in reader.fields
    assert f"{ARCH}.nextn_predict_layers" not in reader.fields
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "deepseek-v3"


# --------------------------------------------------------------------------------------------------
# ds4c opens it unchanged

def test_ds4c_config_equals_written_hparams(written, mf):
    hp, cfg = written["hparams"], mf.config
    assert mf.file_type == "MOSTLY_MXFP4_MOE"
    assert mf.legacy_names == []
    assert mf.extra_tensors == []
    assert mf.nextn_blocks == [] and not mf.mtp_only
    assert cfg.vocab_size == written["vocab_size"] == int(mf.raw("token_embd.weight").shape[0])
    assert len(written["tokens"]) == cfg.vocab_size
    expect = {
        "hidden_size": hp["hidden_size"], "n_layers": hp["num_hidden_layers"], "n_heads": hp["num_attention_heads"],
        "head_dim": hp["head_dim"], "rope_dim": hp["qk_rope_head_dim"], "q_lora_rank": hp["q_lora_rank"],
        "o_lora_rank": hp["o_lora_rank"], "o_groups": hp["o_groups"], "window": hp["sliding_window"],
        "moe_inter": hp["moe_intermediate_size"], "n_experts": hp["n_routed_experts"],
        "n_shared_experts": hp["n_shared_experts"], "n_active_experts": hp["num_experts_per_tok"],
        "n_hash_layers": hp["num_hash_layers"], "route_scale": hp["routed_scaling_factor"],
        "swiglu_limit": hp["swiglu_limit"], "norm_eps": hp["rms_norm_eps"], "hc_mult": hp["hc_mult"],
        "hc_sinkhorn_iters": hp["hc_sinkhorn_iters"], "hc_eps": hp["hc_eps"], "index_n_heads": hp["index_n_heads"],
        "index_head_dim": hp["index_head_dim"], "index_topk": hp["index_topk"], "rope_theta": hp["rope_theta"],
        "compress_rope_theta": hp["compress_rope_theta"], "rope_factor": hp["rope_scaling"]["factor"],
        "original_seq_len": hp["rope_scaling"]["original_max_position_embeddings"],
        "beta_fast": hp["rope_scaling"]["beta_fast"], "beta_slow": hp["rope_scaling"]["beta_slow"],
        "max_position": hp["max_position_embeddings"], "bos_id": 0, "eos_id": 1,
    }
    got = {k: getattr(cfg, k) for k in expect}
    assert got == pytest.approx(expect, rel=1e-6)
    assert tuple(cfg.compress_ratios[:N_LAYERS]) == RATIOS
    assert [cfg.layer_kind(i) for i in range(N_LAYERS)] == ["swa", "swa", "csa", "hca", "csa", "hca"]


SAMPLES = {
    Q.BF16: ["token_embd.weight", "output.weight", "blk.3.attn_compressor_kv.weight",
             "blk.2.indexer_compressor_gate.weight", "blk.2.indexer.proj.weight", "blk.0.ffn_gate_inp.weight"],
    Q.F32: ["blk.0.hc_attn_fn.weight", "blk.5.hc_ffn_base.weight", "blk.1.hc_attn_scale.weight",
            "output_hc_fn.weight", "output_hc_scale.weight", "blk.2.attn_compressor_ape.weight",
            "blk.4.indexer_compressor_ape.weight", "blk.0.attn_sinks.weight", "blk.3.exp_probs_b.bias",
            "blk.0.attn_norm.weight", "output_norm.weight"],
    Q.Q8_0: ["blk.1.attn_q_a.weight", "blk.2.attn_q_b.weight", "blk.3.attn_kv.weight",
             "blk.4.attn_output_a.weight", "blk.5.attn_output_b.weight", "blk.2.indexer.attn_q_b.weight",
             "blk.0.ffn_down_shexp.weight"],
    Q.MXFP4: ["blk.0.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight", "blk.5.ffn_up_exps.weight"],
    Q.I32: ["blk.0.ffn_gate_tid2eid.weight", "blk.2.ffn_gate_tid2eid.weight"],
}


@pytest.mark.parametrize("qtype", list(SAMPLES), ids=lambda q: q.name)
def test_ds4c_tensors_equal_written_data(written, mf, reader, qtype):
    in_file = {t.name: t for t in reader.tensors}
    for name in SAMPLES[qtype]:
        src, stored = written["tensors"][name], written["stored"][name]
        t = in_file[name]
        assert Q(int(t.tensor_type)) == qtype == written["qtypes"][name] == mf.ggml_type(name), name
        raw = np.asarray(t.data)
        assert np.array_equal(raw.reshape(-1).view(np.uint8), stored.reshape(-1).view(np.uint8)), name
        got = mf.tensor(name)
        assert tuple(got.shape) == src.shape, name
        if qtype == Q.I32:
            assert got.dtype == torch.int64
            assert np.array_equal(got.numpy(), src.astype(np.int64)), name
            assert int(got.min()) >= 0 and int(got.max()) < mf.config.n_experts
            # each token's experts are distinct, as the checkpoint's table
            assert all(len(set(row)) == row.size for row in got.numpy()[:64])
            continue
        ref = raw.astype(np.float32) if qtype == Q.F32 else dequantize(raw, qtype).astype(np.float32)
        ref = ref.reshape(src.shape)
        assert np.array_equal(got.numpy().view(np.uint32), ref.view(np.uint32)), f"{name}: not bitwise"
        if qtype == Q.Q8_0:
            # within half a quantization step d = amax/127 of the float source per 32-block, plus the fp16
            # rounding of d (relative 2^-11, times |q| <= 127)
            blocks = src.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127.0
            err = np.abs(got.numpy().reshape(-1, 32) - blocks)
            assert np.all(err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-8), name
            assert np.all(err <= 0.6 * step + 1e-8), name   # in practice: about half a step
            assert err.max() > 0   # Q8_0 of random normals is lossy: the comparison above did compare something
        else:
            # F32 is stored as is; BF16 sources are bf16-exact; FP4 sources are on the e2m1 grid (exact repack)
            np.testing.assert_array_equal(got.numpy(), src, err_msg=name)


def test_ds4c_expert_slices(written, mf):
    name = "blk.4.ffn_gate_exps.weight"
    src = written["tensors"][name]
    for e in (0, 7, 15):
        np.testing.assert_array_equal(mf.expert(name, e).numpy(), src[e])


def test_ds4c_reads_every_tensor_it_needs(written, mf):
    assert set(mf.specs) == set(written["tensors"])
    for name, spec in mf.specs.items():
        assert tuple(spec.shape) == written["tensors"][name].shape, name


def test_ds4c_opens_vision_bias_file(tmp_path):
    from ds4c.sources import open_model

    w = write_llama_layout_model(tmp_path / "vl.gguf", seed=1, vision_bias=True)
    vl = [n for n in w["tensors"] if "exp_probs_b_vl" in n]
    assert vl == [f"blk.{b}.exp_probs_b_vl.bias" for b in range(N_HASH)]
    m = open_model(w["path"])
    assert sorted(m.extra_tensors) == sorted(vl)
    assert m.config.n_layers == N_LAYERS


# --------------------------------------------------------------------------------------------------
# the tokenizer

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello world! 12345 678",
         "def add(a, b):\n    return a + b\n", "深度求索 こんにちは", "Café “naïve” €100 ±3",
         "unseen wordz xyzzy\t\ttabs  and  spaces\n\n", "{\"ok\": true}"]


def test_tokenizer_from_metadata(written, mf):
    from ds4c.tokenizer import Tokenizer, TokenType

    tk = Tokenizer.from_metadata(mf.metadata, source=str(mf.path))
    hf = written["tokenizer"]
    assert tk.vocab_size == len(tk) == written["vocab_size"]
    assert tk.model == "gpt2" and tk.pre == "deepseek-v3"
    assert tk.bos_id == hf.token_to_id(BOS) == 0 and tk.eos_id == hf.token_to_id(EOS) == 1
    assert tk.add_bos is True and tk.add_eos is False
    assert tk.chat_template == written["chat_template"]
    for s in TEXTS:
        ids = tk.encode(s, add_bos=False)
        assert ids == hf.encode(s, add_special_tokens=False).ids, s
        assert tk.decode(ids) == s
    assert tk.encode("hi", add_bos=True)[0] == 0
    for t in [BOS, EOS, *ROLE_TOKENS]:
        i = hf.token_to_id(t)
        assert tk.token_to_id(t) == i and tk.token_type(i) == TokenType.CONTROL == TT_CONTROL, t
        assert tk.encode(f"a{t}b", add_bos=False) == hf.encode(f"a{t}b", add_special_tokens=False).ids
        assert i in tk.encode(f"x {t} y", add_bos=False)
        assert i in tk.special_ids
        assert tk.decode([i]) == t and tk.decode([i], skip_special=True) == ""
    for t in THINK_TOKENS:
        i = hf.token_to_id(t)
        assert tk.token_type(i) == TokenType.USER_DEFINED == TT_USER_DEFINED
        assert tk.encode(f"{t}ok", add_bos=False)[0] == i
    # the [PAD{i}] filler up to the config's vocab_size (get_vocab_base)
    n_real = hf.get_vocab_size(with_added_tokens=True)
    assert n_real < tk.vocab_size
    for i in range(n_real, tk.vocab_size):
        assert tk.id_to_token(i) == f"[PAD{i}]" and tk.token_type(i) == TokenType.UNUSED == TT_UNUSED
    assert tk.token_type(300) == TokenType.NORMAL == TT_NORMAL
    # control tokens written as text are plain text when parse_special is off
    assert hf.token_to_id(ROLE_TOKENS[0]) not in tk.encode(ROLE_TOKENS[0], add_bos=False, parse_special=False)


def test_tokenizer_training_is_deterministic(written):
    from llama_fixture import train_tokenizer, vocab_entries

    again = vocab_entries(train_tokenizer(), written["vocab_size"])
    assert again == (written["tokens"], written["token_types"], written["merges"])


# --------------------------------------------------------------------------------------------------
# generation

def test_generate_greedy_deterministic(model, written):
    a = model.generate("The quick brown fox", max_new_tokens=8, ignore_eos=True)
    b = model.generate("The quick brown fox", max_new_tokens=8, ignore_eos=True)
    assert len(a.ids) == 8 and a.stop_reason == "length"
    assert all(0 <= i < written["vocab_size"] for i in a.ids)
    assert a.ids == b.ids and a.text == b.text
    assert isinstance(a.text, str) and a.text == model.tokenizer.decode(a.ids)
    assert a.prompt_ids == [0] + written["tokenizer"].encode("The quick brown fox", add_special_tokens=False).ids
    logits_differ = model.generate("Numbers: 0 1 2 3", max_new_tokens=8, ignore_eos=True)
    assert len(logits_differ.ids) == 8


def test_chat_renders_file_template(model, written):
    hf = written["tokenizer"]
    msgs = [{"role": "user", "content": "hi"}]
    text = model.apply_chat_template(msgs)
    assert text == f"{BOS}<｜User｜>hi<｜Assistant｜></think>"
    assert model.apply_chat_template(msgs, thinking=True).endswith("<｜Assistant｜><think>")
    sys_text = model.apply_chat_template([{"role": "system", "content": "Be brief."}, *msgs])
    assert sys_text == f"{BOS}Be brief.<｜User｜>hi<｜Assistant｜></think>"
    c = model.chat(msgs, max_new_tokens=4, ignore_eos=True)
    assert c.prompt_ids == hf.encode(text, add_special_tokens=False).ids
    assert c.prompt_ids[:2] == [0, hf.token_to_id("<｜User｜>")] and c.prompt_ids.count(0) == 1
    assert c.prompt_ids[-2:] == [hf.token_to_id("<｜Assistant｜>"), hf.token_to_id("</think>")]
    assert len(c.ids) == 4 and isinstance(c.text, str)


def test_cli_info_and_generate(written):
    from ds4c.cli import main

    path = str(written["path"])
    r = CliRunner().invoke(main, ["info", path])
    assert r.exit_code == 0, r.output
    assert "MOSTLY_MXFP4_MOE" in r.output
    assert re.search(r"tokenizer: gpt2 \(pre deepseek-v3\), %d tokens" % written["vocab_size"], r.output), r.output
    assert "chat template present" in r.output
    r = CliRunner().invoke(main, ["generate", path, "--prompt", "Hello world", "--max-new-tokens", "4",
                                  "--ignore-eos", "--json"])
    assert r.exit_code == 0, r.output
    import json

    rec = json.loads(r.output.strip().splitlines()[-1])
    assert len(rec["tokens"]) == 4 and rec["stop_reason"] == "length", rec
    assert rec["prompt"] == [0] + written["tokenizer"].encode("Hello world", add_special_tokens=False).ids


# --------------------------------------------------------------------------------------------------
# the --mtp export (only that it is written as the converter writes it)

def test_mtp_file_layout(written_mtp):
    r = GGUFReader(written_mtp["path"])
    hp = written_mtp["hparams"]
    n_mtp = hp["num_nextn_predict_layers"]
    assert r.fields[f"{ARCH}.block_count"].contents() == N_LAYERS + n_mtp
    assert r.fields[f"{ARCH}.nextn_predict_layers"].contents() == n_mtp
    assert r.fields[f"{ARCH}.nextn_predict_layers"].types == [GGUFValueType.UINT32]
    ratios = r.fields[f"{ARCH}.attention.compress_ratios"].contents()
    assert len(ratios) >= N_LAYERS + n_mtp and ratios[N_LAYERS] == 0
    assert r.fields[f"{ARCH}.swiglu_clamp_exp"].contents() == [10.0] * (N_LAYERS + n_mtp)
    assert r.fields["general.file_type"].contents() == 38
    got = {t.name: t for t in r.tensors}
    bid = N_LAYERS
    want = _root_shapes(hp)
    want.update(_loader_shapes(hp, bid, 0))
    d = hp["hidden_size"]
    want.update({f"blk.{bid}.nextn.eh_proj.weight": [2 * d, d], f"blk.{bid}.nextn.enorm.weight": [d],
                 f"blk.{bid}.nextn.hnorm.weight": [d], f"blk.{bid}.nextn.shared_head_norm.weight": [d]})
    assert sorted(got) == sorted(want)
    assert not any(n.startswith(tuple(f"blk.{i}." for i in range(N_LAYERS))) for n in got)
    for name, t in got.items():
        assert [int(x) for x in t.shape] == want[name], name
        assert Q(int(t.tensor_type)) == _expected_type(name, len(want[name])), name
    assert Q(int(got[f"blk.{bid}.nextn.eh_proj.weight"].tensor_type)) == Q.Q8_0
    assert f"blk.{bid}.exp_probs_b.bias" in got and f"blk.{bid}.ffn_gate_tid2eid.weight" not in got


def test_ds4c_reads_the_mtp_export(written_mtp):
    """ds4c on the converter's --mtp export: refused as a model in one line, opened as a draft with the MTP
    block's tensors read exactly, named by ``ds4c info``."""
    from click.testing import CliRunner

    from ds4c.cli import main
    from ds4c.errors import ModelFileError
    from ds4c.sources import open_model

    path = written_mtp["path"]
    with pytest.raises(ModelFileError, match=r"MTP-only GGUF .*blk\.6") as ei:
        open_model(path)
    assert "\n" not in str(ei.value)
    mf = open_model(path, allow_mtp_only=True)
    assert mf.mtp_only and mf.nextn_blocks == [N_LAYERS] and mf.config.n_layers == N_LAYERS
    assert mf.extra_tensors == []
    r = GGUFReader(path)
    names = {t.name for t in r.tensors}
    assert set(mf.mtp_specs) | set(mf.specs) == names
    eh = next(t for t in r.tensors if t.name == "blk.6.nextn.eh_proj.weight")
    want = dequantize(np.asarray(eh.data), Q.Q8_0).reshape(mf.mtp_specs[eh.name].shape)
    assert np.array_equal(mf.tensor(eh.name).numpy(), want)
    out = CliRunner().invoke(main, ["info", str(path)])
    assert out.exit_code == 0, out.output
    assert "MTP-only file" in out.output and "eh_proj Q8_0" in out.output and "shared_head_norm F32" in out.output


# --------------------------------------------------------------------------------------------------
# a config.json saved by transformers 5.x: no raw rope_scaling, so no rope.scaling.* keys (issue 28.2)

@pytest.fixture(scope="module")
def written_no_scaling(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return write_llama_layout_model(tmp_path_factory.mktemp("llama_layout_hf5") / "dsv4-hf5.gguf", seed=0,
                                    rope_scaling=False)


def test_file_without_rope_scaling_keys_runs_without_yarn(written_no_scaling, written, mf, capfd):
    """llama.cpp's loader reads the rope.scaling.* keys as optional (no factor: freq_scale 1, no YaRN); ds4c
    opens such a file the same way, says so once on stderr and in ``ds4c info``, and generates from it."""
    import ds4c
    from ds4c.cli import main
    from ds4c.sources import open_model
    from ds4c.reference.primitives import rope_freqs

    path = written_no_scaling["path"]
    assert not [k for k in GGUFReader(path).fields if k.startswith(f"{ARCH}.rope.scaling.")]
    capfd.readouterr()
    f = open_model(path)
    cfg, hp = f.config, written_no_scaling["hparams"]
    assert not cfg.yarn and cfg.rope_factor == 1.0 and cfg.original_seq_len == hp["max_position_embeddings"]
    assert f.absent_keys == {f"{ARCH}.rope.scaling.factor": 1.0,
                             f"{ARCH}.rope.scaling.original_context_length": hp["max_position_embeddings"],
                             f"{ARCH}.rope.scaling.yarn_beta_fast": 32.0, f"{ARCH}.rope.scaling.yarn_beta_slow": 1.0}
    # everything else reads as from the file with the keys
    assert cfg.replace(rope_factor=mf.config.rope_factor, original_seq_len=mf.config.original_seq_len) == mf.config
    assert mf.absent_keys == {} and mf.config.yarn
    err = capfd.readouterr().err
    assert err.count("ds4c: note:") == 1 and f"no {ARCH}.rope.scaling.factor" in err and "RoPE scaling: none" in err
    open_model(path)
    assert "note" not in capfd.readouterr().err  # once per file and process
    # the compressing layers rotate with the plain frequencies of their base, as llama.cpp's ext_factor 0 does
    m = ds4c.Model(f)
    d = cfg.rope_dim
    plain = 1.0 / (cfg.compress_rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert torch.equal(m.stepper._freqs[True].cpu(), plain)
    assert not torch.equal(rope_freqs(d, cfg.compress_rope_theta, True, 16.0, 65536, 32.0, 1.0), plain)
    c = m.generate("Hello world", max_new_tokens=3, ignore_eos=True)
    assert len(c.ids) == 3 and c.stop_reason == "length"
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 0, r.output
    assert "rope scaling: none" in r.output and f"metadata: no {ARCH}.rope.scaling.factor" in r.output, r.output
    r = CliRunner().invoke(main, ["info", str(written["path"])])
    assert "rope scaling: YaRN on the compressing layers (factor 16" in r.output and "metadata:" not in r.output
