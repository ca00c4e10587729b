"""A model's step graph as an MLIR file: the API behind ``ds4c export-mlir`` (docs/mlir.md).

::

    from ds4c.export import export_mlir

    e = export_mlir("model.gguf", "step.mlir", width=2, ctx=4096, dialect="linalg", weights="external")
    e.path, e.weights_path            # step.mlir, step.safetensors
    [i.name for i in e.inputs]        # the function's arguments: graph inputs, then the weights

The step graph (:func:`step_graph`: ``build_step`` and the passes up to ``after``) is traced op by op into a
``torch.export`` program (:mod:`ds4c.export.fx`, :mod:`ds4c.export.lowerings`), imported with torch-mlir
(:mod:`ds4c.export.mlir`) and written. Weights: ``inline`` (constants of the module: at most
:data:`INLINE_MAX_BYTES`), ``external`` (function arguments; their values written beside the module as safetensors,
:mod:`ds4c.export.weights`) or ``none`` (arguments, nothing written).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ds4c.version import __version__
from ds4c.buckets import BucketSpec
from ds4c.config import MAX_PREFILL_ROWS, Ds4Config
from ds4c.errors import ExportError
from ds4c.export import mlir as M
from ds4c.export.fx import WEIGHT_MODES, StepProgram, trace_step
from ds4c.export.weights import ModelWeights, TensorInfo, weight_infos, write_safetensors
from ds4c.gguf_file import ModelFile
from ds4c.sources import open_model
from ds4c.ir import build_step
from ds4c.ir.graph import Graph
from ds4c.passes.manager import PIPELINES, run_pipeline
from ds4c.reference import primitives as P
from ds4c.tempfiles import check_writable

#: the passes an export may stop after: the default pipeline from the one that makes every shape static on
DEFAULT_AFTER = "pad_compressed_kv"
AFTER_PASSES = PIPELINES["default"][PIPELINES["default"].index(DEFAULT_AFTER):]
#: ``weights="inline"`` holds at most this many bytes of weights (the module's text holds them as hex, twice that)
INLINE_MAX_BYTES = 256 << 20
WEIGHTS_SUFFIX = ".safetensors"


@dataclass
class MlirExport:
    """What :func:`export_mlir` wrote.

    Attributes:
        path: the MLIR module (text).
        weights_path: the safetensors file of the weights (``weights="external"``), else None.
        dialect: one of :data:`ds4c.export.mlir.DIALECTS`.
        weights_mode: ``inline``, ``external`` or ``none``.
        inputs: the function ``@step``'s arguments in order (graph inputs, then the weights unless inline).
        outputs: its results in order (the updated state buffers under their input names, then ``logits`` or a
            shard's ``hc_out``).
        weights: every weight the step reads (GGUF names; a layer's routed experts as three stacked tensors).
        description: the module's ``ds4c.step`` attribute (model, config, width, ctx, layers, passes, ...).
        module: the torch-mlir module (``ir.Module``) as written; :func:`ds4c.export.mlir.compile_cpu` takes it.
        program: the traced :class:`~ds4c.export.fx.StepProgram` (its ``program.module()`` runs in torch).
    """

    path: Path
    weights_path: Path | None
    dialect: str
    weights_mode: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    weights: list[TensorInfo]
    description: dict[str, Any]
    module: Any = field(repr=False)
    program: StepProgram = field(repr=False)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight the step reads (as exported: dequantized fp32, the bf16 embedding, ...)."""
        return sum(w.nbytes() for w in self.weights)


def step_graph(cfg: Ds4Config, width: int = 1, prefill: int | None = None, ctx: int = 4096,
               layers: tuple[int, int] | None = None, after: str = DEFAULT_AFTER) -> Graph:
    """The step graph an export holds: ``build_step`` of ``width`` rows (or a prefill chunk of ``prefill`` rows),
    state for ``ctx`` positions (rounded up to a multiple of the compress ratios, as the largest context bucket),
    compressed spans padded to it, after the default pipeline's passes up to ``after``.

    Raises:
        ExportError: ``width`` and ``prefill`` both given, ``after`` not one of :data:`AFTER_PASSES`.
        StepError: a width, chunk or layer range out of range (``build_step``).
        ConfigError: ``ctx`` outside 1..the model's context length.
    """
    if prefill is not None and width != 1:
        raise ExportError("give a width (a decode / verify step) or a prefill chunk, not both")
    if after not in AFTER_PASSES:
        raise ExportError(f"after must be one of {', '.join(AFTER_PASSES)} (the shapes are static from "
                          f"{DEFAULT_AFTER} on), found {after!r}")
    cap = BucketSpec.build(cfg, (1,), ctx).contexts[-1]
    if prefill is not None:
        if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill <= min(MAX_PREFILL_ROWS, cap):
            raise ExportError(f"a prefill chunk must have 1..{min(MAX_PREFILL_ROWS, cap)} rows (at most the context "
                              f"{cap}), found {prefill}")
        g = build_step(cfg, prefill, cap, layers=layers, prefill=True)
    else:
        g = build_step(cfg, width, cap, layers=layers)
    names = PIPELINES["default"]
    return run_pipeline(g, names[:names.index(after) + 1], context=cap).graph


def _weights_path(output: Path) -> Path:
    return output.with_suffix(WEIGHTS_SUFFIX) if output.suffix else output.with_name(output.name + WEIGHTS_SUFFIX)


def export_mlir(model: str | os.PathLike[str] | ModelFile, output: str | os.PathLike[str], *, width: int = 1,
                prefill: int | None = None, ctx: int = 4096, layers: tuple[int, int] | None = None,
                dialect: str = "linalg", weights: str = "external", after: str = DEFAULT_AFTER,
                dataflow: str = "bf16", quant_emulation: bool = True) -> MlirExport:
    """Export ``model``'s step graph (:func:`step_graph`) as the MLIR function ``@step`` to ``output``.

    The function takes the graph's inputs (``tokens`` i64 [q], ``pos`` i64 [], ``n_valid`` of a prefill chunk,
    the live lengths ``live_r{ratio}`` i64 [], the state buffers ``l{i}.*``; a shard's ``hc_in``), then, unless
    inline, the weights; it returns the updated state buffers and ``logits`` fp32 [q, vocab] (a prefill chunk:
    [1, vocab]; a shard not ending at the last layer: ``hc_out``). ``bf16`` values are bf16 in the spec's dataflow,
    fp32 in the fp32 one. Arguments and results are named (``{ds4c.name = ...}``), locations name the IR op.

    Args:
        model: a model file path, ``synthetic:PRESET[:FORMATS[:SEED]]``, or an opened model.
        output: the MLIR text file (replaced atomically). ``weights="external"`` also writes ``output`` with the
            suffix ``.safetensors`` (same folder).
        width: step rows 1..5 (1 = decode); ``prefill``: instead, a prefill chunk of this many rows.
        ctx: positions the state holds (rounded up to a multiple of the compress ratios).
        layers: ``(start, stop)``: a layer-split shard's graph.
        dialect: ``torch``, ``linalg``, ``stablehlo`` or ``tosa``.
        weights: ``inline``, ``external`` or ``none``.
        after: the last pass run (:data:`AFTER_PASSES`; default: padding and width fixing, before fusion).
        dataflow: ``bf16`` (the spec) or ``fp32`` (activations and state fp32, nothing rounded to bf16).
        quant_emulation: the FP8 / FP4 fake quantization of the spec (off: as ports without it).

    Raises:
        ExportError: the ``ds4c[mlir]`` extra missing, a bad option or output path, inline weights over
            :data:`INLINE_MAX_BYTES`, an IR op with no lowering, a conversion torch-mlir refuses (one line each).
        StepError, ConfigError: a width, chunk, layer range or context out of range.
        ModelFileError: an unreadable model.
        OSError: the output folder is not writable or a write fails (nothing is left half-written).
    """
    if dialect not in M.DIALECTS:
        raise ExportError(f"dialect must be one of {', '.join(M.DIALECTS)}, found {dialect!r}")
    if weights not in WEIGHT_MODES:
        raise ExportError(f"weights must be one of {', '.join(WEIGHT_MODES)}, found {weights!r}")
    if dataflow not in P.DATAFLOWS:
        raise ExportError(f"dataflow must be one of {', '.join(P.DATAFLOWS)}, found {dataflow!r}")
    out = Path(output)
    if out.suffix == WEIGHTS_SUFFIX:
        raise ExportError(f"the output {out} ends in {WEIGHTS_SUFFIX}, the suffix of the weights file written "
                          f"beside it: name the module e.g. step.mlir")
    wpath = _weights_path(out) if weights == "external" else None
    for p in (out, wpath):
        if p is not None:
            try:
                check_writable(p)
            except OSError as e:
                raise ExportError(f"cannot write {p}: {e.strerror or e}") from None
    mf = model if isinstance(model, ModelFile) else open_model(model)
    cfg = mf.config if quant_emulation else mf.config.replace(quant_emulation=False)
    graph = step_graph(cfg, width, prefill, ctx, layers, after)
    values = ModelWeights(mf, dataflow)
    infos = weight_infos(graph, cfg)
    total = sum(w.nbytes() for w in infos)
    if weights == "inline" and total > INLINE_MAX_BYTES:  # refused before a weight is read
        raise ExportError(f"weights inline: the step reads {total / 2**20:.0f} MiB of weights, inline holds at "
                          f"most {INLINE_MAX_BYTES >> 20} MiB; use weights external (a side file) or none")
    M.require()  # after the cheap checks, before the work
    sp = trace_step(graph, cfg, weights, weight_values=values.tensor if weights == "inline" else None,
                    dataflow=dataflow)
    module = M.import_step(sp, dialect)
    lay = graph.meta.get("layers") or (0, cfg.n_layers)  # a shard's graph records its range
    description: dict[str, Any] = {
        "ds4c_version": __version__, "model": str(getattr(mf, "path", model)), "config": cfg.name,
        "config_hash": cfg.hash(), "width": int(graph.meta["width"]), "prefill": prefill is not None,
        "ctx": int(graph.meta["max_ctx"]), "layers": f"{lay[0]}:{lay[1]}",
        "passes": ",".join(graph.meta.get("passes", [])), "dataflow": dataflow, "quant_emulation": cfg.quant_emulation,
        "weights": weights, "n_step_inputs": sp.n_step_inputs}
    if wpath is not None:
        description["weights_file"] = wpath.name
    M.annotate(module, sp, description)
    if wpath is not None:
        write_safetensors(wpath, infos, values, metadata={k: str(v) for k, v in description.items()})
    M.write_module(module, out)
    return MlirExport(out, wpath, dialect, weights, sp.inputs, sp.outputs, infos, description, module, sp)
