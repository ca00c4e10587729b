"""DeepSeek-V4-Flash hyper-parameters (docs/model.md section 1) and their GGUF metadata keys.

:class:`Ds4Config` holds every hyper-parameter the step needs. It is read from and written to GGUF metadata
with the ``deepseek4.*`` keys of docs/gguf-layout.md; keys ds4c adds for itself use the ``ds4c.`` prefix.

Presets:

* ``flash``: the official dimensions, 43 layers (spec section 1.1).
* ``flash-l4``: official widths, 4 layers, one of every layer kind: SWA-only hash-routed, CSA hash-routed,
  HCA scored, CSA scored.
* ``tiny``: small widths for tests, 6 layers in the official pattern (2 SWA hash, CSA hash, HCA, CSA, HCA),
  HCA ratio 16 instead of 128 so flushes happen within a few dozen tokens.
* ``tiny-128``: ``tiny`` with the official HCA ratio 128, ratios (0, 0, 4, 128, 4, 128): the compress ratios
  llama.cpp's loader accepts, for running one file in both engines (docs/interop.md); 16 indexer heads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ds4c.errors import ConfigError

ARCH = "deepseek4"
GATING_SQRT_SOFTPLUS = 4  # deepseek4.expert_gating_func value for sqrt(softplus(z))

MAX_WIDTH = 5  # widest step: q = 1 decode, q = 2..5 speculative verify
MAX_PREFILL_ROWS = 4096  # widest prefill chunk graph (ds4c.ir.builder.build_step(prefill=True))
LAYER_SWA = "swa"  # compress ratio 0: 128-token sliding window only
LAYER_CSA = "csa"  # compress ratio 4: window + indexer-selected compressed rows
LAYER_HCA = "hca"  # any other ratio (128 official): window + all compressed rows


@dataclass(frozen=True)
class Ds4Config:
    """Every hyper-parameter of a DeepSeek-V4-Flash model (spec section 1).

    Widths are element counts; ``*_theta`` are RoPE bases; ``compress_ratios`` has one entry per layer
    (0 = SWA-only, 4 = CSA, 128 = HCA). ``quant_emulation`` is not a model property and is not written to
    GGUF: it turns off all three quantization emulations of the reference at once (activation FP8 before
    FP8/FP4 projections, KV FP8 fake-quant, indexer FP4 fake-quant; spec sections 2.3, P3, P4), for
    comparisons with ports that skip them. Default: the official behaviour (on).

    Raises:
        ConfigError: when the values are inconsistent (see :meth:`validate`).
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    n_layers: int = 43
    n_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    window: int = 128
    moe_inter: int = 2048
    n_experts: int = 256
    n_shared_experts: int = 1
    n_active_experts: int = 6
    n_hash_layers: int = 3
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-6
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position: int = 1048576
    compress_ratios: tuple[int, ...] = field(
        default_factory=lambda: (0, 0) + (4, 128) * 20 + (4,)
    )
    bos_id: int = 0
    eos_id: int = 1
    name: str = "flash"
    quant_emulation: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        self.validate()

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check internal consistency.

        Raises:
            ConfigError: naming the field, the value found and what was expected.
        """

        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"invalid DeepSeek-V4 config {self.name!r}: {what}")

        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "head_dim", "rope_dim", "q_lora_rank",
                  "o_lora_rank", "o_groups", "window", "moe_inter", "n_experts", "n_active_experts",
                  "hc_mult", "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk"):
            need(getattr(self, f) > 0, f"expected {f} > 0, found {getattr(self, f)}")
        need(len(self.compress_ratios) >= self.n_layers,
             f"expected at least n_layers={self.n_layers} compress_ratios, found {len(self.compress_ratios)}")
        for i, r in enumerate(self.compress_ratios[: self.n_layers]):
            need(r == 0 or r == 4 or (r > 4 and r % 4 == 0),
                 f"expected compress_ratios[{i}] in {{0, 4, 8, 12, ...}}, found {r}")
        need(0 <= self.n_hash_layers <= self.n_layers,
             f"expected 0 <= n_hash_layers <= n_layers, found {self.n_hash_layers}")
        need(self.n_active_experts <= self.n_experts,
             f"expected n_active_experts <= n_experts={self.n_experts}, found {self.n_active_experts}")
        need(self.n_shared_experts == 1, f"expected n_shared_experts == 1, found {self.n_shared_experts}")
        need(self.n_heads % self.o_groups == 0,
             f"expected n_heads ({self.n_heads}) divisible by o_groups, found o_groups={self.o_groups}")
        need(self.rope_dim % 2 == 0 and self.rope_dim < self.head_dim,
             f"expected an even rope_dim < head_dim={self.head_dim}, found {self.rope_dim}")
        need(self.nope_dim % 64 == 0,
             f"expected head_dim - rope_dim to be a multiple of 64 (KV FP8 fake-quant blocks, P3), "
             f"found {self.nope_dim}")
        need(self.rope_dim < self.index_head_dim,
             f"expected rope_dim < index_head_dim={self.index_head_dim}, found {self.rope_dim}")
        need(self.index_head_dim & (self.index_head_dim - 1) == 0 and self.index_head_dim % 32 == 0,
             f"expected index_head_dim a power of two >= 32 (Hadamard, FP4 blocks), found {self.index_head_dim}")
        for f in ("hidden_size", "q_lora_rank", "moe_inter"):
            need(getattr(self, f) % 128 == 0,
                 f"expected {f} to be a multiple of 128 (FP8 activation blocks), found {getattr(self, f)}")
        need((self.o_groups * self.o_lora_rank) % 128 == 0,
             f"expected o_groups*o_lora_rank a multiple of 128, found {self.o_groups * self.o_lora_rank}")
        need(self.hc_mult == 4, f"expected hc_mult == 4 (24 mixing logits), found {self.hc_mult}")
        need(self.window >= 1, f"expected window >= 1, found {self.window}")
        for f in ("norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "rope_factor", "route_scale",
                  "swiglu_limit", "beta_fast", "beta_slow"):
            v = getattr(self, f)
            need(math.isfinite(v) and v > 0, f"expected {f} to be a finite number > 0, found {v}")
        need(0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size,
             f"expected bos/eos ids in 0..{self.vocab_size - 1}, found {self.bos_id}/{self.eos_id}")

    # ----------------------------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        """Non-RoPE dims of a 512-wide KV/q row (448 official)."""
        return self.head_dim - self.rope_dim

    @property
    def hc_dim(self) -> int:
        """Width of the flattened HC residual stream (hc_mult * hidden_size = 16384 official)."""
        return self.hc_mult * self.hidden_size

    @property
    def n_mix(self) -> int:
        """HC mixing logits per sub-block: hc_mult pre + hc_mult post + hc_mult^2 comb (24)."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def heads_per_group(self) -> int:
        return self.n_heads // self.o_groups

    def ratio(self, layer: int) -> int:
        """Compress ratio of ``layer`` (0, 4 or the HCA ratio)."""
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """``"swa"``, ``"csa"`` or ``"hca"`` (spec section 1.3)."""
        r = self.compress_ratios[layer]
        return LAYER_SWA if r == 0 else LAYER_CSA if r == 4 else LAYER_HCA

    def is_hash_layer(self, layer: int) -> bool:
        """True for the first ``n_hash_layers`` layers, whose MoE gate is the tid2eid lookup."""
        return layer < self.n_hash_layers

    def rope_base(self, layer: int) -> float:
        return self.rope_theta if self.ratio(layer) == 0 else self.compress_rope_theta

    @property
    def yarn(self) -> bool:
        """Whether the compressing layers scale their RoPE with YaRN: ``rope_factor`` != 1 (a file without
        ``rope.scaling.*`` keys reads as factor 1: no scaling, as llama.cpp runs it)."""
        return self.rope_factor != 1.0

    def uses_yarn(self, layer: int) -> bool:
        """YaRN applies to compressing layers only (spec P6, checklist item 1); with ``rope_factor`` 1 (no
        :attr:`yarn`) their frequencies are the plain ones of ``compress_rope_theta``."""
        return self.ratio(layer) != 0

    # ----------------------------------------------------------------------------------------------
    def model_dict(self) -> dict[str, Any]:
        """The model hyper-parameters (everything but runtime switches), JSON-serialisable."""
        d = dataclasses.asdict(self)
        d.pop("quant_emulation")
        d["compress_ratios"] = list(self.compress_ratios[: self.n_layers])
        return d

    def hash(self) -> str:
        """Stable hex digest of the model hyper-parameters (used in artifact manifests)."""
        blob = json.dumps(self.model_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    def replace(self, **changes: Any) -> "Ds4Config":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# presets

def _flash() -> Ds4Config:
    return Ds4Config()


def _flash_l4() -> Ds4Config:
    return Ds4Config(n_layers=4, compress_ratios=(0, 4, 128, 4), n_hash_layers=2, name="flash-l4")


def _tiny() -> Ds4Config:
    return Ds4Config(
        vocab_size=512, hidden_size=256, n_layers=6, n_heads=4, head_dim=192, rope_dim=64,
        q_lora_rank=128, o_lora_rank=64, o_groups=2, window=16, moe_inter=128, n_experts=16,
        n_active_experts=4, n_hash_layers=3, index_n_heads=4, index_head_dim=128, index_topk=8,
        compress_ratios=(0, 0, 4, 16, 4, 16), max_position=65536, name="tiny",
    )


def _tiny_128() -> Ds4Config:
    # llama.cpp's deepseek4 loader accepts compress ratios 0, 4 and 128 only: tiny widths, the official ratios.
    # 16 indexer heads instead of 4: a block's indexer score is a sum of per-head ReLUs, exactly 0 for about one
    # block in 2^heads; at the top-k boundary such ties are broken by index (the spec: lower first) and
    # llama.cpp's top-k breaks them otherwise, so with 4 heads the engines pick different blocks now and then
    return _tiny().replace(compress_ratios=(0, 0, 4, 128, 4, 128), index_n_heads=16, name="tiny-128")


PRESETS = {"flash": _flash, "flash-l4": _flash_l4, "tiny": _tiny, "tiny-128": _tiny_128}


def preset(name: str) -> Ds4Config:
    """Return the named preset (``flash``, ``flash-l4``, ``tiny``, ``tiny-128``).

    Raises:
        ConfigError: for an unknown name, listing the known ones.
    """
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}: expected one of {sorted(PRESETS)}") from None


# --------------------------------------------------------------------------------------------------
# GGUF metadata: (key without the arch prefix, field, kind). kind: u32, f32, bool, arr_i32, arr_f32.

_P = ARCH + "."
_KEYS: list[tuple[str, str, str]] = [
    ("embedding_length", "hidden_size", "u32"),
    ("block_count", "n_layers", "u32"),
    ("context_length", "max_position", "u32"),
    ("attention.head_count", "n_heads", "u32"),
    ("attention.key_length", "head_dim", "u32"),
    ("attention.value_length", "head_dim", "u32"),
    ("rope.dimension_count", "rope_dim", "u32"),
    ("attention.q_lora_rank", "q_lora_rank", "u32"),
    ("attention.output_lora_rank", "o_lora_rank", "u32"),
    ("attention.output_group_count", "o_groups", "u32"),
    ("attention.sliding_window", "window", "u32"),
    ("attention.layer_norm_rms_epsilon", "norm_eps", "f32"),
    ("attention.compress_ratios", "compress_ratios", "arr_i32"),
    ("attention.compress_rope_freq_base", "compress_rope_theta", "f32"),
    ("attention.indexer.head_count", "index_n_heads", "u32"),
    ("attention.indexer.key_length", "index_head_dim", "u32"),
    ("attention.indexer.top_k", "index_topk", "u32"),
    ("rope.freq_base", "rope_theta", "f32"),
    ("rope.scaling.factor", "rope_factor", "f32"),
    ("rope.scaling.original_context_length", "original_seq_len", "u32"),
    ("rope.scaling.yarn_beta_fast", "beta_fast", "f32"),
    ("rope.scaling.yarn_beta_slow", "beta_slow", "f32"),
    ("expert_count", "n_experts", "u32"),
    ("expert_used_count", "n_active_experts", "u32"),
    ("expert_shared_count", "n_shared_experts", "u32"),
    ("expert_feed_forward_length", "moe_inter", "u32"),
    ("expert_weights_scale", "route_scale", "f32"),
    ("hash_layer_count", "n_hash_layers", "u32"),
    ("hyper_connection.count", "hc_mult", "u32"),
    ("hyper_connection.sinkhorn_iterations", "hc_sinkhorn_iters", "u32"),
    ("hyper_connection.epsilon", "hc_eps", "f32"),
]


# Keys of _KEYS that llama.cpp's loader reads as optional (src/llama-model.cpp load_hparams, l. 1407-1432, and
# llama-hparams.h), with the value it then uses: a DeepSeek-V4 config.json saved by transformers 5.x has no raw
# rope_scaling, so the converter (conversion/base.py l. 1462-1482) writes no rope.scaling.* keys, and llama.cpp runs
# such a file without scaling (freq_scale 1, no YaRN ramp). The other keys its loader takes as optional (head
# count, key/value length, rope dimension count, expert counts) default to values no DeepSeek-V4 model has
# (n_embd / n_head, 0 experts), so ds4c keeps requiring them.
#: metadata key (without the arch prefix) -> the value used when it is absent (None: see from_gguf_metadata)
OPTIONAL_KEYS: dict[str, Any] = {
    "rope.freq_base": 10000.0,                   # hparams.rope_freq_base_train's default
    "rope.scaling.factor": 1.0,                  # no factor: freq_scale_train = 1, no scaling
    "rope.scaling.original_context_length": None,  # n_ctx_orig_yarn = n_ctx_train (context_length)
    "rope.scaling.yarn_beta_fast": 32.0,         # llama_hparams.yarn_beta_fast
    "rope.scaling.yarn_beta_slow": 1.0,          # llama_hparams.yarn_beta_slow
}


def absent_optional_keys(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`OPTIONAL_KEYS` missing from ``meta`` (full key -> the value read instead), in table order."""
    out: dict[str, Any] = {}
    for key, default in OPTIONAL_KEYS.items():
        if _P + key not in meta:
            out[_P + key] = meta.get(_P + "context_length") if default is None else default
    return out


def rope_scaling_text(cfg: Ds4Config) -> str:
    """How the compressing layers' RoPE is scaled, in words: YaRN with its factor, original context and betas,
    or none (``rope_factor`` 1, as a file without ``rope.scaling.*`` keys is read)."""
    if not cfg.yarn:
        return "none (factor 1: plain RoPE on every layer)"
    return (f"YaRN on the compressing layers (factor {cfg.rope_factor:g}, original context {cfg.original_seq_len}, "
            f"beta_fast {cfg.beta_fast:g}, beta_slow {cfg.beta_slow:g})")


def absent_keys_text(absent: Mapping[str, Any]) -> str:
    """``absent`` (:func:`absent_optional_keys`) in words: the keys and the values read instead."""
    return (f"no {', '.join(absent)}: read with llama.cpp's defaults ("
            + ", ".join(f"{k.removeprefix(_P)} {v:g}" for k, v in absent.items()) + ")")


def to_gguf_metadata(cfg: Ds4Config) -> list[tuple[str, Any, str]]:
    """The metadata entries for ``cfg`` as ``(full_key, value, kind)`` with kind in
    ``u32, f32, bool, str, arr_i32, arr_f32`` (the GGUF writer maps kinds to GGUF value types)."""
    out: list[tuple[str, Any, str]] = [("general.architecture", ARCH, "str"), ("general.name", cfg.name, "str")]
    seen = set()
    for key, fld, kind in _KEYS:
        val = getattr(cfg, fld)
        if fld == "compress_ratios":
            val = list(cfg.compress_ratios[: cfg.n_layers])
        out.append((_P + key, val, kind))
        seen.add(fld)
    out += [
        (_P + "embedding_length_out", cfg.hidden_size * cfg.hc_mult, "u32"),
        (_P + "attention.head_count_kv", 1, "u32"),
        (_P + "rope.scaling.type", "yarn", "str"),
        (_P + "expert_gating_func", GATING_SQRT_SOFTPLUS, "u32"),
        (_P + "expert_weights_norm", True, "bool"),
        (_P + "swiglu_clamp_exp", [cfg.swiglu_limit] * cfg.n_layers, "arr_f32"),
        (_P + "swiglu_clamp_shexp", [cfg.swiglu_limit] * cfg.n_layers, "arr_f32"),
        ("tokenizer.ggml.bos_token_id", cfg.bos_id, "u32"),
        ("tokenizer.ggml.eos_token_id", cfg.eos_id, "u32"),
    ]
    return out


def _f32(x: Any) -> float:
    """An f32 metadata value as the shortest decimal that rounds to the same float32 (1e-6 stored as f32 reads
    back as 1e-6, not 9.99999997e-07), so configs and their hashes survive a write/read round trip."""
    return float(str(np.float32(float(x))))


def from_gguf_metadata(meta: Mapping[str, Any], source: str = "<metadata>", vocab_size: int | None = None
                       ) -> Ds4Config:
    """Build a :class:`Ds4Config` from GGUF metadata values (a mapping full key -> python value).

    The vocabulary size is ``deepseek4.vocab_size`` when present (ds4c 0.1 wrote it), else ``vocab_size``
    (the caller passes the rows of ``token_embd.weight``: llama.cpp's converter writes no such key), else the
    length of ``tokenizer.ggml.tokens``.

    The :data:`OPTIONAL_KEYS` (``rope.freq_base`` and the ``rope.scaling.*`` keys) may be absent, as llama.cpp's
    loader allows: they then take its defaults (no ``rope.scaling.factor``: factor 1, no YaRN);
    :func:`absent_optional_keys` lists those a file lacks.

    Raises:
        ConfigError: when ``general.architecture`` is not ``deepseek4``, a required key is missing, the
            gating function is not sqrt-softplus, the RoPE scaling is not YaRN (nor absent), or the values are
            inconsistent.
    """
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ConfigError(f"{source}: expected general.architecture = {ARCH!r}, found {arch!r}")
    kw: dict[str, Any] = {}
    meta = {**absent_optional_keys(meta), **meta}
    for key, fld, kind in _KEYS:
        full = _P + key
        if full not in meta or meta[full] is None:
            raise ConfigError(f"{source}: missing metadata key {full!r} (needed for Ds4Config.{fld})")
        v = meta[full]
        if kind == "arr_i32":
            v = tuple(int(x) for x in v)
        elif kind == "u32":
            v = int(v)
        else:
            v = _f32(v)
        kw[fld] = v
    if _P + "vocab_size" in meta:
        kw["vocab_size"] = int(meta[_P + "vocab_size"])
        if vocab_size is not None and kw["vocab_size"] != vocab_size:
            raise ConfigError(f"{source}: {_P}vocab_size is {kw['vocab_size']} but token_embd.weight has "
                              f"{vocab_size} rows")
    elif vocab_size is not None:
        kw["vocab_size"] = int(vocab_size)
    elif isinstance(meta.get("tokenizer.ggml.tokens"), (list, tuple)):
        kw["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    else:
        raise ConfigError(f"{source}: cannot tell the vocabulary size: no {_P}vocab_size key, no token_embd.weight "
                          f"and no tokenizer.ggml.tokens")
    key_len, value_len = int(meta[_P + "attention.key_length"]), int(meta[_P + "attention.value_length"])
    if value_len != key_len:  # both keys map to head_dim: compare the stored values, not head_dim with itself
        raise ConfigError(f"{source}: expected attention.value_length == key_length ({key_len}), found {value_len}")
    kw["head_dim"] = key_len
    kv_heads = int(meta.get(_P + "attention.head_count_kv", 1))
    if kv_heads != 1:
        raise ConfigError(f"{source}: expected attention.head_count_kv = 1 (one shared latent), found {kv_heads}")
    gating = int(meta.get(_P + "expert_gating_func", GATING_SQRT_SOFTPLUS))
    if gating != GATING_SQRT_SOFTPLUS:
        raise ConfigError(f"{source}: expected expert_gating_func = {GATING_SQRT_SOFTPLUS} (sqrt-softplus), "
                          f"found {gating}")
    if not bool(meta.get(_P + "expert_weights_norm", True)):
        raise ConfigError(f"{source}: expected expert_weights_norm = true (normalised top-k weights)")
    clamp = meta.get(_P + "swiglu_clamp_exp")
    if clamp is not None:
        vals = [_f32(x) for x in (clamp if isinstance(clamp, (list, tuple)) else [clamp])]
        if len(set(vals)) > 1:
            raise ConfigError(f"{source}: expected one swiglu_clamp_exp value for all layers, found {sorted(set(vals))}")
        kw["swiglu_limit"] = vals[0]
    scaling = meta.get(_P + "rope.scaling.type", "yarn")
    if scaling not in ("yarn", "none") or (scaling == "none" and kw["rope_factor"] != 1.0):
        raise ConfigError(f"{source}: expected {_P}rope.scaling.type 'yarn' (DeepSeek-V4's YaRN, spec P6) or no "
                          f"scaling, found {scaling!r} with factor {kw['rope_factor']:g}")
    kw["bos_id"] = int(meta.get("tokenizer.ggml.bos_token_id", 0))
    kw["eos_id"] = int(meta.get("tokenizer.ggml.eos_token_id", 1))
    kw["name"] = str(meta.get("general.name", "deepseek4"))
    try:
        return Ds4Config(**kw)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def yarn_ramp_bounds(cfg: Ds4Config) -> tuple[int, int]:
    """YaRN NTK-by-parts correction range (low, high) over the rope_dim/2 frequencies (spec P6).

    ``corr(r) = d * ln(orig / (2 pi r)) / (2 ln base)`` with d = rope_dim; low = floor(corr(beta_fast)),
    high = ceil(corr(beta_slow)), clamped to [0, d-1]. Official values: (15, 25).
    """
    d, base, orig = cfg.rope_dim, cfg.compress_rope_theta, cfg.original_seq_len

    def corr(r: float) -> float:
        return d * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(corr(cfg.beta_fast))
    high = math.ceil(corr(cfg.beta_slow))
    return max(low, 0), min(high, d - 1)
