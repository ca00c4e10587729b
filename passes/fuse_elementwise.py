"""fuse_elementwise: fold elementwise ops (norms, RoPE, fake-quant, Hadamard, scalings, casts, SwiGLU,
router scores) into neighbouring kernels.

Rule, per elementwise op in graph order:

* **prologue**: when its only reader is a GEMV-like op (``linear``, ``grouped_linear``, ``multi_gemv``,
  ``route``, ``moe_experts``), it joins that reader (e.g. ``q_norm`` before ``wq_b``; inverse RoPE before
  grouped ``wo_a``; router scores before the top-k);
* **epilogue**: otherwise it joins the kernel that produces its first input (e.g. the KV norm, RoPE and
  FP8 fake-quant after ``wkv``; per-head RMS and RoPE after ``wq_b``; the indexer's RoPE, Hadamard and FP4
  fake-quant after indexer ``wq_b``);
* it stays alone when its producer is a graph input or an input-free op.

Preserves: the interpreter's outputs bit for bit (grouping only).
"""

from __future__ import annotations

from typing import Any

from ds4c.ir.graph import Graph, Op
from ds4c.passes.rewrite import fuse, is_leaf_constant, producers, users

ELEMENTWISE = frozenset({"rms_norm", "head_rms", "rope", "kv_fake_quant", "fp4_fake_quant", "hadamard",
                         "mul_scalar", "reshape", "cast", "swiglu", "router_scores", "add"})
GEMV_LIKE = frozenset({"linear", "grouped_linear", "route"})
GEMV_PATTERNS = frozenset({"multi_gemv", "moe_experts"})


def _gemv_like(op: Op) -> bool:
    return op.kind in GEMV_LIKE or (op.kind == "fused" and op.attrs.get("pattern") in GEMV_PATTERNS)


def fuse_elementwise(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` with elementwise ops folded into neighbours (see module docstring)."""
    g = g.clone()
    prod, u = producers(g), users(g)
    outs = set(g.outputs.values())
    parent: dict[int, Op] = {}

    def find(op: Op) -> Op:
        while id(op) in parent:
            op = parent[id(op)]
        return op

    for op in g.ops:
        if op.kind not in ELEMENTWISE:
            continue
        readers = {id(r): r for v in op.outputs for r in u.get(v, [])}
        if len(readers) == 1 and not any(v in outs for v in op.outputs):
            (reader,) = readers.values()
            if _gemv_like(reader):
                parent[id(op)] = reader
                continue
        src = prod.get(op.inputs[0])
        if src is not None and not is_leaf_constant(src) and src.kind != "row_positions":
            parent[id(op)] = src
    groups: dict[int, list[Op]] = {}
    for op in g.ops:
        root = find(op)
        if root is not op:
            groups.setdefault(id(root), [root]).append(op)
    for members in groups.values():
        root = members[0]
        pattern = root.attrs["pattern"] if root.kind == "fused" else root.kind
        extra = {k: v for k, v in root.attrs.items() if k != "pattern"} if root.kind == "fused" else {}
        fuse(g, members, pattern, layer=root.layer, **extra)
    return g
