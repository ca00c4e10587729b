"""Read and write DeepSeek-V4-Flash GGUF model files (docs/gguf-layout.md).

Reading memory-maps the file (``gguf.GGUFReader``), builds the :class:`~ds4c.config.Ds4Config` from the
metadata, and checks every tensor of :func:`~ds4c.tensors.tensor_specs` for presence, shape and type before
anything is used, so a bad file fails at open with an error naming the tensor. Tensors are dequantized on
demand; routed experts one expert at a time.

Writing streams tensor by tensor (and expert by expert) into a temporary file that is renamed into place
only when complete, so memory stays far below the file size and a failed write leaves no partial file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from ds4c.config import (ARCH, Ds4Config, absent_keys_text, absent_optional_keys, from_gguf_metadata,
                         rope_scaling_text, to_gguf_metadata)
from ds4c.errors import ConfigError, ModelFileError
from ds4c.quant import GGMLType, dequantize, nbytes
from ds4c.tempfiles import AtomicFile
from ds4c.tensors import (ACCEPTED_TYPES, TensorSpec, legacy_names, nextn_tensor_specs, root_tensor_specs,
                          storage_type, tensor_specs)
from ds4c.write_errors import write_error_text

_TYPE_NAMES = {int(t): t.name for t in GGMLType}


class _CheckedReader(GGUFReader):
    """GGUFReader that names the tensor whose data runs past the end of the file (gguf itself fails with a
    reshape error that names nothing), and says "truncated" when the header does (gguf leaks numpy's view errors:
    "When changing to a larger dtype...")."""

    def _need(self, offset: int, nbytes: int) -> None:
        """Raise ModelFileError when the header bytes ``offset .. offset + nbytes`` run past the end of the file."""
        if offset + nbytes > len(self.data):
            raise ModelFileError(f"truncated GGUF file: its header (metadata and tensor table) needs bytes up to "
                                 f"{offset + nbytes} but the file has {len(self.data)} bytes")

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:  # type: ignore[override]
        self._need(offset, int(np.dtype(dtype).itemsize) * int(count))
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs: int, raw_type: int):  # type: ignore[override]
        """Arrays parsed in one pass: gguf's reader makes two memory-mapped views per array element, 15 s for
        the 129,280 tokens and merges of a DeepSeek-V4 vocabulary; this builds the same parts (a length and
        a data array per string, an array per number) from one ``frombuffer`` per item, ~0.3 s. Other types,
        and files not in native byte order, take gguf's own path."""
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype = GGUFValueType(int(raw_itype[0]))
        n = int(alen[0])
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        types = [GGUFValueType.ARRAY]
        buf = memoryview(self.data)
        if itype == GGUFValueType.STRING:
            types.append(itype)
            idxs = list(range(3, 3 + 2 * n, 2))
            for _ in range(n):
                self._need(offs, 8)
                slen = np.frombuffer(buf, dtype=np.uint64, count=1, offset=offs)
                k = int(slen[0])
                self._need(offs + 8, k)
                parts.append(slen)
                parts.append(np.frombuffer(buf, dtype=np.uint8, count=k, offset=offs + 8))
                offs += 8 + k
            return offs - orig_offs, parts, idxs, types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # nested arrays: gguf's path
            return super()._get_field_parts(orig_offs, raw_type)
        types.append(itype)
        self._need(offs, n * int(np.dtype(nptype).itemsize))
        arr = np.frombuffer(buf, dtype=nptype, count=n, offset=offs)
        parts += list(arr.reshape(n, 1)) if n else []
        return 12 + arr.nbytes, parts, list(range(2, 2 + n)), types

    def _build_tensors(self, start_offs: int, fields: list) -> None:  # type: ignore[override]
        size = len(self.data)
        for field in fields:
            _n, name_data, _d, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
            except (ValueError, KeyError):
                raise ModelFileError(f"tensor {name!r} has unknown GGML type id {int(raw_dtype[0])}") from None
            if len(dims) and int(dims[0]) % block:  # gguf's reader fails on it with a reshape error naming nothing
                raise ModelFileError(f"tensor {name!r} of type {_type_name(int(raw_dtype[0]))} has rows of "
                                     f"{int(dims[0])} values, not a multiple of its block of {block} values")
            end = int(start_offs + offset_tensor[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ModelFileError(f"tensor {name!r} ends at byte {end} but the file has {size} bytes "
                                     f"(truncated file)")
        super()._build_tensors(start_offs, fields)


def check_magic(path: Path, size: int) -> None:
    """Raise ModelFileError (one line) when ``path`` does not start with the GGUF magic: another kind of file,
    whatever its size (a truncated GGUF file still starts with it)."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (it starts with {head!r}, a GGUF file with b'GGUF'; "
                             f"{size} bytes)")


def check_tensor_extent(path: Path, name: str, t: Any, file_size: int) -> None:
    """Raise ModelFileError (one line) when the bytes of GGUF tensor ``t`` (a reader tensor) run past the end of
    the file of ``file_size`` bytes (a truncated file)."""
    end = t.data_offset + t.n_bytes
    if end > file_size or t.data.size * t.data.itemsize != t.n_bytes:
        raise ModelFileError(f"{path}: tensor {name!r} ends at byte {end} but the file has {file_size} bytes "
                             f"(truncated file)")


def check_tensor_type(path: Path, name: str, t: Any, spec: TensorSpec) -> None:
    """Raise ModelFileError (one line) when GGUF tensor ``t`` is stored in a type its role does not accept
    (:data:`ds4c.tensors.ACCEPTED_TYPES`), naming the type found and the types expected."""
    if int(t.tensor_type) not in [int(x) for x in ACCEPTED_TYPES[spec.role]]:
        allowed = ", ".join(x.name for x in ACCEPTED_TYPES[spec.role])
        raise ModelFileError(f"{path}: tensor {name!r} has type {_type_name(t.tensor_type)}, expected one of "
                             f"{allowed} (role {spec.role})")


def _type_name(t: int) -> str:
    return _TYPE_NAMES.get(int(t), f"type-{int(t)}")


def _field_value(field: Any) -> Any:
    """Python value of a GGUFReader field (scalars, strings, arrays)."""
    vt = field.types[0] if field.types else None
    if vt == GGUFValueType.ARRAY:
        return [_scalar(field.parts[i], field.types[-1]) for i in field.data]
    return _scalar(field.parts[field.data[0]], vt)


def _scalar(part: np.ndarray, vt: Any) -> Any:
    if vt == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    if vt == GGUFValueType.BOOL:
        return bool(part[0])
    v = part[0]
    return float(v) if np.issubdtype(part.dtype, np.floating) else int(v)


class ArchitectureError(ModelFileError):
    """A readable GGUF file of another architecture (``arch``: its ``general.architecture``)."""

    def __init__(self, message: str, arch: Any):
        super().__init__(message)
        self.arch = arch


class ModelFile:
    """An opened, validated DeepSeek-V4-Flash GGUF.

    Attributes:
        path: the file.
        config: the :class:`Ds4Config` read from its metadata.
        metadata: every metadata key -> python value.
        specs: ``name -> TensorSpec`` of the tensors the model needs (extra tensors in the file are ignored).
        nextn_blocks, mtp_specs, mtp_only: the MTP (nextn) blocks of a ``--mtp`` conversion, if any.

    Args:
        allow_mtp_only: open an MTP-only file (only ``ds4c info`` and the draft loader want that).

    Raises (from the constructor):
        ModelFileError: the file is missing, not GGUF, truncated, of another architecture, its embedding and
            tokenizer disagree on the vocabulary size, or a needed tensor is missing, mis-shaped or of a type its
            role does not allow. The message names the
            tensor, what was expected and what was found. Also an MTP-only file unless ``allow_mtp_only``.
    """

    generates_on_device = False
    """A file's tensors are read on the host (``device`` arguments copy there after); the synthetic source
    (:class:`ds4c.synth_source.SyntheticModel`) has True: it makes them on the device asked for, and has no GGUF
    file to hand to another program."""

    def __init__(self, path: str | os.PathLike[str], allow_mtp_only: bool = False):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(f"{self.path}: no such model file")
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: expected a GGUF model file, found a directory or special file")
        size = self.path.stat().st_size
        check_magic(self.path, size)
        try:
            self._reader = _CheckedReader(self.path)
        except ModelFileError as e:
            raise ModelFileError(f"{self.path}: {e}") from None
        except Exception as e:  # gguf raises ValueError/IndexError/struct errors on garbage or truncation
            raise ModelFileError(
                f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e}); expected a complete GGUF v3 "
                f"file of architecture {ARCH!r} (file size {size} bytes, truncated?)") from None
        self.metadata = {name: _field_value(f) for name, f in self._reader.fields.items()
                         if not name.startswith("GGUF.")}
        arch = self.metadata.get("general.architecture")
        if arch != ARCH:
            hint = " (a DSpark drafter: give it to --draft; `ds4c info` describes it)" if arch == "dflash" else ""
            raise ArchitectureError(f"{self.path}: expected general.architecture = {ARCH!r}, found {arch!r}{hint}",
                                    arch)
        self._tensors = {t.name: t for t in self._reader.tensors}
        emb = self._tensors.get("token_embd.weight")
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if emb is not None and isinstance(tokens, list) and len(tokens) != int(emb.shape.tolist()[-1]):
            # before the config: its vocabulary comes from the embedding, and the first tensor whose shape then
            # disagrees (a hash layer's tid2eid) would be blamed instead
            raise ModelFileError(f"{self.path}: vocabulary mismatch: token_embd.weight has "
                                 f"{int(emb.shape.tolist()[-1])} rows (one per token) but the tokenizer "
                                 f"(tokenizer.ggml.tokens) has {len(tokens)} tokens")
        meta, n_nextn = self._trunk_metadata()
        try:
            self.config = from_gguf_metadata(meta, source=str(self.path),
                                             vocab_size=None if emb is None else int(emb.shape.tolist()[-1]))
        except ConfigError as e:
            raise ModelFileError(str(e)) from None
        cfg = self.config
        self.absent_keys = absent_optional_keys(meta)
        """Optional metadata keys the file lacks (full key -> the value read instead, llama.cpp's default; see
        :data:`ds4c.config.OPTIONAL_KEYS`): ``{}`` for a file ds4c wrote."""
        _note_absent_keys(self.path, self.absent_keys, cfg)
        self.nextn_blocks = list(range(cfg.n_layers, cfg.n_layers + n_nextn))
        """Block ids of the MTP (nextn) blocks the file holds (``[]`` for a file without them)."""
        self.mtp_only = bool(self.nextn_blocks) and "blk.0.attn_norm.weight" not in self._tensors
        """True for an MTP-only file (the converter's ``--mtp`` export): the nextn blocks and the shared
        embedding/head, no trunk layers; it serves as the draft of the main model, never as a model."""
        if self.mtp_only and not allow_mtp_only:
            raise ModelFileError(
                f"{self.path}: expected a DeepSeek-V4 model, found an MTP-only GGUF (llama.cpp's convert --mtp): "
                f"it holds the nextn block{'s' if n_nextn > 1 else ''} "
                f"{', '.join(f'blk.{b}' for b in self.nextn_blocks)} and the shared embedding and head but no "
                f"trunk layers; open the main model file (this one is a speculative-decoding draft)")
        aliases = legacy_names(cfg)
        self.legacy_names = [old for old, new in aliases.items() if old in self._tensors and new not in self._tensors]
        """Tensors found under their ds4c 0.1 names (read under the converter's names, :data:`legacy_names`)."""
        for old in self.legacy_names:
            self._tensors[aliases[old]] = self._tensors[old]
        trunk = root_tensor_specs(cfg) if self.mtp_only else tensor_specs(cfg)
        self.specs = {s.name: s for s in trunk}
        self.mtp_specs = {s.name: s for b in self.nextn_blocks
                          for s in nextn_tensor_specs(cfg, b) + [o for o in nextn_tensor_specs(cfg, b, optional=True)
                                                                 if o.name in self._tensors]}
        """``name -> TensorSpec`` of the MTP blocks' tensors present in the file (read by speculative decoding;
        validated like the trunk's)."""
        self._validate(size, self.specs)
        self._validate(size, self.mtp_specs)

    def _trunk_metadata(self) -> tuple[dict[str, Any], int]:
        """The metadata with ``block_count`` reduced to the trunk, and the number of MTP blocks.

        A file of the converter's ``--mtp`` export counts its MTP block in ``block_count`` and says how many
        with ``deepseek4.nextn_predict_layers``; like llama.cpp's loader, the blocks count only when the first
        one's ``nextn.eh_proj`` is present.
        """
        key, n = f"{ARCH}.nextn_predict_layers", self.metadata.get(f"{ARCH}.nextn_predict_layers", 0)
        blocks = self.metadata.get(f"{ARCH}.block_count")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or (n and (not isinstance(blocks, int) or n >= blocks)):
            raise ModelFileError(f"{self.path}: expected {key} in 0..block_count-1, found {n!r} "
                                 f"(block_count {blocks!r})")
        if n == 0 or f"blk.{blocks - n}.nextn.eh_proj.weight" not in self._tensors:
            return self.metadata, 0
        ratios = self.metadata.get(f"{ARCH}.attention.compress_ratios")
        if isinstance(ratios, list) and len(ratios) < blocks:  # llama.cpp's loader refuses this too
            raise ModelFileError(f"{self.path}: expected {ARCH}.attention.compress_ratios to have an entry per block "
                                 f"including the {n} MTP block{'s' if n > 1 else ''} ({blocks}), found {len(ratios)}")
        return {**self.metadata, f"{ARCH}.block_count": blocks - n}, n

    # ----------------------------------------------------------------------------------------------
    def _validate(self, file_size: int, specs: dict[str, TensorSpec]) -> None:
        for name, spec in specs.items():
            t = self._tensors.get(name)
            if t is None:
                nextn = sorted({n.split(".nextn.")[0] for n in self._tensors if ".nextn." in n})
                hint = (f"; the file holds MTP tensors of {', '.join(nextn)}: an MTP file whose "
                        f"{ARCH}.nextn_predict_layers ({self.metadata.get(f'{ARCH}.nextn_predict_layers')!r}) "
                        f"does not count its nextn blocks?" if nextn and name not in self.mtp_specs else "")
                raise ModelFileError(f"{self.path}: missing tensor {name!r} (expected shape {list(spec.shape)} "
                                     f"in torch order, role {spec.role}; names as llama.cpp's converter "
                                     f"writes them{hint})")
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if shape != spec.shape:
                hint = ""
                if spec.role == "fp4" and shape[1:] == spec.shape[1:] and shape[0] != spec.shape[0]:
                    hint = " (pruned-expert files are not supported)"
                raise ModelFileError(f"{self.path}: tensor {name!r} has shape {list(shape)}, expected "
                                     f"{list(spec.shape)} (torch order){hint}")
            check_tensor_type(self.path, name, t, spec)
            if spec.role == "i32":
                vals = np.asarray(t.data)
                lo, hi = int(vals.min()), int(vals.max())
                if lo < 0 or hi >= self.config.n_experts:
                    raise ModelFileError(f"{self.path}: tensor {name!r} holds expert ids {lo}..{hi}, expected "
                                         f"0..{self.config.n_experts - 1}")
            check_tensor_extent(self.path, name, t, file_size)

    # ----------------------------------------------------------------------------------------------
    def ggml_type(self, name: str) -> GGMLType:
        """The GGUF storage type of tensor ``name``."""
        return GGMLType(int(self._get(name).tensor_type))

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes/values of ``name`` as a read-only memory-mapped numpy array (no copy)."""
        return self._get(name).data

    def stored(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The stored bytes of ``name``: uint8 ``[nbytes]``; on the host a zero-copy view of the memory map (read
        only: never write through it), else copied to ``device``."""
        raw = np.ascontiguousarray(self.raw(name)).reshape(-1).view(np.uint8)
        with warnings.catch_warnings():  # the memory map is read-only; the bytes are only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw)
        return t if device is None or torch.device(device).type == "cpu" else t.to(device)

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0 .. r1 - 1`` of the 2-D tensor ``name`` dequantized: fp32 ``[r1 - r0, cols]`` on the host (only
        those rows' bytes are read). Raises ModelFileError for an unknown or not 2-D name, or rows out of range."""
        spec = self.specs.get(name) or self.mtp_specs.get(name)
        if spec is None or len(spec.shape) != 2 or not 0 <= r0 <= r1 <= spec.shape[0]:
            raise ModelFileError(f"{self.path}: expected rows of a 2-D tensor {name!r} within its shape, found "
                                 f"{r0}..{r1 - 1} of {list(spec.shape) if spec else 'no such tensor'}")
        raw = np.ascontiguousarray(np.asarray(self.raw(name))[r0:r1]).reshape(-1).view(np.uint8)
        return dequantize(raw, self.ggml_type(name), (r1 - r0, spec.shape[1]))

    def tensor(self, name: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype`` (shape = its spec shape, torch order), on ``device`` (default
        the host; the file's bytes are decoded on the host).

        I32 tensors come back as int64. Raises ModelFileError for an unknown name.
        """
        t = self._get(name)
        spec = self.specs.get(name) or self.mtp_specs.get(name)
        shape = spec.shape if spec else tuple(int(x) for x in reversed(t.shape.tolist()))
        if int(t.tensor_type) == int(GGMLType.I32):
            out = torch.from_numpy(np.array(t.data, dtype=np.int64)).reshape(shape)
        else:
            out = dequantize(np.asarray(t.data), GGMLType(int(t.tensor_type)), shape, dtype=dtype)
        return out if device is None else out.to(device)

    def expert(self, name: str, e: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Expert ``e`` of the 3-d expert tensor ``name`` ([n_expert, out, in]) dequantized: [out, in] (on
        ``device``, default the host)."""
        t = self._get(name)
        shape = self._expert_shape(name, e)
        out = dequantize(np.asarray(t.data[e]), GGMLType(int(t.tensor_type)), shape[1:], dtype=dtype)
        return out if device is None else out.to(device)

    def _expert_shape(self, name: str, e: int) -> tuple[int, ...]:
        spec = self.specs.get(name) or self.mtp_specs.get(name)
        if spec is None or len(spec.shape) != 3:
            raise ModelFileError(f"{self.path}: {name!r} is not an expert tensor of this model")
        shape = spec.shape
        if not 0 <= e < shape[0]:
            raise ModelFileError(f"{name}: expert index {e} out of range 0..{shape[0] - 1}")
        return shape

    def weight_bytes_by_type(self) -> dict[str, tuple[int, int]]:
        """``type name -> (tensor count, bytes)`` over every tensor in the file."""
        out: dict[str, tuple[int, int]] = {}
        for t in self._reader.tensors:
            k = _type_name(t.tensor_type)
            n, b = out.get(k, (0, 0))
            out[k] = (n + 1, b + int(t.n_bytes))
        return out

    @property
    def extra_tensors(self) -> list[str]:
        """Tensors of the file neither the model nor its MTP blocks read (e.g. the converter's
        ``exp_probs_b_vl`` image-token routing bias), in file order."""
        used = set(self.specs) | set(self.mtp_specs) | set(self.legacy_names)
        return [t.name for t in self._reader.tensors if t.name not in used]

    @property
    def file_type(self) -> str:
        """``general.file_type`` as llama.cpp names it (e.g. ``MOSTLY_MXFP4_MOE``), or ``unset``."""
        from gguf import LlamaFileType

        v = self.metadata.get("general.file_type")
        try:
            return "unset" if v is None else LlamaFileType(int(v)).name
        except ValueError:
            return f"unknown ({v})"

    @property
    def n_tensors(self) -> int:
        return len(self._reader.tensors)

    def _get(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: no tensor named {name!r}") from None


_NOTED: set[str] = set()  # files whose absent optional keys were noted on stderr (once per process and file)


def _note_absent_keys(path: Path, absent: dict[str, Any], cfg: Ds4Config) -> None:
    """Say once per process and file, on stderr, which optional keys a file lacks and how it is read then."""
    where = str(path.resolve())
    if not absent or where in _NOTED:
        return
    _NOTED.add(where)
    print(f"ds4c: note: {path}: {absent_keys_text(absent)}; RoPE scaling: {rope_scaling_text(cfg)}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# writing

# A producer gives the bytes of one tensor as an iterator of numpy chunks (concatenated in order they
# must hold exactly nbytes(type, spec.shape) bytes).
Producer = Callable[[TensorSpec, GGMLType], Iterable[np.ndarray]]


def write_model(path: str | os.PathLike[str], cfg: Ds4Config, types: dict[str, GGMLType], produce: Producer,
                extra_metadata: dict[str, Any] | None = None,
                progress: Callable[[TensorSpec, int], None] | None = None,
                tokenizer: dict[str, Any] | None = None, *, arch: str = ARCH,
                specs: Iterable[TensorSpec] | None = None,
                metadata: Iterable[tuple[str, Any, str]] | None = None) -> Path:
    """Write a complete model file for ``cfg``, streaming.

    Args:
        path: destination; written as ``<path>.tmp-<pid>-<host>-<random>`` in the same folder (locked while
            written, see :mod:`ds4c.tempfiles`) and renamed when complete. Temporaries of earlier writers of
            ``path`` that were killed (SIGKILL included) are removed first.
        cfg: the config; its metadata goes to the ``deepseek4.*`` keys.
        types: role -> GGUF type to store (see :data:`ds4c.tensors.FORMATS`); each tensor is stored in
            :func:`ds4c.tensors.storage_type` of it (a K-quant role type falls back to Q8_0 for rows that are not
            whole super-blocks of 256 values).
        produce: ``(spec, ggml_type) -> iterable of numpy chunks`` giving the stored bytes of one tensor.
        extra_metadata: extra ``ds4c.*`` string/int/float keys.
        progress: called with ``(spec, bytes)`` after each tensor.
        tokenizer: the ``tokenizer.*`` keys (e.g. :func:`ds4c.synth_vocab.synthetic_vocab`), written with the
            GGUF types llama.cpp's converter uses (string arrays, INT32 token types, UINT32 ids, BOOL flags);
            its bos/eos ids must equal ``cfg``'s.
        arch, specs, metadata: for files of another layout (the DSpark drafter, :mod:`ds4c.drafters.dspark_file`):
            ``general.architecture``, the tensors in file order (default :func:`~ds4c.tensors.tensor_specs` of
            ``cfg``) and the ``(key, value, kind)`` entries written instead of ``cfg``'s ``deepseek4.*`` keys.

    Returns:
        the final path. Raises ModelFileError when a producer yields the wrong number of bytes (the
        temporary file is removed; nothing is left at ``path``).
    """
    if not str(path).strip():
        raise ModelFileError("-o: expected a file path to write, found ''")
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ModelFileError(f"{path}: expected a regular file path to write, found a directory or special file")
    blocked = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ModelFileError(f"cannot write {path}: {blocked} is a file, not a folder")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = AtomicFile.create(path)  # sweeps what killed writers of this path left
    except OSError as e:
        raise ModelFileError(f"cannot write {path}: cannot create a file in {path.parent} "
                             f"({e.strerror or e})") from None
    specs = tensor_specs(cfg) if specs is None else list(specs)
    w = None
    try:
        with _signals_raise():
            w = GGUFWriter(out.tmp, arch)
            _add_metadata(w, cfg, extra_metadata or {}, types, metadata)
            add_metadata_entries(w, tokenizer_entries(cfg, tokenizer or {}))
            for s in specs:
                t = storage_type(s, types)
                w.add_tensor_info(s.name, s.shape, np.dtype(np.float32) if t == GGMLType.F32 else
                                  np.dtype(np.int32) if t == GGMLType.I32 else np.dtype(np.float16),
                                  nbytes(t, s.shape), raw_dtype=t)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            fout = w.fout[0]
            for s in specs:
                t = storage_type(s, types)
                want = nbytes(t, s.shape)
                w.write_padding(fout, fout.tell())
                got = 0
                for chunk in produce(s, t):
                    b = np.ascontiguousarray(chunk).view(np.uint8)
                    got += b.nbytes
                    fout.write(b.data)  # not ndarray.tofile: its short write on a full disk has no errno
                if got != want:
                    raise ModelFileError(f"writing {s.name}: producer gave {got} bytes, expected {want} "
                                         f"({t.name} {list(s.shape)})")
                w.write_padding(fout, want)
                if progress:
                    progress(s, want)
            fout.flush()
            os.fsync(fout.fileno())
            w.close()
            out.publish()
    except BaseException as e:
        if w is not None:
            with contextlib.suppress(OSError):  # a full disk fails the flush again; the handle closes all the same
                w.close()  # else the open handle keeps the deleted file's disk space while the traceback lives
        out.discard()
        if isinstance(e, OSError):
            raise ModelFileError(f"{write_error_text(e, path)} (nothing was written)") from None
        raise
    return path


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While writing, SIGTERM and SIGHUP raise KeyboardInterrupt (as Ctrl-C does) so the temporary file is
    removed; the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"interrupted by signal {signum}")

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


_ARRAY_TYPES = {"arr_i32": (int, GGUFValueType.INT32), "arr_u32": (int, GGUFValueType.UINT32),
                "arr_f32": (float, GGUFValueType.FLOAT32)}


def add_metadata_entries(w: GGUFWriter, entries: Iterable[tuple[str, Any, str]]) -> None:
    """Add ``(key, value, kind)`` entries; kind in str, u32, u64, f32, bool, arr_i32, arr_u32, arr_f32,
    arr_str. ``general.architecture`` is skipped (the writer sets it from its ``arch``)."""
    scalar = {"str": w.add_string, "u32": w.add_uint32, "u64": w.add_uint64, "f32": w.add_float32,
              "bool": w.add_bool}
    cast = {"str": str, "u32": int, "u64": int, "f32": float, "bool": bool}
    for key, val, kind in entries:
        if key == "general.architecture":
            continue
        if kind in scalar:
            scalar[kind](key, cast[kind](val))
        elif kind in _ARRAY_TYPES:
            conv, sub = _ARRAY_TYPES[kind]
            w.add_key_value(key, [conv(v) for v in val], GGUFValueType.ARRAY, sub_type=sub)
        elif kind == "arr_str":
            w.add_array(key, [str(v) for v in val])
        else:
            raise ValueError(f"unknown metadata kind {kind!r}")


def tokenizer_entries(cfg: Ds4Config, meta: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """``(key, value, kind)`` entries of the ``tokenizer.*`` keys ``meta`` for :func:`add_metadata_entries`, less
    the bos/eos ids the config writes.

    Raises:
        ModelFileError: a bos/eos id that differs from the config's, or a value of no GGUF kind.
    """
    out = []
    for key, val in meta.items():
        if key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            want = cfg.bos_id if key.endswith("bos_token_id") else cfg.eos_id
            if int(val) != want:
                raise ModelFileError(f"{key} is {val} in the tokenizer but {want} in the config")
            continue
        if isinstance(val, bool):
            kind = "bool"
        elif isinstance(val, int):
            kind = "u32"
        elif isinstance(val, str):
            kind = "str"
        elif isinstance(val, (list, tuple)) and all(isinstance(v, str) for v in val):
            kind = "arr_str"
        elif isinstance(val, (list, tuple)) and all(isinstance(v, int) for v in val):
            kind = "arr_i32"
        else:
            raise ModelFileError(f"tokenizer key {key}: no GGUF kind for a {type(val).__name__}")
        out.append((key, val, kind))
    return out


def file_type(types: dict[str, GGMLType]) -> int:
    """``general.file_type`` (llama.cpp's ``LlamaFileType``) of a role -> type table: MOSTLY_MXFP4_MOE (38) when
    the routed experts are MXFP4, as the converter sets for the official checkpoint; else MOSTLY_BF16 (32) when
    the experts are BF16, MOSTLY_Q8_0 (7) for Q8_0, ALL_F32 (0) for F32, and for K-quant / IQ4_XS experts the
    file type llama-quantize names after that type (MOSTLY_Q2_K, MOSTLY_Q3_K_M, MOSTLY_Q4_K_M, MOSTLY_Q5_K_M,
    MOSTLY_Q6_K, MOSTLY_IQ4_XS)."""
    from gguf import LlamaFileType as L

    t = types["fp4"]
    return int({GGMLType.MXFP4: L.MOSTLY_MXFP4_MOE, GGMLType.BF16: L.MOSTLY_BF16, GGMLType.Q8_0: L.MOSTLY_Q8_0,
                GGMLType.F16: L.MOSTLY_F16, GGMLType.Q2_K: L.MOSTLY_Q2_K, GGMLType.Q3_K: L.MOSTLY_Q3_K_M,
                GGMLType.Q4_K: L.MOSTLY_Q4_K_M, GGMLType.Q5_K: L.MOSTLY_Q5_K_M, GGMLType.Q6_K: L.MOSTLY_Q6_K,
                GGMLType.IQ4_XS: L.MOSTLY_IQ4_XS}.get(t, L.ALL_F32))


def _add_metadata(w: GGUFWriter, cfg: Ds4Config, extra: dict[str, Any], types: dict[str, GGMLType],
                  metadata: Iterable[tuple[str, Any, str]] | None = None) -> None:
    add_metadata_entries(w, to_gguf_metadata(cfg) if metadata is None else metadata)
    w.add_file_type(file_type(types))
    for key, val in extra.items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint64(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        else:
            w.add_string(key, str(val))

