"""Our GGUF models in the Hugging Face ``transformers`` port of DeepSeek-V4 (``DeepseekV4ForCausalLM``).

A peer to time next to the compiled step (``ds4c bench``): the same model's weights, run by the port users run
today, eager PyTorch, one-token decode (or a q-token verify) after the same prefill, through the port's own cache.
``transformers`` is optional: nothing here imports it until a function needs it, and those functions raise
:class:`HFPortUnavailable` (a :class:`~ds4c.errors.Ds4cError`) with the reason when it is missing.

Written against ``transformers`` 5.17.0 (``models/deepseek_v4``). What it provides:

* :func:`hf_config` maps a :class:`~ds4c.config.Ds4Config` onto ``DeepseekV4Config``;
* :func:`hf_weight_map` is the explicit name table HF parameter/buffer -> GGUF tensor(s);
* :func:`load_hf_model` builds the port on a device without random initialisation and fills every parameter
  and persistent buffer exactly once from the GGUF tensors, dequantized (the port's plain path: no
  ``quantization_config``, so FP8/Q8_0 weights and MXFP4 experts become ``dtype`` tensors; the port's FP8
  quantizer, which the official checkpoint would use, is not involved);
  (:func:`build_empty_model`, :func:`mapping_problems` and :func:`hf_model_bytes` expose its parts: the
  uninitialised port, the map's completeness check, the bytes it will hold);
* :func:`time_hf_decode` / :func:`time_hf_verify` / :func:`time_hf_widths` time one step of 1 / q tokens
  after a prefill, every timed step from a copy of the same post-prefill cache;
* :func:`hf_logits` runs a prefill then one-token decodes and returns every position's logits (for
  cross-checks against :class:`ds4c.reference.Reference`).

Cross-check on ``tiny`` (CPU, 48 tokens: window, CSA/indexer top-k and HCA flushes all exercised): the fp32 port
against the reference with ``quant_emulation=False`` differs by 4-6e-3 relative L2 per logits row (the
reference's bf16 roundings), same argmax everywhere; 2 rows of 48 reach 5e-2..7e-2 where layer 5's scored
router picks one different expert on a near tie (forcing the reference's expert ids makes every row <= 6.3e-3).
The bf16 port: 7-9e-3, same near-tie rows. Against the reference *with* emulation: ~2.8e-2, like the reference
with emulation on vs off. A q-token chunk through the port's cache equals q one-token decodes (fp32, 4e-7).

Usage (the benchmark's eager peer on a GPU; flash-l4 in bf16 holds about 55 GB)::

    mf = open_model("flash-l4.gguf")
    model = load_hf_model(mf, "cuda", torch.bfloat16)
    ms = time_hf_widths(model, prompt_ids, next_ids, widths=[1, 2, 3, 4, 5], repeats=20)

Semantics of the port that differ from the reference (docs/model.md), found by reading the port:

* no quantization emulation at all: no activation FP8 before FP8/FP4 projections, no KV FP8 fake-quant, no
  indexer FP4 fake-quant (compare with ``quant_emulation=False``);
* no Hadamard rotation in the indexer (orthogonal on both q and keys, so scores agree up to rounding);
* in ``bfloat16`` only our F32-role tensors stay fp32 (HC parameters, sinks, compressor ``ape`` =
  ``position_bias``, router bias: all named by the port's ``_keep_in_fp32_modules_strict``); everything else,
  including the compressor/indexer projections, router and head, is bf16 (the reference holds those in fp32).
  The port's ``from_pretrained(dtype=bfloat16)`` would also make the norm gains fp32, and then its forward
  fails in 5.17.0 (an fp32 RMSNorm weight promotes the normed activation to fp32, which meets a bf16 linear:
  ``RuntimeError: expected m1 and m2 to have the same dtype``; reproduced with ``save_pretrained`` +
  ``from_pretrained`` on tiny). Our norm gains are BF16-role values, so bf16 storage is exact;
* the routing weight multiplies the expert's output after ``down_proj`` (the reference: the intermediate
  before ``w2``), the compressor softmax-weighted sum is in the projection dtype, attention is a dense
  softmax over window + all compressed rows with a -inf mask (the reference: chunked online softmax over the
  selected list): equal in exact arithmetic, different roundings.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ds4c.config import Ds4Config
from ds4c.errors import Ds4cError
from ds4c.gguf_file import ModelFile
from ds4c.quant import GGMLType, dequantize
from ds4c.tensors import ROLE_F32, ROLE_FP4, ROLE_I32, tensor_specs

CSA_TYPE, HCA_TYPE, SWA_TYPE = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# GGUF tensors the port has no use for, by design; empty today (every tensor of our inventory is mapped).
UNUSED_GGUF: frozenset[str] = frozenset()


class HFPortUnavailable(Ds4cError):
    """``transformers`` with ``DeepseekV4ForCausalLM`` is not importable, or the config cannot be expressed in
    the port (the message says which field and why)."""


def _transformers() -> Any:
    try:
        import transformers
        for name in ("DeepseekV4Config", "DeepseekV4ForCausalLM", "DynamicCache"):
            getattr(transformers, name)  # the lazy module imports the port here
    except Exception as e:  # ImportError, or a broken install raising something else at import
        raise HFPortUnavailable(
            f"the transformers DeepSeek-V4 port is not importable ({type(e).__name__}: {e}); "
            f"install transformers>=5.17 (pip install transformers==5.17.0) to use ds4c.hf_port") from None
    return transformers


def available() -> tuple[bool, str]:
    """``(True, version)`` when ``DeepseekV4ForCausalLM`` is importable, else ``(False, reason)``."""
    try:
        return True, _transformers().__version__
    except HFPortUnavailable as e:
        return False, str(e)


# -------------------------------------------------------------------------------------------------- config
def hf_config(cfg: Ds4Config) -> Any:
    """The ``transformers.DeepseekV4Config`` of ``cfg``.

    Every hyper-parameter of :class:`Ds4Config` that the model uses maps onto a port field: widths
    (``hidden_size``, ``num_attention_heads``, ``head_dim``, ``q_lora_rank``, ``o_lora_rank``, ``o_groups``,
    ``moe_intermediate_size``, ``vocab_size``), RoPE (``partial_rotary_factor = rope_dim / head_dim``,
    ``rope_theta`` for SWA layers, ``compress_rope_theta`` + YaRN ``{factor, original_max_position_embeddings,
    beta_fast, beta_slow}`` with ``attention_factor = 1`` for compressing layers), ``sliding_window``, one
    ``layer_types`` entry per layer from ``compress_ratios`` (0 SWA, 4 CSA, other HCA) with
    ``compress_rates``, the indexer (``index_n_heads``, ``index_head_dim``, ``index_topk``), MoE
    (``n_routed_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``mlp_layer_types`` = ``hash_moe``
    for the first ``n_hash_layers``, ``scoring_func = sqrtsoftplus``, ``norm_topk_prob``,
    ``routed_scaling_factor``, ``swiglu_limit``), HC (``hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps``),
    ``rms_norm_eps``, ``max_position_embeddings``, bos/eos ids. ``tie_word_embeddings`` is false and
    ``num_nextn_predict_layers`` 0 (our files carry no MTP/DSpark stages). ``quant_emulation`` has no
    counterpart (the port never emulates quantization).

    Raises:
        HFPortUnavailable: transformers is missing, or ``cfg`` has HCA layers of different ratios (the port has
            one ``compress_rates`` entry per layer type), or the port derives a RoPE width other than
            ``rope_dim`` from ``head_dim``.
    """
    tf = _transformers()
    ratios = list(cfg.compress_ratios[: cfg.n_layers])
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise HFPortUnavailable(f"config {cfg.name!r}: the port has one HCA compress rate, found HCA ratios {hca}")
    layer_types = [SWA_TYPE if r == 0 else CSA_TYPE if r == 4 else HCA_TYPE for r in ratios]
    hc = tf.DeepseekV4Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        moe_intermediate_size=cfg.moe_inter,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        num_experts_per_tok=cfg.n_active_experts,
        n_routed_experts=cfg.n_experts,
        n_shared_experts=cfg.n_shared_experts,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=cfg.route_scale,
        max_position_embeddings=cfg.max_position,
        rope_theta=cfg.rope_theta,
        layer_types=layer_types,
        compress_rates={CSA_TYPE: 4, HCA_TYPE: hca[0] if hca else 128},
        compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={
            "rope_type": "yarn", "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_seq_len,
            "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
        },
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        swiglu_limit=cfg.swiglu_limit,
        sliding_window=cfg.window,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk,
        num_nextn_predict_layers=0,
        hidden_act="silu",
        rms_norm_eps=cfg.norm_eps,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        tie_word_embeddings=False,
    )
    if hc.qk_rope_head_dim != cfg.rope_dim:
        raise HFPortUnavailable(f"config {cfg.name!r}: the port derives a RoPE width of {hc.qk_rope_head_dim} "
                                f"from head_dim={cfg.head_dim}, expected rope_dim={cfg.rope_dim}")
    return hc


# -------------------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class WeightMap:
    """One HF parameter or persistent buffer and where its values come from.

    ``hf``: the name in ``model.state_dict()``; ``gguf``: the GGUF tensor(s); ``kind``: ``"copy"`` (one tensor,
    same torch-order shape) or ``"cat1"`` (the tensors concatenated along dim 1: ``gate_up_proj`` =
    ``[gate_exps ; up_exps]`` per expert, ``[E, 2F, D]``).
    """

    hf: str
    gguf: tuple[str, ...]
    kind: str = "copy"


def hf_weight_map(cfg: Ds4Config) -> list[WeightMap]:
    """The explicit name table: every HF parameter/persistent buffer of the port for ``cfg`` with its GGUF
    source(s) (names of :mod:`ds4c.tensors`). Every GGUF tensor of :func:`ds4c.tensors.tensor_specs` appears
    exactly once."""
    out = [
        WeightMap("model.embed_tokens.weight", ("token_embd.weight",)),
        WeightMap("lm_head.weight", ("output.weight",)),
        WeightMap("model.norm.weight", ("output_norm.weight",)),
        WeightMap("model.hc_head.hc_fn", ("output_hc_fn.weight",)),
        WeightMap("model.hc_head.hc_base", ("output_hc_base.weight",)),
        WeightMap("model.hc_head.hc_scale", ("output_hc_scale.weight",)),
    ]
    for i in range(cfg.n_layers):
        h, g = f"model.layers.{i}.", f"blk.{i}."
        pairs = [
            ("attn_hc.fn", "hc_attn_fn.weight"), ("attn_hc.base", "hc_attn_base.weight"), ("attn_hc.scale", "hc_attn_scale.weight"),
            ("ffn_hc.fn", "hc_ffn_fn.weight"), ("ffn_hc.base", "hc_ffn_base.weight"), ("ffn_hc.scale", "hc_ffn_scale.weight"),
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
            ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
            ("self_attn.q_a_norm.weight", "attn_q_a_norm.weight"),
            ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
            ("self_attn.kv_proj.weight", "attn_kv.weight"),
            ("self_attn.kv_norm.weight", "attn_kv_a_norm.weight"),
            ("self_attn.o_a_proj.weight", "attn_output_a.weight"),
            ("self_attn.o_b_proj.weight", "attn_output_b.weight"),
            ("self_attn.sinks", "attn_sinks.weight"),
            ("mlp.gate.weight", "ffn_gate_inp.weight"),
            ("mlp.experts.down_proj", "ffn_down_exps.weight"),
            ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
            ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
            ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
        ]
        r = cfg.ratio(i)
        if r:
            c = "self_attn.compressor."
            pairs += [(c + "kv_proj.weight", "attn_compressor_kv.weight"),
                      (c + "gate_proj.weight", "attn_compressor_gate.weight"),
                      (c + "position_bias", "attn_compressor_ape.weight"),
                      (c + "kv_norm.weight", "attn_compressor_norm.weight")]
        if r == 4:
            x = "self_attn.compressor.indexer."
            pairs += [(x + "kv_proj.weight", "indexer_compressor_kv.weight"),
                      (x + "gate_proj.weight", "indexer_compressor_gate.weight"),
                      (x + "position_bias", "indexer_compressor_ape.weight"),
                      (x + "kv_norm.weight", "indexer_compressor_norm.weight"),
                      (x + "q_b_proj.weight", "indexer.attn_q_b.weight"),
                      (x + "scorer.weights_proj.weight", "indexer.proj.weight")]
        if cfg.is_hash_layer(i):
            pairs.append(("mlp.gate.tid2eid", "ffn_gate_tid2eid.weight"))
        else:
            pairs.append(("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"))
        out += [WeightMap(h + a, (g + b,)) for a, b in pairs]
        out.append(WeightMap(h + "mlp.experts.gate_up_proj", (g + "ffn_gate_exps.weight", g + "ffn_up_exps.weight"),
                             "cat1"))
    return out


def build_empty_model(cfg: Ds4Config, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16,
                      experts_implementation: str | None = None) -> Any:
    """``DeepseekV4ForCausalLM(hf_config(cfg))`` with its tensors allocated on ``device`` in ``dtype`` and not
    initialised (``transformers.initialization.no_init_weights``; on ``"meta"`` nothing is allocated). The
    RoPE ``inv_freq`` buffers are computed (they are not weights).

    Raises:
        HFPortUnavailable: transformers/DeepseekV4ForCausalLM missing, or the config is not expressible.
    """
    tf = _transformers()
    from transformers.initialization import no_init_weights

    config = hf_config(cfg)
    kw = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    with torch.device(torch.device(device)), no_init_weights():
        return tf.DeepseekV4ForCausalLM._from_config(config, dtype=dtype, **kw)


def mapping_problems(cfg: Ds4Config, model: Any) -> list[str]:
    """Every way :func:`hf_weight_map` fails to be a one-to-one, shape-exact map between the port's
    parameters/persistent buffers (``model.state_dict()``) and the GGUF inventory
    (:func:`ds4c.tensors.tensor_specs`): HF names mapped twice, missing in the port or left unmapped; GGUF
    tensors used twice or not at all; shape mismatches. Empty when the map is complete."""
    specs = {s.name: s for s in tensor_specs(cfg)}
    state = model.state_dict(keep_vars=True)  # parameters + persistent buffers, no copies
    table = hf_weight_map(cfg)
    problems: list[str] = []
    seen = Counter(m.hf for m in table)
    problems += [f"{n}: mapped {k} times" for n, k in seen.items() if k > 1]
    problems += [f"{n}: no such parameter/buffer in the port" for n in seen if n not in state]
    problems += [f"{n}: not mapped (no GGUF source)" for n in state if n not in seen]
    used = Counter(g for m in table for g in m.gguf)
    problems += [f"GGUF {g}: used {k} times" for g, k in used.items() if k > 1]
    problems += [f"GGUF {g}: not used" for g in specs if g not in used and g not in UNUSED_GGUF]
    for m in table:
        if m.hf not in state:
            continue
        if any(g not in specs for g in m.gguf):
            problems.append(f"{m.hf}: GGUF source {m.gguf} not in the model's tensor inventory")
            continue
        shapes = [specs[g].shape for g in m.gguf]
        want = shapes[0] if m.kind == "copy" else (shapes[0][0], sum(s[1] for s in shapes)) + shapes[0][2:]
        if tuple(state[m.hf].shape) != tuple(want):
            problems.append(f"{m.hf}: port shape {list(state[m.hf].shape)}, GGUF {m.gguf} gives {list(want)}")
    return problems


def hf_model_bytes(cfg: Ds4Config, dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes :func:`load_hf_model` holds on its device: ``{"experts", "other", "total"}`` (F32-role tensors
    4 B, ``tid2eid`` 8 B, everything else ``dtype``). flash-l4 in bf16: experts 51.5 GB, total about 55 GB."""
    size = torch.empty((), dtype=dtype).element_size()
    out = {"experts": 0, "other": 0}
    for s in tensor_specs(cfg):
        b = s.numel * (4 if s.role == ROLE_F32 else 8 if s.role == ROLE_I32 else size)
        out["experts" if s.role == ROLE_FP4 else "other"] += b
    out["total"] = out["experts"] + out["other"]
    return out


def _dequant(mf: ModelFile, name: str, device: torch.device, dtype: torch.dtype,
             rows: slice | None = None) -> torch.Tensor:
    """GGUF tensor ``name`` (or experts ``rows`` of a 3-d expert tensor) dequantized on ``device`` to ``dtype``.

    Same decoding as :meth:`ModelFile.tensor` / :meth:`ModelFile.expert` (both call
    :func:`ds4c.quant.dequantize`), but the raw bytes move to ``device`` first, so MXFP4/Q8_0 decode on the GPU.
    """
    t = mf.ggml_type(name)
    shape = mf.specs[name].shape
    raw = mf.raw(name)
    if t == GGMLType.I32:
        return torch.from_numpy(np.array(raw, dtype=np.int64)).reshape(shape).to(device)
    if rows is not None:
        raw = raw[rows]
        shape = (len(range(*rows.indices(shape[0]))),) + tuple(shape[1:])
    with warnings.catch_warnings():  # a read-only memmap: never written through this view
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(np.ascontiguousarray(raw)).to(device)
    return dequantize(src, t, shape, dtype=torch.float32).to(dtype)


def load_hf_model(mf: ModelFile, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                  experts_implementation: str | None = None, expert_chunk: int = 16) -> Any:
    """Build ``DeepseekV4ForCausalLM`` for ``mf.config`` on ``device`` and fill it from the GGUF tensors.

    The modules are created directly on ``device`` with the port's initialisers disabled
    (``transformers.initialization.no_init_weights``): parameters are allocated, never randomly initialised,
    then every parameter and persistent buffer is assigned exactly once through :func:`hf_weight_map`.
    Values are dequantized on ``device`` (Q8_0 and MXFP4 exactly to fp32, then cast to the parameter dtype).
    Parameter dtypes: ``dtype`` everywhere except the GGUF's F32-role tensors (HC ``fn/base/scale``, sinks,
    ``position_bias``, router bias: a subset of the port's ``_keep_in_fp32_modules_strict``), which stay fp32,
    and ``tid2eid`` (int64). Norm gains are ``dtype`` (the port's from_pretrained plan would make them fp32,
    which breaks its bf16 forward in 5.17.0; see the module docstring). ``wo_a`` is rounded to bf16 first
    (as the official ``convert.py`` does; a no-op in bf16).
    Routed experts are plain ``dtype`` 3-d tensors (``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``);
    the port's FP8/FP4 paths are not used.

    Memory on ``device``: the whole model in ``dtype`` (flash-l4 in bf16: about 55 GB, of which routed experts
    4 x 256 x 3 x 2048 x 4096 x 2 B = 51.5 GB; :func:`hf_model_bytes`), plus transient fp32 copies while
    loading: one chunk of ``expert_chunk`` experts (16: 0.5 GB at official widths) or one other tensor (at
    most the embedding/head, 2.1 GB). The raw GGUF bytes are read from the memory-mapped file.

    Args:
        mf: the opened model file.
        device: where the model lives (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        dtype: ``torch.bfloat16`` (the port's usual dtype) or ``torch.float32``.
        experts_implementation: the port's MoE backend (``"eager"``: a Python loop over the hit experts;
            ``"grouped_mm"``: one ``torch._grouped_mm`` per projection; ``"batched_mm"``); ``None`` = what
            the port picks by default (``grouped_mm`` in 5.17.0), i.e. what its users get.
        expert_chunk: experts dequantized at a time.

    Returns:
        the model, in eval mode, gradients off. ``model.config`` is :func:`hf_config` of ``mf.config``.

    Raises:
        HFPortUnavailable: transformers/DeepseekV4ForCausalLM missing, or the config is not expressible.
        Ds4cError: an HF parameter/buffer is unmapped, assigned twice, or of another shape than its GGUF
            source, or a GGUF tensor is left unused (every offender is listed).
    """
    dev = torch.device(device)
    model = build_empty_model(mf.config, dev, dtype, experts_implementation)
    problems = mapping_problems(mf.config, model)
    if problems:
        raise Ds4cError(f"{mf.path}: cannot map the GGUF tensors onto DeepseekV4ForCausalLM "
                        f"({len(problems)} problems):\n  " + "\n  ".join(problems))
    table = hf_weight_map(mf.config)
    state = model.state_dict(keep_vars=True)
    mods = dict(model.named_modules())
    with torch.no_grad():
        for m in table:
            owner, _, leaf = m.hf.rpartition(".")
            mod = mods[owner]
            cur = state[m.hf]
            role = mf.specs[m.gguf[0]].role
            want_dtype = torch.int64 if role == ROLE_I32 else torch.float32 if role == ROLE_F32 else dtype
            if cur.dtype != want_dtype:  # re-allocate in the planned dtype (uninitialised: filled below)
                new = torch.empty(cur.shape, dtype=want_dtype, device=dev)
                if leaf in mod._parameters:
                    mod._parameters[leaf] = torch.nn.Parameter(new, requires_grad=False)
                else:
                    mod._buffers[leaf] = new
                cur = new
            if m.kind == "cat1":
                F = mf.specs[m.gguf[0]].shape[1]
                E = cur.shape[0]
                for e0 in range(0, E, expert_chunk):
                    rows = slice(e0, min(E, e0 + expert_chunk))
                    for k, g in enumerate(m.gguf):
                        cur[rows, k * F:(k + 1) * F].copy_(_dequant(mf, g, dev, want_dtype, rows))
            elif mf.specs[m.gguf[0]].role == ROLE_FP4:
                E = cur.shape[0]
                for e0 in range(0, E, expert_chunk):
                    rows = slice(e0, min(E, e0 + expert_chunk))
                    cur[rows].copy_(_dequant(mf, m.gguf[0], dev, want_dtype, rows))
            else:
                src = _dequant(mf, m.gguf[0], dev, torch.float32 if want_dtype.is_floating_point else want_dtype)
                if m.gguf[0].endswith("attn_output_a.weight"):
                    src = src.to(torch.bfloat16)
                cur.copy_(src.to(want_dtype))
    model.eval()
    model.requires_grad_(False)
    return model


# -------------------------------------------------------------------------------------------------- running
def _device(model: Any) -> torch.device:
    return model.lm_head.weight.device


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def new_cache(model: Any) -> Any:
    """An empty port cache (``DynamicCache`` with the port's per-layer SWA / CSA / HCA cache layers)."""
    from transformers import DynamicCache
    return DynamicCache(config=model.config)


def _inputs(model: Any, tokens: Sequence[int], pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    dev = _device(model)
    ids = torch.tensor([[int(t) for t in tokens]], dtype=torch.long, device=dev)
    position_ids = torch.arange(pos, pos + len(tokens), device=dev).unsqueeze(0)
    return ids, position_ids


def _forward(model: Any, ids: torch.Tensor, position_ids: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=position_ids, past_key_values=cache, use_cache=True,
                logits_to_keep=keep)
    return out.logits[0]


def _step(model: Any, tokens: Sequence[int], pos: int, cache: Any, keep: int) -> torch.Tensor:
    return _forward(model, *_inputs(model, tokens, pos), cache, keep)


def prefill(model: Any, tokens: Sequence[int]) -> Any:
    """Run ``tokens`` (positions 0..n-1) through the port in one call; returns the filled cache.

    Raises:
        Ds4cError: ``tokens`` is empty or holds ids outside the vocabulary.
    """
    _check_tokens(model, tokens, "prefill")
    cache = new_cache(model)
    with torch.inference_mode():
        _step(model, tokens, 0, cache, 1)
    return cache


def _check_tokens(model: Any, tokens: Sequence[int], what: str) -> None:
    if len(tokens) == 0:
        raise Ds4cError(f"{what}: expected at least one token, found none")
    V = model.config.vocab_size
    bad = [t for t in tokens if not 0 <= int(t) < V]
    if bad:
        raise Ds4cError(f"{what}: token ids must be in 0..{V - 1}, found {bad[:8]}")


def hf_logits(model: Any, tokens: Sequence[int], n_prefill: int | None = None) -> torch.Tensor:
    """Logits of every position: ``tokens[:n_prefill]`` in one prefill call (default: the first token only),
    then one decode call per remaining token through the cache.

    Returns:
        fp32 ``[len(tokens), vocab]`` on the CPU.

    Raises:
        Ds4cError: empty ``tokens``, ids outside the vocabulary, or ``n_prefill`` outside 1..len(tokens).
    """
    _check_tokens(model, tokens, "hf_logits")
    n = 1 if n_prefill is None else n_prefill
    if not 1 <= n <= len(tokens):
        raise Ds4cError(f"hf_logits: n_prefill must be in 1..{len(tokens)}, found {n_prefill}")
    cache = new_cache(model)
    rows = []
    with torch.inference_mode():
        rows.append(_step(model, tokens[:n], 0, cache, 0).float().cpu())
        for p in range(n, len(tokens)):
            rows.append(_step(model, tokens[p:p + 1], p, cache, 0).float().cpu())
    return torch.cat(rows)


def _time_from(model: Any, snap: Any, pos: int, tokens: Sequence[int], repeats: int, warmup: int) -> float:
    dev = _device(model)
    ids, position_ids = _inputs(model, tokens, pos)
    times = []
    with torch.inference_mode():
        for r in range(warmup + repeats):
            cache = copy.deepcopy(snap)  # outside the timed region
            _sync(dev)
            t0 = time.perf_counter()
            _forward(model, ids, position_ids, cache, 0)
            _sync(dev)
            if r >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_hf_widths(model: Any, prefill_tokens: Sequence[int], tokens: Sequence[int], widths: Sequence[int],
                   repeats: int, warmup: int = 2) -> dict[int, float]:
    """``{q: median ms}`` for each width q in ``widths``: one forward of ``tokens[:q]`` after a single prefill
    of ``prefill_tokens``, each timed step from a copy of the same post-prefill cache (see
    :func:`time_hf_verify`).

    Raises:
        Ds4cError: empty prefill, ids outside the vocabulary, a width outside 1..len(tokens), or
            ``repeats < 1``.
    """
    if repeats < 1:
        raise Ds4cError(f"repeats must be >= 1, found {repeats}")
    bad = [q for q in widths if not 1 <= q <= len(tokens)]
    if bad:
        raise Ds4cError(f"widths must be in 1..len(tokens)={len(tokens)}, found {bad}")
    _check_tokens(model, tokens, "step tokens")
    snap = prefill(model, prefill_tokens)
    return {q: _time_from(model, snap, len(prefill_tokens), tokens[:q], repeats, warmup) for q in widths}


def time_hf_verify(model: Any, prefill_tokens: Sequence[int], tokens: Sequence[int], repeats: int,
                   warmup: int = 2) -> float:
    """Median wall time in ms of one port forward of ``q = len(tokens)`` tokens at positions
    ``P .. P+q-1`` (``P = len(prefill_tokens)``) through the cache after a prefill of ``prefill_tokens``.

    The prefill runs once (untimed); each timed step starts from a deep copy of the post-prefill cache made
    outside the timed region, so every step does the same work (same window, same compressor buffers, same
    compressed rows). Inputs are on the device before timing; logits of all q rows are computed (a verify
    needs them) and stay on the device. CUDA is synchronised before and after each timed step (wall clock,
    so Python/launch overhead of the eager port is included, as users see it). ``q = 1`` is a decode step
    (see :func:`time_hf_decode`); the port accepts any q with a cache (its compressors buffer partial
    windows; on tiny a q-token chunk equals q sequential decodes to 1e-6 in fp32), so widths 2..5 are
    verify steps.

    Raises:
        Ds4cError: empty token lists, ids outside the vocabulary, or ``repeats < 1``.
    """
    return time_hf_widths(model, prefill_tokens, tokens, [len(tokens)], repeats, warmup)[len(tokens)]


def time_hf_decode(model: Any, prefill_tokens: Sequence[int], token: int, repeats: int, warmup: int = 2) -> float:
    """Median wall time in ms of one-token decode (``token`` at position ``len(prefill_tokens)``) after a
    prefill of ``prefill_tokens``, with the port's cache; see :func:`time_hf_verify` (``tokens=[token]``).

    Raises:
        Ds4cError: empty prefill, ids outside the vocabulary, or ``repeats < 1``.
    """
    return time_hf_verify(model, prefill_tokens, [token], repeats, warmup)
