"""Per-sequence state of a DeepSeek-V4-Flash decode (docs/model.md section 4).

Per layer: the window ring (``window`` rows of head_dim bf16, row of position t at slot t mod window);
for compressing layers the compressed rows (row j = block j) and the main compressor's fp32 ``kv_state`` /
``score_state``; for ratio-4 layers the indexer keys and the indexer compressor's state. ``pos`` is the
number of tokens processed.

A state may hold a contiguous range of layers only (a shard of a layer split, :mod:`ds4c.reference.sharded`):
``layers`` then holds layers ``first .. first + len(layers) - 1`` in order; :meth:`SequenceState.layer` takes
the model's layer index.

Every write goes through :meth:`SequenceState.write`, which keeps an undo journal per verify row while a
step is open, so :meth:`SequenceState.rollback` can return the state to "the accepted prefix only", bit for
bit, as sequential decoding of that prefix would have left it (spec section 6, Rollback).
:meth:`snapshot` / :meth:`restore` copy the whole state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.config import Ds4Config
from ds4c.errors import StepError
from ds4c.reference.primitives import act_dtype
from ds4c.shard_plan import ShardPlanError

BF16, F32 = torch.bfloat16, torch.float32


@dataclass
class CompressorState:
    """fp32 ``kv`` and ``score`` [slots, c*d]: ratio 4 -> 8 slots (rows 0-3 previous block, 4-7 current),
    ratio r > 4 -> r slots (row t mod r). Initial kv 0, score -inf."""

    kv: torch.Tensor
    score: torch.Tensor

    @classmethod
    def empty(cls, ratio: int, width: int, device: torch.device) -> "CompressorState":
        slots = 8 if ratio == 4 else ratio
        return cls(torch.zeros(slots, width, dtype=F32, device=device),
                   torch.full((slots, width), float("-inf"), dtype=F32, device=device))


@dataclass
class LayerState:
    ring: torch.Tensor  # bf16 [window, hd]
    comp: torch.Tensor | None = None  # bf16 [max_ctx // ratio, hd]
    comp_state: CompressorState | None = None
    idx_keys: torch.Tensor | None = None  # bf16 [max_ctx // 4, index_head_dim]
    idx_state: CompressorState | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = [self.ring]
        for t in (self.comp, self.idx_keys):
            if t is not None:
                out.append(t)
        for s in (self.comp_state, self.idx_state):
            if s is not None:
                out += [s.kv, s.score]
        return out


@dataclass
class SequenceState:
    """The state of one sequence. Create with :meth:`new`; ``max_ctx`` bounds the positions it can hold.

    ``layers[j]`` is the state of the model's layer ``first + j`` (``first`` is 0 and ``layers`` holds every
    layer unless the state was made for a layer range)."""

    config: Ds4Config
    max_ctx: int
    layers: list[LayerState]
    pos: int = 0
    first: int = 0
    _journal: list[list[tuple[torch.Tensor, Any, torch.Tensor]]] | None = field(default=None, repr=False)
    _journal_pos: int = 0
    #: this sequence's final HC ring in a batch (``Reference.step_lanes`` records every row of its lane there, as
    #: ``Reference.record_final_hc`` does for the reference's own sequence): None unless a drafter asked for it
    final_hc_rows: torch.Tensor | None = field(default=None, repr=False)
    #: this sequence's DSpark tap rows in a batch (act dtype ``[max_ctx, len(tap_layers), hidden]``, row ``pos``:
    #: spec 5.2(q)'s mean over the HC streams after each layer of ``tap_layers``; ``Reference.step_lanes`` writes
    #: them as ``Reference.set_taps`` does for the reference's own sequence): None unless a drafter asked for them
    tap_rows: torch.Tensor | None = field(default=None, repr=False)
    tap_layers: tuple[int, ...] = field(default=(), repr=False)

    @classmethod
    def new(cls, cfg: Ds4Config, max_ctx: int, device: str | torch.device = "cpu",
            layers: tuple[int, int] | None = None) -> "SequenceState":
        """A reset state (all KV zero, compressor scores -inf, pos 0).

        Args:
            layers: ``(start, stop)``: state for layers ``start .. stop - 1`` only (a shard); None: every layer.

        Raises:
            StepError: ``max_ctx`` < 1 or above the config's max_position.
            ShardPlanError: ``layers`` not a range with ``0 <= start < stop <= n_layers``.
        """
        if not 1 <= max_ctx <= cfg.max_position:
            raise StepError(f"max_ctx must be in 1..{cfg.max_position}, found {max_ctx}")
        start, stop = check_layer_range(layers, cfg.n_layers)
        dev = torch.device(device)
        act = act_dtype()  # KV ring and compressed KV hold activations (bf16 in the spec's dataflow)
        out = []
        for i in range(start, stop):
            r = cfg.ratio(i)
            ls = LayerState(ring=torch.zeros(cfg.window, cfg.head_dim, dtype=act, device=dev))
            if r:
                c = 2 if r == 4 else 1
                ls.comp = torch.zeros(max(max_ctx // r, 1), cfg.head_dim, dtype=act, device=dev)
                ls.comp_state = CompressorState.empty(r, c * cfg.head_dim, dev)
            if r == 4:
                ls.idx_keys = torch.zeros(max(max_ctx // 4, 1), cfg.index_head_dim, dtype=act, device=dev)
                ls.idx_state = CompressorState.empty(4, 2 * cfg.index_head_dim, dev)
            out.append(ls)
        return cls(cfg, max_ctx, out, first=start)

    @property
    def layer_range(self) -> tuple[int, int]:
        """``(start, stop)``: the model's layers this state holds."""
        return self.first, self.first + len(self.layers)

    def layer(self, i: int) -> LayerState:
        """The state of the model's layer ``i``.

        Raises:
            StepError: layer ``i`` is not in this state's range.
        """
        j = i - self.first
        if not 0 <= j < len(self.layers):
            raise StepError(f"layer {i}: this state holds layers [{self.first},{self.first + len(self.layers)})")
        return self.layers[j]

    # ---------------------------------------------------------------------------------------------
    def begin_step(self, rows: int) -> None:
        """Open a step of ``rows`` rows: earlier journals are committed, a fresh journal starts."""
        self._journal = [[] for _ in range(rows)]
        self._journal_pos = self.pos

    def write(self, buf: torch.Tensor, index: Any, value: torch.Tensor, row: int) -> None:
        """``buf[index] = value``, journaled under verify row ``row``."""
        if self._journal is not None:
            self._journal[row].append((buf, index, buf[index].clone()))
        buf[index] = value

    def rollback(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the last step and undo the rest (spec 6, Rollback).

        Raises:
            StepError: no step is open, or ``accepted`` is outside 0..rows.
        """
        if self._journal is None:
            raise StepError("rollback: no verify step to roll back (already committed or rolled back)")
        rows = len(self._journal)
        if not 0 <= accepted <= rows:
            raise StepError(f"rollback: accepted must be in 0..{rows}, found {accepted}")
        for entries in reversed(self._journal[accepted:]):
            for buf, index, old in reversed(entries):
                buf[index] = old
        self.pos = self._journal_pos + accepted
        self._journal = None

    def snapshot(self) -> "SequenceState":
        """A deep copy of the state (tensors cloned; the journal is not copied)."""
        layers = []
        for ls in self.layers:
            cp = lambda s: None if s is None else CompressorState(s.kv.clone(), s.score.clone())  # noqa: E731
            layers.append(LayerState(ls.ring.clone(), None if ls.comp is None else ls.comp.clone(),
                                     cp(ls.comp_state), None if ls.idx_keys is None else ls.idx_keys.clone(),
                                     cp(ls.idx_state)))
        return SequenceState(self.config, self.max_ctx, layers, self.pos, self.first)

    def to(self, device: str | torch.device) -> "SequenceState":
        """A copy of the state on ``device`` (the journal is not copied)."""
        snap = self.snapshot()
        for ls in snap.layers:
            ls.ring = ls.ring.to(device)
            ls.comp = None if ls.comp is None else ls.comp.to(device)
            ls.idx_keys = None if ls.idx_keys is None else ls.idx_keys.to(device)
            for cs in (ls.comp_state, ls.idx_state):
                if cs is not None:
                    cs.kv, cs.score = cs.kv.to(device), cs.score.to(device)
        return snap

    def restore(self, snap: "SequenceState") -> None:
        """Copy ``snap`` (from :meth:`snapshot` of a state of the same shape) back into this state.

        Raises:
            StepError: ``snap`` is of another model, max_ctx or layer range.
        """
        if snap.config != self.config or snap.max_ctx != self.max_ctx:
            raise StepError("restore: snapshot is of another model or max_ctx")
        if snap.layer_range != self.layer_range:
            raise StepError(f"restore: snapshot holds layers [{snap.layer_range[0]},{snap.layer_range[1]}), this "
                            f"state [{self.layer_range[0]},{self.layer_range[1]})")
        for dst, src in zip(self.layers, snap.layers):
            for a, b in zip(dst.tensors(), src.tensors()):
                a.copy_(b)
        self.pos = snap.pos
        self._journal = None

    def equal(self, other: "SequenceState") -> bool:
        """True when both states hold the same layers, bit-identical tensors and the same position."""
        return self.pos == other.pos and self.layer_range == other.layer_range and all(
            torch.equal(a, b) for la, lb in zip(self.layers, other.layers)
            for a, b in zip(la.tensors(), lb.tensors()))


def check_layer_range(layers: tuple[int, int] | None, n_layers: int) -> tuple[int, int]:
    """``(start, stop)`` of ``layers`` (None: ``(0, n_layers)``).

    Raises:
        ShardPlanError: not two ints with ``0 <= start < stop <= n_layers``.
    """
    if layers is None:
        return 0, n_layers
    try:
        start, stop = layers
    except (TypeError, ValueError):
        raise ShardPlanError(f"layer range {layers!r}: expected (start, stop)") from None
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, stop)) or not 0 <= start < stop <= n_layers:
        raise ShardPlanError(f"layer range {layers!r}: expected ints 0 <= start < stop <= {n_layers}")
    return int(start), int(stop)
