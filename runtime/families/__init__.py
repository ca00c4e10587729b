"""Kernel families: render parameters, launch shapes, argument orders and CPU references per fused op."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """Launch shape of one kernel of a family: ``grid`` and ``block`` (x, y, z), ``smem`` dynamic shared bytes
    (0: static shared memory only; above 48 KiB CUDA needs the function attribute, which
    ``ds4c.runtime.launch.CudaModule.function(entry, dynamic_smem)`` sets) and ``kernel``, the family's name
    for the launch when it has several (e.g. ``mix`` / ``norm``, ``up`` / ``down``, ``main`` / ``combine``)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0
    kernel: str = ""
