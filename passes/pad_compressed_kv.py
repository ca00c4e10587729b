"""pad_compressed_kv: give every growing span a static bucket capacity.

Each ``live_rows(rows, tokens, pos)`` (the compressed rows visible to the step: HCA rows, CSA candidate rows,
the indexer key scan; ``n = (pos+q) // ratio`` rows, a symbolic dim) becomes ``bucket_rows(rows, live_r)``
with capacity ``context // ratio`` for the graph's context bucket, and a new scalar input ``live_r{ratio}``
(the live length, uploaded per step). Every ``span_mask`` reading such a span also takes the live length.
One graph then serves every position inside the bucket. In a lanes step (``build_step(..., lanes=...)``) each
lane has its own live lengths: ``lane{j}.live_r{ratio}``, named after the lane's ``lane{j}.pos`` the span reads.

Preserves: the interpreter's outputs bit for bit (attention chunks and indexer tiles have fixed shapes, so
masked entries appended to a span change nothing). Requires ``meta["context"]`` (the bucket, set from the
:class:`~ds4c.buckets.BucketSpec` by the pass manager).
"""

from __future__ import annotations

from typing import Any

from ds4c.buckets import span_capacity
from ds4c.ir.graph import Graph, Op, TensorType, Value
from ds4c.ir.verify import VerifyError
from ds4c.passes.rewrite import reinfer


def pad_compressed_kv(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` with bucketed spans.

    Raises:
        VerifyError: no ``meta["context"]``, a state buffer smaller than the bucket capacity, or a symbolic
            dimension left after the rewrite.
    """
    context = g.meta.get("context")
    if not isinstance(context, int):
        raise VerifyError(f"pad_compressed_kv: meta['context'] (the bucket) must be an int, found {context!r}")
    g = g.clone()
    live: dict[tuple[str, int], Value] = {}
    spans: dict[Value, Value] = {}
    input_names = {v: k for k, v in g.inputs.items()}

    def rewrite(op: Op) -> None:
        for b in op.body or ():
            rewrite(b)
        if op.kind == "live_rows":
            r = op.attrs["ratio"]
            cap = span_capacity(context, r)
            if op.inputs[0].type.shape[0] < cap:  # type: ignore[operator]
                raise VerifyError(f"pad_compressed_kv: layer {op.layer} holds {op.inputs[0].type.shape[0]} "
                                  f"compressed rows of ratio {r}, the bucket needs {cap}")
            pos_name = input_names.get(op.inputs[2], "pos")
            key = (pos_name[: -len("pos")], r)  # "" or a lane's "lane{j}."
            if key not in live:
                live[key] = Value(TensorType((), "i64"), f"{key[0]}live_r{r}")
            op.kind, op.attrs = "bucket_rows", {"capacity": cap}
            op.inputs = [op.inputs[0], live[key]]
            spans[op.outputs[0]] = live[key]
        elif op.kind == "span_mask" and op.inputs[0] in spans and len(op.inputs) == 2:
            op.inputs = op.inputs + [spans[op.inputs[0]]]

    for op in g.ops:
        rewrite(op)
    for key in sorted(live):
        g.inputs[live[key].name] = live[key]
    reinfer(g)
    left = {str(s) for op in g.leaf_ops() for v in op.outputs for s in v.type.syms()}
    if left:
        raise VerifyError(f"pad_compressed_kv: symbolic dims remain: {sorted(left)}")
    return g
