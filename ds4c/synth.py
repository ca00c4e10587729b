"""Deterministic synthetic DeepSeek-V4-Flash weights (``ds4c make-model``).

Every tensor gets its own random stream, seeded by ``(seed, crc32(name))``, so a tensor's values do not
depend on which other tensors are written or in what order. Quantized tensors are generated directly in
their stored form (random Q8_0 int8 codes with jittered fp16 block scales; random MXFP4 nibbles with
jittered e8m0 exponents), so writing a full-width model needs no float-to-quant pass and block scales vary
the way real ones do. ``--formats bf16`` stores the same model with FP8/FP4-role tensors dequantized to
BF16 (MXFP4 values are exact in BF16; Q8_0 values are rounded to BF16).

Scales are chosen so activations stay sane through all layers (see :data:`RESIDUAL_RMS_BAND` and the test
that runs 43 tiny-width layers): projections preserve unit RMS (std = 1/sqrt(fan_in)); the two sub-block
output projections (``wo_b``, expert/shared ``w2``) have gain :data:`OUT_GAIN`, so the HC residual grows
slowly; the HC comb logits favour the diagonal so Sinkhorn converges from a well-conditioned start.

Every synthetic file carries a real byte-level BPE vocabulary of the preset's vocab size with DeepSeek's
special tokens and a chat template (:func:`ds4c.tokenizer.synthetic_vocab`, deterministic), so text works on
every preset.
"""

from __future__ import annotations

import math
import re
import zlib
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from ds4c.config import Ds4Config
from ds4c.gguf_file import write_model
from ds4c.quant import GGMLType, dequantize, is_super_block
from ds4c.tensors import FORMATS, ROLE_BF16, ROLE_F32, ROLE_FP4, ROLE_FP8, ROLE_I32, ROLE_NORM, TensorSpec

OUT_GAIN = 0.25
"""RMS gain of the sub-block output projections relative to a unit-RMS projection."""

RESIDUAL_RMS_BAND = (0.5, 4.0)
"""The RMS of every HC residual stream stays inside this band through 43 layers (tested)."""

HC_COMB_SCALE, HC_COMB_DIAG = 0.2, 1.0
"""Scale of the comb mixing logits and the diagonal bias of the comb base: with these, 20 Sinkhorn
iterations bring rows and columns to 1 within 1e-5 for mixing logits up to ~3 sigma (tested)."""

_ROWS_PER_CHUNK = 4096
_Q8_RMS = math.sqrt(sum(q * q for q in range(-127, 128)) / 255)  # RMS of uniform int8 codes in [-127,127]
_MX_TABLE = (0, 1, 2, 3, 4, 6, 8, 12)
_MX_RMS = math.sqrt(sum(v * v for v in _MX_TABLE) / 8)  # RMS of the doubled e2m1 table, uniform nibbles


def _rng(seed: int, name: str) -> np.random.Generator:
    """The tensor's own stream. HC base/scale tensors are seeded by their ds4c 0.1 names (without ``.weight``),
    so a (preset, seed) gives the same weights in the converter's layout as it gave before."""
    if re.fullmatch(r"(blk\.\d+\.hc_(attn|ffn)|output_hc)_(base|scale)\.weight", name):
        name = name[: -len(".weight")]
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def _std(cfg: Ds4Config, spec: TensorSpec) -> float:
    """Target standard deviation of a projection weight (1/sqrt(fan_in), output gains applied)."""
    out_proj = any(k in spec.name for k in ("attn_output_b", "ffn_down_exps", "ffn_down_shexp"))
    return (OUT_GAIN if out_proj else 1.0) / math.sqrt(spec.shape[-1])


# --------------------------------------------------------------------------------------------------
# stored-form generators (yield byte chunks of whole rows)

def _q8_0_rows(rng: np.random.Generator, rows: int, k: int, std: float) -> np.ndarray:
    nb = rows * k // 32
    blk = np.empty((nb, 34), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=nb).astype(np.float32)  # per-block scale variety
    d = (std / _Q8_RMS / math.sqrt(13 / 12) * jitter).astype(np.float16)
    blk[:, :2] = d.view(np.uint8).reshape(nb, 2)
    blk[:, 2:] = rng.integers(-127, 128, size=(nb, 32), dtype=np.int8).view(np.uint8)
    return blk.reshape(rows, k // 32 * 34)


def _mxfp4_rows(rng: np.random.Generator, rows: int, k: int, std: float) -> np.ndarray:
    nb = rows * k // 32
    blk = np.empty((nb, 17), dtype=np.uint8)
    e0 = round(128 + math.log2(std / _MX_RMS / math.sqrt(1.75)))  # jitter {-1,0,+1}: mean square 1.75
    blk[:, 0] = (e0 + rng.integers(-1, 2, size=nb)).astype(np.uint8)
    blk[:, 1:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return blk.reshape(rows, k // 32 * 17)


def _normal_rows(rng: np.random.Generator, rows: int, k: int, std: float, mean: float = 0.0) -> np.ndarray:
    return (rng.standard_normal((rows, k), dtype=np.float32) * np.float32(std) + np.float32(mean))


def _as_type(x: np.ndarray, t: GGMLType) -> np.ndarray:
    """Float32 rows -> stored bytes of a float type (F32/F16/BF16)."""
    if t == GGMLType.F32:
        return x.astype(np.float32)
    if t == GGMLType.F16:
        return x.astype(np.float16)
    if t == GGMLType.BF16:
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).view(torch.int16).numpy()
    raise ValueError(f"not a float type: {t.name}")


def _quant_rows(rng: np.random.Generator, role: str, rows: int, k: int, std: float, t: GGMLType) -> np.ndarray:
    """Rows of an FP8/FP4-role weight in its official stored form, converted to ``t`` if needed."""
    official = GGMLType.MXFP4 if role == ROLE_FP4 else GGMLType.Q8_0
    raw = (_mxfp4_rows if official == GGMLType.MXFP4 else _q8_0_rows)(rng, rows, k, std)
    if t == official:
        return raw
    vals = dequantize(raw, official, (rows, k)).numpy()
    return _as_type(vals, t)


def _matrix(rng: np.random.Generator, spec: TensorSpec, t: GGMLType, std: float) -> Iterator[np.ndarray]:
    """A 2-d (or expert-stacked 3-d) projection, chunked by rows (and by expert)."""
    k = spec.shape[-1]
    rows_total = spec.numel // k
    for r0 in range(0, rows_total, _ROWS_PER_CHUNK):
        rows = min(_ROWS_PER_CHUNK, rows_total - r0)
        if spec.role in (ROLE_FP8, ROLE_FP4):
            yield _quant_rows(rng, spec.role, rows, k, std, t)
        else:  # BF16 in the checkpoint: bf16 values, whatever type stores them
            x = _normal_rows(rng, rows, k, std)
            yield _as_type(torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy(), t)


def _small(cfg: Ds4Config, spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Float32 values of the non-projection tensors (norm gains, HC params, ape, sinks, biases)."""
    n = spec.name
    shape = spec.shape
    if n.endswith("norm.weight"):
        return 1.0 + 0.05 * rng.standard_normal(shape, dtype=np.float32)
    if n.endswith("hc_attn_fn.weight") or n.endswith("hc_ffn_fn.weight") or n == "output_hc_fn.weight":
        return rng.standard_normal(shape, dtype=np.float32) / np.float32(math.sqrt(cfg.hc_dim))
    if n.endswith("_scale.weight"):  # pre, post, comb logit scales (the head has only the first)
        want = np.array([0.5, 0.5, HC_COMB_SCALE], dtype=np.float32)[: shape[0]]
        return want + 0.02 * rng.standard_normal(shape, dtype=np.float32)
    if n.endswith("hc_attn_base.weight") or n.endswith("hc_ffn_base.weight"):
        hc = cfg.hc_mult
        base = 0.2 * rng.standard_normal(shape, dtype=np.float32)
        comb = base[2 * hc:].reshape(hc, hc)
        comb += np.eye(hc, dtype=np.float32) * HC_COMB_DIAG  # favour keeping each stream
        return base
    if n == "output_hc_base.weight":
        return 0.2 * rng.standard_normal(shape, dtype=np.float32)
    if n.endswith("attn_sinks.weight"):
        return rng.standard_normal(shape, dtype=np.float32)
    if n.endswith("_ape.weight"):
        return 0.5 * rng.standard_normal(shape, dtype=np.float32)
    if n.endswith("exp_probs_b.bias"):
        return 0.1 * rng.standard_normal(shape, dtype=np.float32)
    raise AssertionError(f"no synthetic rule for {n}")


def _tid2eid(cfg: Ds4Config, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Hash routing table: for every token, n_active distinct expert ids (chunked by tokens)."""
    for r0 in range(0, cfg.vocab_size, 65536):
        rows = min(65536, cfg.vocab_size - r0)
        keys = rng.random((rows, cfg.n_experts), dtype=np.float32)
        yield np.argsort(keys, axis=1)[:, : cfg.n_active_experts].astype(np.int32)


def producer(cfg: Ds4Config, seed: int) -> Callable[[TensorSpec, GGMLType], Iterator[np.ndarray]]:
    """The ``produce(spec, type)`` callback of :func:`ds4c.gguf_file.write_model` for synthetic weights."""

    def produce(spec: TensorSpec, t: GGMLType) -> Iterator[np.ndarray]:
        rng = _rng(seed, spec.name)
        if spec.role == ROLE_I32:
            yield from _tid2eid(cfg, rng)
        elif spec.role in (ROLE_FP8, ROLE_FP4):
            yield from _matrix(rng, spec, t, _std(cfg, spec))
        elif spec.name == "token_embd.weight":
            yield from _matrix(rng, spec, t, 1.0)
        elif spec.role == ROLE_BF16:
            yield from _matrix(rng, spec, t, _std(cfg, spec))  # head, router, compressor, indexer proj
        else:
            assert spec.role in (ROLE_F32, ROLE_NORM), spec
            x = _small(cfg, spec, rng)
            if spec.role == ROLE_NORM:  # BF16 in the checkpoint: bf16 values, whatever type stores them
                x = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
            yield _as_type(x, t)

    return produce


def make_model(cfg: Ds4Config, path: str | Path, seed: int = 0, formats: str = "official",
               progress: Callable[[TensorSpec, int], None] | None = None) -> Path:
    """Write a synthetic model file for ``cfg`` (see module docstring).

    Args:
        cfg: the config (e.g. ``ds4c.config.preset("tiny")``).
        path: output file; written atomically.
        seed: the random seed; the same (cfg, seed, formats) always gives the same bytes.
        formats: ``"official"`` (Q8_0 for FP8 weights, MXFP4 experts, BF16/F32 as spec 2.1), ``"bf16"`` or
            ``"f32"`` (:data:`ds4c.tensors.FORMATS`; each tensor's type: :func:`ds4c.tensors.storage_type`).
        progress: optional per-tensor callback ``(spec, bytes_written)``.

    Raises:
        ConfigError: unknown ``formats``, or a K-quant / IQ4_XS one (``q2_k`` .. ``iq4_xs``: their stored-form
            generators are not written yet).
    """
    from ds4c.errors import ConfigError

    if formats not in FORMATS:
        raise ConfigError(f"unknown formats {formats!r}: expected one of {sorted(FORMATS)}")
    if is_super_block(FORMATS[formats][ROLE_FP4]):
        raise ConfigError(f"make-model --formats {formats}: the stored-form {formats.upper()} generator is pending "
                          f"(ds4c reads {formats.upper()} files, e.g. from llama.cpp's llama-quantize, but cannot "
                          f"write synthetic ones yet)")
    from ds4c.tokenizer import synthetic_vocab

    extra = {"ds4c.synthetic_seed": int(seed), "ds4c.formats": formats}
    return write_model(path, cfg, FORMATS[formats], producer(cfg, seed), extra_metadata=extra, progress=progress,
                       tokenizer=synthetic_vocab(cfg.vocab_size, seed))
