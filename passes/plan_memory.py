"""plan_memory: a static arena for the values that pass between kernels.

Values that live inside a kernel stay in registers/shared memory; graph inputs and outputs (token ids,
position, live lengths, state buffers, logits) are external buffers (state outputs are written in place
over their inputs); free ops (reshapes, span views, a lanes step's ``lane_rows``) alias their source, and the
inputs of a ``concat_rows`` (each lane's attention output) live in its output, at their rows. Every other value produced by a
kernel and read by a later one gets an offset in one arena, assigned first-fit in kernel order from
liveness (a value's slot is reused once its last reader has run), aligned to 256 bytes.

Records ``meta["memory"] = {"arena_bytes", "no_reuse_bytes", "slots": {value: [offset, bytes]}}``.
Requires static shapes (after ``fix_verify_width`` and ``pad_compressed_kv``). Preserves: the
interpreter's outputs bit for bit (annotation only).
"""

from __future__ import annotations

from typing import Any

from ds4c.ir.graph import Graph, Value
from ds4c.ir.verify import VerifyError

ALIGN = 256


def plan_memory(g: Graph, ctx: Any = None) -> Graph:
    """Return a copy of ``g`` annotated with the arena plan (see module docstring).

    Raises:
        VerifyError: a value that needs a slot has a symbolic shape.
    """
    g = g.clone()
    external = set(g.inputs.values()) | set(g.outputs.values())
    alias: dict[Value, Value] = {}
    for op in g.ops:
        if op.body is None and op.kind in ("reshape", "live_rows", "bucket_rows", "lane_rows"):
            src = op.inputs[0]
            alias[op.outputs[0]] = alias.get(src, src)
        elif op.body is None and op.kind == "concat_rows":
            for v in op.inputs:
                alias[v] = op.outputs[0]
    last_use: dict[Value, int] = {}
    for k, op in enumerate(g.ops):
        for v in op.inputs:
            last_use[alias.get(v, v)] = k
    slots: dict[str, list[int]] = {}
    free: list[tuple[int, int]] = []  # (offset, size) holes
    live: dict[Value, tuple[int, int]] = {}
    top = total = 0
    names: dict[str, int] = {}
    for k, op in enumerate(g.ops):
        if op.kind == "fused":
            for v in op.outputs:
                v = alias.get(v, v)
                if v in external or v not in last_use or v in live:
                    continue
                if not v.type.is_static:
                    raise VerifyError(f"plan_memory: {v!r} has a symbolic shape; run fix_verify_width and "
                                      f"pad_compressed_kv first")
                size = -(-v.type.nbytes() // ALIGN) * ALIGN
                total += size
                hole = next((h for h in free if h[1] >= size), None)
                if hole is not None:
                    free.remove(hole)
                    off = hole[0]
                    if hole[1] > size:
                        free.append((off + size, hole[1] - size))
                else:
                    off, top = top, top + size
                live[v] = (off, size)
                base = v.name or "v"
                n = names[base] = names.get(base, -1) + 1
                slots[base if n == 0 else f"{base}.{n}"] = [off, size]
        for v in [v for v, _ in live.items() if last_use.get(v, -1) <= k]:
            free.append(live.pop(v))
            free.sort()
            merged: list[tuple[int, int]] = []
            for off, size in free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + size)
                else:
                    merged.append((off, size))
            free = merged
    g.meta = {**g.meta, "memory": {"arena_bytes": top, "no_reuse_bytes": total, "slots": slots}}
    return g
