"""The compiled step's per-step scalars: one int64 device buffer the kernels read (position, live compressed rows,
the rows' positions and tokens, a rollback's accepted rows, the rows a device-side acceptance may keep, a prefill
chunk's real rows), written through pinned host buffers and uploaded in one copy per step, so a captured graph
replays with new values."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class StepScalars:
    """The step buffer: its layout, two pinned host copies used in turn, and the device buffer.

    Args:
        cfg: the model's config (the compression ratios of its layers give the ``live_r{r}`` scalars).
        rows: the most rows a step has (the widest width or prefill chunk): the length of ``positions`` and
            ``tokens``.
        dev: the step's CUDA device.

    Attributes: ``ratios`` (the compression ratios, ascending), ``offsets`` (scalar name -> index: ``pos``,
    ``live_r{r}``, ``positions``, ``tokens``, ``accepted``, ``keep``, ``n_valid``), ``buffer`` (the device int64
    buffer the kernels read).
    """

    def __init__(self, cfg: Any, rows: int, dev: torch.device):
        # step buffer: [pos, live_r..., positions (rows), tokens (rows), accepted, keep, n_valid]
        self.ratios: list[int] = sorted({r for r in cfg.compress_ratios[: cfg.n_layers] if r})
        off = {"pos": 0}
        for k, r in enumerate(self.ratios):
            off[f"live_r{r}"] = 1 + k
        off["positions"] = 1 + len(self.ratios)
        off["tokens"] = off["positions"] + rows
        off["accepted"] = off["tokens"] + rows  # a rollback's accepted rows (undo family)
        off["keep"] = off["accepted"] + 1  # the most rows a device-side acceptance keeps
        off["n_valid"] = off["keep"] + 1  # a prefill chunk's real rows (the rest is padding)
        self.offsets: dict[str, int] = off
        n_step = off["n_valid"] + 1
        self._hosts = [torch.zeros(n_step, dtype=torch.int64).pin_memory() for _ in range(2)]
        # numpy views of the same pinned memory: the per-step scalars are written through them (a torch
        # element assignment costs microseconds: ~110 us per q=5 upload, measured on the H200)
        self._np = [h.numpy() for h in self._hosts]
        self._done = [torch.cuda.Event() for _ in range(2)]
        self._turn = 0
        self.buffer = torch.zeros(n_step, dtype=torch.int64, device=dev)

    def upload(self, tokens: list[int], pos: int, rows: int | None = None) -> None:
        """Write the step's scalars into the pinned host buffer and copy them to the device (one copy);
        ``rows``: a prefill chunk's row count (:meth:`fill`)."""
        # two pinned host buffers used in turn; a buffer is rewritten only after its last copy has run
        self._turn ^= 1
        h, done = self._hosts[self._turn], self._done[self._turn]
        done.synchronize()
        self.fill(self._np[self._turn], tokens, pos, rows=rows)
        self.buffer.copy_(h, non_blocking=True)  # the one upload of the step
        done.record()

    def upload_accepted(self, accepted: int) -> None:
        """Upload a rollback's ``accepted`` rows into the ``accepted`` slot (the other scalars, the verify's, stay)."""
        self._turn ^= 1
        h, done = self._hosts[self._turn], self._done[self._turn]
        done.synchronize()
        off = self.offsets["accepted"]
        h[off] = int(accepted)
        self.buffer[off:off + 1].copy_(h[off:off + 1], non_blocking=True)
        done.record()

    def fill(self, a: np.ndarray, tokens: list[int], pos: int, keep: int | None = None,
             rows: int | None = None) -> None:
        """Write a step's scalars (``pos``, ``live_r`` = (pos + q) // r, the rows' positions and tokens, ``keep``,
        the most rows a device-side acceptance may keep: default all, and ``n_valid`` = q) into ``a``, an int64
        numpy view of a host copy of the step buffer (layout :attr:`offsets`). ``rows`` (a prefill chunk of C >= q
        rows): the padded rows q..C-1 get positions pos + q .. pos + C - 1 and token 0 (computed, never kept: the
        chunk's kernels write no state past ``n_valid``)."""
        q, off = len(tokens), self.offsets
        n = q if rows is None else rows
        a[off["pos"]] = pos
        a[off["keep"]] = q if keep is None else keep
        a[off["n_valid"]] = q
        for r in self.ratios:
            a[off[f"live_r{r}"]] = (pos + q) // r
        a[off["positions"]:off["positions"] + n] = range(pos, pos + n)
        a[off["tokens"]:off["tokens"] + q] = tokens
        a[off["tokens"] + q:off["tokens"] + n] = 0

    def token_slot(self) -> torch.Tensor:
        """The device view of the next step's first token id (int64 [1])."""
        return self.buffer[self.offsets["tokens"]:self.offsets["tokens"] + 1]
