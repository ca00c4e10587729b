"""Export a graph to networkx (for analysis) and to Graphviz dot (for viewing)."""

from __future__ import annotations

import networkx as nx

from ds4c.ir.graph import Graph, Value


def to_networkx(g: Graph) -> nx.MultiDiGraph:
    """Nodes: ``"in:<name>"`` for graph inputs, ``"op<k>"`` for top-level ops (attrs kind, layer, pattern),
    ``"out:<name>"`` for graph outputs; one edge per value use, labelled with the value's type."""
    G = nx.MultiDiGraph()
    src: dict[Value, str] = {}
    for name, v in g.inputs.items():
        G.add_node(f"in:{name}", kind="input", layer=-1)
        src[v] = f"in:{name}"
    for k, op in enumerate(g.ops):
        node = f"op{k}"
        G.add_node(node, kind=op.kind, layer=op.layer, pattern=op.attrs.get("pattern", ""),
                   n_leaf=sum(1 for _ in op.walk()))
        for v in op.inputs:
            G.add_edge(src[v], node, type=str(v.type))
        for v in op.outputs:
            src[v] = node
    for name, v in g.outputs.items():
        G.add_node(f"out:{name}", kind="output", layer=-1)
        G.add_edge(src[v], f"out:{name}", type=str(v.type))
    return G


def to_dot(g: Graph) -> str:
    """Graphviz text of :func:`to_networkx` (param ops folded away to keep the picture readable)."""
    G = to_networkx(g)
    lines = ["digraph step {", "  rankdir=TB; node [shape=box, fontname=monospace, fontsize=9];"]
    skip = {n for n, d in G.nodes(data=True) if d["kind"] in ("param", "const", "rope_freqs")}
    for n, d in G.nodes(data=True):
        if n in skip:
            continue
        label = d["kind"] if d["kind"] != "fused" else f"fused[{d['pattern']}] ({d['n_leaf']} ops)"
        if d["layer"] >= 0:
            label += f"\\nl{d['layer']}"
        shape = ", shape=ellipse" if d["kind"] in ("input", "output") else ""
        lines.append(f'  "{n}" [label="{label if d["kind"] not in ("input", "output") else n}"{shape}];')
    for a, b, d in G.edges(data=True):
        if a in skip or b in skip:
            continue
        lines.append(f'  "{a}" -> "{b}" [label="{d["type"]}", fontsize=7];')
    lines.append("}")
    return "\n".join(lines) + "\n"


