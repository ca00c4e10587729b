"""Graph-rewriting helpers shared by the passes: use maps, value replacement, type re-inference, fusion of
an op set into one ``fused`` op, and a stable topological re-sort."""

from __future__ import annotations

from typing import Iterable

from ds4c.ir.graph import Graph, Op, Value
from ds4c.ir.ops import OPS
from ds4c.ir.verify import VerifyError


def producers(g: Graph) -> dict[Value, Op]:
    """Value -> the top-level op that defines it (graph inputs are absent)."""
    return {v: op for op in g.ops for v in op.outputs}


def users(g: Graph) -> dict[Value, list[Op]]:
    """Value -> top-level ops reading it (graph outputs not included)."""
    return g.users()


def output_values(g: Graph) -> set[Value]:
    return set(g.outputs.values())


def replace_uses(g: Graph, mapping: dict[Value, Value]) -> None:
    """Make every use of a key of ``mapping`` (op inputs at any depth, graph outputs) use its value."""
    if not mapping:
        return

    def fix(op: Op) -> None:
        op.inputs = [mapping.get(v, v) for v in op.inputs]
        for b in op.body or ():
            fix(b)

    for op in g.ops:
        fix(op)
    g.outputs = {k: mapping.get(v, v) for k, v in g.outputs.items()}


def reinfer(g: Graph) -> None:
    """Recompute every leaf op's output types from its inputs, in order (after an input was retyped)."""
    for op in g.leaf_ops():
        types = OPS[op.kind].infer([v.type for v in op.inputs], op.attrs)
        for v, t in zip(op.outputs, types):
            v.type = t


def is_leaf_constant(op: Op) -> bool:
    """Ops with no inputs (weights, constants, RoPE tables): hoisted to the top, never part of a kernel."""
    return op.body is None and not op.inputs


def fuse(g: Graph, members: Iterable[Op], pattern: str, layer: int | None = None, **attrs: object) -> Op:
    """Replace the top-level ops ``members`` by one ``fused`` op (body = members in graph order). Its
    inputs are the values the body reads but does not define; its outputs the body values used outside
    the group or as graph outputs; its layer is ``layer`` or the members' (largest) layer. The graph is
    re-sorted; a non-convex group raises VerifyError."""
    mem = [op for op in g.ops if op in set(members)]
    if not mem:
        raise ValueError("fuse: empty group")
    inside = {v for op in mem for leaf in op.walk() for v in leaf.outputs}
    ins: list[Value] = []
    for op in mem:
        for v in op.inputs:
            if v not in inside and v not in ins:
                ins.append(v)
    used_outside = {v for op in g.ops if op not in mem for v in op.inputs} | output_values(g)
    outs = [v for op in mem for v in op.outputs if v in used_outside]
    if layer is None:
        layer = max(op.layer for op in mem)
    body: list[Op] = []
    for op in mem:  # flatten nested fused ops: a kernel's body is a flat list of leaf ops
        body.extend(op.body if op.body is not None else [op])
    new = Op("fused", ins, outs, {"pattern": pattern, **attrs}, layer, body)
    first = g.ops.index(mem[0])
    g.ops = [op for op in g.ops if op not in mem]
    g.ops.insert(min(first, len(g.ops)), new)
    toposort(g)
    return new


def toposort(g: Graph) -> None:
    """Stable topological sort of the top-level ops (ties keep the current order).

    Raises:
        VerifyError: the ops form a cycle (a fusion group was not convex).
    """
    prod = producers(g)
    deps: dict[int, set[int]] = {}
    for op in g.ops:
        deps[id(op)] = {id(prod[v]) for v in op.inputs if v in prod and prod[v] is not op}
    done: set[int] = set()
    order: list[Op] = []
    pending = list(g.ops)
    while pending:
        for k, op in enumerate(pending):
            if deps[id(op)] <= done:
                order.append(op)
                done.add(id(op))
                pending.pop(k)
                break
        else:
            kinds = ", ".join(f"{op.kind}@l{op.layer}" for op in pending[:4])
            raise VerifyError(f"ops form a cycle (non-convex fusion?): {kinds} ...")
    g.ops = order


def hoist_constants(g: Graph) -> None:
    """Move every input-free op (params, constants, RoPE tables) to the top, keeping relative order."""
    g.ops = [op for op in g.ops if is_leaf_constant(op)] + [op for op in g.ops if not is_leaf_constant(op)]
