"""The synthetic DSpark drafter source: a drafter with no file, whose tensors are made on demand on a device.

``synthetic:PRESET[:FORMATS[:SEED]]`` given where a DSpark drafter path goes (``--draft dspark:synthetic:flash-l4``,
:func:`ds4c.drafters.dspark_sources.open_dspark`, ``tools/dspark_time.py --drafter``, ``compile --draft``) names the
drafter ``ds4c make-model --preset PRESET --drafter dspark --formats FORMATS --seed SEED`` would write (the drafter
of the target ``synthetic:PRESET:...:SEED`` / of that make-model file); opening it gives a :class:`SyntheticDSpark`
instead of a :class:`~ds4c.drafters.dspark_file.DSparkFile`. Every tensor comes from
:func:`ds4c.drafters.dspark_synth.dspark_pieces`, the generator ``make_dspark`` writes the file with, so it equals
the file's tensor byte for byte, and it is made directly on the device asked for (``stored(name, device)``,
``tensor(name, device=)``): the compiled drafter generates each weight in GPU memory with no host staging, and the
reference drafter likewise on its device. FORMATS is ``official`` (default), ``bf16`` or ``f32``: a K-quant formats
is refused as ``make-model --drafter dspark`` refuses it (the drafter has no routed experts of its own format).

It sits where the drafter file reader sits (as :mod:`ds4c.synth_source` sits where the model reader sits): the
engines read it through the interface of ``DSparkFile`` (docs/synthetic.md, docs/drafter.md).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from ds4c.config import ARCH as TARGET_ARCH
from ds4c.config import from_gguf_metadata, preset
from ds4c.drafters.dspark_file import (ARCH, KEY_MASK_ID, OFFICIAL_BLOCK_SIZE, DSparkFile, dspark_metadata,
                                       dspark_tensor_specs, stage_config)
from ds4c.drafters.dspark_synth import dspark_options, dspark_pieces, drafter_seed
from ds4c.errors import ConfigError, ModelFileError
from ds4c.gguf_file import file_type, tokenizer_entries
from ds4c.quant import GGMLType, dequantize, nbytes
from ds4c.synth import extra_metadata, is_matrix, n_rows
from ds4c.synth_source import PREFIX, _reader_value, is_spec, parse_spec
from ds4c.tensors import FORMATS, storage_type

__all__ = ["SyntheticDSpark", "open_synthetic_dspark", "is_spec"]

_USAGE = ("a synthetic DSpark drafter is synthetic:PRESET[:FORMATS[:SEED]] (as --draft dspark:synthetic:PRESET"
          "[:FORMATS[:SEED]]), the drafter make-model --preset PRESET --drafter dspark --formats FORMATS --seed SEED "
          "writes, FORMATS official (default), bf16 or f32")


class SyntheticDSpark(DSparkFile):
    """The synthetic DSpark drafter of target preset ``preset_name``, ``formats`` and ``seed``, with the interface of
    :class:`~ds4c.drafters.dspark_file.DSparkFile` (it passes for one wherever a drafter file is taken); no file is
    read or written.

    Args:
        preset_name: the target's preset (:data:`ds4c.config.PRESETS`); the stages are :func:`stage_config` of it.
        formats: ``official``, ``bf16`` or ``f32`` (:data:`ds4c.tensors.FORMATS`). seed: the target's seed (the
            drafter's streams are :func:`~ds4c.drafters.dspark_synth.drafter_seed` of it), an int >= 0.
        device: where tensors are made when a call names none.
        taps, block_size, markov_rank, noise_id, conf_bias: as :func:`~ds4c.drafters.dspark_synth.make_dspark`
            (defaults: the last three layers, 5, :func:`default_rank`, :func:`default_noise`, no bias).

    Attributes (as ``DSparkFile``'s): ``config`` (the stages' config, built from the metadata as the reader builds
    it), ``metadata`` (every key the make_dspark file holds, as the GGUF reader gives it; built on first use),
    ``block_size``, ``taps``, ``noise_id``, ``markov_rank``, ``has_confidence`` (True), ``has_conf_bias``, ``specs``,
    ``path`` (= ``identity``, for messages). Plus ``identity``: the canonical ``synthetic:PRESET:FORMATS:SEED``
    (options other than the defaults appended in brackets), ``preset``, ``formats``, ``seed``, ``device``, ``types``
    (``name -> GGMLType``).

    Raises (constructor):
        ModelFileError: an unknown preset, a formats that is not a drafter's, a bad seed or option (one line).
    """

    generates_on_device = True
    """Engines load its weights with ``stored(name, device)`` / ``tensor(name, device=)`` straight on the device
    (no host staging); a ``DSparkFile`` has False."""

    def __init__(self, preset_name: str, formats: str = "official", seed: int = 0,
                 device: torch.device | str = "cpu", *, taps: tuple[int, ...] | None = None,
                 block_size: int = OFFICIAL_BLOCK_SIZE, markov_rank: int | None = None, noise_id: int | None = None,
                 conf_bias: bool = False):
        spec = f"{PREFIX}{preset_name}:{formats}:{seed}"
        try:
            name, formats, seed = parse_spec(spec)
        except ModelFileError as e:
            raise ModelFileError(f"{e}; {_USAGE}") from None
        target = preset(name)
        try:
            taps, block_size, rank, noise = dspark_options(target, formats, taps, block_size, markov_rank, noise_id)
        except ConfigError as e:
            raise ModelFileError(f"{spec!r}: {e}; {_USAGE}") from None
        defaults = dspark_options(target)
        self.preset, self.formats, self.seed = name, formats, seed
        opts = [f"{k}={v}" for k, v, d in (("taps", list(taps), list(defaults[0])), ("block_size", block_size,
                                                                                     defaults[1]),
                                            ("markov_rank", rank, defaults[2]), ("noise_id", noise, defaults[3]),
                                            ("conf_bias", bool(conf_bias), False)) if v != d]
        self.identity = f"{PREFIX}{name}:{formats}:{seed}" + (f"[{', '.join(opts)}]" if opts else "")
        self.path = self.identity  # type: ignore[assignment]  # messages print it where a file's path goes
        self.device = torch.device(device)
        self._stage = stage_config(target)  # what make_dspark generates with (the config the reader rebuilds equals it)
        self._entries = dspark_metadata(self._stage, taps, block_size, noise)
        meta = {(TARGET_ARCH + k[len(ARCH):] if k.startswith(ARCH + ".") else k): _reader_value(v, kind)
                for k, v, kind in self._entries}
        meta["general.architecture"] = TARGET_ARCH
        self.config = from_gguf_metadata(meta, source=self.identity, vocab_size=target.vocab_size)
        self.block_size, self.taps, self.noise_id, self.markov_rank = block_size, tuple(taps), noise, rank
        self.has_confidence, self.has_conf_bias = True, bool(conf_bias)
        specs = dspark_tensor_specs(self.config, len(self.taps), rank, True, self.has_conf_bias)
        self.specs = {s.name: s for s in specs}
        self.types = {s.name: storage_type(s, FORMATS[formats]) for s in specs}
        """``name -> GGMLType`` each tensor is stored as (as the make_dspark file stores it)."""
        self._wseed = drafter_seed(seed)

    @classmethod
    def from_spec(cls, text: str, device: torch.device | str = "cpu") -> "SyntheticDSpark":
        """The drafter ``synthetic:PRESET[:FORMATS[:SEED]]`` names (default options). Raises ModelFileError (one
        line) for a bad spec."""
        text = str(text)
        try:
            args = parse_spec(text)
        except ModelFileError as e:
            raise ModelFileError(f"{e}; {_USAGE}") from None
        return cls(*args, device=device)

    def __repr__(self) -> str:
        return f"SyntheticDSpark({self.identity!r}, device={str(self.device)!r})"

    # ------------------------------------------------------------------------------------------ metadata
    @cached_property
    def metadata(self) -> dict[str, Any]:  # type: ignore[override]
        """Every metadata key of the make_dspark file of this drafter -> its value as the GGUF reader gives it (the
        target's synthetic vocabulary included: a few seconds for the official vocabulary, built on first use)."""
        from ds4c.synth_vocab import synthetic_vocab

        tok = {k: v for k, v in synthetic_vocab(self.config.vocab_size, self.seed).items()
               if k.startswith("tokenizer.") and k != KEY_MASK_ID}
        out: dict[str, Any] = {"general.architecture": ARCH}
        for key, val, kind in self._entries + tokenizer_entries(self._stage, tok):
            if key != "general.architecture":  # the writer's is the file's arch (dflash), not the config's
                out[key] = _reader_value(val, kind)
        out["general.file_type"] = file_type(FORMATS[self.formats])
        out.update(extra_metadata(self.seed, self.formats))
        return out

    @property
    def tensor_names(self) -> list[str]:  # type: ignore[override]
        """Every tensor, in the file's order."""
        return list(self.specs)

    def weight_bytes(self) -> int:
        """Stored bytes of every tensor (arithmetic: nothing is generated)."""
        return sum(nbytes(self.types[n], s.shape) for n, s in self.specs.items())

    # ------------------------------------------------------------------------------------------ tensors
    def _spec(self, name: str):
        try:
            return self.specs[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}") from None

    def _dev(self, device: torch.device | str | None) -> torch.device:
        return self.device if device is None else torch.device(device)

    def _rows(self, spec, r0: int, r1: int, dev: torch.device) -> torch.Tensor:
        """Stored bytes of rows ``[r0, r1)`` of a matrix (of the whole tensor otherwise), flat uint8 on ``dev``."""
        t = self.types[spec.name]
        if not is_matrix(spec):
            return next(dspark_pieces(self._stage, spec, t, self._wseed, device=dev)).reshape(-1)
        row_bytes = nbytes(t, spec.shape) // n_rows(spec)
        out = torch.empty((r1 - r0) * row_bytes, dtype=torch.uint8, device=dev)
        off = 0
        for piece in dspark_pieces(self._stage, spec, t, self._wseed, r0, r1, device=dev):
            n = piece.numel()
            out[off:off + n] = piece.reshape(-1)
            off += n
        return out

    def ggml_type(self, name: str) -> GGMLType:
        """The storage type of tensor ``name`` (the make_dspark file's)."""
        return self.types[self._spec(name).name]

    def stored(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The stored bytes of ``name`` generated on ``device`` (default :attr:`device`): uint8 ``[nbytes]``, equal to
        the make_dspark file's bytes of this tensor."""
        spec = self._spec(name)
        return self._rows(spec, 0, n_rows(spec) if is_matrix(spec) else 1, self._dev(device))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor ``name`` decoded to ``dtype`` in its spec shape (torch order), generated and decoded on ``device``
        (default :attr:`device`). Raises ModelFileError for an unknown name."""
        spec = self._spec(name)
        return dequantize(self.stored(name, device), self.types[name], spec.shape, dtype=dtype)

    def expert(self, name: str, e: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Expert ``e`` of the expert tensor ``name`` ([n_expert, out, in]) decoded: [out, in] on ``device``; only its
        rows are generated. Raises ModelFileError for a non-expert name or an index out of range."""
        spec = self.specs.get(name)
        if spec is None or len(spec.shape) != 3:
            raise ModelFileError(f"{self.path}: {name!r} is not an expert tensor of this drafter")
        if not 0 <= e < spec.shape[0]:
            raise ModelFileError(f"{name}: expert index {e} out of range 0..{spec.shape[0] - 1}")
        out = spec.shape[1]
        raw = self._rows(spec, e * out, (e + 1) * out, self._dev(device))
        return dequantize(raw, self.types[name], spec.shape[1:], dtype=dtype)


def open_synthetic_dspark(text: str, device: torch.device | str = "cpu") -> SyntheticDSpark:
    """:class:`SyntheticDSpark` of the spec ``synthetic:PRESET[:FORMATS[:SEED]]`` (a leading ``dspark:`` is
    accepted too). Raises ModelFileError (one line) for a bad spec."""
    text = str(text)
    if text.startswith("dspark:"):
        text = text[len("dspark:"):]
    return SyntheticDSpark.from_spec(text, device)
