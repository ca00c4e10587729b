"""A lowered graph's launches bound to device buffers: the records the compiled step and the compiled DSpark drafter
(runtime/dspark_exec.py) share, the activation arena's layout rule and how one kernel argument is resolved."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ds4c.ir.graph import Graph
from ds4c.ir.printer import value_names
from ds4c.runtime.launch import CudaKernel
from ds4c.runtime.lowered import Arg, LoweredKernel

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64, "bool": torch.bool, "u8": torch.uint8}
"""The torch dtype of each IR dtype name."""


@dataclass
class Bound:
    """One launch with its arguments bound: the loaded kernel, its grid, block, dynamic shared memory and the
    argument values (tensors and ints)."""

    kernel: CudaKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: list[Any]
    programmatic: bool = False  # launched with programmatic stream serialization (KernelSource.programmatic_launch)
    lane: int | None = None  # a lanes step's per-lane launch: the lane whose state it reads and writes (lane_of)


@dataclass
class StepGraph:
    """The compiled step's graph of one (width, context bucket) key: the IR graph, its lowered kernels, the bound
    launches (and, of a verify graph, its rollback kernel bound apart), the device tensors of its values and its
    captured CUDA graph."""

    width: int
    context: int
    graph: Graph
    kernels: list[LoweredKernel]
    launches: list[Bound] = field(default_factory=list)
    rollback: Bound | None = None
    """A verify graph's rollback kernel (runtime/families/undo.py), bound but not part of the step."""
    rollback_args: Any = None
    """Its driver argument array, packed once (the bound tensors never change)."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    cuda_graph: Any = None
    capture_s: float = 0.0


_LANE_NAME = re.compile(r"^lane(\d+)\.")


def lane_of(args: Any) -> int | None:
    """The lane a launch of a lanes step belongs to: the one lane ``j`` whose state buffers or step scalars
    (``lane{j}.*``) its arguments name, or None (a row-wise launch over every lane, or any launch of another
    step)."""
    lanes = {int(m.group(1)) for a in args if a.kind in ("value", "step") for m in [_LANE_NAME.match(a.name)] if m}
    return lanes.pop() if len(lanes) == 1 else None


def lane_segments(lanes: list[int | None]) -> list[tuple[int, int, bool]]:
    """The launch list of a step cut into ``(start, stop, parallel)`` runs, in order: a run of consecutive per-lane
    launches touching at least two lanes is ``parallel`` (its lanes are independent: each reads the row-wise values
    before the run and its own state and workspaces, and writes its own state and rows); every other launch is a
    run of its own, in order."""
    out: list[tuple[int, int, bool]] = []
    i, n = 0, len(lanes)
    while i < n:
        j = i
        while j < n and lanes[j] is not None:
            j += 1
        if j > i and len(set(lanes[i:j])) > 1:
            out.append((i, j, True))
            i = j
            continue
        out.append((i, i + 1, False))
        i += 1
    return out


def arena_layout(g: Graph, kernels: list[LoweredKernel], external: set[str]
                 ) -> tuple[dict[str, tuple[int, int, tuple, Any]], int]:
    """The activation arena layout of one lowered graph: ``name -> (byte offset, bytes, shape, dtype)`` for every
    graph value a launch argument names, except ``external`` names (buffers bound elsewhere) and constants, and
    the bytes it needs (256-byte aligned slots, in first-use order)."""
    names = value_names(g)
    by_name = {names[v]: v for v in names}
    consts = {names[op.outputs[0]] for op in g.ops if op.kind == "const"}
    layout: dict[str, tuple[int, int, tuple, Any]] = {}
    off = 0
    for k in kernels:
        for la in k.launches:
            # a lane-batched launch: each argument's lanes in lane order, so per-lane values sit a constant stride apart
            args = [lane[n] for n in range(len(la.args)) for lane in la.lanes] if la.lanes else la.args
            for a in args:
                if a.kind != "value" or a.name in external or a.name in consts or a.name in layout \
                        or a.name not in by_name:
                    continue
                v = by_name[a.name]
                shape, dt = tuple(int(d) for d in v.type.shape), DTYPES[v.type.dtype]
                n = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
                layout[a.name] = (off, n, shape, dt)
                off += (n + 255) // 256 * 256
    return layout, off


def resolve_arg(a: Arg, values: dict[str, torch.Tensor], consts: dict[str, torch.Tensor],
                state: dict[str, torch.Tensor], step_buf: torch.Tensor, offsets: dict[str, int],
                workspaces: dict[str, torch.Tensor], weight: Any, dev: torch.device) -> Any:
    """The bound value of one kernel argument of a lowered graph (the compiled step's and the compiled drafter's):
    a weight (``weight(name, form)``), an int, the step buffer from a scalar's offset, a workspace (grown on
    demand, shared by name), a state buffer, a constant (uploaded once into ``values``), or an activation of the
    graph (an arena slot or the logits buffer, already in ``values``)."""
    if a.kind == "weight":
        return weight(a.name, a.form or "f32")
    if a.kind == "int":
        return int(a.value)
    if a.kind == "step":
        return step_buf[offsets[a.name] + a.row:]
    if a.kind == "workspace":
        t = workspaces.get(a.name)
        if t is None or t.numel() < a.nbytes:
            t = workspaces[a.name] = torch.empty(a.nbytes, dtype=torch.uint8, device=dev)
        return t
    if a.name in state:
        return state[a.name][a.row:] if a.row else state[a.name]
    if a.name in consts:
        t = values.get(a.name)
        if t is None:
            t = values[a.name] = consts[a.name].to(dev).contiguous()
        return t[a.row:] if a.row else t
    return values[a.name][a.row:] if a.row else values[a.name]
