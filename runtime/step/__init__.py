"""The compiled step (:class:`CompiledStep`) and its parts, one job each (:mod:`ds4c.runtime.step.compiled` lists
them). :func:`arena_layout`, :func:`resolve_arg` and :class:`Bound` are shared with the compiled DSpark drafter
(runtime/dspark_exec.py)."""

from ds4c.runtime.step.binding import Bound, StepGraph, arena_layout, resolve_arg
from ds4c.runtime.step.compiled import CompiledStep, device_arch

__all__ = ["Bound", "CompiledStep", "StepGraph", "arena_layout", "device_arch", "resolve_arg"]
