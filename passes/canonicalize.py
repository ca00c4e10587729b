"""canonicalize: constant folding, common-subexpression elimination, dead-code elimination, and hoisting
of input-free ops (weights, constants) to the top of the graph.

Preserves: the interpreter's outputs bit for bit (folded ops are evaluated with the same implementation;
CSE merges ops that compute the same function of the same inputs; DCE removes ops nothing reads).
"""

from __future__ import annotations

from typing import Any

import torch

from ds4c.ir.graph import Graph, Op
from ds4c.ir.ops import OPS, RunCtx
from ds4c.passes.rewrite import hoist_constants, replace_uses


def _key(op: Op) -> tuple:
    def norm(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", v.dtype, tuple(v.shape), v.detach().cpu().numpy().tobytes())
        if isinstance(v, (list, tuple)):
            return tuple(norm(x) for x in v)
        return (type(v).__name__, v)

    return (op.kind, tuple(id(v) for v in op.inputs), tuple(sorted((k, norm(a)) for k, a in op.attrs.items())))


def fold_constants(g: Graph) -> int:
    """Replace foldable ops whose inputs are all constants by ``const`` ops. Returns the count."""
    consts = {op.outputs[0]: op.attrs["data"] for op in g.ops if op.kind == "const"}
    n = 0
    ctx = RunCtx(None, lambda name: None, lambda layer, e: None)
    for k, op in enumerate(g.ops):
        d = OPS.get(op.kind)
        if op.body is None and d is not None and d.foldable and all(v in consts for v in op.inputs):
            (data,) = d.run(ctx, [consts[v] for v in op.inputs], op.attrs)
            new = Op("const", [], list(op.outputs), {"data": data}, op.layer)
            for v in new.outputs:
                v.producer = new
            g.ops[k] = new
            consts[new.outputs[0]] = data
            n += 1
    return n


def cse(g: Graph) -> int:
    """Merge top-level leaf ops with the same kind, inputs and attributes. Returns merged count."""
    seen: dict[tuple, Op] = {}
    mapping = {}
    keep = []
    for op in g.ops:
        if op.body is None:
            op.inputs = [mapping.get(v, v) for v in op.inputs]
            key = _key(op)
            first = seen.get(key)
            if first is not None:
                mapping.update(zip(op.outputs, first.outputs))
                continue
            seen[key] = op
        keep.append(op)
    g.ops = keep
    replace_uses(g, mapping)
    return len(mapping)


def dce(g: Graph) -> int:
    """Remove top-level ops none of whose outputs is read or returned. Returns the count."""
    live = set(g.outputs.values())
    keep: list[Op] = []
    for op in reversed(g.ops):
        if any(v in live for v in op.outputs):
            keep.append(op)
            live.update(op.inputs)
    removed = len(g.ops) - len(keep)
    g.ops = keep[::-1]
    return removed


def canonicalize(g: Graph, ctx: Any = None) -> Graph:
    """Fold, CSE, DCE and hoist on a copy of ``g``; ``meta["canonicalize"]`` records the counts."""
    g = g.clone()
    stats = {"folded": fold_constants(g), "merged": cse(g), "removed": dce(g)}
    hoist_constants(g)
    g.meta = {**g.meta, "canonicalize": stats}
    return g
