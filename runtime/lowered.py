"""What lowering produces: the launch records of a lowered kernel plan, and the error it raises.

Each plan kernel (a top-level ``fused`` op after ``partition``) becomes a :class:`LoweredKernel`: one or more
:class:`Launch` records, each a rendered :class:`~ds4c.runtime.render.KernelSource`, a launch shape, and argument
bindings (:class:`Arg`) that name what each kernel argument points to: a graph value (activations in the arena,
state buffers, graph inputs and outputs), a weight by GGUF name, a per-step scalar in the step buffer, or a
scratch workspace. The lowering (:func:`ds4c.runtime.lower.lower_graph`) makes them; the executor resolves the
bindings to device pointers; the artifact stores them (:func:`describe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ds4c.runtime.render import KernelSource, RenderError

ARG_KINDS = ("value", "weight", "step", "workspace", "int")


@dataclass(frozen=True)
class Arg:
    """One kernel argument.

    ``kind``:
      * ``value``: a graph value by its printed name (activation slot, state buffer, graph input/output);
      * ``weight``: a model tensor by GGUF name, stored as in the file (Q8_0/MXFP4 bytes, BF16 bits, F32,
        int64 for tid2eid), or a routed-expert tensor;
      * ``step``: a per-step scalar in device memory: ``pos``, ``tokens``, ``live_r<ratio>``;
      * ``workspace``: scratch of ``nbytes`` bytes private to this launch sequence (``name`` labels it);
      * ``int``: a 32-bit constant ``value``.
    """

    kind: str
    name: str
    nbytes: int = 0
    value: int = 0
    row: int = 0
    """For ``value`` and ``step``: the argument points at this row of the buffer (the first row of one lane of a
    lanes step: a ``lane_rows`` view, or a lane's rows of a ``concat_rows``), not at its start."""
    form: str = ""
    """For ``weight``: how the kernel reads it — ``raw`` (the stored GGUF bytes: GEMV and expert weights),
    ``f32`` (dequantized to fp32, as the reference holds norms, HC parameters, sinks, ape, biases), ``bf16``
    (dequantized and rounded to bf16: the embedding, grouped ``wo_a``) or ``i64`` (tid2eid)."""

    def __post_init__(self) -> None:
        if self.kind not in ARG_KINDS:
            raise ValueError(f"unknown argument kind {self.kind!r}: expected one of {ARG_KINDS}")


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel`` rendered for the target; ``grid``/``block`` 3-d; ``smem`` dynamic shared
    memory bytes; ``args`` in kernel order. ``lanes``: a lane-batched launch (runtime/step/lane_batch.py) over
    ``grid[2]`` lanes: each lane's arguments (the first is ``args``), bound as the first lane's plus one stride per
    pointer."""

    kernel: KernelSource
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple[Arg, ...]
    lanes: tuple[tuple[Arg, ...], ...] = ()


@dataclass
class LoweredKernel:
    """The launches of one plan kernel, in order."""

    name: str
    family: str
    layer: int
    launches: list[Launch] = field(default_factory=list)


def describe(k: LoweredKernel) -> dict[str, Any]:
    """JSON-serialisable description (for manifests and inspection)."""
    return {"name": k.name, "family": k.family, "layer": k.layer,
            "launches": [{"entry": l.kernel.entry, "kernel": l.kernel.name, "grid": list(l.grid),
                          "block": list(l.block), "smem": l.smem,
                          "args": [{"kind": a.kind, "name": a.name, **({"nbytes": a.nbytes} if a.nbytes else {}),
                                    **({"form": a.form} if a.form else {}),
                                    **({"row": a.row} if a.row else {}),
                                    **({"value": a.value} if a.kind == "int" else {})} for a in l.args]}
                         for l in k.launches]}


class LoweringError(RenderError):
    """A plan kernel has no lowering (an op pattern no family implements) or its operands do not fit."""
