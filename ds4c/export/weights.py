"""The weights of an exported step: which ones a graph reads (names, shapes, dtypes), their values from a model
file as the reference holds them, and the side file ``--weights external`` writes.

Values are those the interpreter multiplies: dequantized fp32 (FP8 / FP4 / Q8_0 / K-quant storage expanded, ``wo_a``
rounded to bf16 values in the bf16 dataflow), the bf16 embedding table, int64 ``tid2eid``. A layer's routed experts
(the IR's ``handle`` param ``blk.{i}.experts``) are three stacked tensors under their GGUF names
``blk.{i}.ffn_{gate,up,down}_exps.weight``: ``[E, F, D]``, ``[E, F, D]``, ``[E, D, F]``.

The side file is safetensors (one header of names, dtypes, shapes and byte offsets, then the raw little-endian
data), written here a tensor (an expert) at a time so a model larger than memory can be written; the
``safetensors`` package, numpy or IREE's ``iree-convert-parameters`` read it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import torch

from ds4c.config import Ds4Config
from ds4c.gguf_file import ModelFile
from ds4c.ir.graph import Graph
from ds4c.reference.weights import load_tensor
from ds4c.tempfiles import write_stream_atomic

IR_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i64": torch.int64, "bool": torch.bool}
BANK_PARTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorInfo:
    """A named tensor of an exported function: shape and torch dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def bank_names(bank: str) -> tuple[str, str, str]:
    """The three stacked tensors of an expert bank param ``blk.{i}.experts``."""
    prefix = bank[: -len("experts")]
    return tuple(prefix + p for p in BANK_PARTS)  # type: ignore[return-value]


def weight_infos(graph: Graph, cfg: Ds4Config) -> list[TensorInfo]:
    """The weights ``graph`` reads, in the order of their first ``param`` op (expert banks as their three
    tensors)."""
    out: dict[str, TensorInfo] = {}
    E, F, D = cfg.n_experts, cfg.moe_inter, cfg.hidden_size
    for op in graph.leaf_ops():
        if op.kind != "param":
            continue
        name = op.attrs["weight"]
        if op.attrs["dtype"] == "handle":
            for n, shape in zip(bank_names(name), ((E, F, D), (E, F, D), (E, D, F))):
                out.setdefault(n, TensorInfo(n, shape, torch.float32))
        else:
            out.setdefault(name, TensorInfo(name, tuple(op.attrs["shape"]), IR_DTYPES[op.attrs["dtype"]]))
    return list(out.values())


class ModelWeights:
    """Weight values from a model file, one tensor at a time (nothing kept).

    ``dataflow``: the reference's (``"bf16"`` rounds ``wo_a`` to bf16 values, ``"fp32"`` keeps it)."""

    def __init__(self, mf: ModelFile, dataflow: str = "bf16"):
        self.mf = mf
        self.dataflow = dataflow

    def chunks(self, info: TensorInfo) -> Iterator[torch.Tensor]:
        """The tensor's values in row-major order: the whole tensor, or an expert bank one expert at a time.

        Raises:
            ModelFileError: the tensor is not in the file.
        """
        if info.name.endswith(BANK_PARTS):
            for e in range(info.shape[0]):
                yield self.mf.expert(info.name, e, info.dtype)
        else:
            yield load_tensor(self.mf, info.name, info.dtype, "cpu", self.dataflow)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor (an expert bank stacked)."""
        parts = list(self.chunks(info))
        return parts[0] if len(parts) == 1 and tuple(parts[0].shape) == info.shape else torch.stack(parts)


def write_safetensors(path: str | os.PathLike, infos: list[TensorInfo], weights: ModelWeights,
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``infos``' values from ``weights`` to a safetensors file at ``path``, whole or not at all (an owned
    temporary beside it, renamed at the end), streaming one tensor or expert at a time.

    Raises:
        OSError: the folder is not writable or the write fails.
        ModelFileError: a tensor missing from the model file.
        ValueError: a value whose shape or dtype differs from its info.
    """
    header: dict[str, object] = {}
    offset = 0
    for info in infos:
        n = info.nbytes()
        header[info.name] = {"dtype": _SAFETENSORS_DTYPES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def write(f: BinaryIO) -> None:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for info in infos:
            written = 0
            for t in weights.chunks(info):
                if t.dtype != info.dtype:
                    raise ValueError(f"{info.name}: expected {info.dtype}, found {t.dtype}")
                data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data.tobytes())
                written += data.size
            if written != info.nbytes():
                raise ValueError(f"{info.name}: expected {info.nbytes()} bytes of {list(info.shape)}, wrote {written}")

    write_stream_atomic(path, write)
