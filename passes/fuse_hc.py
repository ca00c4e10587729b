"""fuse_hc: one fused op per hyper-connection boundary.

Each sub-block's HC post, the next sub-block's HC pre (mixing-logit GEMV with the square-sum, Sinkhorn,
pre-mix) and the RMSNorm after it become one ``fused`` op:

* ``hc_embed_pre``: embedding lookup + stream expansion + HC pre + attn_norm (layer 0);
* ``hc_post_pre``: HC post of a sub-block + HC pre of the next + its RMSNorm;
* ``hc_post_head``: the last HC post + the HC head (sigmoid gate, pre-mix) + the final RMSNorm (in a prefill
  chunk graph with the ``take_row`` of the last valid row between them).

At the boundaries of a layer-split shard (``build_step(..., layers=...)``), where the HC state crosses
devices, the boundary is cut in two:

* ``hc_pre``: HC pre + RMSNorm of the shard's first layer on the incoming HC state (graph input ``hc_in``);
* ``hc_post_out``: the shard's last HC post alone, its new streams being the graph output ``hc_out``.

``hc_post_out`` then ``hc_pre`` compute exactly what one ``hc_post_pre`` computes (the same bf16 streams,
the same mixing sums from them), so a split graph gives the unsplit graph's results bit for bit.

Preserves: the interpreter's outputs bit for bit (ops are grouped, not changed). Afterwards no HC op
(``hc_expand``, ``hc_mix``, ``sinkhorn``, ``hc_head_gate``, ``hc_premix``, ``hc_post``) is left outside a
fused op.
"""

from __future__ import annotations

from typing import Any

from ds4c.ir.graph import Graph, Op
from ds4c.passes.rewrite import fuse, producers, users

HC_KINDS = frozenset({"hc_expand", "hc_mix", "sinkhorn", "hc_head_gate", "hc_premix", "hc_post"})


def _only_user(u: dict, v: Any, kind: str) -> Op | None:
    ops = [op for op in u.get(v, []) if op.kind == kind]
    return ops[0] if len(ops) == 1 else None


def fuse_hc(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` with every HC boundary fused (see module docstring)."""
    g = g.clone()
    groups: list[tuple[list[Op], str, int]] = []
    prod, u = producers(g), users(g)
    for mix in [op for op in g.ops if op.kind == "hc_mix"]:
        x = mix.inputs[0]
        gate = _only_user(u, mix.outputs[0], "sinkhorn") or _only_user(u, mix.outputs[0], "hc_head_gate")
        if gate is None:
            continue
        premix = next((op for op in u.get(x, []) if op.kind == "hc_premix" and op.inputs[1] is gate.outputs[0]), None)
        norm = premix and _only_user(u, premix.outputs[0], "rms_norm")
        if premix is None or norm is None:
            continue
        members = [mix, gate, premix, norm]
        src = prod.get(x)
        if src is not None and src.kind == "take_row" and gate.kind == "hc_head_gate":  # a prefill chunk's head
            members.insert(0, src)
            src = prod.get(src.inputs[0])
        if src is not None and src.kind == "hc_post":
            members.insert(0, src)
            pattern = "hc_post_head" if gate.kind == "hc_head_gate" else "hc_post_pre"
        elif src is not None and src.kind == "hc_expand":
            emb = prod.get(src.inputs[0])
            members[:0] = ([emb] if emb is not None and emb.kind == "embed" else []) + [src]
            pattern = "hc_embed_pre"
        elif src is None and x is g.inputs.get("hc_in"):
            pattern = "hc_pre"
        else:
            continue
        groups.append((members, pattern, mix.layer))
    out = g.outputs.get("hc_out")
    if out is not None and prod.get(out) is not None and prod[out].kind == "hc_post":
        groups.append(([prod[out]], "hc_post_out", prod[out].layer))
    for members, pattern, layer in groups:
        fuse(g, members, pattern, layer=layer)  # the layer whose HC pre it computes (-1: the head)
    left = [op for op in g.ops if op.kind in HC_KINDS]
    if left:
        from ds4c.ir.verify import VerifyError

        raise VerifyError(f"fuse_hc: {len(left)} HC ops left unfused, e.g. {left[0].kind} in layer {left[0].layer}")
    return g
