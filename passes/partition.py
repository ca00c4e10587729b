"""partition: group the remaining ops into kernels and describe the kernel plan.

After this pass every top-level op is either *free* (weights, constants, row positions, reshapes, span views
and a lanes step's row views: no launch, they are addresses and scalars) or a ``fused`` op that is one kernel. Singles are
wrapped (pattern = their kind); span masks join their reader; the main and indexer compressor updates of
a layer form one ``compressor`` kernel; the ring write joins the inverse-RoPE + grouped ``wo_a`` kernel
(it must follow the attention, which reads the old ring rows), or, in a graph with no attention in that layer
(the DSpark drafter's commit graph), the GEMV kernel whose epilogue computes the row.

:func:`kernel_plan` reads the plan off a partitioned graph: per kernel its name, family, layer, leaf ops,
inputs, outputs, the weight bytes it streams, and a launch description.

Preserves: the interpreter's outputs bit for bit (grouping only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ds4c.ir.graph import Graph, Op, Value
from ds4c.quant import GGMLType, nbytes
from ds4c.passes.rewrite import fuse, is_leaf_constant, producers, users

FREE_KINDS = frozenset({"param", "const", "row_positions", "reshape", "live_rows", "bucket_rows", "lane_rows",
                        "concat_rows"})

FAMILIES = {
    "hc_embed_pre": "hc", "hc_post_pre": "hc", "hc_post_head": "hc", "hc_pre": "hc", "hc_post_out": "hc",
    "multi_gemv": "gemv", "linear": "gemv",
    "compressor": "compressor", "compress": "compressor",
    "indexer_topk": "indexer", "sparse_attention": "attention", "grouped_linear": "wo_a",
    "route": "router", "moe_experts": "experts", "dspark_tap": "tap", "record_hc": "tap", "markov_chain": "dspark",
    "dspark_confidence": "dspark", "ring_write": "rowchain",
}


def _free(op: Op) -> bool:
    return op.body is None and (op.kind in FREE_KINDS or is_leaf_constant(op))


def partition(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` whose non-free top-level ops are all kernels (see module docstring)."""
    g = g.clone()
    u = users(g)
    for mask in [op for op in g.ops if op.kind == "span_mask"]:
        readers = {id(r): r for r in u.get(mask.outputs[0], [])}
        if len(readers) == 1:
            fuse(g, [mask, *readers.values()], _pattern(next(iter(readers.values()))))
            u = users(g)
    by_layer: dict[tuple[int, str], list[Op]] = {}
    for op in g.ops:
        if op.kind == "compress":  # per layer, and per lane in a lanes step (each lane's own state)
            by_layer.setdefault((op.layer, _lane_of(g, op)), []).append(op)
    for ops in by_layer.values():
        fuse(g, ops, "compressor")
    for ring in [op for op in g.ops if op.kind == "ring_write"]:
        if g.meta.get("lanes"):  # a lane's ring write covers its rows only: its own kernel after the attention
            continue
        target = next((op for op in g.ops if op.layer == ring.layer and _pattern(op) == "grouped_linear"), None)
        if target is not None:
            fuse(g, [target, ring], "grouped_linear", layer=ring.layer, ring_write=True)
            continue
        # no attention after it (the DSpark drafter's commit graph, ds4c.ir.dspark): the ring write joins the
        # GEMV kernel whose epilogue computes the row (the row chain then also stores the row into the ring)
        src = producers(g).get(ring.inputs[1])
        if src is not None and src.kind == "fused" and src.attrs.get("pattern") in ("multi_gemv", "linear"):
            fuse(g, [src, ring], src.attrs["pattern"], layer=src.layer,
                 **{k: v for k, v in src.attrs.items() if k != "pattern"})
    for op in list(g.ops):
        if not _free(op) and op.kind != "fused":
            fuse(g, [op], op.kind)
    g.meta = {**g.meta, "kernels": len([op for op in g.ops if op.kind == "fused"])}
    return g


def _lane_of(g: Graph, op: Op) -> str:
    """The lane prefix (``lane{j}.``) of a per-lane op of a lanes step, by the state buffer it updates; ``""``
    otherwise."""
    names = {v: k for k, v in g.inputs.items()}
    state = names.get(op.inputs[4], "") if op.kind == "compress" else ""
    return state[: state.index(".") + 1] if state.startswith("lane") else ""


def _pattern(op: Op) -> str:
    return op.attrs.get("pattern", op.kind) if op.kind == "fused" else op.kind


# ---------------------------------------------------------------------------------------------- plan

@dataclass
class Kernel:
    """One kernel of the plan. ``weight_bytes`` counts the stored bytes of the weights it reads (routed
    experts: the ``n_active`` experts one row touches); ``launch`` = grid/block description."""

    name: str
    family: str
    layer: int
    ops: list[str]
    inputs: list[str]
    outputs: list[str]
    weight_bytes: int
    launch: dict[str, Any] = field(default_factory=dict)


@dataclass
class KernelPlan:
    kernels: list[Kernel]
    arena_bytes: int | None = None

    def per_layer(self) -> dict[int, list[Kernel]]:
        out: dict[int, list[Kernel]] = {}
        for k in self.kernels:
            out.setdefault(k.layer, []).append(k)
        return out


def plan_weight_types(cfg: Any, types: dict[str, GGMLType]) -> dict[str, Any]:
    """The ``weight_types`` argument of :func:`kernel_plan` for a model: ``types`` (tensor name -> stored GGUF
    type, e.g. of a model file) plus every tensor's shape under ``"<name>:shape"`` (docs/gguf-layout.md)."""
    from ds4c.tensors import tensor_specs

    return {**types, **{s.name + ":shape": s.shape for s in tensor_specs(cfg)}}


def kernel_plan(g: Graph, weight_types: dict[str, GGMLType] | None = None, n_active: int = 6) -> KernelPlan:
    """The kernel plan of a partitioned graph.

    ``weight_types`` maps weight names to their stored GGUF types (missing: BF16) and, under
    ``"<expert tensor name>:shape"``, the expert tensors' shapes, so a routed-expert bank counts the
    ``n_active`` experts one row reads. Embedding and hash-table lookups count only the step's rows."""
    prod = producers(g)
    names: dict[Value, str] = {}

    def vname(v: Value) -> str:
        return names.setdefault(v, v.name or f"v{len(names)}")

    kernels = []
    seen: dict[str, int] = {}
    for k, op in enumerate(g.ops):
        if op.kind != "fused":
            continue
        pattern = op.attrs.get("pattern", "")
        q = int(g.meta.get("width", 1))
        wbytes = 0
        for v in op.inputs:
            p = prod.get(v)
            if p is not None and p.kind == "param":
                wbytes += _param_bytes(p, weight_types, n_active, q)
        name = f"l{op.layer}.{pattern}" if op.layer >= 0 else pattern
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # e.g. the two multi-GEMVs of a CSA layer: l1.multi_gemv, l1.multi_gemv.2
            name = f"{name}.{seen[name]}"
        kernels.append(Kernel(
            name=name, family=FAMILIES.get(pattern, pattern),
            layer=op.layer, ops=[leaf.kind for leaf in op.walk()], inputs=[vname(v) for v in op.inputs],
            outputs=[vname(v) for v in op.outputs], weight_bytes=wbytes,
            launch=_launch(op, pattern, q)))
    return KernelPlan(kernels, g.meta.get("memory", {}).get("arena_bytes"))


def _gathered(name: str) -> bool:
    """Row-lookup tables: the embedding and the hash-routing table."""
    return name == "token_embd.weight" or name.endswith("ffn_gate_tid2eid.weight")


def _param_bytes(p: Op, weight_types: dict[str, GGMLType] | None, n_active: int, rows: int) -> int:
    """Stored bytes of a weight; for a routed-expert bank, the ``n_active`` experts one row reads."""
    shape, name = tuple(p.attrs["shape"]), p.attrs["weight"]
    types = weight_types or {}
    if p.attrs["dtype"] == "handle":  # blk.N.experts -> the three expert tensors of layer N
        prefix = name[: -len("experts")]
        total = 0
        for t in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"):
            full = types.get(prefix + t + ":shape")
            if full is not None:
                total += nbytes(types.get(prefix + t, GGMLType.BF16), full) // full[0] * n_active
        return total
    full = nbytes(types.get(name, GGMLType.BF16), shape)
    if _gathered(name):  # only the step's rows are read
        return full // shape[0] * rows
    return full


def _launch(op: Op, pattern: str, q: int) -> dict[str, Any]:
    """Launch description: GEMV-family kernels one 256-thread block per 8 output rows (all rows of the
    step in each block); attention one block per (head, row) with the list split in 64-entry chunks;
    everything else one 256-thread block per row."""
    leaves = list(op.walk())
    gemv_rows = sum(int(v.type.shape[-1]) for leaf in leaves if leaf.kind == "linear" for v in leaf.outputs)
    if pattern == "sparse_attention":
        qv = next(leaf for leaf in leaves if leaf.kind == "sparse_attention").inputs[0]
        return {"grid": [int(qv.type.shape[1]), q], "block": [256], "rows": q, "split_k_chunk": 64}
    if gemv_rows:
        return {"grid": [max(1, -(-gemv_rows // 8))], "block": [256], "rows": q}
    return {"grid": [q], "block": [256], "rows": q}
