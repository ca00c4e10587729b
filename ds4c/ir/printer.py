"""Readable, stable text of a graph: the same graph always prints the same text (values are named from
their hints in definition order, attributes sorted, constants shown by shape and digest), so the text can
be hashed into cache keys."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ds4c.ir.graph import Graph, Op, Value


def _fmt_attr(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        digest = hashlib.sha1(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]
        return f"<{str(v.dtype).replace('torch.', '')}{list(v.shape)} {digest}>"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_fmt_attr(x) for x in v) + ")"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def value_names(g: Graph) -> dict[Value, str]:
    """Stable unique names of every value (graph inputs, then op outputs in order, bodies included): the
    value's hint, suffixed ``.1``, ``.2`` ... on repeats. The printer, the lowering and the runtime share them."""
    names: dict[Value, str] = {}
    taken: set[str] = set()

    def add(v: Value) -> None:
        if v not in names:
            base = v.name or "v"
            n, k = base, 1
            while n in taken:
                n, k = f"{base}.{k}", k + 1
            taken.add(n)
            names[v] = n

    for v in g.inputs.values():
        add(v)

    def walk(op: Op) -> None:
        for v in op.inputs:
            add(v)
        for b in op.body or ():
            walk(b)
        for v in op.outputs:
            add(v)

    for op in g.ops:
        walk(op)
    return names


def print_graph(g: Graph, layers: set[int] | None = None) -> str:
    """The text of ``g`` (only the ops of ``layers`` when given; -1 = embedding and head)."""
    names = value_names(g)

    def name(v: Value) -> str:
        return names[v]

    meta = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(g.meta.items()))
    lines = [f"graph step({meta}) {{"]
    for k, v in g.inputs.items():
        lines.append(f"  input %{name(v)}: {v.type}")

    def emit(op: Op, indent: str) -> None:
        outs = ", ".join(f"%{name(o)}: {o.type}" for o in op.outputs)
        ins = ", ".join(f"%{name(v)}" for v in op.inputs)
        attrs = ", ".join(f"{k}={_fmt_attr(op.attrs[k])}" for k in sorted(op.attrs))
        kind = f"fused[{op.attrs.get('pattern', '')}]" if op.kind == "fused" else op.kind
        if op.kind == "fused":
            attrs = ""
        lines.append(f"{indent}{outs} = {kind}({ins})" + (f" {{{attrs}}}" if attrs else "")
                     + (f"  # l{op.layer}" if op.layer >= 0 else "") + (" {" if op.body else ""))
        if op.body:
            for b in op.body:
                emit(b, indent + "    ")
            lines.append(f"{indent}}}")

    for op in g.ops:
        if layers is None or op.layer in layers:
            emit(op, "  ")
    for k, v in g.outputs.items():
        lines.append(f"  output {k} = %{name(v)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def graph_hash(g: Graph) -> str:
    """sha256 of :func:`print_graph` (a content key of the graph)."""
    return hashlib.sha256(print_graph(g).encode()).hexdigest()
