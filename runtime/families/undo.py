"""The undo family: a verify step's rollback as one kernel (docs/model.md section 6, Rollback): it costs
what was rejected, not the size of the state. Template:
``templates/undo/rollback.cu.j2`` (its header says what is and is not restored, and why).

A verify step (q >= 2) saves, as it goes, only what it overwrites that a later step may read:

* the grouped ``wo_a`` kernel (``GroupedSpec.ring_undo``) saves the old window-ring row of every slot it
  overwrites into the workspace ``l{i}.ring_undo`` (bf16 ``[MAX_WIDTH, head_dim]``);
* each ratio-4 compressor kernel (``CompressorSpec.undo``) saves the whole 8-slot state before its first row
  and the slot values each row writes into ``l{i}.comp_undo`` / ``l{i}.idx_undo`` (fp32
  ``[16 W + 2 MAX_WIDTH W]``, W = 2d);
* each ratio > 4 compressor kernel saves the old kv and score of every slot it overwrites into
  ``l{i}.comp_undo`` (fp32 ``[2 MAX_WIDTH W]``, W = d): a rejected row of the next block overwrites a slot of
  the current block, whose flush (rejected too) still needs it.

The rollback kernel (one launch per verify graph, lowered with it as the plan kernel ``rollback`` and bound,
not run, by the executor) puts back the ring rows and the ratio > 4 state slots of rejected rows and rebuilds
each ratio-4 state as it was after the accepted rows. Its only runtime input besides the verify's ``pos`` is the step scalar ``accepted``.
It moves ~(q - accepted) x head_dim x 2 bytes per layer plus 16-26 W floats per ratio-4 compressor: microseconds,
against a verify step of milliseconds; no state is copied before a verify.

Numerics: copies only; the rebuilt state is bit for bit the state the verify's own kernels left after its
accepted rows (``reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4c.config import MAX_WIDTH, Ds4Config
from ds4c.runtime.families import Launch
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target

TEMPLATE = "undo/rollback.cu.j2"
FAMILY = "undo"
THREADS = 256


def ring_undo_bytes(cfg: Ds4Config) -> int:
    """Bytes of one layer's ring-undo workspace: MAX_WIDTH rows of head_dim bf16 (the same for every width,
    so all verify graphs share one buffer per layer)."""
    return MAX_WIDTH * cfg.head_dim * 2


def compressor_undo_floats(ratio: int, width: int) -> int:
    """fp32 elements of a compressor's undo workspace with state width ``width``: ratio 4 (W = 2d): the 8-slot
    kv and score state (16 W), then kv and score of up to MAX_WIDTH rows (2 MAX_WIDTH W); ratio > 4 (W = d):
    the old kv and score of up to MAX_WIDTH overwritten slots (2 MAX_WIDTH W)."""
    return (16 * width if ratio == 4 else 0) + 2 * MAX_WIDTH * width


def workspace_name(layer: int, what: str) -> str:
    """``l{layer}.ring_undo`` / ``l{layer}.comp_undo`` / ``l{layer}.idx_undo``."""
    return f"l{layer}.{what}_undo"


@dataclass(frozen=True)
class RollbackSpec:
    """The rollback kernel of one verify graph (all render-time).

    Attributes:
        q: the verify width (2..5). window: ring slots; kv_width: ring row width (head_dim).
        rings: layers whose ring it restores (all the graph's layers).
        comps: ``(ratio, state width W)`` of each compressor it restores, in argument order.
    """

    q: int
    window: int
    kv_width: int
    rings: int
    comps: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        bad = []
        if not 2 <= self.q <= MAX_WIDTH:
            bad.append(f"q {self.q} (expected 2..{MAX_WIDTH}: a verify step)")
        if self.window < self.q:
            bad.append(f"window {self.window} (expected >= q)")
        if self.rings < 1:
            bad.append(f"rings {self.rings} (expected >= 1)")
        if any(r < 4 or r % 4 or w < 1 for r, w in self.comps):
            bad.append(f"comps {self.comps} (expected (ratio 4 or a multiple of 4, width >= 1) pairs)")
        if bad:
            raise RenderError(f"RollbackSpec: bad {'; '.join(bad)}")


def render_rollback(spec: RollbackSpec, target: Target, name: str) -> KernelSource:
    """The rollback kernel of ``spec`` for ``target``."""
    if THREADS % target.wave:
        raise RenderError(f"rollback {name}: block size {THREADS} is not a multiple of {target.slug}'s wave")
    return render(TEMPLATE, name, FAMILY, target, {"q": spec.q, "threads": THREADS, "window": spec.window,
                                                   "kv_width": spec.kv_width, "rings": spec.rings,
                                                   "comps": [{"ratio": r, "width": w} for r, w in spec.comps]})


def launch_shape(spec: RollbackSpec) -> Launch:
    """One block per ring and per ratio-4 compressor, 256 threads."""
    return Launch((spec.rings + len(spec.comps), 1, 1), (THREADS, 1, 1), 0)


def arg_names(spec: RollbackSpec) -> list[str]:
    """``pos, accepted``, then ``ring{i}, ring_undo{i}`` per ring, then ``kv{k}, score{k}, undo{k}``."""
    return (["pos", "accepted"] + [f"{a}{i}" for i in range(spec.rings) for a in ("ring", "ring_undo")]
            + [f"{a}{k}" for k in range(len(spec.comps)) for a in ("kv", "score", "undo")])


def reference(spec: RollbackSpec, pos: int, accepted: int, rings: list[tuple[torch.Tensor, torch.Tensor]],
              comps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[list, list]:
    """What the kernel leaves, in torch: per ring ``(ring, ring_undo)`` the restored ring; per compressor ``(kv,
    score, undo)`` the rebuilt (ratio 4) or restored (ratio > 4: needs ``kv`` / ``score``) ``(kv, score)``.
    Inputs are not modified."""
    out_r = []
    for ring, undo in rings:
        r = ring.clone()
        for i in range(accepted, spec.q):
            r[(pos + i) % spec.window] = undo[i]
        out_r.append(r)
    out_c = []
    for (kv, sc, undo), (ratio, w) in zip(comps, spec.comps):
        if ratio != 4:
            k, s = kv.clone(), sc.clone()
            old = undo.view(-1, 2, w)
            for i in range(spec.q - 1, accepted - 1, -1):
                slot = (pos + i) % ratio
                k[slot], s[slot] = old[i, 0], old[i, 1]
            out_c.append((k, s))
            continue
        k = undo[:8 * w].view(8, w).clone()
        s = undo[8 * w:16 * w].view(8, w).clone()
        rows = undo[16 * w:].view(-1, 2, w)
        for i in range(accepted):
            p = pos + i
            slot = 4 + p % 4
            k[slot], s[slot] = rows[i, 0], rows[i, 1]
            if (p + 1) % 4 == 0:
                k[:4], s[:4] = k[4:].clone(), s[4:].clone()
        out_c.append((k, s))
    return out_r, out_c
