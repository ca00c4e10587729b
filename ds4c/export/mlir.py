"""A traced step (:mod:`ds4c.export.fx`) into MLIR with torch-mlir, and the linalg form lowered to LLVM and run
on the CPU with MLIR's ExecutionEngine.

* :func:`import_step`: ``torch_mlir.fx.export_and_import`` to one of :data:`DIALECTS` (``torch``: torch-mlir's
  backend contract; ``linalg``: linalg-on-tensors with arith / math / tensor / tm_tensor; ``stablehlo``; ``tosa``).
  Every MLIR op's location names the IR op it comes from (``loc("ds4c:rope (layer 2)":0:0)``), so a conversion
  that fails is reported in one line naming the aten op and the IR ops that produced it. The function's arguments
  and results carry their names (``{ds4c.name = "l2.comp"}``) and the module the step's description
  (:func:`annotate`); :func:`write_module` writes it as text.
* :func:`compile_cpu`: a linalg module lowered to the LLVM dialect (bufferized, results as out-parameters, loops,
  libm for the math functions) and JIT-compiled; :class:`CpuStep` calls it on torch tensors.

torch-mlir and ml_dtypes are the optional extra ``ds4c[mlir]``; :func:`require` says what is missing.
"""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any

import numpy as np
import torch

from ds4c.errors import ExportError
from ds4c.export.fx import StepProgram
from ds4c.export.weights import TensorInfo
from ds4c.tempfiles import write_stream_atomic

try:  # the optional extra ds4c[mlir]
    import ml_dtypes
    from torch_mlir import fx as tm_fx
    from torch_mlir import ir
    from torch_mlir.compiler_utils import TorchMlirCompilerError, run_pipeline_with_repro_report
    from torch_mlir.dialects import torch as torch_d
    from torch_mlir.execution_engine import ExecutionEngine
    from torch_mlir.extras.fx_decomp_util import get_decomposition_table
    from torch_mlir.extras.fx_importer import FxImporter
    from torch_mlir.runtime import get_ranked_memref_descriptor
    _MISSING: str | None = None
except ImportError as _e:  # pragma: no cover - depends on the installation
    _MISSING = f"{_e.name or _e}"

DIALECTS = ("torch", "linalg", "stablehlo", "tosa")
#: the module attribute holding the step's description (:func:`annotate`)
STEP_ATTR = "ds4c.step"
#: the argument / result attribute holding its name
NAME_ATTR = "ds4c.name"
_OUTPUT_TYPES = {"torch": "torch", "linalg": "linalg-on-tensors", "stablehlo": "stablehlo", "tosa": "tosa"}
FUNC_NAME = "step"
_LOC = re.compile(r'loc\("ds4c:([^"]+)"')

# linalg-on-tensors -> LLVM: torch-mlir's reference backend pipeline (refbackend.py) with the function results
# turned into caller-allocated out-parameters and C wrappers, so any dtype (bf16 too) crosses by memref descriptor
_LLVM_PIPELINE = ",".join([
    "func.func(linalg-generalize-named-ops)",
    "func.func(linalg-fuse-elementwise-ops)",
    "convert-shape-to-std",
    "func.func(refback-generalize-tensor-pad)",
    "func.func(refback-generalize-tensor-concat)",
    "func.func(tm-tensor-bufferize)",
    "one-shot-bufferize{copy-before-write bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}",
    "refback-mlprogram-bufferize",
    "buffer-results-to-out-params{modify-public-functions hoist-static-allocs}",
    "buffer-deallocation-pipeline",
    "func.func(tm-tensor-to-loops)",
    "func.func(refback-munge-memref-copy)",
    "func.func(convert-linalg-to-loops)",
    "func.func(lower-affine)",
    "convert-scf-to-cf",
    "func.func(refback-expand-ops-for-llvm)",
    "func.func(arith-expand)",
    "func.func(convert-math-to-llvm)",
    "convert-math-to-libm",
    "expand-strided-metadata",
    "finalize-memref-to-llvm",
    "lower-affine",
    "convert-bufferization-to-memref",
    "finalize-memref-to-llvm",
    "func.func(convert-arith-to-llvm)",
    "convert-vector-to-llvm",
    "func.func(llvm-request-c-wrappers)",
    "convert-func-to-llvm",
    "convert-cf-to-llvm",
    "convert-complex-to-llvm",
    "reconcile-unrealized-casts",
])


class MlirError(ExportError):
    """torch-mlir is missing, or it cannot import, convert or run a step."""


def available() -> str | None:
    """None when the ``ds4c[mlir]`` extra (torch-mlir, ml_dtypes) is importable, else what is missing."""
    return _MISSING


def require() -> None:
    """Raise :class:`MlirError` (one line) when the ``ds4c[mlir]`` extra is not installed."""
    if _MISSING is not None:
        raise MlirError(f"MLIR export needs the ds4c[mlir] extra (torch-mlir, ml_dtypes): {_MISSING} is not "
                        f"installed; pip install 'ds4c[mlir]'")


def _label_nodes(program: "torch.export.ExportedProgram") -> None:
    """Give every FX node a source location naming its IR op (torch-mlir turns it into the op's ``loc``); the
    arguments (and so the function) get ``loc("step":0:0)``."""
    for node in program.graph.nodes:
        label = (node.meta.get("custom") or {}).get("ds4c_op")
        if node.op == "placeholder":
            node.meta["stack_trace"] = f'File "{FUNC_NAME}", line 0, in {FUNC_NAME}'
        else:
            node.meta["stack_trace"] = f'File "ds4c:{label}", line 0, in {FUNC_NAME}' if label else None


def _one_line(diags: list[str], dialect: str, stage: str) -> str:
    """The first error diagnostic as one line: the op that failed and the IR ops it came from."""
    ops = sorted({m for d in diags for m in _LOC.findall(d)})
    first = next((d for d in diags if "error" in d.split(":", 1)[0] or "error:" in d), diags[0] if diags else "")
    msg = re.sub(r"\s+", " ", _LOC.sub("", first.split("\n")[0])).strip()
    failed = re.search(r"operation '([^']+)'", msg)
    aten = re.search(r'name = "([^"]+)"', first)
    what = (aten or failed).group(1) if (aten or failed) else msg[:200]
    src = f" from IR op {', '.join(ops[:6])}{' ...' if len(ops) > 6 else ''}" if ops else ""
    return f"torch-mlir cannot {stage} to {dialect}: {what}{src}"


def import_step(sp: StepProgram, dialect: str = "linalg") -> "ir.Module":
    """``sp``'s program as an MLIR module in ``dialect`` (one of :data:`DIALECTS`), function ``@step``.

    Raises:
        MlirError: torch-mlir missing, an unknown dialect, or a conversion that fails (one line naming the aten op
            and the IR ops it came from).
    """
    require()
    if dialect not in DIALECTS:
        raise MlirError(f"dialect must be one of {', '.join(DIALECTS)}, found {dialect!r}")
    program = sp.program.run_decompositions(get_decomposition_table())
    _label_nodes(program)
    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    diags: list[str] = []

    def collect(d: Any) -> bool:
        diags.append(f"{d.location}: {d.message}" + "".join(f"\n{n}" for n in d.notes))
        return True

    handler = ctx.attach_diagnostic_handler(collect)
    try:
        return tm_fx.export_and_import(program, output_type=_OUTPUT_TYPES[dialect], fx_importer=FxImporter(context=ctx),
                                       decomposition_table={}, func_name=FUNC_NAME)
    except TorchMlirCompilerError:
        raise MlirError(_one_line(diags, dialect, "convert the step")) from None
    finally:
        handler.detach()


def _function(module: "ir.Module") -> Any:
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == FUNC_NAME:
            return op
    raise MlirError(f"the module has no function @{FUNC_NAME}")  # pragma: no cover - import_step names it


def annotate(module: "ir.Module", sp: StepProgram, description: dict[str, str | int | bool]) -> None:
    """Name the function's arguments and results (``{ds4c.name = "..."}``: the graph's input names, then the weights'
    GGUF names; the graph's output names) and set the module attribute :data:`STEP_ATTR` to ``description`` (a
    dictionary of strings, integers and booleans). Changes ``module`` in place.

    Raises:
        MlirError: torch-mlir missing, or a description value of another type.
    """
    require()
    with module.context:
        fn = _function(module)

        def names(infos: list[TensorInfo]) -> "ir.ArrayAttr":
            return ir.ArrayAttr.get([ir.DictAttr.get({NAME_ATTR: ir.StringAttr.get(i.name)}) for i in infos])

        fn.attributes["arg_attrs"] = names(sp.inputs)
        fn.attributes["res_attrs"] = names(sp.outputs)
        attrs: dict[str, Any] = {}
        for k, v in description.items():
            if isinstance(v, bool):
                attrs[k] = ir.BoolAttr.get(v)
            elif isinstance(v, int):
                attrs[k] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), v)
            elif isinstance(v, str):
                attrs[k] = ir.StringAttr.get(v)
            else:
                raise MlirError(f"step description {k!r}: expected a string, integer or boolean, found {type(v).__name__}")
        module.operation.attributes[STEP_ATTR] = ir.DictAttr.get(attrs)


def write_module(module: "ir.Module", path: str | os.PathLike) -> None:
    """Write ``module`` as MLIR text (with the locations naming the IR ops; inlined weights as hex resource blobs
    at the end) to ``path``, whole or not at all (:func:`ds4c.tempfiles.write_stream_atomic`).

    Raises:
        OSError: the folder does not exist or is not writable, or the write fails.
    """
    write_stream_atomic(path, lambda f: module.operation.print(file=f, binary=True, enable_debug_info=True))


_NP = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return t.numpy().copy()


def _poisoned(info: TensorInfo) -> np.ndarray:
    """An out-parameter buffer for a result, filled with NaN (floats) or the smallest integer, so an element the
    compiled step does not write shows."""
    if info.dtype == torch.bfloat16:
        return np.full(info.shape, np.nan, dtype=ml_dtypes.bfloat16)
    if info.dtype == torch.bool:
        return np.zeros(info.shape, dtype=np.bool_)
    dt = _NP[info.dtype]
    return np.full(info.shape, np.nan if np.issubdtype(dt, np.floating) else np.iinfo(dt).min, dtype=dt)


def _to_torch(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class CpuStep:
    """A linalg step module lowered to LLVM and JIT-compiled (:func:`compile_cpu`); call it with the function's
    arguments (torch tensors in the order of ``inputs``) to get its results (torch tensors, order of ``outputs``).
    Arguments are copied, so the caller's tensors are never written."""

    def __init__(self, engine: "ExecutionEngine", inputs: list[TensorInfo], outputs: list[TensorInfo]):
        self.engine, self.inputs, self.outputs = engine, inputs, outputs

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        """Raises MlirError: argument count, shapes or dtypes differ from ``inputs``."""
        if len(args) != len(self.inputs):
            raise MlirError(f"the step takes {len(self.inputs)} arguments, found {len(args)}")
        for a, info in zip(args, self.inputs):
            if a.dtype != info.dtype or tuple(a.shape) != info.shape:
                raise MlirError(f"argument {info.name}: expected {info.dtype} {list(info.shape)}, found {a.dtype} "
                                f"{list(a.shape)}")
        ins = [_to_numpy(a) for a in args]
        outs = [_poisoned(o) for o in self.outputs]
        descs = [ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(x))) for x in ins + outs]
        self.engine.invoke(FUNC_NAME, *descs)
        return [_to_torch(o, info.dtype) for o, info in zip(outs, self.outputs)]


def compile_cpu(module: "ir.Module", sp: StepProgram, opt_level: int = 0) -> CpuStep:
    """Lower a linalg-on-tensors step module (:func:`import_step` with ``dialect="linalg"``; changed in place: write
    it first) to LLVM and JIT it for this CPU. ``opt_level``: LLVM's (0..3); the default 0 because the JIT of a
    whole step dominates a check (tiny's step: ~15 s at -O0, several minutes at -O2, while a step runs in ~50 ms).

    Raises:
        MlirError: torch-mlir missing, or a lowering that fails (one line).
    """
    require()
    diags: list[str] = []

    def collect(d: Any) -> bool:
        diags.append(f"{d.location}: {d.message}")
        return True

    handler = module.context.attach_diagnostic_handler(collect)
    try:
        run_pipeline_with_repro_report(module, f"builtin.module({_LLVM_PIPELINE})", "linalg to LLVM")
        engine = ExecutionEngine(module, opt_level=opt_level, enable_object_dump=False)
        engine.raw_lookup(FUNC_NAME)  # compile now, inside the handler (the JIT is lazy)
    except (TorchMlirCompilerError, RuntimeError):
        raise MlirError(_one_line(diags, "llvm", "lower the linalg step")) from None
    finally:
        handler.detach()
    return CpuStep(engine, sp.inputs, sp.outputs)
