"""The tap family: the DSpark taps of one step (docs/model.md 5.2(q); docs/drafter.md "Taps") as one
small kernel, the lowering of the IR op ``dspark_tap`` (``ds4c.ir.builder.build_step(..., taps=...)``). Template:
``templates/tap/dspark_tap.cu.j2`` (its header gives the block layout and the numerics).

For each step row r (position t = pos + r) and each tapped layer k of the graph, with its HC state ``x_k`` (bf16
``[q, hc, D]``, the layer's output streams, an activation of the step), the kernel writes the bf16 mean over the
``hc`` streams into the tap ring (bf16 ``[window, n_taps * D]``, a state buffer the step updates in place): row
``t % window``, columns of the layer's slot ``[slot * D, (slot + 1) * D)``. A row holds ``main_hidden(t)`` (the taps
concatenated in the drafter's order) once every slot is written; a shard of a layer split writes the slots of its
layers only.

Cost: it reads ``q * n_x * hc * D`` bf16 (q = 5, 3 taps, D = 4096: 480 KiB, L2-resident: the streams were just
written) and writes ``q * n_x * D`` bf16, in one launch of ``q * n_x * ceil(D / 512)`` blocks of 64 threads: a
microsecond-scale kernel, once per step.

Numerics: bit for bit the reference's ``x.mean(dim=-2)`` (torch: the fp32 sum of the streams in order, divided by
``hc``, rounded to bf16 once), checked against it and against the IR op on the CPU emulation of the kernel
(tests/test_taps.py).

Copy mode (``TapSpec(copy=True)``), the lowering of the IR op ``record_hc`` (``build_step(..., record_hc=True)``;
spec 7.5's ``X_main``, the MTP drafter's input): the same kernel with no mean: for each step row r at position t, the
row's whole HC state (bf16 ``[hc, D]``, the last layer's output streams, the HC head's input) is copied bit for bit
into row ``t % window`` of the final HC ring (bf16 ``[window, hc, D]``, here ``window`` = its row count, the model's
window + MAX_WIDTH). One slot of ``hc * D`` columns; ``q * ceil(hc * D / 512)`` blocks (q = 5, hc = 4, D = 4096:
160 KiB read and written). Checked on the CPU emulation and against the IR op in tests/test_mtp_compiled.py.

Prefill chunks (``TapSpec(valid=True)``, docs/prefill.md; either mode): q = C rows (any C, also > window), the kernel
also takes ``n_valid`` (i64 [1], device, after ``pos``) and only rows ``n_valid - window <= i < n_valid`` write (R =
``window``, the ring's rows): padded rows write nothing, and of the valid rows only the last R, one writer per ring
slot (no race when C > R), which leaves the ring exactly as token-wise decoding leaves it (the IR ops write rows
``0 .. n_valid - 1`` in order; the last writer of a slot is the one that stays). The grid covers only ``min(C, R)``
rows: block row ``j`` is row ``i = n_valid - min(C, R) + j``, skipped when ``i < 0`` (the same rule as
``RowChainSpec.ring_valid``, runtime/families/rowchain.py, without the blocks that would exit). ``valid=False``
renders the decode / verify kernel byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4c.runtime.families import Launch
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target

TEMPLATE = "tap/dspark_tap.cu.j2"
FAMILY = "tap"
THREADS = 64  # one wave on wave-64 targets, two on wave-32 ones
VECS = (8, 4, 2, 1)  # bf16 per thread, widest first (8 = 16-byte loads)


@dataclass(frozen=True)
class TapSpec:
    """One tap launch (all render-time).

    Attributes:
        q: rows of the step (1..window; any with ``valid``). hidden: D. hc: HC streams (a power of two). window: ring rows.
        n_taps: taps of ``main_hidden`` (ring width ``n_taps * D``).
        slots: the ring slot of each HC state the launch reads, in argument order (distinct, < n_taps).
        layers: the layer of each (for the source's comments only; default the slots).
        copy: copy mode (module docstring): the ring is bf16 ``[window, hc * D]`` (``n_taps`` 1, ``slots``
            ``(0,)``) and each row's ``[hc, D]`` streams are copied, not averaged.
        valid: a prefill chunk (module docstring): ``q`` any number of rows, a device ``n_valid`` argument after
            ``pos``, only the last ``window`` valid rows write. False renders the decode kernel byte for byte.
    """

    q: int
    hidden: int
    hc: int
    window: int
    n_taps: int
    slots: tuple[int, ...]
    layers: tuple[int, ...] = ()
    copy: bool = False
    valid: bool = False

    def __post_init__(self) -> None:
        bad = []
        if self.copy and (self.n_taps, tuple(self.slots)) != (1, (0,)):
            bad.append(f"copy mode with n_taps {self.n_taps}, slots {list(self.slots)} (expected one slot: 1, (0,))")
        if self.valid and (self.q < 1 or self.window < 1):
            bad.append(f"q {self.q} / window {self.window} (expected >= 1)")
        if not self.valid and not 1 <= self.q <= self.window:
            bad.append(f"q {self.q} (expected 1..window {self.window}: the step's ring rows must be distinct)")
        if self.hidden < 1:
            bad.append(f"hidden {self.hidden} (expected >= 1)")
        if self.hc < 1 or self.hc & (self.hc - 1):
            bad.append(f"hc {self.hc} (expected a power of two: the mean's 1/hc must be exact)")
        if not self.slots or len(set(self.slots)) != len(self.slots) or \
                any(not 0 <= s < self.n_taps for s in self.slots):
            bad.append(f"slots {list(self.slots)} (expected distinct slots in 0..n_taps-1 = {self.n_taps - 1})")
        if self.layers and len(self.layers) != len(self.slots):
            bad.append(f"layers {list(self.layers)} (expected one per slot {list(self.slots)})")
        if bad:
            raise RenderError(f"TapSpec: bad {'; '.join(bad)}")

    @property
    def row(self) -> int:
        """bf16 of one slot of a ring row: D (mean mode) or hc * D (copy mode)."""
        return self.hc * self.hidden if self.copy else self.hidden

    @property
    def vec(self) -> int:
        """bf16 per thread: the widest of 8, 4, 2, 1 dividing :attr:`row`."""
        return next(v for v in VECS if self.row % v == 0)

    @property
    def chunks(self) -> int:
        """Blocks per (row, tap): ceil(row / (THREADS * vec))."""
        return -(-self.row // (THREADS * self.vec))

    def params(self) -> dict:
        return {"q": self.q, "hc": 1 if self.copy else self.hc, "hidden": self.row, "n_x": len(self.slots),
                "ring_width": self.n_taps * self.row, "window": self.window, "threads": THREADS, "vec": self.vec,
                "slots": list(self.slots), "layers": list(self.layers or self.slots), "copy": self.copy,
                "streams": self.hc, "inv_hc_lit": float(1.0 / self.hc).hex() + "f",
                **({"valid": True, "grid_rows": self.grid_rows} if self.valid else {})}

    @property
    def grid_rows(self) -> int:
        """Rows the grid covers: ``q``; with ``valid`` ``min(q, window)`` (only the last ``window`` valid rows write)."""
        return min(self.q, self.window) if self.valid else self.q


def render_tap(spec: TapSpec, target: Target, name: str) -> KernelSource:
    """The tap kernel of ``spec`` for ``target``.

    Raises:
        RenderError: the block size is not a multiple of the target's wave.
    """
    if THREADS % target.wave:
        raise RenderError(f"tap {name}: block size {THREADS} is not a multiple of {target.slug}'s wave {target.wave}")
    return render(TEMPLATE, name, FAMILY, target, spec.params())


def launch_shape(spec: TapSpec) -> Launch:
    """One block of 64 threads per (row, tap, chunk of ``64 * vec`` dims): grid ``q * len(slots) * chunks``
    (``valid``: ``min(q, window)`` rows, :attr:`TapSpec.grid_rows`)."""
    return Launch((spec.grid_rows * len(spec.slots) * spec.chunks, 1, 1), (THREADS, 1, 1), 0)


def arg_names(spec: TapSpec) -> list[str]:
    """``pos``, (``n_valid`` with ``valid``), ``x0 .. x{n-1}`` (one per slot), ``ring``."""
    return ["pos"] + (["n_valid"] if spec.valid else []) + [f"x{k}" for k in range(len(spec.slots))] + ["ring"]


def reference(spec: TapSpec, pos: int, xs: list[torch.Tensor], ring: torch.Tensor,
              n_valid: int | None = None) -> torch.Tensor:
    """What the kernel leaves in ``ring`` (bf16 ``[window, n_taps * row]``, not modified): for each row r and each
    ``xs[k]`` (bf16 ``[q, hc, D]``), row ``(pos + r) % window``, slot ``slots[k]``, = ``xs[k][r].mean(-2)``, as
    the reference model records its taps (``ds4c.reference.model.Reference._step``); in copy mode ``xs[0][r]``
    flattened (``[hc * D]``), as the reference records ``final_hc_rows``. With ``n_valid`` (``valid`` specs) rows
    ``0 .. n_valid - 1`` only, written in order (later rows overwrite earlier ones of the same slot), as the IR
    ops with ``n_valid`` do.

    Raises:
        ValueError: ``xs`` not one bf16 ``[q, hc, D]`` tensor per slot, ``ring`` not bf16 ``[window, n_taps * row]``,
            or ``n_valid`` given to a spec without ``valid`` (or not in 0..q).
    """
    want = (spec.q, spec.hc, spec.hidden)
    if len(xs) != len(spec.slots) or any(x.dtype != torch.bfloat16 or tuple(x.shape) != want for x in xs):
        raise ValueError(f"tap reference: expected {len(spec.slots)} bf16 {list(want)} HC states, found "
                         f"{[(str(x.dtype), list(x.shape)) for x in xs]}")
    if ring.dtype != torch.bfloat16 or tuple(ring.shape) != (spec.window, spec.n_taps * spec.row):
        raise ValueError(f"tap reference: expected a bf16 ring [{spec.window}, {spec.n_taps * spec.row}], found "
                         f"{ring.dtype} {list(ring.shape)}")
    if n_valid is not None and not (spec.valid and 0 <= n_valid <= spec.q):
        raise ValueError(f"tap reference: n_valid {n_valid} (expected a valid spec and 0..q = {spec.q})")
    rows = spec.q if n_valid is None else n_valid
    out = ring.clone()
    D = spec.row
    for s, x in zip(spec.slots, xs):
        m = x.flatten(1) if spec.copy else x.mean(dim=-2)
        for r in range(rows):
            out[(pos + r) % spec.window, s * D:(s + 1) * D] = m[r]
    return out
