"""fuse_projections: horizontal fusion of projections that read the same activation.

* ``router``: the router GEMV joins the fused HC op that produces its input (router with the FFN norm:
  the kernel that normalises ``b`` also computes ``W_gate . b``).
* ``moe_experts``: the routed experts, the shared expert's gate and up GEMVs, its SwiGLU and down GEMV and
  the fp32 combine form one op (all routed + shared experts of a layer in one unit).
* ``multi_gemv``: remaining ``linear`` ops that share their input (wq_a, wkv, compressor wkv/wgate, indexer
  compressor wkv/wgate and ``weights_proj`` on the attention input; wq_b and indexer wq_b on ``qr``).

Runs after ``fuse_hc``. Preserves: the interpreter's outputs bit for bit (grouping only).
"""

from __future__ import annotations

from typing import Any

from ds4c.ir.graph import Graph, Op
from ds4c.passes.rewrite import fuse, producers


def _weight_name(op: Op, prod: dict) -> str:
    w = prod.get(op.inputs[1])
    return w.attrs.get("weight", "") if w is not None and w.kind == "param" else ""


def fuse_projections(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` with shared-input projections fused (see module docstring)."""
    g = g.clone()
    prod = producers(g)
    # router with the FFN norm
    for op in [o for o in g.ops if o.kind == "linear" and _weight_name(o, prod).endswith("ffn_gate_inp.weight")]:
        src = prod.get(op.inputs[0])
        if src is not None and src.kind == "fused" and src.attrs["pattern"] in ("hc_post_pre", "hc_embed_pre", "hc_pre"):
            fuse(g, [src, op], src.attrs["pattern"], layer=src.layer, router=True)
            prod = producers(g)
    # all experts of a layer: routed + shared (gate/up GEMVs, SwiGLU, down GEMV) + combine
    prod = producers(g)
    for moe in [o for o in g.ops if o.kind == "moe_sum"]:
        routed, down = prod[moe.inputs[0]], prod[moe.inputs[1]]
        cast = prod[down.inputs[0]]
        swiglu = prod[cast.inputs[0]]
        gate, up = prod[swiglu.inputs[0]], prod[swiglu.inputs[1]]
        if routed.kind == "routed_experts" and (down.kind, cast.kind, swiglu.kind, gate.kind, up.kind) == (
                "linear", "cast", "swiglu", "linear", "linear"):
            fuse(g, [routed, gate, up, swiglu, cast, down, moe], "moe_experts")
    # horizontal multi-output GEMVs
    by_input: dict[Any, list[Op]] = {}
    for op in g.ops:
        if op.kind == "linear":
            by_input.setdefault(op.inputs[0], []).append(op)
    for x, ops in by_input.items():
        if len(ops) >= 2:
            fuse(g, ops, "multi_gemv", n_outputs=len(ops))
    return g
