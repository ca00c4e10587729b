"""The compressor kernel family: the ``compress`` IR op (docs/model.md 5.3, P1, P3-P5, P7) for the q rows of
a step, as one CUDA/HIP kernel. Template: ``templates/compressor/compress.cu.j2`` (its header describes the
thread layout).

What one launch computes: for every compressor ``k`` of the launch (block ``k``; a layer's main and indexer
compressors are launched together) and each row ``i`` in order (position ``p = pos[0] + i``): store ``v[i]`` and
``g[i] + ape[p % r]`` into state slot ``4 + p % 4`` (ratio 4) or ``p % r``; when ``(p + 1) % r == 0`` pool the
slots per feature (softmax over the score column), RMSNorm, RoPE at ``p + 1 - r``, then FP8 fake-quant of the
first ``nope`` dims (main) or Hadamard + FP4 fake-quant (indexer), and write compressed row ``p // r``. The
ratio-4 state shift (rows 4-7 -> 0-3) happens at each flush, so a second flush within the step sees it. State
(``kv``, ``score``) and ``rows`` are updated in place; ``pos`` is read from device memory (int64 scalar), so a
captured graph replays with new positions.

Kernel arguments, in order (:func:`arg_names`); pointers are device pointers of contiguous tensors:

* ``pos``: int64 [>= 1], the position of row 0 (only ``pos[0]`` is read);
* per compressor ``k`` (the order of ``specs``): ``v{k}`` fp32 [q, c*d]; ``g{k}`` fp32 [q, c*d] (the gate
  projection *without* ``ape``); ``ape{k}`` fp32 [r, c*d]; ``norm{k}`` fp32 [d]; ``kv{k}`` fp32 [slots, c*d];
  ``score{k}`` fp32 [slots, c*d]; ``rows{k}`` bf16 [>= (pos+q) // r, d] (row j at offset ``j*d``; the caller
  guarantees the capacity); ``freqs{k}`` fp32 [rope_dim / 2] (the layer's RoPE table, P6).

with ``c = 2`` for ratio 4 (overlap) else 1 and ``slots = 8`` (ratio 4) or ``r``.

Numerics (against :func:`reference`): the fp32 state is bit-exact (copies and one fp32 add). The pooled vector
differs from torch's by fp32 rounding (torch's CPU softmax uses its own vectorized exp; sums in another
order; fused multiply-adds in the sums), so a bf16 rounding of ``cvec``, of the RMSNorm or RoPE output, or of
the Hadamard output can differ by one ulp at a rounding boundary; after the fake-quants such an element can
differ by one quantization step (and a block whose amax moved across a power of two by one scale step).
RoPE's four products are rounded separately (no FMA), as in the reference; cos/sin are the vendor's accurate
(non-fast-math) functions, not torch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

TEMPLATE = "compressor/compress.cu.j2"
FAMILY = "compressor"
STATIC_SMEM_LIMIT = 48 * 1024
MAX_THREADS = 1024
ARGS_PER_COMPRESSOR = ("v", "g", "ape", "norm", "kv", "score", "rows", "freqs")


@dataclass(frozen=True)
class CompressorSpec:
    """One compressor of a launch (all render-time).

    Attributes:
        ratio: r: 4 (overlapping, CSA) or a multiple of 4 >= 8 (HCA: 128 official, 16 in the tiny preset).
        d: output width (512 main, 128 indexer; 192 main in the tiny preset).
        indexer: True: Hadamard + FP4 (indexer keys); False: FP8 on the first ``nope`` dims (KV rows).
        emulate: apply the fake-quants (the config's ``quant_emulation``).
        nope: FP8 fake-quantized leading dims of a main row (d - rope_dim), a multiple of 64; unused for an
            indexer.
        rope_dim: RoPE on the last ``rope_dim`` dims (64), even, >= 2.
        q: rows per launch (1..5 for verify steps; any >= 1).
        eps: RMSNorm epsilon (1e-6).
        slots: state rows; 0 = automatic (8 for ratio 4, else ratio). Given, it must equal that.
        width: state row width c*d; 0 = automatic (2d for ratio 4, else d). Given, it must equal that.
        undo: also save what a verify step's rollback needs into ``undo{k}`` (``runtime/families/undo.py``):
            ratio 4: the state before row 0 and each row's slot values (the state after any prefix is rebuilt
            from them); ratio > 4: the old values of each overwritten slot.
        valid: a prefill chunk (docs/prefill.md): the launch takes a device-side ``n_valid`` (i64 [1], after ``pos``)
            and processes rows ``0 .. min(q, n_valid) - 1`` only, so padded rows write no state, no flush and
            no compressed row. Every compressor of one launch must agree; False renders the decode / verify
            kernel byte for byte as before.
    """

    ratio: int
    d: int
    indexer: bool
    emulate: bool
    nope: int
    rope_dim: int
    q: int
    eps: float = 1e-6
    slots: int = 0
    width: int = 0
    undo: bool = False
    valid: bool = False

    def __post_init__(self) -> None:
        bad = []
        r, d = self.ratio, self.d
        if self.valid and self.undo:
            bad.append("valid with undo (a prefill chunk is never rolled back)")
        if r < 4 or r % 4:
            bad.append(f"ratio {r} (expected 4 or a multiple of 4 >= 8)")
        if d < 32 or d % 32:
            bad.append(f"d {d} (expected a positive multiple of 32)")
        if self.rope_dim < 2 or self.rope_dim % 2 or self.rope_dim > d:
            bad.append(f"rope_dim {self.rope_dim} (expected even, 2..d)")
        if self.indexer:
            if d & (d - 1) or d < 64:
                bad.append(f"indexer d {d} (expected a power of two >= 64: Hadamard on one wave, FP4 blocks of 32)")
        elif self.emulate and (self.nope < 0 or self.nope % 64 or self.nope > d):
            bad.append(f"nope {self.nope} (expected a multiple of 64 <= d: FP8 blocks of 64)")
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if not self.eps > 0:
            bad.append(f"eps {self.eps} (expected > 0)")
        if bad:
            raise RenderError(f"CompressorSpec: bad {'; '.join(bad)}")
        for name, want in (("slots", self.state_slots), ("width", self.state_width)):
            got = getattr(self, name)
            if got and got != want:
                raise RenderError(f"CompressorSpec: {name} {got} does not match ratio {r}, d {d} (expected {want})")
        object.__setattr__(self, "slots", self.state_slots)
        object.__setattr__(self, "width", self.state_width)

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    @property
    def state_slots(self) -> int:
        return 8 if self.ratio == 4 else self.ratio

    @property
    def state_width(self) -> int:
        return (2 if self.ratio == 4 else 1) * self.d

    def flushes(self, pos: int) -> list[int]:
        """Rows (0..q-1) of a step at ``pos`` that finish a block."""
        return [i for i in range(self.q) if (pos + i + 1) % self.ratio == 0]

    def bytes_moved(self, pos: int) -> int:
        """Global-memory bytes a launch at ``pos`` reads and writes for this compressor (each touched byte once;
        the ratio > 4 pooling re-reads the score state from cache): per row v, g, ape (reads) and the kv/score
        slot (writes); per flush the pooled state, the ratio-4 shift, norm, freqs and the bf16 row."""
        w = self.state_width
        n = self.q * (3 * w + 2 * w) * 4
        for _ in self.flushes(pos):
            n += 2 * (8 if self.overlap else self.ratio) * self.d * 4  # pooled kv + score columns
            if self.overlap:
                n += 4 * 4 * w * 4 - 2 * 4 * self.d * 4  # shift: read rows 4-7 (half already read), write rows 0-3
            n += self.d * 4 + self.rope_dim // 2 * 4 + self.d * 2
        return n + 8


def _float_literal(x: float) -> str:
    """C float literal of fp32(x) (9 significant digits round-trip a float)."""
    return f"{float(torch.tensor(x, dtype=torch.float32)):.9e}f"


def _check_q(specs: Sequence[CompressorSpec]) -> int:
    if not specs:
        raise RenderError("compressor launch: expected at least one CompressorSpec")
    qs = {s.q for s in specs}
    if len(qs) != 1:
        raise RenderError(f"compressor launch: every compressor of one launch needs the same q, found {sorted(qs)}")
    return qs.pop()


def block_threads(specs: Sequence[CompressorSpec], threads: int = 0) -> int:
    """Block size of a launch: ``threads`` if given (a multiple of 64, <= 1024), else 1024 when a compressor
    of ratio >= 64 and d <= 512 is in the launch (its pooling splits the slots in two), else 512 for d > 256,
    else 256. Multiples of 64 suit waves of 32 and 64."""
    _check_q(specs)
    if threads:
        if threads % 64 or not 64 <= threads <= MAX_THREADS:
            raise RenderError(f"compressor launch: threads {threads} (expected a multiple of 64 in 64..{MAX_THREADS})")
        return threads
    dmax = max(s.d for s in specs)
    if any(s.ratio >= 64 and 2 * s.d <= MAX_THREADS for s in specs):
        return MAX_THREADS
    return 512 if dmax > 256 else 256


def split_of(spec: CompressorSpec, threads: int) -> int:
    """Slot groups of a ratio > 4 pooling: the largest power of two ``s`` with ``s * d <= threads``,
    ``ratio % s == 0`` and ``ratio / s >= 8`` (1 for ratio 4)."""
    if spec.overlap:
        return 1
    s = 1
    while 2 * s * spec.d <= threads and spec.ratio % (2 * s) == 0 and spec.ratio // (2 * s) >= 8:
        s *= 2
    return s


def _hscale(d: int) -> float:
    return d ** -0.5


def smem_bytes(specs: Sequence[CompressorSpec], threads: int, wave: int = 32) -> int:
    """Static shared memory of a launch (bytes)."""
    dmax = max(s.d for s in specs)
    ropemax = max(s.rope_dim for s in specs)
    partmax = max([s.d * split_of(s, threads) for s in specs if split_of(s, threads) > 1] or [0])
    return 4 * (dmax + 2 * ropemax + threads // wave + 3 * partmax)


def params(specs: Sequence[CompressorSpec], threads: int = 0) -> dict[str, Any]:
    """Render parameters of a launch."""
    q = _check_q(specs)
    nt = block_threads(specs, threads)
    comps = []
    for s in specs:
        sp = split_of(s, nt)
        comps.append({"ratio": s.ratio, "d": s.d, "indexer": s.indexer, "emulate": s.emulate,
                      "nope": s.nope if (s.emulate and not s.indexer) else 0, "rope_dim": s.rope_dim,
                      "eps_lit": _float_literal(s.eps), "hscale_lit": _float_literal(_hscale(s.d)), "split": sp,
                      "undo": s.undo})
    splits = [c["d"] * c["split"] for c in comps if c["split"] > 1]
    valid = {s.valid for s in specs}
    if len(valid) > 1:
        raise RenderError("compressor launch: every spec must agree on valid (one n_valid argument per launch)")
    return {"threads": nt, "q": q, "comps": comps, **({"valid": True} if True in valid else {}), "dmax": max(s.d for s in specs),
            "ropemax": max(s.rope_dim for s in specs), "partmax": max(splits or [0])}


# ------------------------------------------------------------------------------------------------- rendering
def render_compressor(specs: Sequence[CompressorSpec] | CompressorSpec, target: Target, name: str,
                      threads: int = 0) -> KernelSource:
    """The kernel of one launch of ``specs`` (block k = compressor k) for ``target``.

    Raises:
        RenderError: empty list, mixed q, a block size that is not a multiple of the target's wave, an indexer
            width the target's wave cannot hold (d / wave must be 1..32), or too much shared memory.
    """
    if isinstance(specs, CompressorSpec):
        specs = [specs]
    return render(TEMPLATE, name, FAMILY, target, _checked_params(list(specs), target, name, threads))


def _checked_params(specs: list[CompressorSpec], target: Target, name: str, threads: int) -> dict[str, Any]:
    """:func:`params` of a launch after the target's limits: raises RenderError (see :func:`render_compressor`)."""
    prm = params(specs, threads)
    nt = prm["threads"]
    if nt % target.wave:
        raise RenderError(f"compressor {name}: block size {nt} is not a multiple of {target.slug}'s wave {target.wave}")
    for s in specs:
        if s.indexer and not 1 <= s.d // target.wave <= 32:
            raise RenderError(f"compressor {name}: indexer d {s.d} does not fit one wave of {target.wave} "
                              f"(needs wave <= d <= 32 * wave)")
    sm = smem_bytes(specs, nt, target.wave)
    if sm > STATIC_SMEM_LIMIT:
        raise RenderError(f"compressor {name}: {sm} bytes of shared memory exceed {STATIC_SMEM_LIMIT}")
    return prm




CHUNK_TEMPLATE = "compressor/compress_chunk.cu.j2"
CHUNK_KERNELS = ("flush", "state")


def max_flushes(spec: CompressorSpec) -> int:
    """The most flushes ``q`` consecutive rows can hold: ``ceil(q / ratio)``."""
    return -(-spec.q // spec.ratio)


def render_compressor_chunk(specs: Sequence[CompressorSpec], target: Target, name: str,
                            threads: int = 0) -> list[KernelSource]:
    """The two kernels of a prefill chunk's compressors parallel over the chunk's flushes
    (templates/compressor/compress_chunk.cu.j2): ``flush`` (one block per (flush, compressor)) then ``state`` (one
    block per compressor), named ``name + "_flush"`` / ``"_state"``. Every spec must have ``valid``; they take the
    serial kernel's arguments (:func:`arg_names`) and leave its state and rows bit for bit.

    Raises:
        RenderError: a spec without ``valid`` (or with ``undo``), or what :func:`render_compressor` refuses.
    """
    specs = list(specs)
    if not specs or not all(s.valid and not s.undo for s in specs):
        raise RenderError(f"compressor {name}: the chunk kernels need valid specs without undo (a prefill chunk)")
    prm = _checked_params(specs, target, name, threads)  # the serial kernel's limits (wave, indexer width, smem)
    return [render(CHUNK_TEMPLATE, f"{name}_{k}", FAMILY, target, {**prm, "part": k}) for k in CHUNK_KERNELS]


def chunk_launch_shapes(specs: Sequence[CompressorSpec], threads: int = 0) -> list[Launch]:
    """``flush``: grid (the most flushes of any spec, compressors); ``state``: grid (compressors); both with the
    serial kernel's block size and static shared memory only."""
    specs = list(specs)
    nt = block_threads(specs, threads)
    return [Launch((max(max_flushes(s) for s in specs), len(specs), 1), (nt, 1, 1), 0, kernel="flush"),
            Launch((len(specs), 1, 1), (nt, 1, 1), 0, kernel="state")]


def launch_shape(specs: Sequence[CompressorSpec] | CompressorSpec, threads: int = 0) -> Launch:
    """Grid (len(specs), 1, 1), block (:func:`block_threads`, 1, 1), no dynamic shared memory."""
    if isinstance(specs, CompressorSpec):
        specs = [specs]
    return Launch((len(specs), 1, 1), (block_threads(list(specs), threads), 1, 1), 0)


def arg_names(specs: Sequence[CompressorSpec] | CompressorSpec) -> list[str]:
    """Kernel argument names in order: ``pos`` (then ``n_valid`` with ``valid``), then ``v{k}, g{k}, ape{k}, norm{k}, kv{k}, score{k}, rows{k},
    freqs{k}`` (and ``undo{k}`` for a compressor with ``undo``) per compressor."""
    specs = [specs] if isinstance(specs, CompressorSpec) else list(specs)
    return ["pos"] + (["n_valid"] if specs and specs[0].valid else []) + [f"{a}{k}" for k, s in enumerate(specs)
                      for a in ARGS_PER_COMPRESSOR + (("undo",) if s.undo else ())]


# ------------------------------------------------------------------------------------------------ reference
def reference(spec: CompressorSpec, v: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor,
              kv_state: torch.Tensor, score_state: torch.Tensor, rows: torch.Tensor, pos: int,
              freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel computes for one compressor, by the reference's own code
    (:func:`ds4c.reference.blocks.compress_token` and :func:`~ds4c.reference.blocks.finish_compressed_row`, as
    the reference model and the IR's ``compress`` op use them). Inputs are not modified.

    Args:
        v, g: fp32 [q, c*d] (g without ape); ape fp32 [r, c*d]; norm fp32 [d]; kv_state, score_state fp32
        [slots, c*d]; rows bf16 [n, d]; pos: position of row 0; freqs fp32 [rope_dim/2].
    Returns:
        (kv_state, score_state, rows) after the step (new tensors).
    """
    from ds4c.reference import blocks as B

    kv, score, out = kv_state.clone(), score_state.clone(), rows.clone()
    r, d = spec.ratio, spec.d
    for i in range(spec.q):
        p = pos + i
        cvec = B.compress_token(kv, score, v[i], g[i] + ape[p % r], p, r, d, B.plain_write)
        if cvec is not None:
            out[p // r] = B.finish_compressed_row(cvec, norm, p, r, freqs, spec.eps, spec.indexer, spec.emulate,
                                                  spec.nope)
    return kv, score, out
