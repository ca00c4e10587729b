"""The tensor inventory of a DeepSeek-V4-Flash GGUF (docs/gguf-layout.md, "Tensors").

For a :class:`~ds4c.config.Ds4Config`, :func:`tensor_specs` lists every tensor a model file must hold, with
its GGUF name, its shape in **torch order** (the reverse of the ggml order the GGUF spec lists: a projection
``[out, in]``, experts ``[n_expert, out, in]``) and its *role*, the storage class of the official checkpoint
(spec section 2.1):

* ``fp8``  FP8 block weights officially (wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared expert);
* ``fp4``  MXFP4 routed experts;
* ``bf16`` BF16 matrices (embedding, head, compressor projections, router, indexer proj);
* ``norm`` RMSNorm gains: BF16 in the checkpoint, stored F32 by llama.cpp's converter (every 1-D tensor);
* ``f32``  F32 tensors (HC parameters, compressor ``ape``, sinks, router bias);
* ``i32``  the hash-routing table ``tid2eid``.

A role decides which GGUF types a reader accepts and which type each ``--formats`` choice writes
(:func:`storage_types`: a K-quant / IQ4_XS choice falls back to Q8_0 for tensors whose rows are not a multiple
of 256 values; docs/gguf-layout.md "K-quants"). Names and
types are those llama.cpp's converter (``conversion/deepseek.py``, ``DeepseekV4Model``) writes from the official
checkpoint; docs/gguf-layout.md records what was taken from it. Files of ds4c 0.1 (bare HC base/scale names,
BF16 norm gains, no tokenizer) still load: :data:`LEGACY_NAMES` maps their names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4c.config import Ds4Config
from ds4c.quant import QK_K, SUPER_BLOCK_NAMES, SUPER_BLOCKS, GGMLType, is_super_block

ROLE_FP8, ROLE_FP4, ROLE_BF16, ROLE_NORM, ROLE_F32, ROLE_I32 = "fp8", "fp4", "bf16", "norm", "f32", "i32"

_K = tuple(SUPER_BLOCKS)  # the K-quants and IQ4_XS

# GGUF types a reader accepts per role. Quantized roles may also be stored wider (bf16/f16/f32). The K-quants and
# IQ4_XS are what llama.cpp's llama-quantize writes: any of them for the routed experts (the file's type) and
# for the other matrices, whose type it mixes per tensor (Q4_K..Q6_K for attention and the shared expert,
# Q2_K/Q3_K in the small types, Q6_K / Q8_0 for token_embd and output, the file's type for the embedding).
ACCEPTED_TYPES: dict[str, tuple[GGMLType, ...]] = {
    ROLE_FP8: (GGMLType.Q8_0,) + _K + (GGMLType.BF16, GGMLType.F16, GGMLType.F32),
    ROLE_FP4: (GGMLType.MXFP4,) + _K + (GGMLType.Q8_0, GGMLType.BF16, GGMLType.F16, GGMLType.F32),
    ROLE_BF16: (GGMLType.BF16, GGMLType.F16, GGMLType.F32, GGMLType.Q8_0) + _K,
    ROLE_NORM: (GGMLType.F32, GGMLType.BF16, GGMLType.F16),
    ROLE_F32: (GGMLType.F32,),
    ROLE_I32: (GGMLType.I32,),
}

_OFFICIAL = {ROLE_FP8: GGMLType.Q8_0, ROLE_FP4: GGMLType.MXFP4, ROLE_BF16: GGMLType.BF16,
             ROLE_NORM: GGMLType.F32, ROLE_F32: GGMLType.F32, ROLE_I32: GGMLType.I32}

# Type written per role for each `make-model --formats` choice. Apply it per tensor with storage_types (a
# K-quant choice cannot store rows that are not whole super-blocks).
FORMATS: dict[str, dict[str, GGMLType]] = {
    "official": dict(_OFFICIAL),
    "bf16": {ROLE_FP8: GGMLType.BF16, ROLE_FP4: GGMLType.BF16, ROLE_BF16: GGMLType.BF16,
             ROLE_NORM: GGMLType.F32, ROLE_F32: GGMLType.F32, ROLE_I32: GGMLType.I32},
    # every float tensor F32: the same model with no rounding in any engine's weight products (llama.cpp
    # quantizes activations to Q8_0 for Q8_0/MXFP4 weights and to bf16 for BF16 ones); for exact comparisons
    "f32": {ROLE_FP8: GGMLType.F32, ROLE_FP4: GGMLType.F32, ROLE_BF16: GGMLType.F32,
            ROLE_NORM: GGMLType.F32, ROLE_F32: GGMLType.F32, ROLE_I32: GGMLType.I32},
    # official, with the routed experts in a K-quant / IQ4_XS type: "q2_k", ..., "q6_k", "iq4_xs"
    **{name: {**_OFFICIAL, ROLE_FP4: t} for name, t in SUPER_BLOCK_NAMES.items()},
    # every FP8 and FP4 weight (projections, shared and routed experts) in that type: "q2_k_all", ..., the shape of
    # a llama-quantize K-quant mix (Q4_K_M, Q3_K_M, ...), whose projections are K-quants too
    **{f"{name}_all": {**_OFFICIAL, ROLE_FP8: t, ROLE_FP4: t} for name, t in SUPER_BLOCK_NAMES.items()},
}

KQUANT_FALLBACK = GGMLType.Q8_0
"""The type a tensor takes instead of a K-quant / IQ4_XS one when its rows (last dim) are not a multiple of 256
values (e.g. the ``tiny`` preset's expert down projection, rows of 128): a block-32 format ds4c reads (every
ds4c row is a multiple of 32) at least as precise as any K-quant. llama.cpp's quantizer falls back too, to
IQ4_NL / Q5_0 / Q5_1 / Q8_0 by type, which ds4c does not read; DeepSeek-V4-Flash itself has no such rows (all
its matrices' rows are multiples of 256), so only ds4c's small synthetic presets meet this rule."""


def storage_type(spec: "TensorSpec", types: dict[str, GGMLType]) -> GGMLType:
    """The GGUF type tensor ``spec`` is stored in under the role table ``types`` (a :data:`FORMATS` value):
    ``types[spec.role]``, or :data:`KQUANT_FALLBACK` (Q8_0) when that is a K-quant / IQ4_XS type and the rows
    of ``spec`` are not a multiple of 256 values."""
    t = types[spec.role]
    if is_super_block(t) and (not spec.shape or spec.shape[-1] % QK_K):
        return KQUANT_FALLBACK
    return t


def storage_types(cfg: Ds4Config, formats: str | dict[str, GGMLType] = "official",
                  specs: "list[TensorSpec] | None" = None) -> dict[str, GGMLType]:
    """``{tensor name: GGUF type}`` of every tensor of ``cfg`` (or of ``specs``) under ``formats`` (a
    :data:`FORMATS` name or a role -> type table), with the Q8_0 fallback of :func:`storage_type`.

    Raises:
        ConfigError: an unknown formats name.
    """
    if isinstance(formats, str):
        if formats not in FORMATS:
            from ds4c.errors import ConfigError

            raise ConfigError(f"unknown formats {formats!r}: expected one of {sorted(FORMATS)}")
        formats = FORMATS[formats]
    return {s.name: storage_type(s, formats) for s in (tensor_specs(cfg) if specs is None else specs)}


def legacy_names(cfg: Ds4Config) -> dict[str, str]:
    """``{ds4c 0.1 name: name llama.cpp's converter writes}``: the HC base/scale tensors, which ds4c 0.1 wrote
    without the ``.weight`` suffix."""
    out = {f"output_hc_{k}": f"output_hc_{k}.weight" for k in ("base", "scale")}
    for layer in range(cfg.n_layers):
        for sub in ("attn", "ffn"):
            for k in ("base", "scale"):
                out[f"blk.{layer}.hc_{sub}_{k}"] = f"blk.{layer}.hc_{sub}_{k}.weight"
    return out


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model file: GGUF ``name``, ``shape`` in torch order, storage ``role``, and
    ``layer`` (-1 for global tensors)."""

    name: str
    shape: tuple[int, ...]
    role: str
    layer: int = -1

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def layer_tensor_specs(cfg: Ds4Config, layer: int) -> list[TensorSpec]:
    """The tensors of block ``layer`` (``blk.N.*``), in file order."""
    D, H, hd = cfg.hidden_size, cfg.n_heads, cfg.head_dim
    r = cfg.ratio(layer)
    p = f"blk.{layer}."
    out: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], role: str) -> None:
        out.append(TensorSpec(p + name, tuple(shape), role, layer))

    for sub in ("attn", "ffn"):
        add(f"hc_{sub}_fn.weight", (cfg.n_mix, cfg.hc_dim), ROLE_F32)
        add(f"hc_{sub}_base.weight", (cfg.n_mix,), ROLE_F32)
        add(f"hc_{sub}_scale.weight", (3,), ROLE_F32)
    add("attn_norm.weight", (D,), ROLE_NORM)
    add("ffn_norm.weight", (D,), ROLE_NORM)
    add("attn_q_a.weight", (cfg.q_lora_rank, D), ROLE_FP8)
    add("attn_q_a_norm.weight", (cfg.q_lora_rank,), ROLE_NORM)
    add("attn_q_b.weight", (H * hd, cfg.q_lora_rank), ROLE_FP8)
    add("attn_kv.weight", (hd, D), ROLE_FP8)
    add("attn_kv_a_norm.weight", (hd,), ROLE_NORM)
    add("attn_output_a.weight", (cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * hd), ROLE_FP8)
    add("attn_output_b.weight", (D, cfg.o_groups * cfg.o_lora_rank), ROLE_FP8)
    add("attn_sinks.weight", (H,), ROLE_F32)
    if r != 0:
        c = 2 if r == 4 else 1  # ratio-4 compressors carry the overlap half
        add("attn_compressor_kv.weight", (c * hd, D), ROLE_BF16)
        add("attn_compressor_gate.weight", (c * hd, D), ROLE_BF16)
        add("attn_compressor_ape.weight", (r, c * hd), ROLE_F32)
        add("attn_compressor_norm.weight", (hd,), ROLE_NORM)
    if r == 4:
        ihd = cfg.index_head_dim
        add("indexer.attn_q_b.weight", (cfg.index_n_heads * ihd, cfg.q_lora_rank), ROLE_FP8)
        add("indexer.proj.weight", (cfg.index_n_heads, D), ROLE_BF16)
        add("indexer_compressor_kv.weight", (2 * ihd, D), ROLE_BF16)
        add("indexer_compressor_gate.weight", (2 * ihd, D), ROLE_BF16)
        add("indexer_compressor_ape.weight", (4, 2 * ihd), ROLE_F32)
        add("indexer_compressor_norm.weight", (ihd,), ROLE_NORM)
    E, F = cfg.n_experts, cfg.moe_inter
    add("ffn_gate_inp.weight", (E, D), ROLE_BF16)
    if cfg.is_hash_layer(layer):
        add("ffn_gate_tid2eid.weight", (cfg.vocab_size, cfg.n_active_experts), ROLE_I32)
    else:
        add("exp_probs_b.bias", (E,), ROLE_F32)
    add("ffn_gate_exps.weight", (E, F, D), ROLE_FP4)
    add("ffn_up_exps.weight", (E, F, D), ROLE_FP4)
    add("ffn_down_exps.weight", (E, D, F), ROLE_FP4)
    add("ffn_gate_shexp.weight", (F, D), ROLE_FP8)
    add("ffn_up_shexp.weight", (F, D), ROLE_FP8)
    add("ffn_down_shexp.weight", (D, F), ROLE_FP8)
    return out


def nextn_tensor_specs(cfg: Ds4Config, block: int, optional: bool = False) -> list[TensorSpec]:
    """The tensors of the MTP (nextn) block ``block`` (``blk.<block>.*``, ``block >= cfg.n_layers``) as
    llama.cpp's converter writes them for a ``--mtp`` conversion: a whole transformer block (HC, attention,
    MoE; compress ratio ``compress_ratios[block]`` when the array reaches that far, else 0) plus
    ``nextn.eh_proj`` ``[D, 2D]`` (the official e_proj and h_proj concatenated along the input; Q8_0),
    ``nextn.enorm``, ``nextn.hnorm`` and ``nextn.shared_head_norm`` (F32 gains, spec section 7).

    Args:
        optional: list instead the tensors llama.cpp's loader treats as optional (``nextn.embed_tokens`` and
            ``nextn.shared_head_head`` ``[vocab, D]``; the converter writes neither, the block shares the
            trunk's embedding and head).
    """
    D = cfg.hidden_size
    p = f"blk.{block}.nextn."
    if optional:
        return [TensorSpec(p + "embed_tokens.weight", (cfg.vocab_size, D), ROLE_BF16, block),
                TensorSpec(p + "shared_head_head.weight", (cfg.vocab_size, D), ROLE_BF16, block)]
    ratio = cfg.compress_ratios[block] if block < len(cfg.compress_ratios) else 0
    body = layer_tensor_specs(cfg.replace(compress_ratios=tuple(cfg.compress_ratios[:block]) + (ratio,)), block)
    return body + [
        TensorSpec(p + "eh_proj.weight", (D, 2 * D), ROLE_FP8, block),
        TensorSpec(p + "enorm.weight", (D,), ROLE_NORM, block),
        TensorSpec(p + "hnorm.weight", (D,), ROLE_NORM, block),
        TensorSpec(p + "shared_head_norm.weight", (D,), ROLE_NORM, block),
    ]


def root_tensor_specs(cfg: Ds4Config) -> list[TensorSpec]:
    """The tensors outside the blocks (embedding, output HC, norm and head): those an MTP-only file of the
    converter's ``--mtp`` export shares with the trunk."""
    return [s for s in tensor_specs(cfg) if s.layer < 0]


def tensor_specs(cfg: Ds4Config) -> list[TensorSpec]:
    """Every tensor of the model, in file order: embedding, the blocks, then the head."""
    D = cfg.hidden_size
    specs = [TensorSpec("token_embd.weight", (cfg.vocab_size, D), ROLE_BF16)]
    for layer in range(cfg.n_layers):
        specs += layer_tensor_specs(cfg, layer)
    specs += [
        TensorSpec("output_hc_fn.weight", (cfg.hc_mult, cfg.hc_dim), ROLE_F32),
        TensorSpec("output_hc_base.weight", (cfg.hc_mult,), ROLE_F32),
        TensorSpec("output_hc_scale.weight", (1,), ROLE_F32),
        TensorSpec("output_norm.weight", (D,), ROLE_NORM),
        TensorSpec("output.weight", (cfg.vocab_size, D), ROLE_BF16),
    ]
    return specs
