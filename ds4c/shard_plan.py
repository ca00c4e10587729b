"""The layer split of one model over devices: which contiguous layer range runs on which device
(docs/layer-split.md).

A :class:`ShardPlan` is data: ``devices`` (one per shard, in order) and ``layers`` (layers per shard, summing
to the model's ``n_layers``). Shard 0 embeds the tokens and expands them to the HC streams; every shard runs
its layers ``[start, stop)``; the boundary between shard k and k + 1 is the full HC state of the step's rows,
bf16 ``[q, hc_mult, hidden]`` (the reference's ``x``), nothing else; the last shard runs the HC head, the
final norm, the LM head and sampling. The same device may appear more than once (a *virtual* split, for
testing the handoff on one GPU or on the CPU).

:func:`auto_split` places layers from a memory plan (exact bytes per layer and per shard) against each
device's free memory; :func:`parse_plan` reads the command-line spelling (``--devices cuda:0,cuda:1
--layer-split 22,21``). The plan is hashed into artifacts (:meth:`ShardPlan.hash`), so an artifact compiled
for one split does not serve another.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ds4c.errors import Ds4cError

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class ShardPlanError(Ds4cError):
    """A device list or layer split that does not describe a valid plan (one line: expected vs found)."""


@dataclass(frozen=True)
class ShardPlan:
    """Contiguous layer ranges mapped to devices.

    Attributes:
        devices: one torch device string per shard (``"cpu"``, ``"cuda"``, ``"cuda:N"``), in layer order.
        layers: layers per shard (each >= 1), summing to ``n_layers``.
    """

    devices: tuple[str, ...]
    layers: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return sum(self.layers)

    @property
    def n_shards(self) -> int:
        return len(self.layers)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every shard."""
        out, a = [], 0
        for n in self.layers:
            out.append((a, a + n))
            a += n
        return out

    @property
    def kind(self) -> str:
        """``"cpu"`` or ``"cuda"``: plans never mix the two."""
        return "cpu" if self.devices[0] == "cpu" else "cuda"

    @property
    def is_split(self) -> bool:
        return self.n_shards > 1

    def as_dict(self) -> dict:
        return {"devices": list(self.devices), "layers": list(self.layers)}

    def hash(self) -> str:
        """sha256 of the layer ranges (what the compiled graphs depend on; the device ordinals are not part
        of it: an artifact compiled for ``cuda:0,cuda:1`` serves ``cuda:2,cuda:3`` with the same split)."""
        return hashlib.sha256(json.dumps({"layers": list(self.layers)}).encode()).hexdigest()

    def describe(self) -> str:
        """One line: ``cuda:0 [0,22) | cuda:1 [22,43)``."""
        return " | ".join(f"{d} [{a},{b})" for d, (a, b) in zip(self.devices, self.ranges))

    @classmethod
    def single(cls, device: str, n_layers: int) -> "ShardPlan":
        """The unsplit plan: every layer on ``device``."""
        return validate(cls((normalize_device(device),), (int(n_layers),)), n_layers)


def normalize_device(d: str) -> str:
    """``"cuda:0"`` / ``"cuda"`` / ``"cpu"`` checked and stripped.

    Raises:
        ShardPlanError: anything else.
    """
    s = str(d).strip()
    if not _DEVICE.match(s):
        raise ShardPlanError(f"device {d!r}: expected cpu, cuda or cuda:N")
    return s


def validate(plan: ShardPlan, n_layers: int) -> ShardPlan:
    """``plan`` when it is valid for a model of ``n_layers`` layers.

    Raises:
        ShardPlanError: no shard, a device string that is not cpu/cuda/cuda:N, cpu and cuda mixed, as many
            layer counts as devices not given, a count < 1, or counts not summing to ``n_layers``.
    """
    if not plan.devices:
        raise ShardPlanError("a shard plan needs at least one device")
    devices = tuple(normalize_device(d) for d in plan.devices)
    kinds = {"cpu" if d == "cpu" else "cuda" for d in devices}
    if len(kinds) > 1:
        raise ShardPlanError(f"devices {','.join(devices)}: expected all cpu or all cuda, found both")
    if len(plan.layers) != len(devices):
        raise ShardPlanError(f"layer split {','.join(map(str, plan.layers))}: expected {len(devices)} layer counts "
                             f"(one per device in {','.join(devices)}), found {len(plan.layers)}")
    bad = [n for n in plan.layers if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad:
        raise ShardPlanError(f"layer split {','.join(map(str, plan.layers))}: expected counts >= 1, found {bad[0]!r}")
    if sum(plan.layers) != n_layers:
        raise ShardPlanError(f"layer split {','.join(map(str, plan.layers))}: expected counts summing to the model's "
                             f"{n_layers} layers, found {sum(plan.layers)}")
    return ShardPlan(devices, tuple(int(n) for n in plan.layers))


def parse_plan(devices: str | Sequence[str] | None, layer_split: str | Sequence[int] | None, n_layers: int,
               default_device: str = "cpu", memory: "MemoryModel | None" = None,
               free_bytes: Sequence[int] | None = None) -> ShardPlan:
    """The plan the options ``--devices`` / ``--layer-split`` describe.

    Args:
        devices: comma-separated devices or a list (None: ``default_device`` alone).
        layer_split: comma-separated layer counts or a list; None: one device -> every layer on it; several
            -> :func:`auto_split` from ``memory`` and ``free_bytes`` (each device's free memory), or an even
            split when no memory model is given (the CPU reference: host memory is shared).
        n_layers: the model's layer count.

    Raises:
        ShardPlanError: a malformed list (one line, naming the option), or an invalid plan (:func:`validate`),
            or an automatic placement that does not fit (:func:`auto_split`).
    """
    if devices is None:
        devs = [default_device]
    elif isinstance(devices, str):
        devs = [d.strip() for d in devices.split(",")]
    elif isinstance(devices, (list, tuple)) and all(isinstance(d, str) for d in devices):
        devs = [d.strip() for d in devices]
    else:
        raise ShardPlanError(f"devices {devices!r}: expected a comma-separated string or a list of device strings "
                             f"such as ['cuda:0', 'cuda:1']")
    if not devs or any(not d for d in devs):
        raise ShardPlanError(f"--devices {devices!r}: expected a comma-separated list such as cuda:0,cuda:1")
    devs = [normalize_device(d) for d in devs]
    if layer_split is None:
        if len(devs) == 1:
            counts = [n_layers]
        elif memory is not None and free_bytes is not None:
            counts = auto_split(memory, list(free_bytes), devs)
        else:
            counts = even_split(n_layers, len(devs))
    else:
        counts = parse_counts(layer_split)
    return validate(ShardPlan(tuple(devs), tuple(counts)), n_layers)


_COUNT = re.compile(r"^[0-9]+$")


def parse_counts(layer_split: str | Sequence[int]) -> list[int]:
    """Layer counts from ``"22,21"`` or ``[22, 21]`` (ints; ASCII digits only in a string).

    Raises:
        ShardPlanError: an empty value, a count that is not a non-negative integer, or an unordered or
            non-sequence value (a set, a number).
    """
    if isinstance(layer_split, str):
        parts = [t.strip() for t in layer_split.split(",")]
        if not layer_split.strip() or any(not _COUNT.match(t) for t in parts):
            raise ShardPlanError(f"--layer-split {layer_split!r}: expected comma-separated layer counts such as "
                                 f"22,21")
        return [int(t) for t in parts]
    if not isinstance(layer_split, (list, tuple)):
        raise ShardPlanError(f"layer_split {layer_split!r}: expected a comma-separated string or a list of layer "
                             f"counts such as [22, 21]")
    if not layer_split:
        raise ShardPlanError("layer_split []: expected at least one layer count")
    bad = [n for n in layer_split if type(n) is not int]
    if bad:
        raise ShardPlanError(f"layer split {list(layer_split)}: expected integer layer counts, found {bad[0]!r}")
    return list(layer_split)


def even_split(n_layers: int, n_shards: int) -> list[int]:
    """``n_layers`` in ``n_shards`` contiguous ranges whose sizes differ by at most one (the larger first).

    Raises:
        ShardPlanError: more shards than layers.
    """
    if n_shards > n_layers:
        raise ShardPlanError(f"{n_shards} devices for {n_layers} layers: expected at most one device per layer")
    q, r = divmod(n_layers, n_shards)
    return [q + (1 if k < r else 0) for k in range(n_shards)]


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a shard needs on its device, from the exact per-layer sizes (the memory plan of the issue).

    Attributes:
        layer_bytes: per layer: its weights as the engine holds them plus its sequence state at the largest
            context bucket.
        first_bytes: shard 0 only (the token embedding table).
        last_bytes: the last shard only (HC head, final norm, LM head, logits and sampler buffers).
        shard_bytes: every shard (activation arena, workspaces, CUDA graphs, step buffers).
        headroom: fraction of each device's free memory left unused (allocator fragmentation, the CUDA
            context of other libraries).
    """

    layer_bytes: tuple[int, ...]
    first_bytes: int = 0
    last_bytes: int = 0
    shard_bytes: int = 0
    headroom: float = 0.05

    def need(self, start: int, stop: int) -> int:
        """Bytes of a shard running layers ``[start, stop)``."""
        n = sum(self.layer_bytes[start:stop]) + self.shard_bytes
        if start == 0:
            n += self.first_bytes
        if stop == len(self.layer_bytes):
            n += self.last_bytes
        return n


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def auto_split(memory: MemoryModel, free_bytes: list[int], devices: Sequence[str]) -> list[int]:
    """Layer counts per device such that every shard fits its device's free memory (less the headroom), and
    the largest fraction of a device used is as small as possible (a balanced split; contiguous ranges in
    device order). Exact: tries every split point by dynamic programming over (shard, first layer).

    Raises:
        ShardPlanError: no split fits: names the smallest shortfall (the shard, its device, bytes needed and
            free) of the best split found.
    """
    n, k = len(memory.layer_bytes), len(devices)
    if len(free_bytes) != k:
        raise ShardPlanError(f"free memory of {len(free_bytes)} devices given for {k} devices")
    if k > n:
        raise ShardPlanError(f"{k} devices for {n} layers: expected at most one device per layer")
    cap = [max(int(f * (1.0 - memory.headroom)), 1) for f in free_bytes]
    # best[s][a]: minimal max-fraction placing layers [a, n) on shards s..k-1, and the first shard's stop
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[-1] * (n + 1) for _ in range(k + 1)]
    best[k][n] = 0.0
    for s in range(k - 1, -1, -1):
        for a in range(n - 1, -1, -1):
            remaining = k - s - 1
            for b in range(a + 1, n - remaining + 1):
                if best[s + 1][b] == inf:
                    continue
                frac = memory.need(a, b) / cap[s]
                v = max(frac, best[s + 1][b])
                if v < best[s][a]:
                    best[s][a], cut[s][a] = v, b
    if best[0][0] <= 1.0:
        counts, a = [], 0
        for s in range(k):
            b = cut[s][a]
            counts.append(b - a)
            a = b
        return counts
    # report the shortfall of the most balanced split (ignoring the fit)
    counts = even_split(n, k) if best[0][0] == inf else None
    if counts is None:
        counts, a = [], 0
        for s in range(k):
            b = cut[s][a]
            counts.append(b - a)
            a = b
    worst, a = None, 0
    for s, c in enumerate(counts):
        need = memory.need(a, a + c)
        short = need - cap[s]
        if worst is None or short > worst[0]:
            worst = (short, s, devices[s], a, a + c, need, cap[s])
        a += c
    _short, s, dev, a, b, need, have = worst
    total = sum(memory.need(x, y) for x, y in _ranges(counts))
    raise ShardPlanError(f"the model does not fit {','.join(devices)}: shard {s} (layers [{a},{b}) on {dev}) needs "
                         f"{_gib(need)}, {_gib(have)} usable ({memory.headroom:.0%} headroom kept); all shards "
                         f"need {_gib(total)}, the devices have {_gib(sum(cap))}")


def _ranges(counts: list[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    return out
