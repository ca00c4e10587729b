"""The take-row family: the ``take_row`` IR op of a prefill chunk graph (docs/prefill.md; ds4c/ir/ops.py: the head
reads only row ``n_valid - 1``), as one launch copying that row of several row-major sources into one-row
destinations. Template: ``templates/takerow/take_row.cu.j2``.

Kernel arguments (:func:`arg_names`): ``n_valid`` i64 [1] in device memory (read on the device, so a captured
graph replays with a new value; clamped to 1..C), then per source ``k`` ``src{k}`` [C, W_k words] and ``dst{k}``
[1, W_k words] (32-bit words: any dtype whose row is a multiple of 4 bytes). Grid (number of sources), one block
per source. A copy: the destination holds the source row's bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4c.runtime.families import Launch
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target

TEMPLATE = "takerow/take_row.cu.j2"
FAMILY = "takerow"
THREADS = 256


@dataclass(frozen=True)
class TakeRowSpec:
    """``rows``: C, the chunk's rows (>= 1); ``row_bytes``: bytes per row of each source (multiples of 4).

    Raises:
        RenderError: no sources, C < 1, or a row size that is not a positive multiple of 4 bytes.
    """

    rows: int
    row_bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_bytes", tuple(int(b) for b in self.row_bytes))
        if self.rows < 1 or not self.row_bytes or any(b < 4 or b % 4 for b in self.row_bytes):
            raise RenderError(f"TakeRowSpec: bad rows {self.rows} / row_bytes {self.row_bytes} (expected C >= 1 and "
                              f"one or more positive multiples of 4)")


def render_take_row(spec: TakeRowSpec, target: Target, name: str) -> KernelSource:
    """The kernel of ``spec`` for ``target``."""
    return render(TEMPLATE, name, FAMILY, target, {"rows": spec.rows, "threads": THREADS,
                                                   "words": [b // 4 for b in spec.row_bytes]})


def launch_shape(spec: TakeRowSpec) -> Launch:
    """Grid (number of sources), :data:`THREADS` threads, no dynamic shared memory."""
    return Launch((len(spec.row_bytes), 1, 1), (THREADS, 1, 1), 0)


def arg_names(spec: TakeRowSpec) -> list[str]:
    """``n_valid``, then ``src{k}``, ``dst{k}`` per source."""
    return ["n_valid"] + [f"{p}{k}" for k in range(len(spec.row_bytes)) for p in ("src", "dst")]


def reference(n_valid: int, srcs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row ``clamp(n_valid, 1, C) - 1`` of each source, kept 2-d / n-d ([1, ...])."""
    out = []
    for s in srcs:
        r = min(max(int(n_valid), 1), s.shape[0]) - 1
        out.append(s[r:r + 1].clone())
    return out
