"""The IR verifier: single definition, defined-before-use (hence acyclic), known op kinds with their
required attributes, types equal to what each op's inference gives, well-formed fused ops, defined outputs.
"""

from __future__ import annotations

from ds4c.errors import Ds4cError
from ds4c.ir.graph import Graph, Op, Value
from ds4c.ir.ops import OPS


class VerifyError(Ds4cError):
    """The graph breaks an IR invariant; the message names the op and what is wrong."""


def verify(g: Graph) -> None:
    """Check ``g``; raises :class:`VerifyError` on the first broken invariant."""
    defined: set[Value] = set()

    def define(v: Value, where: str) -> None:
        if v in defined:
            raise VerifyError(f"value {v!r} defined twice (again by {where})")
        defined.add(v)

    for name, v in g.inputs.items():
        define(v, f"input {name}")

    def check(op: Op, visible: set[Value]) -> None:
        for k, v in enumerate(op.inputs):
            if v not in visible:
                if v in defined:
                    raise VerifyError(f"{op.kind} (layer {op.layer}) input {k} {v!r} is not visible here: it is "
                                      f"defined inside a fused op that does not export it, or outside the fused op "
                                      f"that reads it without being one of that op's inputs")
                raise VerifyError(f"{op.kind} (layer {op.layer}) input {k} {v!r} is used before it is defined")
        if op.body is not None:
            if op.kind != "fused" or not op.body:
                raise VerifyError(f"op {op.kind} has a body; only non-empty 'fused' ops may")
            inner = set(op.inputs)
            for b in op.body:
                check(b, inner)
                inner.update(b.outputs)
            for o in op.outputs:
                if not any(o in b.outputs for b in op.walk()):
                    raise VerifyError(f"fused op output {o!r} is not produced by its body")
            return
        d = OPS.get(op.kind)
        if d is None:
            raise VerifyError(f"unknown op kind {op.kind!r}")
        missing = [a for a in d.attrs if a not in op.attrs]
        if missing:
            raise VerifyError(f"{op.kind} (layer {op.layer}) misses attributes {missing}")
        try:
            want = d.infer([v.type for v in op.inputs], op.attrs)
        except Exception as e:  # inference rejects the input types
            raise VerifyError(f"{op.kind} (layer {op.layer}): type inference failed: {e}") from None
        if len(want) != len(op.outputs):
            raise VerifyError(f"{op.kind} (layer {op.layer}) has {len(op.outputs)} outputs, expected {len(want)}")
        for o, t in zip(op.outputs, want):
            if o.type != t:
                raise VerifyError(f"{op.kind} (layer {op.layer}) output {o!r} has type {o.type}, inferred {t}")
            define(o, op.kind)

    # a fused op's body values stay inside its kernel: only its outputs are visible to later ops and as
    # graph outputs (a reader of an unexported body value would have no buffer to read)
    visible = set(g.inputs.values())
    for op in g.ops:
        check(op, visible)
        visible.update(op.outputs)
    for name, v in g.outputs.items():
        if v not in defined:
            raise VerifyError(f"graph output {name!r} is not defined")
        if v not in visible:
            raise VerifyError(f"graph output {name!r} ({v!r}) is defined inside a fused op that does not "
                              f"export it")
