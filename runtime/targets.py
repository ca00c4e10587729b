"""Compilation targets: a vendor, an arch and its wave size. The arch list is always explicit input;
nothing here queries a device.

CUDA: sm_80, sm_90, sm_90a, sm_100a (wave 32). HIP: gfx90a, gfx942 (wave 64), gfx1100, gfx1151, gfx1201
(wave 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ds4c.errors import Ds4cError

CUDA_ARCHS = ("sm_80", "sm_90", "sm_90a", "sm_100a")
HIP_ARCHS = {"gfx90a": 64, "gfx942": 64, "gfx1100": 32, "gfx1151": 32, "gfx1201": 32}
#: the 16 x 16 x 16 bf16 matrix instruction of the HIP archs whose kernels use one (templates/prelude/amd_matrix.h.j2):
#: CDNA's v_mfma_f32_16x16x16_bf16 (wave 64), RDNA 3's v_wmma_f32_16x16x16_bf16 (wave 32); gfx1201 (RDNA 4, another
#: WMMA operand layout) has none yet
HIP_MATRIX = {"gfx90a": "mfma", "gfx942": "mfma", "gfx1100": "wmma", "gfx1151": "wmma"}
#: LDS (shared memory) one HIP workgroup may use, every arch above
HIP_LDS = 64 * 1024
#: the most dynamic shared memory one CUDA block may have (opted in), per arch
CUDA_SMEM = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024, "sm_100a": 227 * 1024}


class TargetError(Ds4cError):
    """An unknown or malformed arch name."""


@dataclass(frozen=True)
class Target:
    """``vendor`` is ``cuda`` or ``hip``; ``wave`` the warp/wavefront size (32 or 64)."""

    vendor: str
    arch: str
    wave: int

    @property
    def slug(self) -> str:
        """Folder-safe name, e.g. ``cuda-sm_90``."""
        return f"{self.vendor}-{self.arch}"


def target(arch: str) -> Target:
    """The target of one arch name.

    Raises:
        TargetError: the name is not one of :data:`CUDA_ARCHS` or :data:`HIP_ARCHS`.
    """
    a = arch.strip()
    if a in CUDA_ARCHS:
        return Target("cuda", a, 32)
    if a in HIP_ARCHS:
        return Target("hip", a, HIP_ARCHS[a])
    raise TargetError(f"unknown arch {arch!r}: expected one of {', '.join(CUDA_ARCHS + tuple(HIP_ARCHS))}")


def parse_targets(archs: str | Iterable[str]) -> list[Target]:
    """Targets of a comma-separated list (or a sequence) of arch names, in order, without repeats.

    Raises:
        TargetError: an empty list or an unknown name.
    """
    names = [a for a in (archs.split(",") if isinstance(archs, str) else archs) if a.strip()]
    if not names:
        raise TargetError("expected at least one arch, e.g. --arch sm_90,gfx1151")
    out: list[Target] = []
    for n in names:
        t = target(n)
        if t not in out:
            out.append(t)
    return out
