"""The GGUF file of a DeepSeek-V4-Flash-0731 DSpark drafter (docs/model.md section 7), in llama.cpp's layout.

llama.cpp's converter (``conversion/deepseek.py``, ``DeepseekV4DSparkModel``) writes the checkpoint's ``mtp.0..2``
tensors as a file of architecture ``dflash``; ds4c reads and writes that layout unchanged:

* the 3 stages are blocks ``blk.0..2`` with the tensors of a target block of compress ratio 0 and scored routing
  (``exp_probs_b.bias``, no ``tid2eid``), named as in the target file (:func:`ds4c.tensors.layer_tensor_specs`);
* the stage-0 / stage-2 extras are root tensors (``_DSPARK_ROOT_MAP`` and ``root_names``): ``fc`` (``main_proj``,
  FP8 -> Q8_0, ``[hidden, hidden * len(taps)]`` torch order), ``enc.output_norm`` (``main_norm``), ``output_norm``
  (stage 2's ``norm``), ``output_hc_{fn,base,scale}`` (stage 2's ``hc_head_*``), ``markov_w1`` / ``markov_w2``
  (BF16 ``[vocab, rank]``), ``conf_proj`` (``[1, hidden + rank]``; llama.cpp also reads an optional
  ``conf_proj.bias`` ``[1]``);
* no ``token_embd`` / ``output``: the drafter uses the target's embedding and head;
* metadata: the target's hyper-parameter keys under ``dflash.*`` with ``block_count`` 3, ``compress_ratios`` all 0 and
  ``hash_layer_count`` 0 (the converter's ``__init__``; no ``embedding_length_out``, which it writes for
  ``deepseek4`` only), ``dflash.block_size`` (u32), ``dflash.target_layers`` (i32 array of ``layer + 1`` for each tap
  layer), the target's ``tokenizer.*`` keys and ``tokenizer.ggml.mask_token_id`` = the noise token.

Names and keys are those of llama.cpp's ``gguf-py/gguf/constants.py`` (``MODEL_ARCH.DFLASH``: ``FC`` = ``fc``,
``ENC_OUTPUT_NORM`` = ``enc.output_norm``, ``DSPARK_MARKOV_W1/W2`` = ``markov_w1/2``, ``DSPARK_CONF_PROJ`` =
``conf_proj``; ``Keys.LLM.BLOCK_SIZE`` / ``TARGET_LAYERS``; ``Keys.Tokenizer.MASK_ID``); the shapes are those
``src/models/dflash.cpp`` ``load_arch_tensors`` asks for.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from ds4c.config import ARCH as TARGET_ARCH
from ds4c.config import Ds4Config, from_gguf_metadata, to_gguf_metadata
from ds4c.errors import ConfigError, ModelFileError
from ds4c.gguf_file import (Producer, _CheckedReader, _field_value, check_magic, check_tensor_extent,
                            check_tensor_type, write_model)
from ds4c.quant import GGMLType, dequantize
from ds4c.tensors import ROLE_BF16, ROLE_F32, ROLE_FP8, ROLE_NORM, TensorSpec, layer_tensor_specs

ARCH = "dflash"
N_STAGES = 3
"""Stages of the 0731 drafter (``mtp.0..2``)."""
OFFICIAL_BLOCK_SIZE, OFFICIAL_MARKOV_RANK, OFFICIAL_NOISE_ID = 5, 256, 128799
OFFICIAL_TAPS = (40, 41, 42)

KEY_BLOCK_SIZE = f"{ARCH}.block_size"
KEY_TARGET_LAYERS = f"{ARCH}.target_layers"
KEY_MASK_ID = "tokenizer.ggml.mask_token_id"

FC, MAIN_NORM = "fc.weight", "enc.output_norm.weight"
MARKOV_W1, MARKOV_W2 = "markov_w1.weight", "markov_w2.weight"
CONF_PROJ, CONF_BIAS = "conf_proj.weight", "conf_proj.bias"
HEAD_NAMES = ("output_hc_fn.weight", "output_hc_scale.weight", "output_hc_base.weight")  # fn, scale, base
OUT_NORM = "output_norm.weight"

MATCH_FIELDS = ("vocab_size", "hidden_size", "n_heads", "head_dim", "rope_dim", "q_lora_rank", "o_lora_rank",
                "o_groups", "window", "moe_inter", "n_experts", "n_shared_experts", "n_active_experts",
                "route_scale", "swiglu_limit", "norm_eps", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rope_theta")
"""Fields of a drafter's stage config that must equal the target's (the stages are target blocks of ratio 0 with the
target's window and scored MoE; embedding and head are shared)."""


def stage_config(target: Ds4Config, n_stages: int = N_STAGES) -> Ds4Config:
    """The config of the drafter's stages for ``target``: ``n_stages`` blocks of compress ratio 0, scored routing,
    everything else the target's (window included)."""
    return target.replace(n_layers=n_stages, compress_ratios=(0,) * n_stages, n_hash_layers=0,
                          name=f"{target.name}-dspark")


def default_taps(target: Ds4Config) -> tuple[int, ...]:
    """The tap layers: the official ``(40, 41, 42)`` for 43 layers, the last three layers in general."""
    return tuple(range(max(0, target.n_layers - 3), target.n_layers))


def dspark_tensor_specs(stage: Ds4Config, n_taps: int, markov_rank: int, confidence: bool = True,
                        conf_bias: bool = False) -> list[TensorSpec]:
    """Every tensor of a DSpark drafter file, in file order: the stages ``blk.0..`` then the root tensors.

    Args:
        stage: the stages' config (:func:`stage_config`). n_taps: the tap layers (``main_proj`` input is
            ``n_taps * hidden``). markov_rank: the Markov head's rank (official 256).
        confidence: include ``conf_proj.weight`` ``[1, hidden + rank]``; conf_bias: include ``conf_proj.bias`` [1].
    Returns:
        :class:`~ds4c.tensors.TensorSpec` list, shapes in torch order, roles as :mod:`ds4c.tensors`.
    """
    D, hc = stage.hidden_size, stage.hc_mult
    specs: list[TensorSpec] = []
    for s in range(stage.n_layers):
        specs += layer_tensor_specs(stage, s)
    specs += [
        TensorSpec(FC, (D, n_taps * D), ROLE_FP8),
        TensorSpec(MAIN_NORM, (D,), ROLE_NORM),
        TensorSpec("output_hc_fn.weight", (hc, stage.hc_dim), ROLE_F32),
        TensorSpec("output_hc_base.weight", (hc,), ROLE_F32),
        TensorSpec("output_hc_scale.weight", (1,), ROLE_F32),
        TensorSpec(OUT_NORM, (D,), ROLE_NORM),
        TensorSpec(MARKOV_W1, (stage.vocab_size, markov_rank), ROLE_BF16),
        TensorSpec(MARKOV_W2, (stage.vocab_size, markov_rank), ROLE_BF16),
    ]
    if confidence:
        specs.append(TensorSpec(CONF_PROJ, (1, D + markov_rank), ROLE_BF16))
    if conf_bias:
        specs.append(TensorSpec(CONF_BIAS, (1,), ROLE_F32))
    return specs


def dspark_metadata(stage: Ds4Config, taps: Iterable[int], block_size: int, noise_id: int
                    ) -> list[tuple[str, Any, str]]:
    """The ``(key, value, kind)`` metadata entries of a drafter file (tokenizer keys apart): the stage config's
    keys under ``dflash.*`` (no ``embedding_length_out``), ``dflash.block_size``, ``dflash.target_layers`` =
    ``[l + 1 for l in taps]`` and ``tokenizer.ggml.mask_token_id`` = ``noise_id``."""
    out = []
    for key, val, kind in to_gguf_metadata(stage):
        if key == f"{TARGET_ARCH}.embedding_length_out":
            continue
        if key.startswith(TARGET_ARCH + "."):
            key = ARCH + key[len(TARGET_ARCH):]
        out.append((key, val, kind))
    out += [(KEY_BLOCK_SIZE, int(block_size), "u32"), (KEY_TARGET_LAYERS, [int(t) + 1 for t in taps], "arr_i32"),
            (KEY_MASK_ID, int(noise_id), "u32")]
    return out


def write_dspark(path: str | os.PathLike[str], stage: Ds4Config, types: dict[str, GGMLType], produce: Producer, *,
                 taps: Iterable[int], block_size: int, markov_rank: int, noise_id: int,
                 tokenizer: dict[str, Any] | None = None, confidence: bool = True, conf_bias: bool = False,
                 extra_metadata: dict[str, Any] | None = None,
                 progress: Callable[[TensorSpec, int], None] | None = None) -> Path:
    """Write a drafter file (streaming, atomic: :func:`ds4c.gguf_file.write_model`'s temporary-then-rename).

    Args:
        stage: the stages' config (:func:`stage_config` of the target). types: role -> GGUF type
            (:data:`ds4c.tensors.FORMATS`). produce: the bytes of each tensor (as for ``write_model``).
        taps: the target layers tapped (0-based; written as ``layer + 1``). block_size: draft rows per block.
        markov_rank: Markov head rank. noise_id: the noise (mask) token. tokenizer: the target's ``tokenizer.*``
            keys (its mask token id, if any, is replaced by ``noise_id``).
        confidence, conf_bias, extra_metadata, progress: as :func:`dspark_tensor_specs` / ``write_model``.

    Returns:
        the final path. Raises ModelFileError as ``write_model`` does.
    """
    taps = [int(t) for t in taps]
    specs = dspark_tensor_specs(stage, len(taps), markov_rank, confidence, conf_bias)
    tok = {k: v for k, v in (tokenizer or {}).items() if k != KEY_MASK_ID}
    return write_model(path, stage, types, produce, extra_metadata=extra_metadata, progress=progress, tokenizer=tok,
                       arch=ARCH, specs=specs, metadata=dspark_metadata(stage, taps, block_size, noise_id))


class DSparkFile:
    """An opened, validated DSpark drafter GGUF (architecture ``dflash``, see the module docstring).

    Attributes:
        path, metadata: the file and every metadata key -> python value.
        config: the stages' :class:`~ds4c.config.Ds4Config` (``n_layers`` = stages; read from the ``dflash.*`` keys,
            vocabulary from ``tokenizer.ggml.tokens``, else from ``markov_w1``).
        block_size: draft rows per block. taps: the target layers tapped, 0-based (``dflash.target_layers`` - 1).
        noise_id: the noise token (``tokenizer.ggml.mask_token_id``). markov_rank: from ``markov_w1``.
        has_confidence, has_conf_bias: ``conf_proj.weight`` / ``conf_proj.bias`` present.
        specs: ``name -> TensorSpec`` of the tensors read.

    Raises (constructor):
        ModelFileError: one line saying what was expected and what was found: no such file, not a GGUF, truncated,
            ``general.architecture`` not ``dflash``, a missing or invalid key (block size, target layers, mask token,
            a hyper-parameter), compress ratios not all 0, hash layers, a missing / mis-shaped / wrongly typed tensor.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = p = Path(path)
        if not p.exists():
            raise ModelFileError(f"{p}: no such drafter file")
        if not p.is_file():
            raise ModelFileError(f"{p}: expected a DSpark drafter GGUF file, found a directory or special file")
        size = p.stat().st_size
        check_magic(p, size)
        try:
            reader = _CheckedReader(p)
        except ModelFileError as e:
            raise ModelFileError(f"{p}: {e}") from None
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on garbage or truncation
            raise ModelFileError(f"{p}: not a readable GGUF file ({type(e).__name__}: {e}); expected a complete GGUF "
                                 f"v3 file of architecture {ARCH!r} (file size {size} bytes, truncated?)") from None
        self.metadata = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        arch = self.metadata.get("general.architecture")
        if arch != ARCH:
            hint = " (a target model or MTP file, not a DSpark drafter)" if arch == TARGET_ARCH else ""
            raise ModelFileError(f"{p}: expected general.architecture = {ARCH!r} (a DSpark drafter as llama.cpp's "
                                 f"converter writes it), found {arch!r}{hint}")
        self._tensors = {t.name: t for t in reader.tensors}
        self._reader = reader
        self.block_size = self._int_key(KEY_BLOCK_SIZE, 1)
        layers = self.metadata.get(KEY_TARGET_LAYERS)
        if not isinstance(layers, list) or not layers or len(set(layers)) != len(layers) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in layers):
            raise ModelFileError(f"{p}: expected {KEY_TARGET_LAYERS} a non-empty array of distinct ints >= 1 (tap "
                                 f"layer + 1), found {layers!r}")
        self.taps = tuple(v - 1 for v in layers)
        w1 = self._tensors.get(MARKOV_W1)
        if w1 is None:
            raise ModelFileError(f"{p}: missing tensor {MARKOV_W1!r} (the DSpark Markov head, [vocab, rank] torch "
                                 f"order)")
        self.markov_rank = int(w1.shape.tolist()[0])
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) else int(w1.shape.tolist()[-1])
        meta = {(TARGET_ARCH + k[len(ARCH):] if k.startswith(ARCH + ".") else k): v for k, v in self.metadata.items()}
        meta["general.architecture"] = TARGET_ARCH
        try:
            self.config = from_gguf_metadata(meta, source=str(p), vocab_size=vocab)
        except ConfigError as e:
            raise ModelFileError(str(e).replace(f"'{TARGET_ARCH}.", f"'{ARCH}.").replace(
                f" {TARGET_ARCH}.", f" {ARCH}.")) from None
        cfg = self.config
        if any(cfg.compress_ratios[:cfg.n_layers]):
            raise ModelFileError(f"{p}: expected {ARCH}.attention.compress_ratios all 0 (DSpark stages attend a ring, "
                                 f"no compression), found {list(cfg.compress_ratios[:cfg.n_layers])}")
        if cfg.n_hash_layers:
            raise ModelFileError(f"{p}: expected {ARCH}.hash_layer_count = 0 (DSpark stages are score-routed), found "
                                 f"{cfg.n_hash_layers}")
        self.noise_id = self._int_key(KEY_MASK_ID, 0)
        if self.noise_id >= cfg.vocab_size:
            raise ModelFileError(f"{p}: expected {KEY_MASK_ID} (the noise token) in 0..{cfg.vocab_size - 1}, found "
                                 f"{self.noise_id}")
        scaled = [n for n in ("fc.scale", "markov_w2.scale") if n in self._tensors]
        if scaled:  # llama.cpp's loader accepts these per-tensor scales; its converter writes none
            raise ModelFileError(f"{p}: tensor {scaled[0]!r} is a per-tensor weight scale ds4c does not apply: "
                                 f"expected {scaled[0].replace('.scale', '.weight')!r} stored unscaled, as llama.cpp's "
                                 f"converter writes it")
        self.has_confidence = CONF_PROJ in self._tensors
        self.has_conf_bias = CONF_BIAS in self._tensors
        specs = dspark_tensor_specs(cfg, len(self.taps), self.markov_rank, self.has_confidence, self.has_conf_bias)
        self.specs = {s.name: s for s in specs}
        self._validate(size)

    def _int_key(self, key: str, lo: int) -> int:
        v = self.metadata.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ModelFileError(f"{self.path}: expected {key} an int >= {lo}, found {v!r}")
        return v

    def _validate(self, file_size: int) -> None:
        for name, spec in self.specs.items():
            t = self._tensors.get(name)
            if t is None:
                raise ModelFileError(f"{self.path}: missing tensor {name!r} (expected shape {list(spec.shape)} in "
                                     f"torch order, role {spec.role}; names as llama.cpp's converter writes them)")
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if shape != spec.shape:
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(shape)}, expected "
                                     f"{list(spec.shape)} (torch order)")
            check_tensor_type(self.path, name, t, spec)
            check_tensor_extent(self.path, name, t, file_size)

    def check_target(self, target: Ds4Config) -> None:
        """Check that this drafter serves ``target`` (the config of the target model).

        Raises:
            ModelFileError: one line: a stage hyper-parameter (:data:`MATCH_FIELDS`, vocabulary included) that differs
                from the target's, or a tap layer outside the target's layers.
        """
        for f in MATCH_FIELDS:
            mine, theirs = getattr(self.config, f), getattr(target, f)
            if mine != theirs:
                what = "vocabulary size" if f == "vocab_size" else f
                raise ModelFileError(f"{self.path}: the drafter does not fit the target {target.name!r}: expected "
                                     f"{what} = {theirs} (the target's), found {mine}")
        bad = [t + 1 for t in self.taps if t >= target.n_layers]
        if bad:
            raise ModelFileError(f"{self.path}: {KEY_TARGET_LAYERS} {[t + 1 for t in self.taps]} is out of range for "
                                 f"the target's {target.n_layers} layers: expected values in 1..{target.n_layers} "
                                 f"(layer + 1), found {bad}")

    # --------------------------------------------------------------------------------------------
    def ggml_type(self, name: str) -> GGMLType:
        """The GGUF storage type of tensor ``name``."""
        return GGMLType(int(self._get(name).tensor_type))

    generates_on_device = False
    """A file's tensors are read on the host (``device`` arguments copy there after); the synthetic source
    (:class:`ds4c.drafters.dspark_source.SyntheticDSpark`) has True: it makes them on the device asked for."""

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype``, its spec shape (torch order), on the host (copied to ``device``
        when given). Raises ModelFileError for an unknown name."""
        t = self._get(name)
        shape = self.specs[name].shape if name in self.specs else tuple(int(x) for x in reversed(t.shape.tolist()))
        out = dequantize(np.asarray(t.data), GGMLType(int(t.tensor_type)), shape, dtype=dtype)
        return out if device is None else out.to(device)

    def stored(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The stored bytes of ``name``: uint8 ``[nbytes]``, a zero-copy view of the memory map (read only; copied
        to ``device`` when given). What the compiled drafter uploads for the kernels that read a weight as stored
        (GEMV, experts)."""
        import warnings

        raw = np.ascontiguousarray(np.asarray(self._get(name).data)).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # the memory map is read-only; the bytes are only read
            warnings.simplefilter("ignore", UserWarning)
            out = torch.from_numpy(raw)
        return out if device is None else out.to(device)

    def expert(self, name: str, e: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Expert ``e`` of the expert tensor ``name`` ([n_expert, out, in]) dequantized: [out, in] (copied to
        ``device`` when given)."""
        spec = self.specs.get(name)
        if spec is None or len(spec.shape) != 3:
            raise ModelFileError(f"{self.path}: {name!r} is not an expert tensor of this drafter")
        if not 0 <= e < spec.shape[0]:
            raise ModelFileError(f"{name}: expert index {e} out of range 0..{spec.shape[0] - 1}")
        t = self._get(name)
        out = dequantize(np.asarray(t.data[e]), GGMLType(int(t.tensor_type)), spec.shape[1:], dtype=dtype)
        return out if device is None else out.to(device)

    @property
    def tensor_names(self) -> list[str]:
        """Every tensor of the file, in file order."""
        return [t.name for t in self._reader.tensors]

    def _get(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}") from None
