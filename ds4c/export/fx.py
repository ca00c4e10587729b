"""IR step graph -> a ``torch.export`` program (an FX graph of aten ops), op by op.

The program is a function of the graph's inputs (token ids, position, live lengths, ``n_valid``, the state
buffers, in the graph's input order), then, unless the weights are inlined, of the weights (in the order of
:func:`ds4c.export.weights.weight_infos`). It returns the graph's outputs in the graph's output order: the updated
state buffers under their input names, and ``logits`` (or ``hc_out`` of a layer-split shard). Every value has the
static shape of its IR type; a ``bf16`` IR type is the dataflow's activation dtype (bf16, or fp32 in the fp32
dataflow), except that weights keep their own dtype.

The graph's leaf ops (fused ops contribute their bodies) are traced through the static lowerings of
:mod:`ds4c.export.lowerings`; each FX node records the IR op it came from in ``node.meta["custom"]["ds4c_op"]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx.traceback as fx_traceback

from ds4c.config import Ds4Config
from ds4c.errors import ExportError
from ds4c.export.lowerings import LOWERINGS, LowerCtx, unsupported
from ds4c.export.weights import IR_DTYPES, TensorInfo, bank_names, weight_infos
from ds4c.ir.graph import Graph, Op, TensorType
from ds4c.reference import primitives as P

WEIGHT_MODES = ("inline", "external", "none")


@dataclass
class StepProgram:
    """A traced step: ``program`` with its function signature.

    ``inputs``: the function's arguments in order (the graph's inputs, then the weights unless inlined);
    ``outputs``: its results in order; ``weights``: every weight the step reads (arguments, or inlined literals);
    ``n_step_inputs``: how many leading arguments are graph inputs."""

    program: torch.export.ExportedProgram
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    weights: list[TensorInfo]
    n_step_inputs: int
    weights_mode: str
    dataflow: str
    meta: dict[str, Any] = field(default_factory=dict)


def op_label(op: Op) -> str:
    """How errors and locations name an IR op: ``kind (layer i)``, or ``kind (embedding / head)`` outside the layers."""
    return f"{op.kind} (layer {op.layer})" if op.layer >= 0 else f"{op.kind} (embedding / head)"


def check_exportable(graph: Graph) -> None:
    """Raise :class:`ExportError` (one line) naming every leaf op with no static lowering, or the symbolic dims
    of the graph's inputs and outputs."""
    bad: dict[str, tuple[str, list[int]]] = {}
    for op in graph.leaf_ops():
        why = unsupported(op)
        if why is not None:
            layers = bad.setdefault(op.kind, (why, []))[1]
            if op.layer not in layers:
                layers.append(op.layer)
    if bad:
        parts = [f"{kind} (layers {', '.join(map(str, ls))}): {why}" for kind, (why, ls) in bad.items()]
        raise ExportError(f"cannot export: no lowering for IR op {'; '.join(parts)}")
    syms = sorted({str(d) for v in (*graph.inputs.values(), *graph.outputs.values()) for d in v.type.syms()})
    if syms:
        raise ExportError(f"cannot export: symbolic dims {', '.join(syms)} in the graph's inputs or outputs; export "
                          f"after fix_verify_width and pad_compressed_kv")


def _info(name: str, ty: TensorType, act: torch.dtype) -> TensorInfo:
    return TensorInfo(name, tuple(int(d) for d in ty.shape), act if ty.dtype == "bf16" else IR_DTYPES[ty.dtype])


class _Step(torch.nn.Module):
    """The module torch.export traces: ``forward(*graph inputs, *weights)`` runs the lowerings op by op."""

    def __init__(self, graph: Graph, cfg: Ds4Config, weights: list[TensorInfo], inline: dict[str, torch.Tensor] | None,
                 dataflow: str):
        super().__init__()
        self.graph, self.cfg, self.dataflow = graph, cfg, dataflow
        self.weight_names = [w.name for w in weights]
        self.inline = inline is not None
        if inline is not None:
            for k, name in enumerate(self.weight_names):
                self.register_buffer(f"w{k}", inline[name])

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.graph.inputs)
        env: dict[Any, Any] = dict(zip(self.graph.inputs.values(), args[:n]))
        if self.inline:
            by_name = {name: getattr(self, f"w{k}") for k, name in enumerate(self.weight_names)}
        else:
            by_name = dict(zip(self.weight_names, args[n:]))

        def weight(name: str) -> Any:
            if name.endswith(".experts"):
                return tuple(by_name[b] for b in bank_names(name))
            return by_name[name]

        ctx = LowerCtx(self.cfg, weight)
        with P.dataflow(self.dataflow):
            for op in self.graph.leaf_ops():
                with fx_traceback.annotate({"ds4c_op": op_label(op)}):
                    outs = LOWERINGS[op.kind](ctx, [env[v] for v in op.inputs], op.attrs)
                for v, t in zip(op.outputs, outs):
                    env[v] = t
        return tuple(env[v] for v in self.graph.outputs.values())


def trace_step(graph: Graph, cfg: Ds4Config, weights_mode: str = "external",
               weight_values: Callable[[TensorInfo], torch.Tensor] | None = None,
               dataflow: str = "bf16") -> StepProgram:
    """Trace ``graph`` (any pass prefix from ``fix_verify_width`` and ``pad_compressed_kv`` on) into a
    ``torch.export`` program.

    Args:
        graph: the step graph (``cfg``'s; static shapes).
        weights_mode: ``inline`` (weights are constants of the program: ``weight_values`` required), ``external``
            or ``none`` (weights are arguments after the graph inputs; traced on shape-only placeholders).
        weight_values: a weight's values (``inline`` only), e.g. :meth:`ds4c.export.weights.ModelWeights.tensor`.
        dataflow: ``"bf16"`` or ``"fp32"`` (the activation dtype; :func:`ds4c.reference.primitives.dataflow`).

    Raises:
        ExportError: an op with no lowering, symbolic dims, an unknown mode or dataflow, inline without values.
    """
    if weights_mode not in WEIGHT_MODES:
        raise ExportError(f"weights must be one of {', '.join(WEIGHT_MODES)}, found {weights_mode!r}")
    if dataflow not in P.DATAFLOWS:
        raise ExportError(f"dataflow must be one of {sorted(P.DATAFLOWS)}, found {dataflow!r}")
    if weights_mode == "inline" and weight_values is None:
        raise ExportError("weights inline: the weight values are needed")
    check_exportable(graph)
    act = P.DATAFLOWS[dataflow]
    step_in = [_info(k, v.type, act) for k, v in graph.inputs.items()]
    step_out = [_info(k, v.type, act) for k, v in graph.outputs.items()]
    winfos = weight_infos(graph, cfg)
    inline = {w.name: weight_values(w) for w in winfos} if weights_mode == "inline" else None  # type: ignore[misc]
    # example arguments: their values are never read (the lowerings do not branch on data); the weights'
    # placeholders are one broadcast zero, so a 100 GB model needs no memory to trace
    args = [torch.zeros(i.shape, dtype=i.dtype) for i in step_in]
    if inline is None:
        args += [torch.zeros((), dtype=w.dtype).expand(w.shape) for w in winfos]
    module = _Step(graph, cfg, winfos, inline, dataflow)
    with torch.no_grad(), fx_traceback.preserve_node_meta():  # keeps the ds4c_op annotations on the nodes
        program = torch.export.export(module, tuple(args), strict=False)
    return StepProgram(program, step_in + ([] if inline is not None else winfos), step_out, winfos, len(step_in),
                       weights_mode, dataflow, dict(graph.meta))
