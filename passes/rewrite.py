"""Graph-rewriting helpers shared by the passes: use maps, value replacement, type re-inference, fusion of
an op set into one ``fused`` op, and a stable topological re-sort."""

from __future__ import annotations

import heapq
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
    re-sorted; a non-convex group raises VerifyError.

    Cost: linear in the graph's ops (one scan for the group, its outside uses and the re-sort), so a pass
    that fuses every layer of the 43-layer model stays well under a second."""
    mset = set(members)
    at = [i for i, op in enumerate(g.ops) if op in mset]
    if not at:
        raise ValueError("fuse: empty group")
    first, last = at[0], at[-1]
    mem = [g.ops[i] for i in at]
    inside = {v for op in mem for leaf in op.walk() for v in leaf.outputs}
    ins: list[Value] = []
    for op in mem:
        for v in op.inputs:
            if v not in inside and v not in ins:
                ins.append(v)
    # ops before the group cannot read it (the graph is sorted), so its outside uses are at or after `first`
    used_outside = {v for op in g.ops[first:] if op not in mset for v in op.inputs} | output_values(g)
    outs = [v for op in mem for v in op.outputs if v in used_outside]
    if layer is None:
        layer = max(op.layer for op in mem)
    body: list[Op] = []
    for op in mem:  # flatten nested fused ops: a kernel's body is a flat list of leaf ops
        body.extend(op.body if op.body is not None else [op])
    new = Op("fused", ins, outs, {"pattern": pattern, **attrs}, layer, body)
    # only the span from the first to the last member can be out of order: the ops before it do not read it,
    # the ops after it read only what precedes them. Re-sorting that span equals re-sorting the whole graph.
    span = [new] + [op for op in g.ops[first + 1:last + 1] if op not in mset]
    g.ops = g.ops[:first] + _stable_order(span) + g.ops[last + 1:]
    return new


def toposort(g: Graph) -> None:
    """Stable topological sort of the top-level ops: of the ops whose inputs are all defined, the one earliest
    in the current order comes next (so an already sorted graph is unchanged).

    Raises:
        VerifyError: the ops form a cycle (a fusion group was not convex).
    """
    g.ops = _stable_order(g.ops)


def _stable_order(ops: list[Op]) -> list[Op]:
    """``ops`` in a stable topological order by the dependencies among them (values defined outside the list
    count as defined): Kahn's algorithm with a heap on the current position, O(n log n).

    Raises:
        VerifyError: the ops form a cycle.
    """
    prod = {v: i for i, op in enumerate(ops) for v in op.outputs}
    n = len(ops)
    waiting = [0] * n  # distinct producers in the list not yet placed
    readers: list[list[int]] = [[] for _ in range(n)]
    for i, op in enumerate(ops):
        deps = {prod[v] for v in op.inputs if v in prod and prod[v] != i}
        waiting[i] = len(deps)
        for d in deps:
            readers[d].append(i)
    ready = [i for i in range(n) if not waiting[i]]
    heapq.heapify(ready)
    order: list[Op] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(ops[i])
        for r in readers[i]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, r)
    if len(order) < n:
        placed = set(map(id, order))
        kinds = ", ".join(f"{op.kind}@l{op.layer}" for op in ops if id(op) not in placed)[:200]
        raise VerifyError(f"ops form a cycle (non-convex fusion?): {kinds} ...")
    return order


def hoist_constants(g: Graph) -> None:
    """Move every input-free op (params, constants, RoPE tables) to the top, keeping relative order."""
    g.ops = [op for op in g.ops if is_leaf_constant(op)] + [op for op in g.ops if not is_leaf_constant(op)]
