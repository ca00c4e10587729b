"""The state of the one sequence a compiled step runs: every tensor a step reads and writes that belongs to the
sequence (per layer the attention window ring, the compressors' and the indexer's state; the drafters' rings the
target writes: the DSpark tap ring and the final HC ring), the sequence's position, how far the rings were written,
and the rollback journal of the last verify step.

The tensors are allocated once, at the step's capacity (its largest context bucket), on the step's device; the
captured graphs are bound to them, so :meth:`StepSequence.reset` and :meth:`StepSequence.restore` write them in
place and never replace one.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.ir.builder import FINAL_HC_RING, TAP_RING, final_hc_ring_type, state_inputs, tap_ring_type
from ds4c.runtime.step.binding import DTYPES


class StepSequence:
    """One sequence's device state (module docstring).

    Args:
        cfg: the model's config.
        capacity: positions the state buffers hold (the largest context bucket).
        layers: the layer range ``(start, stop)`` whose state this step holds (a shard of a split: its own).
        n_taps: the DSpark taps every step records (the tap ring's width is ``n_taps * hidden``); 0: no tap ring
            (also for a shard that holds none of the tap layers).
        final_hc: whether the step records the final HC state (a ring of ``window + MAX_WIDTH`` rows).
        dev: the step's CUDA device.

    Attributes:
        buffers: buffer name (as the graphs' state inputs name it, ``l{i}.ring``...) -> device tensor.
        pos: the sequence's next position.
        tap_end: one past the highest position any step wrote (into the tap and final HC rings).
        undo: the rollback journal of the last verify step, or None: ``("kernel", step graph, tokens, pos)`` (its
            rollback kernel undoes it from what it saved itself) or ``("snapshot", snapshot, tokens, pos)``.
    """

    def __init__(self, cfg: Any, capacity: int, layers: tuple[int, int], n_taps: int, final_hc: bool,
                 dev: torch.device):
        self.cfg, self.dev = cfg, dev
        self.specs = state_inputs(cfg, capacity, layers)
        if n_taps:  # the tap ring is state too: bound by name, in snapshots, reset with the sequence
            self.specs[TAP_RING] = tap_ring_type(cfg, n_taps)
        if final_hc:  # so is the final HC ring
            self.specs[FINAL_HC_RING] = final_hc_ring_type(cfg)
        self.buffers: dict[str, torch.Tensor] = {}
        self.pos = 0
        self.tap_end = 0
        self.undo: tuple | None = None

    def reset(self) -> None:
        """A new sequence: every buffer back to its initial value (KV 0, compressor scores -inf), allocated on
        first use; position 0. The current device must be the step's."""
        for name, t in self.specs.items():
            buf = self.buffers.get(name)
            if buf is None:
                buf = self.buffers[name] = torch.empty(tuple(t.shape), dtype=DTYPES[t.dtype], device=self.dev)
            buf.fill_(float("-inf") if name.endswith("_score") else 0)
        self.pos = 0
        self.tap_end = 0

    def advance(self, pos: int, written: int | None = None) -> None:
        """The sequence now ends at ``pos`` (its next position), its rings written up to ``written`` (exclusive;
        default ``pos``)."""
        self.pos = pos
        self.tap_end = max(self.tap_end, pos if written is None else written)

    def snapshot(self) -> dict[str, Any]:
        """A device copy of every buffer, the position and how far the rings were written."""
        return {"pos": self.pos, "tap_end": self.tap_end, "state": {k: v.clone() for k, v in self.buffers.items()}}

    def restore(self, snap: dict[str, Any]) -> None:
        """Copy a :meth:`snapshot` back (in place: captured graphs keep pointing at the same buffers)."""
        for k, v in snap["state"].items():
            self.buffers[k].copy_(v)
        self.pos = snap["pos"]
        self.tap_end = snap.get("tap_end", self.tap_end)

    # ------------------------------------------------------------------------------------ the drafters' rings
    @property
    def tap_ring(self) -> torch.Tensor | None:
        """The DSpark tap ring, bf16 ``[window, n_taps * hidden]`` (row ``t % window``: ``main_hidden(t)``), or
        None."""
        return self.buffers.get(TAP_RING)

    @property
    def final_hc_ring(self) -> torch.Tensor | None:
        """The final HC ring, bf16 ``[window + MAX_WIDTH, hc, hidden]`` (row ``t % rows``), or None."""
        return self.buffers.get(FINAL_HC_RING)

    def tap_rows(self, start: int, stop: int) -> torch.Tensor:
        """The tap ring rows of the committed positions ``start .. stop - 1`` (a copy).

        Raises:
            StepError: no tap ring, non-int positions, or a range outside the committed positions the ring still
                holds: ``max(0, tap_end - window) <= start <= stop <= pos``.
        """
        ring = self.tap_ring
        if ring is None:
            raise StepError("main_hidden: this compiled step records no taps")
        start, stop = _positions("main_hidden", start, stop)
        lo = max(0, self.tap_end - self.cfg.window)
        if not lo <= start <= stop <= self.pos:
            raise StepError(f"main_hidden: positions {start}..{stop - 1} are not committed positions held by the tap "
                            f"ring: expected a range inside {lo}..{self.pos - 1} (the sequence is at position "
                            f"{self.pos}; the ring keeps the last {self.cfg.window} positions written)")
        idx = torch.arange(start, stop, device=self.dev) % self.cfg.window
        return ring.index_select(0, idx)

    def final_hc(self, start: int, stop: int) -> torch.Tensor:
        """The final HC ring rows of the committed positions ``start .. stop - 1`` (a copy).

        Raises:
            StepError: no final HC ring, non-int positions, or a range outside the newest committed positions the
                ring holds: ``lo <= start <= stop <= pos`` with ``lo = max(0, pos - window, tap_end - rows)``.
        """
        ring = self.final_hc_ring
        if ring is None:
            raise StepError("final_hc: this compiled step records no final HC state")
        start, stop = _positions("final_hc", start, stop)
        rows = int(ring.shape[0])
        lo = max(0, self.pos - self.cfg.window, self.tap_end - rows)
        if not lo <= start <= stop <= self.pos:
            raise StepError(f"final_hc: positions {start}..{stop - 1} are not committed positions held by the final "
                            f"HC ring: expected a range inside {lo}..{self.pos - 1} (the sequence is at position "
                            f"{self.pos}; the ring keeps the newest {self.cfg.window} committed positions)")
        idx = torch.arange(start, stop, device=self.dev) % rows
        return ring.index_select(0, idx)


def _positions(what: str, start: Any, stop: Any) -> tuple[int, int]:
    """``start``, ``stop`` as ints. Raises StepError (naming ``what``) for anything but ints (a bool included)."""
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (start, stop)):
        raise StepError(f"{what}: expected int positions, found {start!r}, {stop!r}")
    return int(start), int(stop)
