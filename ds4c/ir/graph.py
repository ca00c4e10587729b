"""ds4c's step IR: a typed SSA graph of ops on tensor values.

* :class:`Sym` is a symbolic dimension: the verify width ``q`` until ``fix_verify_width`` specialises it,
  and the live compressed-row spans (``n_r4``, ``n_r128``, ...) that grow with the position until
  ``pad_compressed_kv`` replaces them by bucket capacities.
* :class:`Value` is defined exactly once, by a graph input or by one op output.
* :class:`Op` has a ``kind`` from the op registry (:mod:`ds4c.ir.ops`), input values, attributes, output
  values and the layer it belongs to (-1 = embedding/head). A ``fused`` op groups a convex set of ops
  (its ``body``) into one unit that later becomes one kernel; the body ops keep their own values, so the
  interpreter runs a fused op by running its body, bit for bit as before fusion.
* :class:`Graph` holds named inputs (token ids, position, live lengths, state buffers), ops in topological
  order and named outputs (logits and the updated state buffers).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Union


@dataclass(frozen=True)
class Sym:
    """A symbolic dimension (printed as its name)."""

    name: str

    def __str__(self) -> str:
        return self.name


Dim = Union[int, Sym]
DTYPES = ("bf16", "f32", "i64", "bool", "u8", "handle")


@dataclass(frozen=True)
class TensorType:
    """Shape (ints or :class:`Sym`) and dtype (one of :data:`DTYPES`; ``handle`` = an opaque weight bank,
    e.g. the routed experts of a layer, read by index)."""

    shape: tuple[Dim, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: expected one of {DTYPES}")

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def syms(self) -> set[Sym]:
        return {d for d in self.shape if isinstance(d, Sym)}

    def nbytes(self) -> int:
        """Bytes of a static tensor of this type (handles count 0)."""
        if not self.is_static:
            raise ValueError(f"nbytes of a symbolic type {self}")
        n = 1
        for d in self.shape:
            n *= d  # type: ignore[operator]
        return n * {"bf16": 2, "f32": 4, "i64": 8, "bool": 1, "u8": 1, "handle": 0}[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


_ids = itertools.count()


@dataclass(eq=False)
class Value:
    """An SSA value. ``producer`` is None for graph inputs."""

    type: TensorType
    name: str = ""
    producer: "Op | None" = None
    id: int = field(default_factory=lambda: next(_ids))

    def __repr__(self) -> str:
        return f"%{self.name or self.id}:{self.type}"


@dataclass(eq=False)
class Op:
    """One operation. ``body`` is set for ``fused`` ops only (the grouped ops, topologically ordered)."""

    kind: str
    inputs: list[Value]
    outputs: list[Value]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int = -1
    body: list["Op"] | None = None

    def walk(self) -> Iterator["Op"]:
        """This op's leaf ops: itself, or the leaves of its body."""
        if self.body is None:
            yield self
        else:
            for o in self.body:
                yield from o.walk()

    def __repr__(self) -> str:
        return f"Op({self.kind}, layer={self.layer}, {len(self.inputs)} in, {len(self.outputs)} out)"


@dataclass(eq=False)
class Graph:
    """A step graph. ``meta`` records the config name, width, max_ctx and the passes applied."""

    inputs: dict[str, Value]
    ops: list[Op]
    outputs: dict[str, Value]
    meta: dict[str, Any] = field(default_factory=dict)

    def leaf_ops(self) -> Iterator[Op]:
        for op in self.ops:
            yield from op.walk()

    def users(self) -> dict[Value, list[Op]]:
        """Value -> the top-level ops that read it."""
        out: dict[Value, list[Op]] = {}
        for op in self.ops:
            for v in op.inputs:
                out.setdefault(v, []).append(op)
        return out

    def clone(self) -> "Graph":
        """A deep structural copy with new values and ops (attrs shared, they are immutable), so a pass can
        rewrite its copy freely while the input graph stays valid."""
        vmap: dict[Value, Value] = {}

        def v(x: Value) -> Value:
            if x not in vmap:
                vmap[x] = Value(x.type, x.name)
            return vmap[x]

        def cp(op: Op) -> Op:
            new = Op(op.kind, [v(x) for x in op.inputs], [v(x) for x in op.outputs], dict(op.attrs), op.layer,
                     None if op.body is None else [cp(b) for b in op.body])
            for o in new.outputs:
                o.producer = new
            return new

        inputs = {k: v(x) for k, x in self.inputs.items()}
        ops = [cp(o) for o in self.ops]
        # body outputs that are also fused-op outputs: the fused op is their top-level producer, the body
        # op their leaf producer; keep the leaf producer for values defined inside bodies
        for op in ops:
            if op.body is not None:
                for leaf in op.walk():
                    for o in leaf.outputs:
                        o.producer = leaf
        return Graph(inputs, ops, {k: v(x) for k, x in self.outputs.items()}, dict(self.meta))
