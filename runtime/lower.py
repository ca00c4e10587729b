"""Lower a partitioned graph (its kernel plan) to launches of the kernel families: the entry point.

:func:`lower_graph` hands a prefill chunk graph (``meta["prefill"]``) to :mod:`ds4c.runtime.lower_prefill` and
every other graph (decode, verify, the DSpark drafter's) to :mod:`ds4c.runtime.lower_step`; both return the records
of :mod:`ds4c.runtime.lowered`. The executor resolves their bindings to device pointers; the artifact stores them.

Data flows one way: the lowering reads the graph and the config and renders templates; it knows nothing of
devices, caches or files.
"""

from __future__ import annotations

from ds4c.config import Ds4Config
from ds4c.ir.graph import Graph
from ds4c.quant import GGMLType
from ds4c.runtime.lowered import LoweredKernel, LoweringError
from ds4c.runtime.lower_prefill import lower_prefill
from ds4c.runtime.lower_step import lower_step
from ds4c.runtime.targets import Target


def lower_graph(g: Graph, cfg: Ds4Config, target: Target,
                weight_types: dict[str, GGMLType] | None = None, pending: list | None = None) -> list[LoweredKernel]:
    """The launches of every plan kernel of ``g`` (after the default pipeline) for ``target``.

    Args:
        weight_types: GGUF storage type per weight name (default: the official formats of ``cfg``).

        pending: prefill chunk graphs only (``meta["prefill"]``, :mod:`ds4c.runtime.lower_prefill`): a list that
            receives a :class:`~ds4c.runtime.lower_prefill.PendingKernel` for every plan kernel whose C-row
            kernel is not written yet (the routed experts, ...) instead of raising on the first; the kernels that
            do lower are returned. Ignored for decode / verify graphs.

    Raises:
        LoweringError: a plan kernel whose pattern no family implements (or the graph was not partitioned); for
            a prefill chunk graph without ``pending``, the first plan kernel whose C-row kernel is pending.
    """
    if "partition" not in g.meta.get("passes", ()):
        raise LoweringError("lower_graph needs a partitioned graph (run the default pipeline first)")
    if g.meta.get("prefill"):
        return lower_prefill(g, cfg, target, weight_types, pending)
    return lower_step(g, cfg, target, weight_types)
