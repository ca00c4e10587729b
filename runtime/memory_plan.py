"""The memory plan of the compiled step: what each device will hold, computed before any weight is loaded.

Everything is arithmetic on the model's tensor inventory and the lowered graphs (no device is touched except
to read its free memory, which the caller passes in): every weight in the form its kernels read it (stored
bytes for quantized tensors, fp32 / bf16 / int64 conversions otherwise), grouped by kind; the sequence state at
each context bucket (the step holds the largest); per shard the activation arena and HC boundary rows, the
logits buffer (last shard), and :data:`SHARD_OVERHEAD_BYTES` for CUDA graphs, kernel
modules, workspaces and allocator slack; each device's free memory less the headroom. The same numbers feed the
automatic layer split (:func:`memory_model`).

:func:`memory_plan` builds a :class:`MemoryPlan`; :meth:`MemoryPlan.describe` is what ``ds4c generate`` /
``bench`` print to stderr before loading and ``ds4c info MODEL --plan`` prints without a GPU;
:meth:`MemoryPlan.check` refuses, in one line naming the shortfall, a plan that does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ds4c.buckets import BucketSpec
from ds4c.gguf_file import ModelFile
from ds4c.ir.builder import MAX_LANE_ROWS
from ds4c.pages import default_page_tokens, lane_state_bytes, page_bytes
from ds4c.shard_plan import MemoryModel, ShardPlan, ShardPlanError

HEADROOM = 0.05
"""Fraction of each device's free memory the plan leaves unused (as :class:`ds4c.shard_plan.MemoryModel`)."""

KINDS = ("routed experts", "shared expert", "attention", "compressor+indexer", "router", "HC+norms",
         "embedding", "head")
"""Weight kinds of the plan, in print order."""

_SIZE = {"f32": 4, "bf16": 2, "i64": 8, "bool": 1, "u8": 1}


#: Per shard, beyond its weights, state and activation arena: CUDA graph instantiation, kernel modules,
#: workspaces and the caching allocator's slack (measured on the H200 at flash-l4: ~0.2 GiB; 0.5 GiB kept).
SHARD_OVERHEAD_BYTES = 512 << 20


def weight_kind(name: str) -> str:
    """The plan's kind (one of :data:`KINDS`) of GGUF tensor ``name``."""
    if name.startswith("token_embd"):
        return "embedding"
    if name.startswith("output"):
        return "head"
    if "_exps" in name:
        return "routed experts"
    if "_shexp" in name:
        return "shared expert"
    if "compressor" in name or "indexer" in name:
        return "compressor+indexer"
    if "ffn_gate_inp" in name or "exp_probs_b" in name or "tid2eid" in name:
        return "router"
    if ".hc_" in name or name.endswith((".attn_norm.weight", ".ffn_norm.weight")):
        return "HC+norms"
    return "attention"


@dataclass(frozen=True)
class Parts:
    """The plan's inputs for one (model, buckets, arch): exact bytes, before any placement.

    Attributes:
        weights: per GGUF tensor the kernels read: ``(layer or -1, kind, bytes)`` in the read form.
        state: per context bucket, per layer: the sequence state's bytes at that capacity.
        arena: the largest activation arena of the q = 1 and widest graphs (bytes); with prefill chunks, at least
            the widest chunk graph's arena plus its kernels' workspaces (the grouped experts' ``[C, k, D]``
            outputs, the quantized activations: they grow with C, the steps' stay in the fixed overhead).
        hc_rows: one HC boundary buffer (bf16 ``[max width, hc, hidden]``), bytes.
        logits: the logits buffer (fp32 ``[max width, vocab]``), bytes.
    """

    weights: dict[str, tuple[int, str, int]]
    state: dict[int, tuple[int, ...]]
    arena: int
    hc_rows: int
    logits: int


def plan_parts(mf: ModelFile, buckets: BucketSpec, arch: str = "sm_90", prefill_chunks: tuple[int, ...] = ()
               ) -> Parts:
    """The exact bytes of :class:`Parts` from the lowered q = 1 and widest graphs of the largest bucket (the
    same lowering the compiled step runs; sizes from the tensor inventory and types: nothing is read or
    generated), and with ``prefill_chunks`` the widest chunk graph (at the largest bucket)."""
    import numpy as np

    from ds4c.ir import build_step
    from ds4c.ir.builder import state_inputs
    from ds4c.passes.manager import run_pipeline
    from ds4c.quant import nbytes
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.targets import target

    cfg = mf.config
    types = {n: mf.ggml_type(n) for n in mf.specs}
    forms: dict[str, str] = {}
    arena = 0
    graphs = [(w, False) for w in sorted({min(buckets.widths), max(buckets.widths)})]
    if prefill_chunks:
        graphs.append((max(prefill_chunks), True))
    for w, chunk in graphs:
        g = run_pipeline(build_step(cfg, w, buckets.contexts[-1], prefill=chunk), "default",
                         context=buckets.contexts[-1]).graph
        ws: dict[str, int] = {}
        for k in lower_graph(g, cfg, target(arch), types):
            for la in k.launches:
                for a in la.args:
                    if a.kind == "weight":
                        forms[a.name] = a.form or "f32"
                    elif a.kind == "workspace" and chunk:
                        ws[a.name] = max(ws.get(a.name, 0), int(a.nbytes))
        arena = max(arena, int(g.meta["memory"]["arena_bytes"]) + sum(ws.values()))
    weights = {}
    for name, form in forms.items():
        spec = mf.specs[name]
        n = nbytes(types[name], spec.shape) if form == "raw" else spec.numel * _SIZE.get(form, 4)
        weights[name] = (spec.layer, weight_kind(name), int(n))
    state = {}
    for c in buckets.contexts:
        state[c] = tuple(sum(int(np.prod(t.shape)) * _SIZE.get(t.dtype, 4)
                             for t in state_inputs(cfg, c, (i, i + 1)).values()) for i in range(cfg.n_layers))
    maxq = max(buckets.widths)
    return Parts(weights, state, arena, maxq * cfg.hc_mult * cfg.hidden_size * 2, maxq * cfg.vocab_size * 4)


def memory_model(mf: ModelFile, buckets: BucketSpec, arch: str = "sm_90",
                 parts: Parts | None = None) -> MemoryModel:
    """The exact bytes the compiled step holds per layer on its device (``ds4c.shard_plan.MemoryModel``), from
    :func:`plan_parts` (or the given ``parts``): every weight in the form its kernels read it (from the lowered q = 1 and widest graphs of the largest bucket: stored bytes for quantized tensors,
    fp32 / bf16 / int64 conversions otherwise), the layer's sequence state at the largest bucket, the token
    embedding on the first shard, the head and logits on the last, and per shard the largest activation arena
    of its graphs, the HC boundary buffers and :data:`SHARD_OVERHEAD_BYTES`."""
    p = parts or plan_parts(mf, buckets, arch)
    per_layer = list(p.state[buckets.contexts[-1]])
    first = last = 0
    for _name, (layer, kind, n) in p.weights.items():
        if layer >= 0:
            per_layer[layer] += n
        elif kind == "embedding":
            first += n
        else:
            last += n
    return MemoryModel(tuple(per_layer), first_bytes=first, last_bytes=last + p.logits,
                       shard_bytes=p.arena + 2 * p.hc_rows + SHARD_OVERHEAD_BYTES)


def _gib(n: float) -> str:
    """Bytes as GiB (2 decimals), or MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class ShardNeed:
    """What one shard holds on its device (bytes) and what the device offers.

    ``weights``: kind -> bytes; ``state``: the sequence state at the largest bucket; ``arena``: activation arena
    plus the HC boundary buffers; ``logits``: the logits buffer (last shard); ``overhead``: CUDA graphs, kernel
    modules, workspaces, allocator slack; ``free``: the device's free memory (None: not known, e.g. no GPU)."""

    device: str
    layers: tuple[int, int]
    weights: dict[str, int]
    state: int
    arena: int
    logits: int
    overhead: int
    free: int | None
    headroom: float = HEADROOM

    @property
    def need(self) -> int:
        return sum(self.weights.values()) + self.state + self.arena + self.logits + self.overhead

    @property
    def usable(self) -> int | None:
        return None if self.free is None else int(self.free * (1.0 - self.headroom))

    @property
    def short(self) -> int:
        """Bytes missing on the device (0 when it fits or its free memory is unknown)."""
        return 0 if self.usable is None else max(0, self.need - self.usable)


@dataclass(frozen=True)
class MemoryPlan:
    """The memory plan of a compiled step (see the module docstring); data, printable, checkable.

    Attributes:
        model: the model's name (file path or synthetic identity); ``max_ctx``, ``contexts``: the buckets.
        weights: kind -> bytes over the whole model; ``state_by_bucket``: context -> state bytes of the whole
            model at that capacity (the step holds the largest); ``shards``: per shard its :class:`ShardNeed`.
        synthetic: the model is a synthetic source (the refusal suggests a smaller FORMATS of its spec).
    """

    model: str
    max_ctx: int
    contexts: tuple[int, ...]
    weights: dict[str, int]
    state_by_bucket: dict[int, int]
    shards: tuple[ShardNeed, ...]
    synthetic: bool = False
    hints: dict[str, Any] = field(default_factory=dict)
    pool: dict[str, int] = field(default_factory=dict)
    """The paged state pool of many sequences (docs/batching.md): ``page_tokens``, ``page_bytes`` (one page of every
    layer's compressed rows and indexer keys), ``lane_bytes`` (what a sequence holds beside its pages: rings and the
    compressors' partial state), ``sequence_bytes`` (one sequence of ``max_ctx``), and, on one device whose free
    memory is known, ``sequences``: how many sequences of ``max_ctx`` fit (the one the plan holds, plus what the
    memory left takes). The compiled step's batch keeps each sequence in a slot of the whole state at ``max_ctx``
    (no pages, docs/batching.md): ``slot_bytes``, and with known free memory ``slots``: how many fit, up to the
    16 a lanes step holds."""

    @property
    def need(self) -> int:
        return sum(s.need for s in self.shards)

    @property
    def fits(self) -> bool:
        """True unless a shard needs more than its device's usable free memory (unknown free memory fits)."""
        return all(s.short == 0 for s in self.shards)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (bytes as ints; ``fits`` is null when a shard's free memory is unknown and no known
        shard is short)."""
        return {"model": self.model, "max_ctx": self.max_ctx, "contexts": list(self.contexts),
                "weights": dict(self.weights), "state_by_bucket": {str(k): v for k, v in self.state_by_bucket.items()},
                "need": self.need,
                "fits": None if any(s.free is None for s in self.shards) and self.fits else self.fits,
                "pool": dict(self.pool),
                "shards": [{"device": s.device, "layers": list(s.layers), "weights": dict(s.weights),
                            "state": s.state, "arena": s.arena, "logits": s.logits, "overhead": s.overhead,
                            "need": s.need, "free": s.free, "usable": s.usable, "short": s.short}
                           for s in self.shards]}

    def describe(self) -> str:
        """The plan as a few lines of text (what the CLI prints to stderr before loading)."""
        g = _gib
        lines = [f"memory plan for {self.model} (max ctx {self.max_ctx}, buckets {self.contexts[0]}.."
                 f"{self.contexts[-1]}): needs {_gib(self.need)}"]
        w = sum(self.weights.values())
        lines.append(f"  weights {_gib(w)}: " + ", ".join(f"{k} {g(v)}" for k, v in self.weights.items() if v))
        lines.append("  state by bucket: " + ", ".join(f"{c} {g(v)}" for c, v in self.state_by_bucket.items())
                     + f" (held: {self.contexts[-1]})")
        if self.pool:
            pl = self.pool
            fit = f"; {pl['sequences']} such sequences fit" if "sequences" in pl else ""
            lines.append(f"  paged pool (lanes): pages of {pl['page_tokens']} tokens, {g(pl['page_bytes'])} each, "
                         f"+ {g(pl['lane_bytes'])} per sequence: a {self.max_ctx}-token sequence "
                         f"{g(pl['sequence_bytes'])}{fit}")
            if "slot_bytes" in pl:
                slots = f"; {pl['slots']} fit (a lanes step holds at most {MAX_LANE_ROWS})" if "slots" in pl else ""
                lines.append(f"  compiled lanes (--lanes on cuda): a slot of {g(pl['slot_bytes'])} per sequence (its "
                             f"whole {self.max_ctx} positions){slots}")
        for k, s in enumerate(self.shards):
            have = "free unknown" if s.free is None else (
                f"free {_gib(s.free)}, usable {_gib(s.usable)} ({s.headroom:.0%} headroom): "
                + (f"short {_gib(s.short)}" if s.short else f"fits, {_gib(s.usable - s.need)} left"))
            lines.append(f"  shard {k} {s.device} layers [{s.layers[0]},{s.layers[1]}): weights "
                         f"{g(sum(s.weights.values()))} + state {g(s.state)} + arena {g(s.arena)} + logits "
                         f"{g(s.logits)} + graphs/modules/slack {g(s.overhead)} = {_gib(s.need)}; {have}")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise ShardPlanError (one line) naming the shortfall of the worst shard when the plan does not fit:
        what it needs, what its device has free, by how much it is short, and what to try."""
        if self.fits:
            return
        s = max(self.shards, key=lambda x: x.short)
        where = f"{s.device}" if len(self.shards) == 1 else f"shard {self.shards.index(s)} (layers " \
                                                           f"[{s.layers[0]},{s.layers[1]})) on {s.device}"
        tries = []
        # synthetic models: the same preset in formats whose weights are smaller by at least the shortfall
        smaller = " or ".join(spec for spec, saved in self.hints.get("smaller_formats") or () if saved >= s.short)
        if smaller:
            tries.append(f"a smaller format ({smaller})")
        per = max(x.usable or 0 for x in self.shards)
        n_dev = math.ceil(self.need / per) if per else 0  # a lower bound: layers do not split finer
        if n_dev > len({x.device for x in self.shards}) and per > max(x.overhead for x in self.shards):
            tries.append(f"a layer split over at least {n_dev} such devices (--devices "
                         + ",".join(f"cuda:{i}" for i in range(min(n_dev, 2))) + ",...)")
        raise ShardPlanError(f"{self.model} does not fit: {where} needs {_gib(s.need)}, has {_gib(s.free)} free "
                             f"({_gib(s.usable)} usable, {s.headroom:.0%} headroom): short {_gib(s.short)}"
                             + (f"; try {' or '.join(tries)}" if tries else ""))


def _smaller_formats(mf: ModelFile) -> list[tuple[str, int]]:
    """For a synthetic model, ``(spec, bytes saved)`` of the same preset in each format whose weights are fewer
    bytes, smallest first (:meth:`MemoryPlan.check` names those that save at least the shortfall)."""
    if not getattr(mf, "generates_on_device", False):
        return []
    from ds4c.quant import nbytes
    from ds4c.tensors import FORMATS, storage_type

    def total(types: dict) -> int:
        return sum(nbytes(storage_type(s, types), s.shape) for s in mf.specs.values())

    mine = sum(nbytes(mf.ggml_type(n), s.shape) for n, s in mf.specs.items())
    sizes = sorted((total(types), f) for f, types in FORMATS.items())
    return [(f"synthetic:{mf.preset}:{f}", mine - n) for n, f in sizes if n < mine]


def memory_plan(mf: ModelFile, buckets: BucketSpec, plan: ShardPlan | None = None,
                free_bytes: list[int] | None = None, arch: str = "sm_90", parts: Parts | None = None) -> MemoryPlan:
    """The :class:`MemoryPlan` of the compiled step of ``mf`` serving ``buckets``.

    Args:
        plan: the layer split (None: the whole model on one device, named ``cuda``).
        free_bytes: each shard's device free memory (as :func:`ds4c.runtime.sharded.free_memory` returns it;
            None: unknown, the plan is printed without a verdict). Shards on one device share it: a shard's
            ``free`` is what the earlier shards on its device leave.
        parts: precomputed :func:`plan_parts` (else computed here).
    """
    p = parts or plan_parts(mf, buckets, arch)
    cfg = mf.config
    devices = ["cuda"] if plan is None else list(plan.devices)
    ranges = [(0, cfg.n_layers)] if plan is None else list(plan.ranges)
    if free_bytes is not None and len(free_bytes) != len(devices):
        raise ValueError(f"free memory of {len(free_bytes)} devices for {len(devices)} shards")
    held = p.state[buckets.contexts[-1]]
    shards = []
    used: dict[str, int] = {}  # shards sharing a device share its free memory: each gets what the earlier left
    for k, (dev, (a, b)) in enumerate(zip(devices, ranges)):
        kinds = {kind: 0 for kind in KINDS}
        for _name, (layer, kind, n) in p.weights.items():
            if (a <= layer < b) or (layer < 0 and (kind == "embedding" and a == 0 or
                                                   kind != "embedding" and b == cfg.n_layers)):
                kinds[kind] += n
        free = None if free_bytes is None else max(0, int(free_bytes[k]) - used.get(dev, 0))
        shards.append(ShardNeed(dev, (a, b), kinds, sum(held[a:b]), p.arena + 2 * p.hc_rows,
                                p.logits if b == cfg.n_layers else 0, SHARD_OVERHEAD_BYTES, free))
        used[dev] = used.get(dev, 0) + shards[-1].need
    total = {kind: sum(s.weights[kind] for s in shards) for kind in KINDS}
    return MemoryPlan(str(mf.path), buckets.max_ctx, tuple(buckets.contexts), total,
                      {c: sum(v) for c, v in p.state.items()}, tuple(shards),
                      synthetic=bool(getattr(mf, "generates_on_device", False)),
                      hints={"smaller_formats": _smaller_formats(mf)},
                      pool=_pool(cfg, buckets.max_ctx, shards, p.state[buckets.contexts[-1]]))


def _pool(cfg: Any, max_ctx: int, shards: list[ShardNeed], state: list[int]) -> dict[str, int]:
    """:attr:`MemoryPlan.pool` (the sequence and slot counts only for one shard whose device's free memory is
    known). ``state``: the whole model's state per layer at the largest bucket (a compiled lanes slot)."""
    pt = default_page_tokens(cfg)
    pb, lane = page_bytes(cfg, pt), lane_state_bytes(cfg)
    seq = -(-max_ctx // pt) * pb + lane
    out = {"page_tokens": pt, "page_bytes": pb, "lane_bytes": lane, "sequence_bytes": seq, "slot_bytes": sum(state)}
    if len(shards) == 1 and shards[0].usable is not None and not shards[0].short:
        left = shards[0].usable - shards[0].need
        out["sequences"] = 1 + left // seq
        out["slots"] = min(MAX_LANE_ROWS, left // max(out["slot_bytes"], 1))
    return out
