"""ds4c.hf_port: our GGUF models in the transformers DeepSeek-V4 port (the benchmark's eager peer).

The name table and the memory estimate are checked without transformers; everything that builds the port
skips with the reason when ``transformers`` with ``DeepseekV4ForCausalLM`` is not importable (CI has none).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ds4c import hf_port
from ds4c.config import preset
from ds4c.errors import Ds4cError
from ds4c.sources import open_model
from ds4c.reference import Reference, ReferenceWeights
from ds4c.reference import primitives as P
from ds4c.tensors import tensor_specs

HF_OK, HF_WHY = hf_port.available()
needs_hf = pytest.mark.skipif(not HF_OK, reason=f"transformers DeepseekV4ForCausalLM not importable: {HF_WHY}")

TOKENS = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


# ------------------------------------------------------------------------------------- no transformers needed
@pytest.mark.parametrize("name", ["tiny", "flash-l4", "flash"])
def test_weight_map_uses_every_gguf_tensor_once(name):
    cfg = preset(name)
    table = hf_port.hf_weight_map(cfg)
    used = Counter(g for m in table for g in m.gguf)
    assert set(used) == {s.name for s in tensor_specs(cfg)}
    assert max(used.values()) == 1
    assert max(Counter(m.hf for m in table).values()) == 1


def test_model_bytes_flash_l4():
    b = hf_port.hf_model_bytes(preset("flash-l4"))
    assert b["experts"] == 4 * 256 * 3 * 2048 * 4096 * 2  # 51.5 GB of bf16 routed experts
    assert 54e9 < b["total"] < 56e9


def test_unavailable_is_a_ds4c_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_transformers(name, *a, **k):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    ok, why = hf_port.available()
    assert not ok and "pip install transformers" in why
    with pytest.raises(hf_port.HFPortUnavailable, match="not importable"):
        hf_port.hf_config(preset("tiny"))


# ------------------------------------------------------------------------------------- with the port
@pytest.fixture(scope="module")
def tiny_mf(tiny_path):
    return open_model(tiny_path)


@pytest.fixture(scope="module")
def hf32(tiny_mf):
    if not HF_OK:
        pytest.skip(f"transformers DeepseekV4ForCausalLM not importable: {HF_WHY}")
    # expert_chunk=5: 16 experts load in 4 chunks, the last one ragged
    return hf_port.load_hf_model(tiny_mf, "cpu", torch.float32, experts_implementation="eager", expert_chunk=5)


@needs_hf
@pytest.mark.parametrize("name", ["tiny", "flash-l4"])
def test_config_mapping(name):
    cfg = preset(name)
    h = hf_port.hf_config(cfg)
    assert (h.vocab_size, h.hidden_size, h.num_hidden_layers, h.num_attention_heads, h.num_key_value_heads,
            h.head_dim, h.qk_rope_head_dim, h.q_lora_rank, h.o_lora_rank, h.o_groups, h.sliding_window,
            h.moe_intermediate_size) == (
        cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, 1, cfg.head_dim, cfg.rope_dim,
        cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups, cfg.window, cfg.moe_inter)
    assert (h.n_routed_experts, h.num_experts_per_tok, h.n_shared_experts, h.routed_scaling_factor,
            h.scoring_func, h.norm_topk_prob, h.swiglu_limit) == (
        cfg.n_experts, cfg.n_active_experts, cfg.n_shared_experts, cfg.route_scale, "sqrtsoftplus", True,
        cfg.swiglu_limit)
    assert (h.index_n_heads, h.index_head_dim, h.index_topk) == (cfg.index_n_heads, cfg.index_head_dim,
                                                                 cfg.index_topk)
    assert (h.hc_mult, h.hc_sinkhorn_iters, h.hc_eps, h.rms_norm_eps) == (cfg.hc_mult, cfg.hc_sinkhorn_iters,
                                                                          cfg.hc_eps, cfg.norm_eps)
    ratio = {"sliding_attention": 0, **h.compress_rates}
    assert [ratio[t] for t in h.layer_types] == list(cfg.compress_ratios[: cfg.n_layers])
    assert h.mlp_layer_types == ["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)]
    assert h.rope_parameters["main"]["rope_theta"] == cfg.rope_theta
    comp = h.rope_parameters["compress"]
    assert (comp["rope_theta"], comp["rope_type"], comp["factor"], comp["original_max_position_embeddings"],
            comp["beta_fast"], comp["beta_slow"], comp["attention_factor"]) == (
        cfg.compress_rope_theta, "yarn", cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow, 1.0)
    assert (h.max_position_embeddings, h.bos_token_id, h.eos_token_id, h.tie_word_embeddings) == (
        cfg.max_position, cfg.bos_id, cfg.eos_id, False)


@needs_hf
def test_config_rejects_two_hca_ratios():
    cfg = preset("tiny").replace(compress_ratios=(0, 0, 4, 16, 4, 32))
    with pytest.raises(hf_port.HFPortUnavailable, match="one HCA compress rate"):
        hf_port.hf_config(cfg)


@needs_hf
@pytest.mark.parametrize("name", ["tiny", "flash-l4", "flash"])
def test_mapping_complete_on_meta(name):
    cfg = preset(name)
    assert hf_port.mapping_problems(cfg, hf_port.build_empty_model(cfg, "meta")) == []


@needs_hf
def test_rope_tables_equal_the_reference(hf32, tiny_mf):
    cfg = tiny_mf.config
    rot = hf32.model.rotary_emb
    for label, yarn, base in (("main", False, cfg.rope_theta), ("compress", True, cfg.compress_rope_theta)):
        want = P.rope_freqs(cfg.rope_dim, base, yarn, cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast,
                            cfg.beta_slow)
        torch.testing.assert_close(getattr(rot, f"{label}_inv_freq").float(), want.float(), rtol=1e-6, atol=0)


@needs_hf
def test_every_parameter_assigned_from_its_gguf_tensor(hf32, tiny_mf):
    state = hf32.state_dict()
    table = hf_port.hf_weight_map(tiny_mf.config)
    assert {m.hf for m in table} == set(state)
    for m in table:
        if m.kind == "cat1":
            E = tiny_mf.specs[m.gguf[0]].shape[0]
            for e in range(E):
                want = torch.cat([tiny_mf.expert(g, e) for g in m.gguf])
                assert torch.equal(state[m.hf][e], want), m.hf
        elif tiny_mf.specs[m.gguf[0]].role == "fp4":
            for e in range(tiny_mf.specs[m.gguf[0]].shape[0]):
                assert torch.equal(state[m.hf][e], tiny_mf.expert(m.gguf[0], e)), m.hf
        else:
            want = tiny_mf.tensor(m.gguf[0], torch.int64 if state[m.hf].dtype == torch.int64 else torch.float32)
            if m.gguf[0].endswith("attn_output_a.weight"):
                want = want.to(torch.bfloat16).float()
            assert torch.equal(state[m.hf], want), m.hf


@needs_hf
def test_bf16_dtypes(tiny_mf):
    m = hf_port.load_hf_model(tiny_mf, "cpu", torch.bfloat16)
    dt = {n: v.dtype for n, v in m.state_dict().items()}
    assert dt["model.layers.0.attn_hc.fn"] == torch.float32
    assert dt["model.layers.2.self_attn.compressor.position_bias"] == torch.float32
    assert dt["model.layers.0.mlp.gate.tid2eid"] == torch.int64
    assert dt["model.layers.3.mlp.experts.gate_up_proj"] == torch.bfloat16
    assert dt["model.layers.0.input_layernorm.weight"] == torch.bfloat16  # the port's fp32 plan breaks bf16
    logits = hf_port.hf_logits(m, TOKENS[:6], n_prefill=3)
    assert logits.shape == (6, tiny_mf.config.vocab_size) and bool(torch.isfinite(logits).all())


@needs_hf
def test_mapping_errors_are_listed(tiny_mf, monkeypatch):
    full = hf_port.hf_weight_map

    def broken(cfg):
        t = full(cfg)
        return t[1:] + [t[5]]  # embed unmapped, one entry twice

    monkeypatch.setattr(hf_port, "hf_weight_map", broken)
    with pytest.raises(Ds4cError) as e:
        hf_port.load_hf_model(tiny_mf, "meta")
    msg = str(e.value)
    assert "model.embed_tokens.weight: not mapped" in msg and "mapped 2 times" in msg
    assert "GGUF token_embd.weight: not used" in msg


@needs_hf
def test_logits_close_to_reference_without_quant_emulation(hf32, tiny_mf):
    """fp32 port vs the reference with quantization emulation off: same semantics, the reference's bf16
    roundings remain (~5e-3). 20 tokens cross the window (16), CSA flushes and one HCA (16) flush."""
    toks = TOKENS[:20]
    w = ReferenceWeights.load(tiny_mf, "cpu")
    w.config = w.config.replace(quant_emulation=False)
    ref = Reference(w, max_ctx=64)
    want = torch.cat([ref.decode(t, i) for i, t in enumerate(toks)])
    got = hf_port.hf_logits(hf32, toks)
    err = rel(got, want)
    assert float(err.max()) < 2e-2, err
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_hf
def test_prefill_and_verify_chunks_equal_sequential_decodes(hf32):
    seq = hf_port.hf_logits(hf32, TOKENS)
    assert float(rel(hf_port.hf_logits(hf32, TOKENS, n_prefill=31), seq).max()) < 1e-5
    cache = hf_port.prefill(hf32, TOKENS[:29])
    with torch.inference_mode():
        chunk = hf_port._step(hf32, TOKENS[29:34], 29, cache, 0).float()
    assert float(rel(chunk, seq[29:34]).max()) < 1e-5


@needs_hf
def test_timing_returns_ms_and_checks_inputs(hf32):
    ms = hf_port.time_hf_decode(hf32, TOKENS[:20], TOKENS[20], repeats=2, warmup=1)
    assert ms > 0
    assert hf_port.time_hf_verify(hf32, TOKENS[:20], TOKENS[20:23], repeats=1, warmup=0) > 0
    with pytest.raises(Ds4cError, match="repeats"):
        hf_port.time_hf_decode(hf32, TOKENS[:20], TOKENS[20], repeats=0)
    with pytest.raises(Ds4cError, match="token ids"):
        hf_port.time_hf_decode(hf32, TOKENS[:20], 10**6, repeats=1)
    with pytest.raises(Ds4cError, match="at least one token"):
        hf_port.time_hf_decode(hf32, [], 5, repeats=1)
    ms = hf_port.time_hf_widths(hf32, TOKENS[:20], TOKENS[20:25], widths=[1, 5], repeats=1, warmup=0)
    assert sorted(ms) == [1, 5] and min(ms.values()) > 0
    with pytest.raises(Ds4cError, match="widths"):
        hf_port.time_hf_widths(hf32, TOKENS[:20], TOKENS[20:22], widths=[3], repeats=1)
