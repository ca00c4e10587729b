"""fix_verify_width: specialise the step width q.

The builder types every row dimension with the symbol ``q``; this pass retypes the ``tokens`` input to
``i64[width]`` (and a shard's ``hc_in`` to ``bf16[width, hc, hidden]``) (``width`` from ``meta["width"]``) and re-infers every type, so all shapes are static except
the growing compressed-row spans (removed by ``pad_compressed_kv``).

Preserves: the interpreter's outputs bit for bit (only types change).
"""

from __future__ import annotations

from typing import Any

from ds4c.ir.graph import Graph, Sym, TensorType
from ds4c.ir.verify import VerifyError
from ds4c.passes.rewrite import reinfer


def fix_verify_width(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` with q = ``g.meta["width"]``.

    Raises:
        VerifyError: the graph has no width, or a dimension named ``q`` survives re-inference.
    """
    width = g.meta.get("width")
    if not isinstance(width, int):
        raise VerifyError(f"fix_verify_width: meta['width'] must be an int, found {width!r}")
    g = g.clone()
    tok = g.inputs["tokens"]
    tok.type = TensorType((width,), tok.type.dtype)
    hc_in = g.inputs.get("hc_in")  # a layer-split shard's incoming HC state [q, hc, hidden]
    if hc_in is not None:
        hc_in.type = TensorType((width, *hc_in.type.shape[1:]), hc_in.type.dtype)
    reinfer(g)
    left = [v for op in g.leaf_ops() for v in op.outputs if Sym("q") in v.type.syms()]
    if left:
        raise VerifyError(f"fix_verify_width: {len(left)} values still carry q, e.g. {left[0]!r}")
    return g
