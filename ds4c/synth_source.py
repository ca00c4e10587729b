"""The synthetic weight source: a model with no file, whose tensors are made on demand on a device.

``synthetic:PRESET[:FORMATS[:SEED]]`` (e.g. ``synthetic:flash:official``, ``synthetic:tiny:bf16:3``) names, where a
model path goes, the model ``ds4c make-model --preset PRESET --formats FORMATS --seed SEED`` would write; opening it
(:func:`ds4c.sources.open_model`) gives a :class:`SyntheticModel` instead of a
:class:`~ds4c.gguf_file.ModelFile`. Every tensor comes from the generator of :mod:`ds4c.synth`, so it equals the
file's tensor byte for byte, and it is made directly on the device asked for (``stored(name, device)``,
``tensor(name, device=)``): the compiled step generates each weight in GPU memory with no host staging, and the
reference's weights likewise. The whole 43-layer ``flash`` model thus runs on a machine whose disk could not hold
its file (docs/synthetic.md).

It sits where the GGUF reader sits (data flows one way: this module reads the config presets, the tensor
inventory and the generator; the engines read it through the interface of ``ModelFile``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import numpy as np
import torch

from ds4c.config import ARCH, PRESETS, preset, to_gguf_metadata
from ds4c.errors import ModelFileError
from ds4c.gguf_file import ModelFile, file_type, tokenizer_entries
from ds4c.quant import GGMLType, dequantize, nbytes
from ds4c.synth import extra_metadata, is_matrix, n_rows, stored_pieces
from ds4c.tensors import FORMATS, tensor_specs, storage_types

PREFIX = "synthetic:"

_USAGE = ("expected synthetic:PRESET[:FORMATS[:SEED]] with PRESET one of {presets}, FORMATS one of {formats} "
          "(default official), SEED an integer >= 0 (default 0), e.g. synthetic:flash:official")


def is_spec(path: Any) -> bool:
    """True when ``path`` (a str or path) names a synthetic model (starts with ``synthetic:``)."""
    return isinstance(path, str) and path.startswith(PREFIX) or (
        hasattr(path, "__fspath__") and str(path).startswith(PREFIX))


def parse_spec(text: str) -> tuple[str, str, int]:
    """``(preset, formats, seed)`` of ``synthetic:PRESET[:FORMATS[:SEED]]``.

    Raises:
        ModelFileError: one line naming what is wrong and listing the presets and formats.
    """
    usage = _USAGE.format(presets=", ".join(PRESETS), formats=", ".join(FORMATS))
    text = str(text)
    if not text.startswith(PREFIX):
        raise ModelFileError(f"{text!r}: {usage}")
    parts = text[len(PREFIX):].split(":")
    if len(parts) > 3 or not parts[0]:
        raise ModelFileError(f"{text!r}: {usage}")
    name, formats, seed = parts[0], parts[1] if len(parts) > 1 else "official", parts[2] if len(parts) > 2 else "0"
    if name not in PRESETS:
        raise ModelFileError(f"{text!r}: unknown preset {name!r}; {usage}")
    if formats not in FORMATS:
        raise ModelFileError(f"{text!r}: unknown formats {formats!r}; {usage}")
    if not (seed.isascii() and seed.isdigit()) or int(seed) >= 2**63:
        raise ModelFileError(f"{text!r}: seed {seed!r} is not an integer in 0..2^63-1; {usage}")
    return name, formats, int(seed)


def _reader_value(val: Any, kind: str) -> Any:
    """A metadata value as a GGUF reader returns it (f32 values through float32)."""
    if kind == "f32":
        return float(np.float32(val))
    if kind == "arr_f32":
        return [float(np.float32(v)) for v in val]
    if kind in ("u32", "u64"):
        return int(val)
    if kind == "bool":
        return bool(val)
    if kind in ("arr_i32", "arr_u32"):
        return [int(v) for v in val]
    if kind == "arr_str":
        return [str(v) for v in val]
    return str(val)


class SyntheticModel(ModelFile):
    """A synthetic model of ``(preset, formats, seed)`` with the interface of :class:`~ds4c.gguf_file.ModelFile`
    (it passes for one wherever a model file is taken); no file is read or written.

    Attributes (as ``ModelFile``'s): ``config``, ``metadata`` (the keys make-model writes: config, file type,
    tokenizer, ``ds4c.synthetic_seed`` / ``ds4c.formats``; built on first use), ``specs``, ``path`` (the
    spec string, for messages); no MTP blocks, extra tensors or legacy names. Plus ``identity``: the canonical
    spec ``synthetic:PRESET:FORMATS:SEED`` (stable: the same model has the same identity), ``preset``,
    ``formats``, ``seed``, and ``device``: where tensors are made when a call names none.

    Every tensor is generated when asked for, from :mod:`ds4c.synth` (identical bytes on every device).

    Raises (from the constructor):
        ModelFileError: an unknown preset or formats, a bad seed (one line listing the choices).
    """

    generates_on_device = True
    """Engines load its weights with ``stored(name, device)`` / ``tensor(name, device=)`` straight on the device
    (no host staging); a ``ModelFile`` has False."""

    def __init__(self, preset_name: str, formats: str = "official", seed: int = 0,
                 device: torch.device | str = "cpu"):
        name, formats, seed = parse_spec(f"{PREFIX}{preset_name}:{formats}:{seed}")
        self.preset, self.formats, self.seed = name, formats, seed
        self.identity = f"{PREFIX}{name}:{formats}:{seed}"
        self.path = self.identity  # type: ignore[assignment]  # messages print it where a file's path goes
        self.device = torch.device(device)
        self.config = preset(name)
        self.specs = {s.name: s for s in tensor_specs(self.config)}
        self.types = storage_types(self.config, formats)
        """``name -> GGMLType`` each tensor is stored as."""
        self.mtp_specs: dict = {}
        self.nextn_blocks: list[int] = []
        self.mtp_only = False
        self.legacy_names: list[str] = []
        self.absent_keys: dict = {}  # the preset's config: no metadata key to lack

    @classmethod
    def from_spec(cls, text: str, device: torch.device | str = "cpu") -> "SyntheticModel":
        """The model ``synthetic:PRESET[:FORMATS[:SEED]]`` names (see :func:`parse_spec`)."""
        return cls(*parse_spec(text), device=device)

    def __repr__(self) -> str:
        return f"SyntheticModel({self.identity!r}, device={str(self.device)!r})"

    # ------------------------------------------------------------------------------------------ metadata
    @cached_property
    def metadata(self) -> dict[str, Any]:  # type: ignore[override]
        """Every metadata key of the make-model file of this model -> its value as the GGUF reader gives it."""
        from ds4c.synth_vocab import synthetic_vocab

        cfg = self.config
        out: dict[str, Any] = {"general.architecture": ARCH}
        for key, val, kind in to_gguf_metadata(cfg) + tokenizer_entries(cfg, synthetic_vocab(cfg.vocab_size,
                                                                                               self.seed)):
            if key != "general.architecture":
                out[key] = _reader_value(val, kind)
        out["general.file_type"] = file_type(FORMATS[self.formats])
        out.update(extra_metadata(self.seed, self.formats))
        return out

    @property
    def extra_tensors(self) -> list[str]:  # type: ignore[override]
        return []

    @property
    def n_tensors(self) -> int:  # type: ignore[override]
        return len(self.specs)

    def weight_bytes_by_type(self) -> dict[str, tuple[int, int]]:
        """``type name -> (tensor count, bytes)`` over every tensor (arithmetic: nothing is generated)."""
        out: dict[str, tuple[int, int]] = {}
        for n, s in self.specs.items():
            k = self.types[n].name
            c, b = out.get(k, (0, 0))
            out[k] = (c + 1, b + nbytes(self.types[n], s.shape))
        return out

    # ------------------------------------------------------------------------------------------ tensors
    def _spec(self, name: str):
        try:
            return self.specs[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}") from None

    def ggml_type(self, name: str) -> GGMLType:
        """The storage type of tensor ``name``."""
        self._spec(name)
        return self.types[name]

    def stored(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The stored bytes of ``name`` generated on ``device`` (default :attr:`device`): uint8 ``[nbytes]``,
        equal to the make-model file's bytes of this tensor."""
        spec = self._spec(name)
        dev = self.device if device is None else torch.device(device)
        return self._rows(spec, 0, n_rows(spec) if is_matrix(spec) else 1, dev)

    def _rows(self, spec, r0: int, r1: int, dev: torch.device) -> torch.Tensor:
        """Stored bytes of rows ``[r0, r1)`` of a matrix (of the whole tensor otherwise), flat uint8."""
        t = self.types[spec.name]
        if not is_matrix(spec):
            return next(stored_pieces(self.config, spec, t, self.seed, device=dev))
        row_bytes = nbytes(t, spec.shape) // n_rows(spec)
        out = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8, device=dev)
        off = 0
        for piece in stored_pieces(self.config, spec, t, self.seed, r0, r1, device=dev):
            n = piece.numel()
            out[off:off + n] = piece.reshape(-1)
            off += n
        return out

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0 .. r1 - 1`` of the 2-D tensor ``name`` dequantized (only those rows generated): fp32
        ``[r1 - r0, cols]`` on the host (as :meth:`ModelFile.rows`)."""
        spec = self._spec(name)
        if len(spec.shape) != 2 or not 0 <= r0 <= r1 <= spec.shape[0]:
            raise ModelFileError(f"{self.path}: expected rows of a 2-D tensor {name!r} within its shape, found "
                                 f"{r0}..{r1 - 1} of {list(spec.shape)}")
        return dequantize(self._rows(spec, r0, r1, torch.device("cpu")), self.types[name], (r1 - r0, spec.shape[1]))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes/values of ``name`` on the host as numpy, shaped as a GGUF reader gives them (F32 /
        F16 / I32 values in the tensor's shape; other types uint8 ``[..., row bytes]``). Generated per call."""
        spec = self._spec(name)
        t = self.types[name]
        b = self.stored(name, "cpu").numpy()
        plain = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.I32: np.int32}
        if t in plain:
            return b.view(plain[t]).reshape(spec.shape)
        return b.reshape(*spec.shape[:-1], -1)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor ``name`` decoded to ``dtype`` in its spec shape, generated and decoded on ``device`` (default
        :attr:`device`); I32 tensors come back as int64 (as ``ModelFile.tensor``)."""
        spec = self._spec(name)
        t = self.types[name]
        raw = self.stored(name, device)
        if t == GGMLType.I32:
            return raw.view(torch.int32).to(torch.int64).view(spec.shape)
        return dequantize(raw, t, spec.shape, dtype=dtype)

    def expert(self, name: str, e: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Expert ``e`` of the 3-d expert tensor ``name`` decoded: ``[out, in]``; only its rows are generated."""
        shape = self._expert_shape(name, e)
        dev = self.device if device is None else torch.device(device)
        raw = self._rows(self.specs[name], e * shape[1], (e + 1) * shape[1], dev)
        return dequantize(raw, self.types[name], shape[1:], dtype=dtype)


def open_synthetic(text: str, device: torch.device | str = "cpu") -> SyntheticModel:
    """:class:`SyntheticModel` of the spec ``synthetic:PRESET[:FORMATS[:SEED]]`` (see :func:`parse_spec`)."""
    return SyntheticModel.from_spec(text, device)
