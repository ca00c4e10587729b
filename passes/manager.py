"""The pass manager: named passes, named pipelines, IR printing after any pass.

A pass is a function ``Graph -> Graph`` that returns a new graph and leaves its input valid. The manager
verifies the graph after every pass and records the pass names in ``meta["passes"]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ds4c.ir.graph import Graph
from ds4c.ir.verify import VerifyError, verify
from ds4c.passes.canonicalize import canonicalize
from ds4c.passes.fix_verify_width import fix_verify_width
from ds4c.passes.fuse_elementwise import fuse_elementwise
from ds4c.passes.fuse_hc import fuse_hc
from ds4c.passes.fuse_projections import fuse_projections
from ds4c.passes.pad_compressed_kv import pad_compressed_kv
from ds4c.passes.partition import partition
from ds4c.passes.plan_memory import plan_memory

Pass = Callable[[Graph], Graph]

PASSES: dict[str, Pass] = {
    "canonicalize": canonicalize,
    "fix_verify_width": fix_verify_width,
    "pad_compressed_kv": pad_compressed_kv,
    "fuse_hc": fuse_hc,
    "fuse_projections": fuse_projections,
    "fuse_elementwise": fuse_elementwise,
    "partition": partition,
    "plan_memory": plan_memory,
}

PIPELINES: dict[str, tuple[str, ...]] = {
    "default": ("canonicalize", "fix_verify_width", "pad_compressed_kv", "fuse_hc", "fuse_projections",
                "fuse_elementwise", "partition", "plan_memory"),
    "static": ("canonicalize", "fix_verify_width", "pad_compressed_kv"),
}

MAX_KERNELS_PER_LAYER = 11
"""After the default pipeline a layer has at most this many kernels: HC post+pre (with the router GEMV on
the FFN side), the attention-input multi-GEMV (with the KV norm/RoPE/fake-quant epilogue), the q-path
GEMV (q norm prologue; head RMS, RoPE and the indexer query epilogues), compressor, indexer, attention,
inverse RoPE + grouped wo_a (+ ring write), wo_b, the second HC, router top-k, experts. Tested."""


@dataclass
class PassRecord:
    name: str
    seconds: float
    top_ops: int
    leaf_ops: int


@dataclass
class PipelineResult:
    graph: Graph
    records: list[PassRecord] = field(default_factory=list)
    snapshots: dict[str, Graph] = field(default_factory=dict)
    """The graph after each pass named in ``print_after`` (print with :func:`ds4c.ir.print_graph`)."""


def run_pipeline(g: Graph, passes: Iterable[str] | str = "default", context: int | None = None,
                 print_after: Iterable[str] | str | None = None, check: bool = True) -> PipelineResult:
    """Run ``passes`` (a pipeline name, one pass name, or a sequence of pass names) on ``g``.

    Args:
        context: the context bucket (tokens) for ``pad_compressed_kv`` (stored in ``meta["context"]``).
        print_after: pass names (or ``"all"``) whose output graph is kept in ``snapshots``.
        check: verify after every pass.

    Raises:
        VerifyError: an unknown pass or pipeline, or a pass that leaves an invalid graph.
    """
    if isinstance(passes, str):
        names = PIPELINES.get(passes) or ((passes,) if passes in PASSES else None)
    else:
        names = tuple(passes)
    if names is None:
        raise VerifyError(f"unknown pipeline or pass {passes!r}: expected one of {sorted(PIPELINES)} or "
                          f"{sorted(PASSES)}")
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise VerifyError(f"unknown passes {unknown}: expected names from {sorted(PASSES)}")
    want = set(names) if print_after == "all" else set(print_after or ())
    if context is not None:
        g = g.clone()
        g.meta = {**g.meta, "context": int(context)}
    res = PipelineResult(g)
    for name in names:
        t0 = time.perf_counter()
        g = PASSES[name](g)
        dt = time.perf_counter() - t0
        g.meta = {**g.meta, "passes": tuple(g.meta.get("passes", ())) + (name,)}
        if check:
            try:
                verify(g)
            except VerifyError as e:
                raise VerifyError(f"after pass {name}: {e}") from None
        res.records.append(PassRecord(name, dt, len(g.ops), sum(1 for _ in g.leaf_ops())))
        if name in want:
            res.snapshots[name] = g
    res.graph = g
    return res
