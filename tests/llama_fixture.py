"""A small DeepSeek-V4 GGUF written the way llama.cpp's converter writes one, by a code path of its own.

Nothing here uses ds4c's writer, tensor inventory, metadata table or synthetic tokenizer: names, keys, value
types, shapes and storage types follow llama.cpp's converter (``/work/shared/peers/llama.cpp-src.tar.xz``):

* ``conversion/deepseek.py`` ``DeepseekV4Model``: ``set_gguf_parameters`` (l. 659-689), ``filter_tensors``
  (l. 579-631, the ``--mtp`` renames and what ``mtp_only`` keeps), ``_map_dsv4_tensor_name`` (l. 809-878),
  ``modify_tensors`` (l. 880-892: hash layers drop ``ffn.gate.bias``), ``tensor_force_quant`` (l. 894-906:
  dequantized FP8 -> Q8_0, ``nextn.eh_proj`` -> Q8_0, F32 sources -> F32, 2-D BF16 sources -> BF16),
  ``generate_extra_tensors`` (l. 765-804: routed experts repacked to MXFP4, ``tid2eid`` as I32, the MTP
  ``e_proj``/``h_proj`` concatenated into ``eh_proj``), ``prepare_tensors`` (l. 921-924: file type
  MOSTLY_MXFP4_MOE), the default chat template (l. 564-571).
* ``conversion/base.py``: ``TextModel.set_gguf_parameters`` (l. 1434-1546, ends with ``add_file_type``),
  ``ModelBase.prepare_metadata`` (l. 1189-1228: quantization version after the parameters),
  ``get_vocab_base`` (l. 1581-1624: ``[PAD{i}]`` UNUSED filler up to the config's ``vocab_size``, added tokens
  CONTROL when special or ``<｜...｜>``-shaped else USER_DEFINED), ``_set_vocab_gpt2`` (l. 1964-1972).
* ``gguf-py/gguf/constants.py`` (that tree's, not the pip ``gguf`` 0.19.0, which lacks ``deepseek4``) for the
  key strings (``class Keys``) and the tensor names (``TENSOR_NAMES``); ``gguf-py/gguf/gguf_writer.py`` for the
  value type each ``add_*`` writes (spelled out below as ``add_uint32`` / ``add_float32`` / ``add_bool`` /
  ``add_string`` / ``add_array``).
* ``src/models/deepseek4.cpp`` ``load_arch_tensors`` (l. 82-187) for the shapes llama.cpp's loader asks for.

The model is a checkpoint in the official ``config.json`` vocabulary (:data:`HF_CONFIG`) with tiny widths; its
tensors are drawn from ``numpy.random.Generator(seed)`` in the source checkpoint's forms (FP8 weights as floats
that become Q8_0, FP4 experts on the e2m1 grid so the MXFP4 repack is exact, BF16 tensors bf16-exact, F32 ones
as they are) and then written in the converter's forms.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

# --------------------------------------------------------------------------------------------------
# names and keys, as llama.cpp's gguf-py/gguf/constants.py spells them (MODEL_ARCH.DEEPSEEK4 = "deepseek4")

ARCH = "deepseek4"

# MODEL_TENSOR -> TENSOR_NAMES entry (constants.py l. 1428-1997); the converter appends ".weight" or ".bias"
# (deepseek.py _map_dsv4_tensor_name).
T = {
    "TOKEN_EMBD": "token_embd",
    "OUTPUT_NORM": "output_norm",
    "OUTPUT": "output",
    "HC_HEAD_FN": "output_hc_fn",
    "HC_HEAD_BASE": "output_hc_base",
    "HC_HEAD_SCALE": "output_hc_scale",
    "ATTN_NORM": "blk.{bid}.attn_norm",
    "ATTN_SINKS": "blk.{bid}.attn_sinks",
    "ATTN_Q_A": "blk.{bid}.attn_q_a",
    "ATTN_Q_B": "blk.{bid}.attn_q_b",
    "ATTN_Q_A_NORM": "blk.{bid}.attn_q_a_norm",
    "ATTN_KV": "blk.{bid}.attn_kv",
    "ATTN_KV_NORM": "blk.{bid}.attn_kv_a_norm",
    "ATTN_OUT_A": "blk.{bid}.attn_output_a",
    "ATTN_OUT_B": "blk.{bid}.attn_output_b",
    "HC_ATTN_FN": "blk.{bid}.hc_attn_fn",
    "HC_ATTN_BASE": "blk.{bid}.hc_attn_base",
    "HC_ATTN_SCALE": "blk.{bid}.hc_attn_scale",
    "HC_FFN_FN": "blk.{bid}.hc_ffn_fn",
    "HC_FFN_BASE": "blk.{bid}.hc_ffn_base",
    "HC_FFN_SCALE": "blk.{bid}.hc_ffn_scale",
    "ATTN_COMPRESSOR_WKV": "blk.{bid}.attn_compressor_kv",
    "ATTN_COMPRESSOR_WGATE": "blk.{bid}.attn_compressor_gate",
    "ATTN_COMPRESSOR_APE": "blk.{bid}.attn_compressor_ape",
    "ATTN_COMPRESSOR_NORM": "blk.{bid}.attn_compressor_norm",
    "INDEXER_PROJ": "blk.{bid}.indexer.proj",
    "INDEXER_ATTN_Q_B": "blk.{bid}.indexer.attn_q_b",
    "INDEXER_COMPRESSOR_WKV": "blk.{bid}.indexer_compressor_kv",
    "INDEXER_COMPRESSOR_WGATE": "blk.{bid}.indexer_compressor_gate",
    "INDEXER_COMPRESSOR_APE": "blk.{bid}.indexer_compressor_ape",
    "INDEXER_COMPRESSOR_NORM": "blk.{bid}.indexer_compressor_norm",
    "FFN_NORM": "blk.{bid}.ffn_norm",
    "FFN_GATE_INP": "blk.{bid}.ffn_gate_inp",
    "FFN_EXP_PROBS_B": "blk.{bid}.exp_probs_b",
    "FFN_EXP_PROBS_B_VL": "blk.{bid}.exp_probs_b_vl",
    "FFN_GATE_TID2EID": "blk.{bid}.ffn_gate_tid2eid",
    "FFN_GATE_EXP": "blk.{bid}.ffn_gate_exps",
    "FFN_DOWN_EXP": "blk.{bid}.ffn_down_exps",
    "FFN_UP_EXP": "blk.{bid}.ffn_up_exps",
    "FFN_GATE_SHEXP": "blk.{bid}.ffn_gate_shexp",
    "FFN_DOWN_SHEXP": "blk.{bid}.ffn_down_shexp",
    "FFN_UP_SHEXP": "blk.{bid}.ffn_up_shexp",
    "NEXTN_EH_PROJ": "blk.{bid}.nextn.eh_proj",
    "NEXTN_ENORM": "blk.{bid}.nextn.enorm",
    "NEXTN_HNORM": "blk.{bid}.nextn.hnorm",
    "NEXTN_SHARED_HEAD_NORM": "blk.{bid}.nextn.shared_head_norm",
}

# class Keys (constants.py l. 20-350); "{arch}" is "deepseek4".
K = {
    "ARCHITECTURE": "general.architecture",
    "TYPE": "general.type",
    "NAME": "general.name",
    "SIZE_LABEL": "general.size_label",
    "QUANTIZATION_VERSION": "general.quantization_version",
    "FILE_TYPE": "general.file_type",
    "CONTEXT_LENGTH": "{arch}.context_length",
    "EMBEDDING_LENGTH": "{arch}.embedding_length",
    "EMBEDDING_LENGTH_OUT": "{arch}.embedding_length_out",
    "BLOCK_COUNT": "{arch}.block_count",
    "EXPERT_FEED_FORWARD_LENGTH": "{arch}.expert_feed_forward_length",
    "EXPERT_COUNT": "{arch}.expert_count",
    "EXPERT_USED_COUNT": "{arch}.expert_used_count",
    "EXPERT_SHARED_COUNT": "{arch}.expert_shared_count",
    "EXPERT_WEIGHTS_SCALE": "{arch}.expert_weights_scale",
    "EXPERT_WEIGHTS_NORM": "{arch}.expert_weights_norm",
    "EXPERT_GATING_FUNC": "{arch}.expert_gating_func",
    "NEXTN_PREDICT_LAYERS": "{arch}.nextn_predict_layers",
    "HASH_LAYER_COUNT": "{arch}.hash_layer_count",
    "SWIGLU_CLAMP_EXP": "{arch}.swiglu_clamp_exp",
    "SWIGLU_CLAMP_SHEXP": "{arch}.swiglu_clamp_shexp",
    "HEAD_COUNT": "{arch}.attention.head_count",
    "HEAD_COUNT_KV": "{arch}.attention.head_count_kv",
    "KEY_LENGTH": "{arch}.attention.key_length",
    "VALUE_LENGTH": "{arch}.attention.value_length",
    "LAYERNORM_RMS_EPS": "{arch}.attention.layer_norm_rms_epsilon",
    "Q_LORA_RANK": "{arch}.attention.q_lora_rank",
    "SLIDING_WINDOW": "{arch}.attention.sliding_window",
    "OUTPUT_GROUP_COUNT": "{arch}.attention.output_group_count",
    "OUTPUT_LORA_RANK": "{arch}.attention.output_lora_rank",
    "COMPRESS_RATIOS": "{arch}.attention.compress_ratios",
    "COMPRESS_ROPE_FREQ_BASE": "{arch}.attention.compress_rope_freq_base",
    "INDEXER_HEAD_COUNT": "{arch}.attention.indexer.head_count",
    "INDEXER_KEY_LENGTH": "{arch}.attention.indexer.key_length",
    "INDEXER_TOP_K": "{arch}.attention.indexer.top_k",
    "HC_COUNT": "{arch}.hyper_connection.count",
    "HC_SINKHORN_ITERATIONS": "{arch}.hyper_connection.sinkhorn_iterations",
    "HC_EPSILON": "{arch}.hyper_connection.epsilon",
    "ROPE_DIMENSION_COUNT": "{arch}.rope.dimension_count",
    "ROPE_FREQ_BASE": "{arch}.rope.freq_base",
    "ROPE_SCALING_TYPE": "{arch}.rope.scaling.type",
    "ROPE_SCALING_FACTOR": "{arch}.rope.scaling.factor",
    "ROPE_SCALING_ORIG_CTX_LEN": "{arch}.rope.scaling.original_context_length",
    "ROPE_SCALING_YARN_BETA_FAST": "{arch}.rope.scaling.yarn_beta_fast",
    "ROPE_SCALING_YARN_BETA_SLOW": "{arch}.rope.scaling.yarn_beta_slow",
    "TOKENIZER_MODEL": "tokenizer.ggml.model",
    "TOKENIZER_PRE": "tokenizer.ggml.pre",
    "TOKENIZER_LIST": "tokenizer.ggml.tokens",
    "TOKENIZER_TOKEN_TYPE": "tokenizer.ggml.token_type",
    "TOKENIZER_MERGES": "tokenizer.ggml.merges",
    "TOKENIZER_BOS_ID": "tokenizer.ggml.bos_token_id",
    "TOKENIZER_EOS_ID": "tokenizer.ggml.eos_token_id",
    "TOKENIZER_PAD_ID": "tokenizer.ggml.padding_token_id",
    "TOKENIZER_ADD_BOS": "tokenizer.ggml.add_bos_token",
    "TOKENIZER_ADD_EOS": "tokenizer.ggml.add_eos_token",
    "CHAT_TEMPLATE": "tokenizer.chat_template",
}

# enum values (constants.py): ExpertGatingFuncType.SQRTSOFTPLUS = 4, RopeScalingType.YARN = "yarn",
# LlamaFileType.MOSTLY_MXFP4_MOE = 38, GGML_QUANT_VERSION = 2, TokenType NORMAL 1 / CONTROL 3 /
# USER_DEFINED 4 / UNUSED 5.
GATING_SQRTSOFTPLUS = 4
ROPE_YARN = "yarn"
FTYPE_MOSTLY_MXFP4_MOE = 38
GGML_QUANT_VERSION = 2
TT_NORMAL, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED = 1, 3, 4, 5


def key(name: str) -> str:
    """The full metadata key of ``K[name]``."""
    return K[name].format(arch=ARCH)


def tname(kind: str, bid: int | None = None, suffix: str = ".weight") -> str:
    """The GGUF tensor name of ``T[kind]`` for block ``bid``."""
    return T[kind].format(bid=bid) + suffix


# --------------------------------------------------------------------------------------------------
# the checkpoint's config.json (official keys, tiny widths; 6 trunk layers + 1 MTP layer)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
ROLE_TOKENS = ["<｜User｜>", "<｜Assistant｜>"]          # special (CONTROL)
THINK_TOKENS = ["<think>", "</think>"]                    # added, not special (USER_DEFINED)

HF_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 192,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 16,
    "moe_intermediate_size": 128,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 8,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    "max_position_embeddings": 1048576,
    # one entry per trunk layer, then the MTP layer's (the official preview config: [0,0]+[4,128]*20+[4,0]).
    # The converter writes this list as it is (deepseek.py l. 680), so the trunk file holds 7 entries for 6 blocks.
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    # "vocab_size" is filled in from the tokenizer (rounded up to a multiple of 64, like 129280 for DeepSeek's)
}

VOCAB_TARGET = 680           # BPE trainer target (before the added tokens and the [PAD] filler)
VOCAB_MULTIPLE = 64

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a small test corpus for a byte-level BPE tokenizer.",
    "DeepSeek-V4-Flash is a mixture-of-experts language model with compressed sparse attention.",
    "Once upon a time, there was a little model that wanted to generate some text.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'even')\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 123 2024 3.14159 1e-6 65536 1048576.",
    "The sliding window holds the most recent tokens; compressed rows cover the rest of the context.",
    "Experts are selected by a router; the first layers use a hash of the token instead.",
    "Hyper-connections mix four residual streams with a Sinkhorn-normalised matrix.",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "A journey of a thousand miles begins with a single step.",
    "深度求索 你好 世界 こんにちは カタカナ ひらがな",
    "Café naïve résumé — “quotes” and ‘apostrophes’ … ellipsis ± × ÷ ≤ ≥ €100.",
    "<html><body><p>Some markup &amp; entities</p></body></html>",
    "JSON: {\"key\": [1, 2, 3], \"ok\": true, \"name\": \"ds4c\"}",
    "Tabs\tand\ttabs, newlines\n\nand   multiple   spaces   here.",
]

# A short DeepSeek-V3/V4-style chat template (the converter's default template file
# models/templates/deepseek-ai-DeepSeek-V4.jinja is not in the trimmed source tree): bos, the system prompt,
# <｜User｜>/<｜Assistant｜> turns, assistant turns closed by eos, and a </think> (or <think> with thinking)
# after the generation prompt.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜></think>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}"
)

# llama.cpp's "deepseek-v3" pre-tokenizer split rules (src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM),
# the ones DeepSeek's tokenizer.json carries as Split pre-tokenizers ahead of a regex-free ByteLevel.
DEEPSEEK3_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]


# --------------------------------------------------------------------------------------------------
# tokenizer

def train_tokenizer():
    """A byte-level BPE (``tokenizers``) trained on :data:`CORPUS`: ids 0/1 = bos/eos, then the byte alphabet
    and merges, then the chat role tokens (special) and ``<think>``/``</think>`` (added, not special).
    Deterministic for the fixed corpus."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in DEEPSEEK3_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, min_frequency=1, show_progress=False,
                                  special_tokens=[AddedToken(BOS, special=True, normalized=False),
                                                  AddedToken(EOS, special=True, normalized=False)],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ROLE_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def _looks_special(text: str) -> bool:
    # base.py does_token_look_special (l. 1557-1578), the cases that can occur here
    return (text.startswith("<|") and text.endswith("|>")) or (text.startswith("<｜") and text.endswith("｜>"))


def vocab_entries(tok, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)`` as ``get_vocab_base`` + ``SpecialVocab`` derive them from ``tok``."""
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = {a.content: a for a in tok.get_added_tokens_decoder().values()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TT_UNUSED)
            continue
        t = reverse[i]
        if t in added:
            types.append(TT_CONTROL if added[t].special or _looks_special(t) else TT_USER_DEFINED)
        else:
            types.append(TT_NORMAL)
        tokens.append(t)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


# --------------------------------------------------------------------------------------------------
# tensors of the source checkpoint, in torch order ([out, in]; experts [n_expert, out, in])

def _bf16_exact(x: np.ndarray) -> np.ndarray:
    return dequantize(quantize(x.astype(np.float32), Q.BF16), Q.BF16).astype(np.float32)


def _fp4_grid(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Values of an official FP4 expert: e2m1 codes times a power-of-two scale per 32-block, each block holding
    a +-6 (its amax), so the MXFP4 repack is exact."""
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    *lead, k = shape
    blocks = grid[rng.integers(0, 8, (*lead, k // 32, 32))] * rng.choice(np.float32([-1, 1]), (*lead, k // 32, 32))
    blocks[..., 0] = 6.0 * rng.choice(np.float32([-1, 1]), (*lead, k // 32))
    e0 = round(math.log2(std / 2.6))  # rms of the codes ~2.6
    scale = np.exp2(e0 + rng.integers(-1, 2, (*lead, k // 32, 1))).astype(np.float32)
    return (blocks * scale).reshape(shape).astype(np.float32)


class _Gen:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def lin(self, out: int, inp: int) -> np.ndarray:
        return (self.rng.standard_normal((out, inp), dtype=np.float32) / np.float32(math.sqrt(inp)))

    def gain(self, n: int) -> np.ndarray:
        return (1.0 + 0.05 * self.rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    def small(self, shape: Any, s: float) -> np.ndarray:
        return (s * self.rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


# storage forms: "f32" (F32 source or a 1-D tensor), "bf16" (2-D BF16 source), "q8_0" (dequantized FP8),
# "mxfp4" (repacked FP4 experts), "i32" (tid2eid)
_QTYPE = {"f32": Q.F32, "bf16": Q.BF16, "q8_0": Q.Q8_0, "mxfp4": Q.MXFP4, "i32": Q.I32}


def _block_tensors(g: _Gen, hp: dict[str, Any], bid: int, ratio: int, hash_layer: bool,
                   vocab: int, vision_bias: bool) -> list[tuple[str, str, np.ndarray]]:
    """``(gguf name, form, torch-order source)`` of one transformer block, in the converter's naming."""
    d, nh, hd = hp["hidden_size"], hp["num_attention_heads"], hp["head_dim"]
    ql, ol, og = hp["q_lora_rank"], hp["o_lora_rank"], hp["o_groups"]
    ne, nu, fe = hp["n_routed_experts"], hp["num_experts_per_tok"], hp["moe_intermediate_size"]
    hc, ihd, inh = hp["hc_mult"], hp["index_head_dim"], hp["index_n_heads"]
    hcd, mix = hc * d, (2 + hc) * hc
    out: list[tuple[str, str, np.ndarray]] = []

    def add(kind: str, form: str, arr: np.ndarray, suffix: str = ".weight") -> None:
        out.append((tname(kind, bid, suffix), form, arr))

    for sub in ("ATTN", "FFN"):
        add(f"HC_{sub}_FN", "f32", g.small((mix, hcd), 1.0 / math.sqrt(hcd)))
        add(f"HC_{sub}_BASE", "f32", g.small(mix, 0.2))
        add(f"HC_{sub}_SCALE", "f32", (np.float32([0.5, 0.5, 0.2]) + g.small(3, 0.02)).astype(np.float32))
    add("ATTN_NORM", "f32", _bf16_exact(g.gain(d)))  # a bf16 source, 1-D: F32 in the file
    add("ATTN_SINKS", "f32", g.small(nh, 0.5))
    add("ATTN_Q_A", "q8_0", g.lin(ql, d))
    add("ATTN_Q_A_NORM", "f32", _bf16_exact(g.gain(ql)))
    add("ATTN_Q_B", "q8_0", g.lin(nh * hd, ql))
    add("ATTN_KV", "q8_0", g.lin(hd, d))
    add("ATTN_KV_NORM", "f32", _bf16_exact(g.gain(hd)))
    add("ATTN_OUT_A", "q8_0", g.lin(og * ol, nh * hd // og))
    add("ATTN_OUT_B", "q8_0", g.lin(d, og * ol))
    if ratio:
        coff = 2 if ratio == 4 else 1
        add("ATTN_COMPRESSOR_APE", "f32", g.small((ratio, coff * hd), 0.1))
        add("ATTN_COMPRESSOR_WKV", "bf16", _bf16_exact(g.lin(coff * hd, d)))
        add("ATTN_COMPRESSOR_WGATE", "bf16", _bf16_exact(g.lin(coff * hd, d)))
        add("ATTN_COMPRESSOR_NORM", "f32", _bf16_exact(g.gain(hd)))
        if ratio == 4:
            add("INDEXER_ATTN_Q_B", "q8_0", g.lin(inh * ihd, ql))
            add("INDEXER_PROJ", "bf16", _bf16_exact(g.lin(inh, d)))
            add("INDEXER_COMPRESSOR_APE", "f32", g.small((ratio, 2 * ihd), 0.1))
            add("INDEXER_COMPRESSOR_WKV", "bf16", _bf16_exact(g.lin(2 * ihd, d)))
            add("INDEXER_COMPRESSOR_WGATE", "bf16", _bf16_exact(g.lin(2 * ihd, d)))
            add("INDEXER_COMPRESSOR_NORM", "f32", _bf16_exact(g.gain(ihd)))
    add("FFN_NORM", "f32", _bf16_exact(g.gain(d)))
    add("FFN_GATE_INP", "bf16", _bf16_exact(g.lin(ne, d)))
    if hash_layer:
        # ffn.gate.bias of a hash layer is dropped (deepseek.py l. 884-886); tid2eid [vocab, n_used] -> I32
        tid2eid = np.argsort(g.rng.random((vocab, ne)), axis=1)[:, :nu].astype(np.int32)
        add("FFN_GATE_TID2EID", "i32", tid2eid)
        if vision_bias:
            add("FFN_EXP_PROBS_B_VL", "f32", g.small(ne, 0.1), ".bias")
    else:
        add("FFN_EXP_PROBS_B", "f32", g.small(ne, 0.1), ".bias")
    # routed experts w1 (gate), w2 (down), w3 (up), written in that order (deepseek.py l. 783-785)
    add("FFN_GATE_EXP", "mxfp4", _fp4_grid(g.rng, (ne, fe, d), 1.0 / math.sqrt(d)))
    add("FFN_DOWN_EXP", "mxfp4", _fp4_grid(g.rng, (ne, d, fe), 1.0 / math.sqrt(fe)))
    add("FFN_UP_EXP", "mxfp4", _fp4_grid(g.rng, (ne, fe, d), 1.0 / math.sqrt(d)))
    add("FFN_GATE_SHEXP", "q8_0", g.lin(fe, d))
    add("FFN_DOWN_SHEXP", "q8_0", g.lin(d, fe))
    add("FFN_UP_SHEXP", "q8_0", g.lin(fe, d))
    return out


def _root_tensors(g: _Gen, hp: dict[str, Any], vocab: int, with_hc_head: bool = True
                  ) -> list[tuple[str, str, np.ndarray]]:
    d, hc = hp["hidden_size"], hp["hc_mult"]
    out = [
        (tname("TOKEN_EMBD"), "bf16", _bf16_exact(g.small((vocab, d), 1.0))),
        (tname("OUTPUT_NORM"), "f32", _bf16_exact(g.gain(d))),
        (tname("OUTPUT"), "bf16", _bf16_exact(g.lin(vocab, d))),
    ]
    if with_hc_head:
        out += [
            (tname("HC_HEAD_FN"), "f32", g.small((hc, hc * d), 1.0 / math.sqrt(hc * d))),
            (tname("HC_HEAD_BASE"), "f32", g.small(hc, 0.2)),
            (tname("HC_HEAD_SCALE"), "f32", (np.float32([0.5]) + g.small(1, 0.02)).astype(np.float32)),
        ]
    return out


def _stored(form: str, src: np.ndarray) -> np.ndarray:
    """The array handed to ``GGUFWriter.add_tensor`` (``quantize`` output for the quantized forms)."""
    if form == "i32":
        return np.ascontiguousarray(src, dtype=np.int32)
    if form == "f32":
        return np.ascontiguousarray(src, dtype=np.float32)
    return quantize(np.ascontiguousarray(src, dtype=np.float32), _QTYPE[form])


# --------------------------------------------------------------------------------------------------
def write_llama_layout_model(path: str | Path, *, seed: int = 0, mtp: bool = False,
                             vision_bias: bool = False, rope_scaling: bool = True) -> dict[str, Any]:
    """Write a small DeepSeek-V4 GGUF at ``path`` in llama.cpp's converter layout.

    Args:
        seed: the numpy Generator seed of every tensor value.
        mtp: write what ``convert_hf_to_gguf.py --mtp`` writes instead (the MTP-only file): ``block_count`` =
            trunk layers + ``num_nextn_predict_layers``, the ``nextn_predict_layers`` key, block ``blk.6`` with
            its ``nextn.*`` tensors, and the shared root tensors (the HC head from the MTP layer's own).
        vision_bias: add ``exp_probs_b_vl.bias`` on the hash layers, as the converter does for a checkpoint
            that carries ``ffn.gate.bias_vl`` (the vision variant; deepseek.py l. 858, 884). The text checkpoint
            has none.
        rope_scaling: False: the config.json has no raw ``rope_scaling`` (as transformers 5.x saves a DeepSeek-V4
            config, its RoPE parameters under ``rope_parameters`` without a ``rope_type``): ``set_gguf_parameters``
            then finds no rope type and writes no ``rope.scaling.*`` key (base.py l. 1462-1482; deepseek.py
            l. 544-548 copies a raw ``rope_scaling`` only when there is one); ``rope.freq_base`` is still written
            from the ``rope_theta`` (l. 1501).

    Returns:
        ``{"path", "hparams" (the config.json), "metadata" (key -> (value, gguf type name)), "tensors" (name ->
        float32/int32 torch-order source), "forms" (name -> f32/bf16/q8_0/mxfp4/i32), "qtypes" (name ->
        GGMLQuantizationType), "stored" (name -> the array given to add_tensor), "tokenizer" (the trained
        ``tokenizers.Tokenizer``), "tokens", "token_types", "merges", "vocab_size", "chat_template"}``.
    """
    path = Path(path)
    tok = train_tokenizer()
    hp = json.loads(json.dumps(HF_CONFIG))
    if not rope_scaling:
        del hp["rope_scaling"]
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-n_tok // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    hp["vocab_size"] = vocab
    n_main, n_mtp = hp["num_hidden_layers"], hp["num_nextn_predict_layers"]
    block_count = n_main + (n_mtp if mtp else 0)
    ratios = hp["compress_ratios"]
    assert len(ratios) >= block_count
    rs = hp.get("rope_scaling")

    g = _Gen(seed)
    tensors: list[tuple[str, str, np.ndarray]] = []
    if not mtp:
        tensors += _root_tensors(g, hp, vocab)
        for bid in range(n_main):
            tensors += _block_tensors(g, hp, bid, ratios[bid], bid < hp["num_hash_layers"], vocab, vision_bias)
    else:
        # filter_tensors with mtp_only keeps embed/norm/head (l. 621-629); mtp.0.hc_head_* become the root
        # output_hc_* (l. 599-605); mtp.0.* become blk.6.* (l. 618), e_proj/h_proj/enorm/hnorm/norm the nextn.*
        # tensors (l. 606-616), e_proj|h_proj concatenated along the input dim (l. 797) and forced to Q8_0 (l. 899).
        tensors += _root_tensors(g, hp, vocab)
        d = hp["hidden_size"]
        for bid in range(n_main, block_count):
            tensors += _block_tensors(g, hp, bid, ratios[bid], False, vocab, False)
            e_proj, h_proj = g.lin(d, d), g.lin(d, d)
            tensors += [
                (tname("NEXTN_EH_PROJ", bid), "q8_0", np.concatenate([e_proj, h_proj], axis=1)),
                (tname("NEXTN_ENORM", bid), "f32", _bf16_exact(g.gain(d))),
                (tname("NEXTN_HNORM", bid), "f32", _bf16_exact(g.gain(d))),
                (tname("NEXTN_SHARED_HEAD_NORM", bid), "f32", _bf16_exact(g.gain(d))),
            ]

    w = GGUFWriter(str(path), ARCH)   # writes general.architecture
    meta: dict[str, tuple[Any, str]] = {key("ARCHITECTURE"): (ARCH, "STRING")}

    def u32(k: str, v: int) -> None:
        w.add_uint32(key(k), int(v)); meta[key(k)] = (int(v), "UINT32")

    def f32(k: str, v: float) -> None:
        w.add_float32(key(k), float(v)); meta[key(k)] = (float(v), "FLOAT32")

    def boolean(k: str, v: bool) -> None:
        w.add_bool(key(k), bool(v)); meta[key(k)] = (bool(v), "BOOL")

    def string(k: str, v: str) -> None:
        w.add_string(key(k), v); meta[key(k)] = (v, "STRING")

    def array(k: str, v: list) -> None:
        w.add_array(key(k), v); meta[key(k)] = (list(v), "ARRAY")

    # DeepseekV4Model.__init__: the default chat template (add_chat_template -> add_string)
    string("CHAT_TEMPLATE", CHAT_TEMPLATE)
    # Metadata.set_gguf_meta_model / set_type (the parts a model directory without a card gives)
    string("TYPE", "model")
    string("NAME", "DeepSeek V4 Llama Layout Fixture")
    string("SIZE_LABEL", "16x0.1M")
    # TextModel.set_gguf_parameters (base.py l. 1434-1546), for the keys this config.json has
    u32("BLOCK_COUNT", block_count)
    u32("CONTEXT_LENGTH", hp["max_position_embeddings"])
    u32("EMBEDDING_LENGTH", hp["hidden_size"])
    u32("HEAD_COUNT", hp["num_attention_heads"])
    u32("HEAD_COUNT_KV", hp["num_key_value_heads"])
    if rs is not None:
        string("ROPE_SCALING_TYPE", ROPE_YARN)
        f32("ROPE_SCALING_FACTOR", rs["factor"])
        u32("ROPE_SCALING_ORIG_CTX_LEN", rs["original_max_position_embeddings"])
        f32("ROPE_SCALING_YARN_BETA_FAST", rs["beta_fast"])
        f32("ROPE_SCALING_YARN_BETA_SLOW", rs["beta_slow"])
    f32("ROPE_FREQ_BASE", hp["rope_theta"])
    f32("LAYERNORM_RMS_EPS", hp["rms_norm_eps"])
    u32("EXPERT_COUNT", hp["n_routed_experts"])
    u32("EXPERT_USED_COUNT", hp["num_experts_per_tok"])
    u32("EXPERT_GATING_FUNC", GATING_SQRTSOFTPLUS)
    u32("KEY_LENGTH", hp["head_dim"])
    u32("VALUE_LENGTH", hp["head_dim"])
    u32("FILE_TYPE", FTYPE_MOSTLY_MXFP4_MOE)   # prepare_tensors set ftype before prepare_metadata runs
    # DeepseekV4Model.set_gguf_parameters (deepseek.py l. 663-689)
    u32("ROPE_DIMENSION_COUNT", hp["qk_rope_head_dim"])
    u32("Q_LORA_RANK", hp["q_lora_rank"])
    u32("SLIDING_WINDOW", hp["sliding_window"])
    u32("EXPERT_FEED_FORWARD_LENGTH", hp["moe_intermediate_size"])
    u32("EXPERT_SHARED_COUNT", hp["n_shared_experts"])
    f32("EXPERT_WEIGHTS_SCALE", hp["routed_scaling_factor"])
    boolean("EXPERT_WEIGHTS_NORM", hp["norm_topk_prob"])
    array("SWIGLU_CLAMP_EXP", [hp["swiglu_limit"]] * block_count)
    array("SWIGLU_CLAMP_SHEXP", [hp["swiglu_limit"]] * block_count)
    u32("INDEXER_HEAD_COUNT", hp["index_n_heads"])
    u32("INDEXER_KEY_LENGTH", hp["index_head_dim"])
    u32("INDEXER_TOP_K", hp["index_topk"])
    u32("OUTPUT_GROUP_COUNT", hp["o_groups"])
    u32("OUTPUT_LORA_RANK", hp["o_lora_rank"])
    array("COMPRESS_RATIOS", list(ratios))
    f32("COMPRESS_ROPE_FREQ_BASE", hp["compress_rope_theta"])
    u32("HC_COUNT", hp["hc_mult"])
    u32("HC_SINKHORN_ITERATIONS", hp["hc_sinkhorn_iters"])
    f32("HC_EPSILON", hp["hc_eps"])
    u32("HASH_LAYER_COUNT", hp["num_hash_layers"])
    u32("EMBEDDING_LENGTH_OUT", hp["hidden_size"] * hp["hc_mult"])
    if mtp:
        u32("NEXTN_PREDICT_LAYERS", n_mtp)
    # ModelBase.prepare_metadata: quantization version
    u32("QUANTIZATION_VERSION", GGML_QUANT_VERSION)
    # TextModel.set_vocab -> _set_vocab_gpt2 (base.py l. 1964-1972) + SpecialVocab.add_to_gguf
    tokens, types, merges = vocab_entries(tok, vocab)
    string("TOKENIZER_MODEL", "gpt2")
    string("TOKENIZER_PRE", "deepseek-v3")
    array("TOKENIZER_LIST", tokens)
    array("TOKENIZER_TOKEN_TYPE", types)
    array("TOKENIZER_MERGES", merges)
    u32("TOKENIZER_BOS_ID", tok.token_to_id(BOS))
    u32("TOKENIZER_EOS_ID", tok.token_to_id(EOS))
    u32("TOKENIZER_PAD_ID", tok.token_to_id(EOS))   # DeepSeek's tokenizer_config: pad_token = eos
    boolean("TOKENIZER_ADD_BOS", True)
    boolean("TOKENIZER_ADD_EOS", False)

    # file order as the converter's: generate_extra_tensors runs first and adds the hash tables, then the MXFP4
    # experts, straight to the writer (deepseek.py l. 771-785); the other tensors follow (order is immaterial to
    # readers, which go by name and offset)
    def rank(item: tuple[str, str, np.ndarray]) -> int:
        return 0 if item[0].endswith("tid2eid.weight") else 1 if item[0].endswith("_exps.weight") else 2

    tensors.sort(key=rank)   # stable: blocks stay in order within each group
    sources: dict[str, np.ndarray] = {}
    forms: dict[str, str] = {}
    stored: dict[str, np.ndarray] = {}
    for name, form, src in tensors:
        assert name not in sources, name
        data = _stored(form, src)
        if form in ("f32", "i32"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=_QTYPE[form])
        sources[name], forms[name], stored[name] = src, form, data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"path": path, "hparams": hp, "metadata": meta, "tensors": sources, "forms": forms,
            "qtypes": {n: _QTYPE[f] for n, f in forms.items()}, "stored": stored, "tokenizer": tok,
            "tokens": tokens, "token_types": types, "merges": merges, "vocab_size": vocab,
            "chat_template": CHAT_TEMPLATE, "block_count": block_count}
