"""Shared helpers for the kernel-family tests: compile a rendered ``KernelSource`` with the project toolchain,
read its resource usage, skip when the target's compiler (nvcc / NVRTC, clang >= 19) is not installed, and
assert that a kernel does not spill.

Not a test module (no ``test_`` prefix); the family tests import it as ``kernel_compile``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ds4c.runtime.render import KernelSource
from ds4c.runtime.targets import target
from ds4c.runtime.toolchain import CompileResult, Toolchain, ToolchainError, find_toolchain, resource_usage


def compiler_missing(arch: str) -> str | None:
    """None when a compiler for ``arch`` is installed, else the reason (the ToolchainError's text)."""
    try:
        find_toolchain(target(arch))
    except ToolchainError as e:
        return str(e)
    return None


def toolchain_or_skip(arch: str, prefer: str | None = None) -> Toolchain:
    """The toolchain ``find_toolchain`` picks for ``arch`` (only ``prefer`` when given); ``pytest.skip`` the
    calling test when there is none."""
    try:
        return find_toolchain(target(arch), prefer)
    except ToolchainError as e:
        pytest.skip(f"no compiler for {arch}: {e}")


@dataclass
class Compiled:
    """One compile: the toolchain's ``result`` and ``usage``, the resource use of the source's entry as
    ``ds4c.runtime.toolchain.resource_usage`` reads it from the log (``{}`` when the log does not name it and
    it was not required)."""

    result: CompileResult
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def log(self) -> str:
        return self.result.log

    @property
    def seconds(self) -> float:
        return self.result.seconds


def compile_kernel(src: KernelSource, workdir: Path, *, require_usage: bool = True) -> Compiled:
    """Compile ``src`` for its target into ``workdir`` with ``find_toolchain(src.target)``; skips the test when
    no compiler is installed. With ``require_usage`` the compile log must report the entry's resource use."""
    try:
        tc = find_toolchain(src.target)
    except ToolchainError as e:
        pytest.skip(f"no compiler for {src.target.slug}: {e}")
    res = tc.compile(src, workdir)
    use = resource_usage(res, src.target)
    if require_usage:
        assert src.entry in use, f"{src.entry}: no resource info in the compile log:\n{res.log[-2000:]}"
    return Compiled(res, use.get(src.entry, {}))


def assert_no_spills(use: dict, src: KernelSource, log: str) -> None:
    """No register spills and no local memory: CUDA no spill stores / loads and no stack frame; AMDGPU no VGPR
    or SGPR spills and no scratch."""
    if src.target.vendor == "cuda":
        assert use.get("spill_stores", 0) == 0 and use.get("spill_loads", 0) == 0, f"ptxas spills:\n{log}"
        assert use.get("stack_bytes", 0) == 0, f"stack frame (local memory) used:\n{log}"
    else:
        assert use.get("vgpr_spills", 0) == 0 and use.get("sgpr_spills", 0) == 0, f"clang spills:\n{log}"
        assert use.get("scratch_bytes", 0) == 0, f"scratch (private memory) used:\n{log}"


__all__ = ["Compiled", "assert_no_spills", "compile_kernel", "compiler_missing", "toolchain_or_skip"]
