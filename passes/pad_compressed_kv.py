"""pad_compressed_kv: give every growing span a static bucket capacity.

Each ``live_rows(rows, tokens, pos)`` (the compressed rows visible to the step: HCA rows, CSA candidate rows,
the indexer key scan; ``n = (pos+q) // ratio`` rows, a symbolic dim) becomes ``bucket_rows(rows, live_r)``
with capacity ``context // ratio`` for the graph's context bucket, and a new scalar input ``live_r{ratio}``
(the live length, uploaded per step). Every ``span_mask`` reading such a span also takes the live length.
One graph then serves every position inside the bucket.

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
    live: dict[int, Value] = {}
    spans: dict[Value, Value] = {}

    def rewrite(op: Op) -> None:
        for b in op.body or ():
            rewrite(b)
        if op.kind == "live_rows":
            r = op.attrs["ratio"]
            cap = span_capacity(context, r)
            if op.inputs[0].type.shape[0] < cap:  # type: ignore[operator]
                raise VerifyError(f"pad_compressed_kv: layer {op.layer} holds {op.inputs[0].type.shape[0]} "
                                  f"compressed rows of ratio {r}, the bucket needs {cap}")
            if r not in live:
                live[r] = Value(TensorType((), "i64"), f"live_r{r}")
            op.kind, op.attrs = "bucket_rows", {"capacity": cap}
            op.inputs = [op.inputs[0], live[r]]
            spans[op.outputs[0]] = live[r]
        elif op.kind == "span_mask" and op.inputs[0] in spans and len(op.inputs) == 2:
            op.inputs = op.inputs + [spans[op.inputs[0]]]

    for op in g.ops:
        rewrite(op)
    for r in sorted(live):
        g.inputs[f"live_r{r}"] = live[r]
    reinfer(g)
    left = {str(s) for op in g.leaf_ops() for v in op.outputs for s in v.type.syms()}
    if left:
        raise VerifyError(f"pad_compressed_kv: symbolic dims remain: {sorted(left)}")
    return g
