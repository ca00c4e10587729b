"""The step graph exported beyond ds4c: IR -> a ``torch.export`` program (op by op) -> MLIR with torch-mlir.

:func:`export_mlir` (``ds4c export-mlir``) writes a model's step as an MLIR module; :mod:`ds4c.export.fx` traces any
step graph into torch, :mod:`ds4c.export.mlir` imports it, and lowers and runs a linalg module on the CPU. Export
reads the IR and the reference's weights; nothing upstream imports it. torch-mlir and ml_dtypes are the optional
extra ``ds4c[mlir]`` (:func:`ds4c.export.mlir.available`). docs/mlir.md.
"""

from ds4c.errors import ExportError
from ds4c.export.step import AFTER_PASSES, INLINE_MAX_BYTES, MlirExport, export_mlir, step_graph

__all__ = ["ExportError", "MlirExport", "export_mlir", "step_graph", "AFTER_PASSES", "INLINE_MAX_BYTES"]
