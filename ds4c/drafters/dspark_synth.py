"""Deterministic synthetic DSpark drafter files for a target model (the drafter of ``ds4c make-model``'s models).

The stages' tensors follow :mod:`ds4c.synth`'s rules (each tensor its own random stream; quantized ones generated
in their stored form; scales that keep activations sane), from a stream seeded apart from the target's
(:func:`drafter_seed`), so a drafter's block ``s`` is not a copy of the target's layer ``s``. The extras:
``fc`` (``main_proj``) unit-RMS like any projection, ``markov_w1`` with unit entries (an embedding) and
``markov_w2`` at ``1/sqrt(rank)``, so the Markov bias is of the size of the head's logits; ``conf_proj`` at
``1/sqrt(hidden + rank)``, its optional bias small. Random weights predict nothing: acceptance against a synthetic
target is near zero (the loop's exactness does not depend on it).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ds4c.config import Ds4Config
from ds4c.drafters.dspark_file import (CONF_BIAS, MARKOV_W1, OFFICIAL_BLOCK_SIZE, OFFICIAL_MARKOV_RANK,
                                       OFFICIAL_NOISE_ID, default_taps, stage_config, write_dspark)
from ds4c.errors import ConfigError
from ds4c.gguf_file import ModelFile
from ds4c.sources import open_model
from ds4c.quant import GGMLType
from ds4c.quant import is_super_block
from ds4c.synth import _as_stored, _normal, matrix_rows, n_rows, piece_rows, stored_pieces, sub_key, tensor_key
from ds4c.tensors import FORMATS, ROLE_FP4, ROLE_FP8, TensorSpec


def drafter_seed(seed: int) -> int:
    """The weight seed of the drafter of a target written with ``seed``."""
    return int(seed) + zlib.crc32(b"ds4c-dspark")


def default_rank(target: Ds4Config) -> int:
    """Markov rank: the official 256, at most a quarter of the hidden size (64 for ``tiny``)."""
    return min(OFFICIAL_MARKOV_RANK, target.hidden_size // 4)


def default_noise(target: Ds4Config) -> int:
    """Noise token: the official 128799 for the official vocabulary, else the last id."""
    return OFFICIAL_NOISE_ID if target.vocab_size > OFFICIAL_NOISE_ID else target.vocab_size - 1


def dspark_pieces(stage: Ds4Config, spec: TensorSpec, t: GGMLType, seed: int, r0: int = 0, r1: int | None = None,
                  device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """The stored bytes of drafter tensor ``spec`` as ``t`` with weight seed ``seed`` (:func:`drafter_seed` of the
    target's; rows ``[r0, r1)`` of a matrix, default all) in pieces of whole rows, each a uint8 tensor on
    ``device``; concatenated they are the tensor's bytes in the file :func:`make_dspark` writes (the same on every
    device: :mod:`ds4c.synth`'s generator). The rules are the module docstring's."""
    if spec.name == MARKOV_W1:  # unit entries (an embedding); any row range is the same rows of the whole
        key, k = tensor_key(seed, spec.name), spec.shape[-1]
        r1 = n_rows(spec) if r1 is None else r1
        step = piece_rows(spec, t, device)
        for a in range(r0, r1, step):
            yield matrix_rows(key, spec.role, t, a, min(r1, a + step), k, 1.0, device)
    elif spec.name == CONF_BIAS:
        key = tensor_key(seed, spec.name)
        yield _as_stored(_normal(sub_key(key, 0), 0, spec.numel, 0.1, device=device).view(spec.shape), t).reshape(-1)
    else:  # stages as ds4c.synth; fc, markov_w2, conf_proj: 1/sqrt(fan_in) projections
        yield from stored_pieces(stage, spec, t, seed, r0, r1, device)


def dspark_producer(stage: Ds4Config, seed: int) -> Callable[[TensorSpec, GGMLType], Iterator[np.ndarray]]:
    """The ``produce(spec, type)`` of a synthetic drafter with weight seed ``seed`` (:func:`dspark_pieces` on the
    CPU, as numpy)."""

    def produce(spec: TensorSpec, t: GGMLType) -> Iterator[np.ndarray]:
        for piece in dspark_pieces(stage, spec, t, seed):
            yield piece.numpy()

    return produce


def dspark_options(cfg: Ds4Config, formats: str = "official", taps: tuple[int, ...] | None = None,
                   block_size: int = OFFICIAL_BLOCK_SIZE, markov_rank: int | None = None,
                   noise_id: int | None = None) -> tuple[tuple[int, ...], int, int, int]:
    """The checked options of a synthetic drafter for the target config ``cfg``: ``(taps, block_size,
    markov_rank, noise_id)`` with the defaults filled in (arguments as :func:`make_dspark`).

    Raises:
        ConfigError: an unknown ``formats`` or a K-quant one, a tap outside the target's layers or repeated, a
            block size < 1, a rank < 1, a noise id outside the vocabulary (one line).
    """
    if formats not in FORMATS:
        raise ConfigError(f"unknown formats {formats!r}: expected one of {sorted(FORMATS)}")
    if any(is_super_block(t) for t in FORMATS[formats].values()):
        why = (f"a drafter has no routed experts, so {formats} would be the official drafter"
               if not is_super_block(FORMATS[formats][ROLE_FP8]) else
               "a synthetic DSpark drafter is written in official, bf16 or f32 formats only")
        raise ConfigError(f"DSpark drafter --formats {formats}: {why}; give --formats official (it drafts for a "
                          f"{formats} target too)")
    taps = default_taps(cfg) if taps is None else tuple(taps)
    if not taps or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < cfg.n_layers for t in taps) \
            or len(set(taps)) != len(taps):
        raise ConfigError(f"DSpark taps: expected distinct layer ids in 0..{cfg.n_layers - 1}, found {list(taps)}")
    rank = default_rank(cfg) if markov_rank is None else markov_rank
    noise = default_noise(cfg) if noise_id is None else noise_id
    for what, v, lo, hi in (("block_size", block_size, 1, None), ("markov_rank", rank, 1, None),
                            ("noise_id", noise, 0, cfg.vocab_size - 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ConfigError(f"DSpark {what}: expected an int {f'in {lo}..{hi}' if hi is not None else f'>= {lo}'}, "
                              f"found {v!r}")
    return taps, block_size, rank, noise


def make_dspark(target: ModelFile | Ds4Config | str | os.PathLike[str], path: str | os.PathLike[str], seed: int = 0,
                formats: str = "official", taps: tuple[int, ...] | None = None, block_size: int = OFFICIAL_BLOCK_SIZE,
                markov_rank: int | None = None, noise_id: int | None = None, conf_bias: bool = False,
                progress: Callable[[TensorSpec, int], None] | None = None) -> Path:
    """Write a synthetic DSpark drafter for ``target`` (atomically; same arguments give the same bytes).

    Args:
        target: the target model file (its config sizes the stages; its ``tokenizer.*`` keys are copied), or a
            config (a preset): the drafter of the synthetic model ``ds4c make-model`` writes for it with ``seed``
            (whose vocabulary, :func:`ds4c.synth_vocab.synthetic_vocab`, it carries).
        path: output file. seed: the weight seed (the drafter's streams are :func:`drafter_seed` of it).
        formats: ``"official"`` (Q8_0 FP8 weights incl. ``fc``, MXFP4 experts, BF16 Markov/confidence heads, F32
            gains and HC), ``"bf16"`` or ``"f32"`` (:data:`ds4c.tensors.FORMATS`).
        taps: tapped target layers (0-based; default its last three, the official 40, 41, 42).
        block_size: draft rows per block (official 5). markov_rank: default :func:`default_rank`.
        noise_id: the noise (mask) token; default :func:`default_noise`. conf_bias: also write ``conf_proj.bias``.

    Raises:
        ConfigError: an unknown ``formats``, a tap outside the target's layers or repeated, a block size < 1, a
            rank < 1, a noise id outside the vocabulary. ModelFileError: an unreadable target or a failed write.
    """
    if isinstance(target, Ds4Config):
        from ds4c.synth_vocab import synthetic_vocab

        cfg, tok_meta = target, dict(synthetic_vocab(target.vocab_size, seed))
    else:
        mf = target if isinstance(target, ModelFile) else open_model(target)
        cfg, tok_meta = mf.config, mf.metadata
    taps, block_size, rank, noise = dspark_options(cfg, formats, taps, block_size, markov_rank, noise_id)
    stage = stage_config(cfg)
    tokenizer: dict[str, Any] = {k: v for k, v in tok_meta.items() if k.startswith("tokenizer.")}
    extra = {"ds4c.synthetic_seed": int(seed), "ds4c.formats": formats}
    return write_dspark(path, stage, FORMATS[formats], dspark_producer(stage, drafter_seed(seed)), taps=taps,
                        block_size=block_size, markov_rank=rank, noise_id=noise, tokenizer=tokenizer,
                        conf_bias=conf_bias, extra_metadata=extra, progress=progress)
