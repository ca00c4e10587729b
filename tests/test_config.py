"""Tests of ds4c.config: presets against spec ds4-flash.md section 1, layer taxonomy (1.3), YaRN / RoPE
tables (P6), the GGUF metadata mapping (gguf-deepseek4.md), the config hash and validation errors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from ds4c.config import (
    ARCH,
    GATING_SQRT_SOFTPLUS,
    PRESETS,
    Ds4Config,
    absent_optional_keys,
    from_gguf_metadata,
    preset,
    to_gguf_metadata,
    yarn_ramp_bounds,
)
from ds4c.errors import ConfigError
from ds4c.sources import open_model
from ds4c.reference.primitives import rope_freqs

FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4,)


# ------------------------------------------------------------------------------------------------ presets

def test_flash_preset_matches_spec_section_1_1():
    c = preset("flash")
    expected = dict(
        vocab_size=129280, hidden_size=4096, n_layers=43, n_heads=64, head_dim=512, rope_dim=64,
        q_lora_rank=1024, o_lora_rank=1024, o_groups=8, window=128, moe_inter=2048, n_experts=256,
        n_shared_experts=1, n_active_experts=6, n_hash_layers=3, route_scale=1.5, swiglu_limit=10.0,
        norm_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, index_n_heads=64, index_head_dim=128,
        index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
        original_seq_len=65536, beta_fast=32.0, beta_slow=1.0, max_position=1048576, bos_id=0, eos_id=1,
    )
    for k, v in expected.items():
        assert getattr(c, k) == v, k
    assert c.compress_ratios == FLASH_RATIOS
    assert len(c.compress_ratios) == 43
    assert c.max_position == c.original_seq_len * c.rope_factor
    assert (c.nope_dim, c.hc_dim, c.n_mix, c.heads_per_group) == (448, 16384, 24, 8)
    assert c.quant_emulation is True


def test_flash_layer_taxonomy_section_1_3():
    c = preset("flash")
    kinds = [c.layer_kind(i) for i in range(c.n_layers)]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 43, 2))
    assert [i for i, k in enumerate(kinds) if k == "hca"] == list(range(3, 42, 2))
    assert [i for i in range(43) if c.is_hash_layer(i)] == [0, 1, 2]
    assert c.rope_base(0) == 10000.0 and not c.uses_yarn(1)
    assert c.rope_base(2) == 160000.0 and c.uses_yarn(2) and c.uses_yarn(3)
    assert c.ratio(3) == 128 and c.ratio(42) == 4


def test_flash_l4_layer_kinds():
    c = preset("flash-l4")
    assert c.n_layers == 4 and c.name == "flash-l4"
    got = [(c.layer_kind(i), c.is_hash_layer(i)) for i in range(4)]
    assert got == [("swa", True), ("csa", True), ("hca", False), ("csa", False)]
    # official widths
    flash = preset("flash")
    for f in ("hidden_size", "n_heads", "head_dim", "n_experts", "moe_inter", "index_topk", "vocab_size"):
        assert getattr(c, f) == getattr(flash, f), f


def test_tiny_has_every_kind_and_both_routers():
    c = preset("tiny")
    assert c.n_layers == 6 and c.name == "tiny"
    kinds = [c.layer_kind(i) for i in range(6)]
    assert kinds == ["swa", "swa", "csa", "hca", "csa", "hca"]
    routers = ["hash" if c.is_hash_layer(i) else "scored" for i in range(6)]
    assert routers == ["hash", "hash", "hash", "scored", "scored", "scored"]
    pairs = set(zip(kinds, routers))
    assert {("swa", "hash"), ("csa", "hash"), ("csa", "scored"), ("hca", "scored")} <= pairs
    assert c.vocab_size == 512


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'.*flash.*tiny"):
        preset("huge")


def test_presets_are_fresh_equal_objects():
    assert set(PRESETS) == {"flash", "flash-l4", "tiny", "tiny-128"}
    for name in PRESETS:
        assert preset(name) == preset(name)
        assert preset(name).hash() == preset(name).hash()


# ------------------------------------------------------------------------------------------------ YaRN / RoPE

def test_yarn_ramp_bounds_flash():
    assert yarn_ramp_bounds(preset("flash")) == (15, 25)
    # a different original length moves the ramp (the function reads the config, not constants)
    lo, hi = yarn_ramp_bounds(preset("flash").replace(original_seq_len=4096))
    assert (lo, hi) != (15, 25) and 0 <= lo < hi <= 63


def _freqs(cfg: Ds4Config, layer: int) -> torch.Tensor:
    return rope_freqs(cfg.rope_dim, cfg.rope_base(layer), cfg.uses_yarn(layer), cfg.rope_factor,
                      cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)


@pytest.mark.parametrize("layer", [2, 3])  # CSA and HCA
def test_rope_freqs_compressing_layers_spec_p6(layer):
    c = preset("flash")
    f = _freqs(c, layer)
    assert f.dtype == torch.float32 and f.shape == (32,)
    assert f[0].item() == 1.0
    assert f[1].item() == pytest.approx(0.68766, rel=1e-5)
    assert f[31].item() == pytest.approx(5.68e-7, rel=2e-3)
    # full table in float64: i <= 15 unchanged, i >= 25 divided by 16, linear blend between
    for i in range(32):
        plain = 160000.0 ** (-2 * i / 64)
        ramp = min(max((i - 15) / 10, 0.0), 1.0)
        want = plain * ramp / 16 + plain * (1 - ramp)
        assert f[i].item() == pytest.approx(want, rel=1e-5), i
    assert f[15].item() == pytest.approx(160000.0 ** (-30 / 64), rel=1e-6)
    assert f[25].item() == pytest.approx(160000.0 ** (-50 / 64) / 16, rel=1e-6)


@pytest.mark.parametrize("layer", [0, 1])
def test_rope_freqs_swa_layers_plain_base_10000(layer):
    f = _freqs(preset("flash"), layer)
    want = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    assert f[0].item() == 1.0
    assert f[1].item() == pytest.approx(0.749894, rel=1e-5)
    torch.testing.assert_close(f.double(), want, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------------ GGUF metadata

def _as_stored(entries: list[tuple[str, object, str]]) -> dict[str, object]:
    """Metadata dict as a GGUF file gives it back: f32 values (and arrays) rounded to float32."""
    out = {}
    for key, val, kind in entries:
        if kind == "f32":
            val = float(np.float32(val))
        elif kind == "arr_f32":
            val = [float(np.float32(v)) for v in val]
        out[key] = val
    return out


@pytest.mark.parametrize("name", ["flash", "flash-l4", "tiny"])
def test_metadata_round_trip_in_memory(name):
    c = preset(name)
    entries = to_gguf_metadata(c)
    keys = [k for k, _, _ in entries]
    assert len(keys) == len(set(keys))
    meta = dict((k, v) for k, v, _ in entries)
    assert meta["general.architecture"] == ARCH
    assert meta["deepseek4.expert_gating_func"] == GATING_SQRT_SOFTPLUS
    assert meta["deepseek4.attention.compress_ratios"] == list(c.compress_ratios)
    assert meta["deepseek4.block_count"] == c.n_layers
    assert meta["deepseek4.attention.head_count_kv"] == 1
    assert meta["deepseek4.swiglu_clamp_exp"] == [10.0] * c.n_layers
    back = from_gguf_metadata(meta, vocab_size=c.vocab_size)
    assert back == c
    assert back.hash() == c.hash()
    # as a file stores it (f32 values rounded to float32): still the same config and hash
    back32 = from_gguf_metadata(_as_stored(entries), vocab_size=c.vocab_size)
    assert back32 == c
    assert back32.hash() == c.hash()


def test_metadata_flash_values_match_gguf_spec_table():
    meta = {k: v for k, v, _ in to_gguf_metadata(preset("flash"))}
    want = {
        "deepseek4.block_count": 43, "deepseek4.context_length": 1048576, "deepseek4.embedding_length": 4096,
        "deepseek4.embedding_length_out": 16384, "deepseek4.attention.head_count": 64,
        "deepseek4.attention.key_length": 512, "deepseek4.attention.value_length": 512,
        "deepseek4.attention.q_lora_rank": 1024, "deepseek4.attention.output_lora_rank": 1024,
        "deepseek4.attention.output_group_count": 8, "deepseek4.attention.compress_rope_freq_base": 160000.0,
        "deepseek4.attention.sliding_window": 128, "deepseek4.attention.indexer.head_count": 64,
        "deepseek4.attention.indexer.key_length": 128, "deepseek4.attention.indexer.top_k": 512,
        "deepseek4.rope.dimension_count": 64, "deepseek4.rope.freq_base": 10000.0,
        "deepseek4.rope.scaling.type": "yarn", "deepseek4.rope.scaling.factor": 16.0,
        "deepseek4.rope.scaling.original_context_length": 65536, "deepseek4.rope.scaling.yarn_beta_fast": 32.0,
        "deepseek4.rope.scaling.yarn_beta_slow": 1.0, "deepseek4.expert_count": 256,
        "deepseek4.expert_used_count": 6, "deepseek4.expert_shared_count": 1,
        "deepseek4.expert_feed_forward_length": 2048, "deepseek4.expert_weights_scale": 1.5,
        "deepseek4.expert_weights_norm": True, "deepseek4.hash_layer_count": 3,
        "deepseek4.hyper_connection.count": 4, "deepseek4.hyper_connection.sinkhorn_iterations": 20,
        "deepseek4.hyper_connection.epsilon": 1e-6, "deepseek4.attention.layer_norm_rms_epsilon": 1e-6,
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1,
    }
    for k, v in want.items():
        assert meta[k] == v, k
    assert "deepseek4.vocab_size" not in meta  # llama.cpp's converter writes none: it comes from token_embd


def test_vocab_size_from_the_legacy_key_the_embedding_or_the_tokens():
    m = _meta()
    assert from_gguf_metadata(m, vocab_size=512).vocab_size == 512
    assert from_gguf_metadata({**m, "tokenizer.ggml.tokens": ["a"] * 512}).vocab_size == 512
    assert from_gguf_metadata({**m, "deepseek4.vocab_size": 512}).vocab_size == 512  # ds4c 0.1 files
    with pytest.raises(ConfigError, match="vocab_size is 512 but token_embd.weight has 1024 rows"):
        from_gguf_metadata({**m, "deepseek4.vocab_size": 512}, vocab_size=1024)
    with pytest.raises(ConfigError, match="cannot tell the vocabulary size"):
        from_gguf_metadata(m)


def test_metadata_round_trip_through_real_file(tiny_path):
    mf = open_model(tiny_path)
    c = preset("tiny")
    assert mf.config == c
    assert mf.config.hash() == c.hash()
    assert mf.metadata["general.architecture"] == "deepseek4"
    assert mf.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 16, 4, 16]
    assert mf.metadata["deepseek4.expert_gating_func"] == 4
    assert mf.metadata["deepseek4.expert_weights_norm"] is True
    assert mf.metadata["deepseek4.rope.scaling.type"] == "yarn"
    assert mf.metadata["ds4c.synthetic_seed"] == 0
    assert mf.metadata["ds4c.formats"] == "official"


def test_metadata_extra_drafter_ratios_accepted():
    """Files list compress_ratios for drafter layers too (44 or 46 entries): the tower is unchanged."""
    c = preset("flash")
    meta = {k: v for k, v, _ in to_gguf_metadata(c)}
    meta["deepseek4.attention.compress_ratios"] = list(FLASH_RATIOS) + [0, 0, 0]
    back = from_gguf_metadata(meta, vocab_size=c.vocab_size)
    assert back.n_layers == 43
    assert [back.layer_kind(i) for i in range(43)] == [c.layer_kind(i) for i in range(43)]
    assert back.hash() == c.hash()


def _meta(name: str = "tiny") -> dict:
    return {k: v for k, v, _ in to_gguf_metadata(preset(name))}


def test_from_metadata_wrong_architecture():
    m = _meta()
    m["general.architecture"] = "llama"
    with pytest.raises(ConfigError, match=r"general\.architecture.*deepseek4.*'llama'"):
        from_gguf_metadata(m, vocab_size=512, source="x.gguf")
    del m["general.architecture"]
    with pytest.raises(ConfigError, match=r"general\.architecture.*None"):
        from_gguf_metadata(m, vocab_size=512)


@pytest.mark.parametrize("key", ["deepseek4.attention.q_lora_rank", "deepseek4.attention.compress_ratios",
                                 "deepseek4.expert_weights_scale", "deepseek4.hash_layer_count"])
def test_from_metadata_missing_key_named(key):
    m = _meta()
    del m[key]
    with pytest.raises(ConfigError, match="missing metadata key '" + key.replace(".", r"\.") + "'") as ei:
        from_gguf_metadata(m, vocab_size=512, source="model.gguf")
    assert "model.gguf" in str(ei.value)


def test_from_metadata_optional_keys_take_llama_cpp_defaults():
    """Issue 28.2: llama.cpp's loader reads rope.freq_base and the rope.scaling.* keys as optional (freq base
    10000; no factor: no scaling; original context = context_length; betas 32 / 1): so does ds4c."""
    m = _meta("flash")
    absent = ["deepseek4.rope.freq_base", "deepseek4.rope.scaling.type", "deepseek4.rope.scaling.factor",
              "deepseek4.rope.scaling.original_context_length", "deepseek4.rope.scaling.yarn_beta_fast",
              "deepseek4.rope.scaling.yarn_beta_slow"]
    for k in absent:
        del m[k]
    m["deepseek4.context_length"] = 4096
    c = from_gguf_metadata(m, vocab_size=129280)
    assert (c.rope_theta, c.rope_factor, c.original_seq_len, c.beta_fast, c.beta_slow) == (10000.0, 1.0, 4096, 32.0, 1.0)
    assert not c.yarn and preset("flash").yarn
    assert absent_optional_keys(m) == {"deepseek4.rope.freq_base": 10000.0, "deepseek4.rope.scaling.factor": 1.0,
                                       "deepseek4.rope.scaling.original_context_length": 4096,
                                       "deepseek4.rope.scaling.yarn_beta_fast": 32.0,
                                       "deepseek4.rope.scaling.yarn_beta_slow": 1.0}
    assert absent_optional_keys(_meta("flash")) == {}
    # factor 1 is no scaling: the compressing layers' frequencies are exactly the plain ones
    plain = rope_freqs(c.rope_dim, c.compress_rope_theta, False, 1.0, 4096, 32.0, 1.0)
    assert torch.equal(rope_freqs(c.rope_dim, c.compress_rope_theta, True, 1.0, 4096, 32.0, 1.0), plain)
    # a scaling ds4c does not implement is refused in one line (llama.cpp would run it as linear scaling)
    with pytest.raises(ConfigError, match=r"rope\.scaling\.type 'yarn'.*found 'linear' with factor 4"):
        from_gguf_metadata({**m, "deepseek4.rope.scaling.type": "linear", "deepseek4.rope.scaling.factor": 4.0},
                           vocab_size=129280)
    assert not from_gguf_metadata({**m, "deepseek4.rope.scaling.type": "none"}, vocab_size=129280).yarn


def test_from_metadata_gating_func_not_sqrt_softplus():
    m = _meta()
    m["deepseek4.expert_gating_func"] = 1
    with pytest.raises(ConfigError, match=r"expert_gating_func = 4.*found 1"):
        from_gguf_metadata(m, vocab_size=512)


@pytest.mark.parametrize("key,val,pattern", [
    ("deepseek4.attention.head_count_kv", 8, r"head_count_kv = 1.*found 8"),
    ("deepseek4.attention.value_length", 128, r"value_length"),
    ("deepseek4.expert_weights_norm", False, r"expert_weights_norm"),
    ("deepseek4.swiglu_clamp_exp", [10.0] * 5 + [7.0], r"swiglu_clamp_exp"),
])
def test_from_metadata_other_unsupported_values(key, val, pattern):
    m = _meta()
    m[key] = val
    with pytest.raises(ConfigError, match=pattern):
        from_gguf_metadata(m, vocab_size=512)


def test_from_metadata_reads_swiglu_and_ids():
    m = _meta()
    m["deepseek4.swiglu_clamp_exp"] = [7.0] * 6
    m["tokenizer.ggml.bos_token_id"] = 5
    m["tokenizer.ggml.eos_token_id"] = 6
    c = from_gguf_metadata(m, vocab_size=512)
    assert (c.swiglu_limit, c.bos_id, c.eos_id) == (7.0, 5, 6)


def test_from_metadata_inconsistent_values_name_the_field():
    m = _meta()
    m["deepseek4.expert_used_count"] = 32  # > 16 experts
    with pytest.raises(ConfigError, match=r"src\.gguf: .*n_active_experts"):
        from_gguf_metadata(m, vocab_size=512, source="src.gguf")


# ------------------------------------------------------------------------------------------------ hash

def _mutate(v):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, float):
        return v * 1.5 + 0.25
    if isinstance(v, str):
        return v + "-x"
    if isinstance(v, tuple):
        return (v[0] + 4,) + v[1:]
    raise AssertionError(type(v))


def test_hash_changes_with_every_hyper_parameter():
    """Each field of the model dict moves the hash (fields set raw to bypass validation, so each field is
    changed alone)."""
    base = preset("tiny")
    h0 = base.hash()
    assert len(h0) == 64 and int(h0, 16) >= 0
    fields = [f.name for f in dataclasses.fields(Ds4Config) if f.name != "quant_emulation"]
    assert set(fields) == set(base.model_dict())
    for f in fields:
        c = base.replace()
        object.__setattr__(c, f, _mutate(getattr(c, f)))
        assert c.hash() != h0, f


@pytest.mark.parametrize("changes", [
    {"hidden_size": 384}, {"n_layers": 5}, {"head_dim": 256}, {"rope_dim": 128, "head_dim": 256, "index_head_dim": 256},
    {"window": 32}, {"n_experts": 32}, {"n_active_experts": 6}, {"n_hash_layers": 2}, {"route_scale": 2.5},
    {"swiglu_limit": 7.0}, {"norm_eps": 1e-5}, {"compress_ratios": (0, 0, 4, 128, 4, 16)},
    {"rope_theta": 20000.0}, {"compress_rope_theta": 10000.0}, {"beta_fast": 16.0}, {"index_topk": 16},
    {"hc_sinkhorn_iters": 10}, {"hc_eps": 1e-5}, {"eos_id": 2}, {"max_position": 4096}, {"vocab_size": 1024},
])
def test_hash_changes_with_valid_replacements(changes):
    base = preset("tiny")
    assert base.replace(**changes).hash() != base.hash()


def test_hash_ignores_quant_emulation_and_unused_ratio_entries():
    base = preset("tiny")
    off = base.replace(quant_emulation=False)
    assert off.quant_emulation is False
    assert off.hash() == base.hash()
    assert "quant_emulation" not in off.model_dict()
    longer = base.replace(compress_ratios=base.compress_ratios + (0, 0))
    assert longer.hash() == base.hash()
    assert preset("flash").hash() != preset("flash-l4").hash() != preset("tiny").hash()


# ------------------------------------------------------------------------------------------------ validation

@pytest.mark.parametrize("changes,field", [
    ({"head_dim": 200}, "head_dim - rope_dim"),  # nope 136: not a multiple of 64
    ({"rope_dim": 32}, "head_dim - rope_dim"),  # nope 160
    ({"n_active_experts": 17}, "n_active_experts"),
    ({"compress_ratios": (0, 0, 4, 6, 4, 16)}, "compress_ratios[3]"),
    ({"compress_ratios": (0, 0, 3, 16, 4, 16)}, "compress_ratios[2]"),
    ({"compress_ratios": (0, 0, 4, 16, 4, -4)}, "compress_ratios[5]"),
    ({"compress_ratios": (0, 0, 4, 16, 4)}, "compress_ratios"),
    ({"hidden_size": 200}, "hidden_size"),
    ({"q_lora_rank": 96}, "q_lora_rank"),
    ({"moe_inter": 100}, "moe_inter"),
    ({"o_groups": 3}, "o_groups"),
    ({"rope_dim": 63, "head_dim": 191}, "rope_dim"),
    ({"index_head_dim": 96}, "index_head_dim"),
    ({"n_hash_layers": 7}, "n_hash_layers"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"hc_mult": 2}, "hc_mult"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"window": -1}, "window"),
    ({"index_topk": 0}, "index_topk"),
])
def test_invalid_config_names_the_field(changes, field):
    with pytest.raises(ConfigError) as ei:
        preset("tiny").replace(**changes)
    msg = str(ei.value)
    assert field in msg, msg
    assert "'tiny'" in msg


def test_invalid_config_message_gives_found_value():
    with pytest.raises(ConfigError, match=r"n_active_experts <= n_experts=16, found 17"):
        Ds4Config(**{**preset("tiny").model_dict(), "n_active_experts": 17})
    with pytest.raises(ConfigError, match=r"multiple of 64.*found 136"):
        preset("tiny").replace(head_dim=200)


def test_model_dict_is_json_and_rebuilds_config():
    import json

    for name in PRESETS:
        c = preset(name)
        d = json.loads(json.dumps(c.model_dict()))
        d["compress_ratios"] = tuple(d["compress_ratios"])
        assert Ds4Config(**d) == c
        assert math.isclose(d["route_scale"], 1.5)
