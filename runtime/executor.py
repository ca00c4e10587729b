"""The compiled step's former module, kept so that ``from ds4c.runtime.executor import CompiledStep, device_arch``
goes on working (tools and notes use it): the step now lives in the package :mod:`ds4c.runtime.step`, one module
per job."""

from ds4c.runtime.step import Bound, CompiledStep, StepGraph, arena_layout, device_arch, resolve_arg

__all__ = ["Bound", "CompiledStep", "StepGraph", "arena_layout", "device_arch", "resolve_arg"]
