"""Row-chain and grouped ``wo_a`` kernel families (docs/model.md P1-P7, 5.2(c),(d),(f.1-3),(f.5),(h.1),
(j),(k)).

**rowchain** (``templates/rowchain/rowchain.cu.j2``): a render-time chain of row-local ops on ``x`` bf16
``[q, G, W]`` (``G`` groups or heads of width ``W``), one block per (group, row), bf16 out; ops:

* ``rms_norm`` (P1, fp32 weight ``[W]`` or ``[G*W]``; the whole row when ``G = 1``),
* ``head_rms`` (P2, bf16 arithmetic, no weight),
* ``rope`` (P7, interleaved pairs of the last ``rope_dim`` dims at the row's position, ``inverse`` flag,
  fp32 frequency table),
* ``kv_fq`` (P3 on the first ``nope`` dims, blocks of 64), ``fp4_fq`` (P4, blocks of 32),
* ``hadamard`` (P5 over ``W``), ``mul_scalar`` (``bf16(x * c)``),

optionally followed by a ring write (row ``i`` also stored into ring slot ``p_i mod window``). Every op
rounds to bf16 where the reference does; the chains of a decode step are in :func:`decode_chains`.

**grouped** (``templates/grouped/grouped_linear.cu.j2``): 5.2(k) ``z[i, g] = bf16(w[g] . o[i, g])`` with
``o`` bf16 ``[q, H, hd]`` viewed ``[q, G, (H/G)*hd]``, ``w`` bf16 ``[G*R, (H/G)*hd]`` (group-major), ``z``
bf16 ``[q, G, R]``; optional fused prologue: 5.2(j) inverse RoPE on the last ``rope_dim`` dims of every head
(so the kernel reads the attention output directly); optional fused ring write (5.2(h.1), which the
partition pass puts into this kernel because it must follow the attention).

Positions: per-step scalars come from device memory (CUDA graph replay): ``pos`` is a pointer, int32 (or
int64 with ``pos_dtype="i64"``); ``pos_mode="base"`` reads ``pos[0]`` and row ``i`` sits at ``pos[0] + i``,
``pos_mode="rows"`` reads ``pos[i]`` (the IR's ``positions`` tensor).

Per family: a spec dataclass, ``render_*`` -> :class:`~ds4c.runtime.render.KernelSource`, ``*_launch`` ->
:class:`Launch`, ``*_args`` -> the kernel arguments in order (:class:`Arg`: name, C declaration, shape
doc), ``make_*_inputs`` (random inputs by argument name) and ``*_reference`` built from
:mod:`ds4c.reference.primitives` / :mod:`ds4c.reference.blocks` (what the GPU check compares with).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

FAMILY = "rowchain"
ROWCHAIN_TEMPLATE = "rowchain/rowchain.cu.j2"
GROUPED_TEMPLATE = "grouped/grouped_linear.cu.j2"
STATIC_SMEM_LIMIT = 48 * 1024  # static shared memory (CUDA); also under the 64 KiB LDS of gfx942 / gfx1151

OP_KINDS = ("rms_norm", "head_rms", "rope", "kv_fq", "hadamard", "fp4_fq", "mul_scalar")
POS_DTYPES = {"i32": ("i32", torch.int32), "i64": ("i64", torch.int64)}
POS_MODES = ("base", "rows")

BF16, F32 = torch.bfloat16, torch.float32


def f32_literal(x: float) -> str:
    """Exact C hex-float literal of fp32(x) (the value the reference's fp32 tensor ops use for a Python
    float scalar)."""
    v = float(torch.tensor(float(x), dtype=F32))
    if math.isinf(v) or math.isnan(v):
        raise RenderError(f"constant {x!r} is not a finite fp32 value")
    return f"({v.hex()}f)"


@dataclass(frozen=True)
class Arg:
    """One kernel argument: ``name``, its C declaration in the kernel signature, and a shape/dtype doc."""

    name: str
    decl: str
    doc: str




# =============================================================================================== rowchain
@dataclass(frozen=True)
class ChainOp:
    """One op of a row chain (see the module docstring). Unused fields are ignored.

    Attributes:
        kind: one of :data:`OP_KINDS`.
        eps: rms_norm / head_rms epsilon.
        per_group: rms_norm weight is ``[G*W]`` (one W-slice per group) instead of ``[W]``.
        rope_dim: rope: rotated trailing dims (even; ``freqs`` has ``rope_dim/2`` entries).
        inverse: rope: rotate by ``-theta``.
        nope: kv_fq: leading dims that are fake-quantized (a multiple of ``block``).
        block: kv_fq (64) / fp4_fq (32) block size.
        value: mul_scalar constant (used as fp32).
    """

    kind: str
    eps: float = 1e-6
    per_group: bool = False
    rope_dim: int = 0
    inverse: bool = False
    nope: int = 0
    block: int = 0
    value: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise RenderError(f"rowchain op {self.kind!r}: expected one of {', '.join(OP_KINDS)}")


def rms_norm(eps: float = 1e-6, per_group: bool = False) -> ChainOp:
    return ChainOp("rms_norm", eps=eps, per_group=per_group)


def head_rms(eps: float = 1e-6) -> ChainOp:
    return ChainOp("head_rms", eps=eps)


def rope(rope_dim: int, inverse: bool = False) -> ChainOp:
    return ChainOp("rope", rope_dim=rope_dim, inverse=inverse)


def kv_fq(nope: int, block: int = 64) -> ChainOp:
    return ChainOp("kv_fq", nope=nope, block=block)


def hadamard() -> ChainOp:
    return ChainOp("hadamard")


def fp4_fq(block: int = 32) -> ChainOp:
    return ChainOp("fp4_fq", block=block)


def mul_scalar(value: float) -> ChainOp:
    return ChainOp("mul_scalar", value=value)


_SHUFFLE_OPS = frozenset({"kv_fq", "fp4_fq", "hadamard"})


@dataclass(frozen=True)
class RowChainSpec:
    """One row-chain kernel (everything render-time except the row count q, which is the grid's y).

    Attributes:
        groups: G (heads; 1 for a whole-row chain). width: W (elements per group).
        ops: the chain, applied in order.
        ring_window: > 0: also write the result row i into ``ring`` slot ``p_i mod ring_window`` (ring bf16
            ``[ring_window, G*W]``); 0: no ring.
        pos_mode / pos_dtype: how positions are read (module docstring).
        per_thread: elements per thread (1, 2, 4 or 8); 0 = automatic (:meth:`per_thread_elems`).
        ring_valid: with ``ring_window`` (a prefill chunk, docs/prefill.md): the kernel also takes ``n_valid`` (i64 [1],
            device, last argument) and row ``i`` writes its ring slot only when ``n_valid - ring_window <= i <
            n_valid``: padded rows write nothing, and of the valid rows only the last ``ring_window`` (one
            writer per slot, so no race when the chunk is longer than the window), which leaves the ring as
            token-wise decoding does. False renders the decode / verify kernel byte for byte.
    """

    groups: int
    width: int
    ops: tuple[ChainOp, ...]
    ring_window: int = 0
    pos_mode: str = "base"
    pos_dtype: str = "i32"
    per_thread: int = 0
    ring_valid: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        bad = []
        G, W = self.groups, self.width
        if G < 1 or W < 1:
            bad.append(f"groups {G} / width {W} (expected >= 1)")
        if self.pos_mode not in POS_MODES:
            bad.append(f"pos_mode {self.pos_mode!r} (expected one of {POS_MODES})")
        if self.pos_dtype not in POS_DTYPES:
            bad.append(f"pos_dtype {self.pos_dtype!r} (expected one of {tuple(POS_DTYPES)})")
        if self.ring_window < 0:
            bad.append(f"ring_window {self.ring_window} (expected >= 0)")
        if not self.ops and not self.ring_window:
            bad.append("an empty chain without a ring write")
        if self.ring_valid and not self.ring_window:
            bad.append("ring_valid without a ring write")
        for op in self.ops:
            if op.kind == "rope" and (op.rope_dim <= 0 or op.rope_dim % 2 or op.rope_dim > W):
                bad.append(f"rope_dim {op.rope_dim} (expected even, 0 < rope_dim <= W={W})")
            if op.kind == "kv_fq" and (op.block <= 0 or op.block > 64 or op.block & (op.block - 1)
                                       or op.nope <= 0 or op.nope % op.block or op.nope > W):
                bad.append(f"kv_fq nope {op.nope} / block {op.block} (expected a power-of-two block <= 64 "
                           f"dividing nope <= W={W})")
            if op.kind == "fp4_fq" and (op.block <= 0 or op.block > 64 or op.block & (op.block - 1)
                                        or W % op.block):
                bad.append(f"fp4_fq block {op.block} (expected a power-of-two block <= 64 dividing W={W})")
            if op.kind == "hadamard" and (W & (W - 1) or W < 32 or W > 256):
                bad.append(f"hadamard over W={W} (expected a power of two in 32..256)")
        if bad:
            raise RenderError(f"RowChainSpec: bad {'; '.join(bad)}")
        self.per_thread_elems()  # raises when no thread layout fits

    # ------------------------------------------------------------------------------------------ derived
    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(op.kind for op in self.ops)

    @property
    def needs_pos(self) -> bool:
        return "rope" in self.kinds or self.ring_window > 0

    @property
    def label(self) -> str:
        chain = "+".join(("irope" if op.kind == "rope" and op.inverse else op.kind) for op in self.ops)
        ring = f"+ring{self.ring_window}" if self.ring_window else ""
        return f"{chain}{ring}[{self.groups}x{self.width}]"

    def _fits(self, e: int) -> bool:
        W, t = self.width, self.width // e if self.width % e == 0 else 0
        if not t or t > 1024:
            return False
        shuffles = bool(_SHUFFLE_OPS & set(self.kinds))
        if shuffles and t % 32:
            return False
        for op in self.ops:
            if op.kind == "rope" and (e % 2 or (W - op.rope_dim) % e):
                return False
            if op.kind in ("kv_fq", "fp4_fq") and (op.block % e or op.block // e > 32):
                return False
            if op.kind == "hadamard" and t != 32:
                return False
        return True

    def per_thread_elems(self) -> int:
        """Elements per thread: ``per_thread`` if set (checked), else the largest of 8, 4, 2, 1 that fits
        with at least 32 threads (so shuffles see whole 32-lane groups), else the largest that fits.

        Raises:
            RenderError: no layout fits (e.g. a rope slice not aligned to the thread's elements).
        """
        if self.per_thread:
            if self.per_thread not in (1, 2, 4, 8) or not self._fits(self.per_thread):
                raise RenderError(f"rowchain {self.label}: per_thread {self.per_thread} does not fit")
            return self.per_thread
        fits = [e for e in (8, 4, 2, 1) if self._fits(e)]
        if not fits:
            raise RenderError(f"rowchain {self.label}: no thread layout fits (width {self.width}, ops {self.kinds})")
        wide = [e for e in fits if self.width // e >= 32 and (self.width // e) % 32 == 0]
        return wide[0] if wide else fits[0]

    def threads(self) -> int:
        return self.width // self.per_thread_elems()

    def args(self) -> list[Arg]:
        """Kernel arguments in order: x, out, one weight per rms_norm (op order), pos (when a rope or the ring
        needs it), one frequency table per rope (op order), ring."""
        G, W = self.groups, self.width
        out = [Arg("x", "const u16* x", f"bf16 [q, {G}, {W}]"),
               Arg("out", "u16* out", f"bf16 [q, {G}, {W}] (may alias x)")]
        for i, op in enumerate(self.ops):
            if op.kind == "rms_norm":
                n = G * W if op.per_group else W
                out.append(Arg(f"w{i}", f"const float* DS4C_RESTRICT w{i}", f"fp32 [{n}] rms_norm weight of op {i}"))
        if self.needs_pos:
            ct = POS_DTYPES[self.pos_dtype][0]
            shape = "[q]: row i at pos[i]" if self.pos_mode == "rows" else "[1]: row i at pos[0] + i"
            out.append(Arg("pos", f"const {ct}* DS4C_RESTRICT pos", f"{self.pos_dtype} {shape}"))
        for i, op in enumerate(self.ops):
            if op.kind == "rope":
                out.append(Arg(f"freqs{i}", f"const float* DS4C_RESTRICT freqs{i}",
                               f"fp32 [{op.rope_dim // 2}] rope frequencies of op {i}"))
        if self.ring_window:
            out.append(Arg("ring", "u16* DS4C_RESTRICT ring", f"bf16 [{self.ring_window}, {G * W}] (updated in place)"))
        if self.ring_valid:
            out.append(Arg("n_valid", "const i64* DS4C_RESTRICT n_valid", "i64 [1]: rows 0 .. n_valid-1 are tokens"))
        return out

    def params(self) -> dict[str, Any]:
        """Render parameters."""
        e = self.per_thread_elems()
        t = self.width // e
        ops = []
        for i, op in enumerate(self.ops):
            d: dict[str, Any] = {"kind": op.kind}
            if op.kind in ("rms_norm", "head_rms"):
                d["eps"] = f32_literal(op.eps)
            if op.kind == "rms_norm":
                d.update(w=f"w{i}", per_group=op.per_group)
            if op.kind == "rope":
                d.update(rope_dim=op.rope_dim, inverse=op.inverse, freqs=f"freqs{i}")
            if op.kind == "kv_fq":
                d.update(nope=op.nope, block=op.block)
            if op.kind == "fp4_fq":
                d.update(block=op.block)
            if op.kind == "hadamard":
                d.update(scale=f32_literal(self.width ** -0.5))
            if op.kind == "mul_scalar":
                d.update(value=f32_literal(op.value))
            ops.append(d)
        need_red = bool({"rms_norm", "head_rms"} & set(self.kinds))
        return {"groups": self.groups, "width": self.width, "per_thread": e, "threads": t, "ops": ops,
                "args": [a.__dict__ for a in self.args()], "need_red": need_red,
                "red_size": (t // 32 if t % 32 == 0 else t) or 1,
                "need_group_max": bool({"kv_fq", "fp4_fq"} & set(self.kinds)),
                "need_e4m3": "kv_fq" in self.kinds, "need_e2m1": "fp4_fq" in self.kinds,
                "need_pos": self.needs_pos, "pos_mode": self.pos_mode, "ring_window": self.ring_window,
                **({"ring_valid": True} if self.ring_valid else {})}


def render_rowchain(spec: RowChainSpec, target: Target, name: str) -> KernelSource:
    """The rendered row-chain kernel of ``spec`` for ``target`` (entry = ``name`` made C-safe).

    Raises:
        RenderError: the spec does not fit, or a template parameter is missing.
    """
    return render(ROWCHAIN_TEMPLATE, name, FAMILY, target, spec.params())


def rowchain_launch(spec: RowChainSpec, q: int) -> Launch:
    """Grid (G, q), block (threads): one block per (group, row)."""
    if q < 1:
        raise RenderError(f"rowchain {spec.label}: q {q} (expected >= 1)")
    return Launch((spec.groups, q, 1), (spec.threads(), 1, 1))


def rowchain_args(spec: RowChainSpec) -> list[Arg]:
    return spec.args()


def _positions(pos: torch.Tensor, q: int, mode: str) -> torch.Tensor:
    p = pos.to(torch.int64).reshape(-1)
    if mode == "rows":
        return p[:q].clone()
    return p[0] + torch.arange(q, dtype=torch.int64, device=p.device)


def rowchain_reference(spec: RowChainSpec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the row-chain kernel computes, by the reference's own functions (:mod:`ds4c.reference`).

    Args:
        inputs: tensors by argument name (:meth:`RowChainSpec.args`); ``out`` is ignored; ``ring`` (when the
            spec writes one) is not modified; ``n_valid`` (i64 [1]) with ``ring_valid``.
    Returns:
        ``{"out": bf16 [q, G, W]}`` plus ``{"ring": the updated ring copy}`` when ``ring_window``.
    """
    from ds4c.reference import blocks as B
    from ds4c.reference import primitives as P

    x = inputs["x"]
    q, G, W = x.shape
    pos = _positions(inputs["pos"], q, spec.pos_mode) if spec.needs_pos else None
    y = x
    for i, op in enumerate(spec.ops):
        if op.kind == "rms_norm":
            w = inputs[f"w{i}"].to(F32)
            y = P.rms_norm(y, w.view(G, W) if op.per_group else w, op.eps)
        elif op.kind == "head_rms":
            y = P.head_rms(y, op.eps)
        elif op.kind == "rope":
            freqs = inputs[f"freqs{i}"].to(F32)
            assert freqs.numel() * 2 == op.rope_dim, "freqs must hold rope_dim/2 entries"
            y = P.apply_rope(y, pos, freqs, inverse=op.inverse)
        elif op.kind == "kv_fq":
            y = torch.cat((P.fp8_fake_quant(y[..., :op.nope], op.block), y[..., op.nope:]), dim=-1) \
                if op.block != 64 else B.kv_fake_quant(y, op.nope, True)
        elif op.kind == "hadamard":
            y = P.hadamard(y)
        elif op.kind == "fp4_fq":
            y = P.fp4_fake_quant(y, op.block)
        elif op.kind == "mul_scalar":
            y = (y.to(F32) * op.value).to(y.dtype)
    out = {"out": y}
    if spec.ring_window:
        ring = inputs["ring"].clone()
        flat = y.reshape(q, G * W)
        nv = int(inputs["n_valid"].reshape(-1)[0]) if spec.ring_valid else q
        for i, p in enumerate(pos.tolist()):
            if not spec.ring_valid or nv - spec.ring_window <= i < nv:  # the kernel's rule (RowChainSpec.ring_valid)
                ring[p % spec.ring_window] = flat[i]
        out["ring"] = ring
    return out


def make_rowchain_inputs(spec: RowChainSpec, q: int, *, pos: int = 1000, freqs: torch.Tensor | None = None,
                         generator: torch.Generator | None = None, device: str | torch.device = "cpu"
                         ) -> dict[str, torch.Tensor]:
    """Random inputs by argument name (CPU generation, then moved to ``device``): x ~ N(0, 1) bf16 with a
    few larger outliers, rms weights ~ 1 + 0.1 N(0, 1) fp32, positions ``pos .. pos+q-1``, frequencies
    ``freqs`` (default: the YaRN table of a compressing layer of DeepSeek-V4-Flash, P6), ring ~ N(0, 1);
    ``out`` is NaN-poisoned."""
    from ds4c.reference import primitives as P

    gen = generator or torch.Generator().manual_seed(0)
    G, W = spec.groups, spec.width
    x = torch.randn(q, G, W, generator=gen)
    x = x * torch.exp(torch.randn(q, G, 1, generator=gen))  # per-group scale spread
    x = x.to(BF16)
    res: dict[str, torch.Tensor] = {"x": x, "out": torch.full((q, G, W), float("nan"), dtype=BF16)}
    for i, op in enumerate(spec.ops):
        if op.kind == "rms_norm":
            n = G * W if op.per_group else W
            res[f"w{i}"] = 1.0 + 0.1 * torch.randn(n, generator=gen)
    if spec.needs_pos:
        ptype = POS_DTYPES[spec.pos_dtype][1]
        res["pos"] = (torch.arange(q, dtype=ptype) + pos) if spec.pos_mode == "rows" else torch.tensor([pos], dtype=ptype)
    for i, op in enumerate(spec.ops):
        if op.kind == "rope":
            f = freqs if freqs is not None else P.rope_freqs(op.rope_dim, 160000.0, True, 16.0, 65536, 32.0, 1.0)
            res[f"freqs{i}"] = f.to(F32).clone()
    if spec.ring_window:
        res["ring"] = torch.randn(spec.ring_window, G * W, generator=gen).to(BF16)
    return {k: v.to(device) for k, v in res.items()}


def decode_chains(cfg: Any) -> dict[str, RowChainSpec]:
    """The row chains of a decode / verify step of ``cfg`` (a :class:`ds4c.config.Ds4Config`):

    * ``kv``: rms_norm(kv_norm) -> rope -> kv_fq on [q, 1, head_dim] (5.2(d.1-3));
    * ``q``: head_rms -> rope on [q, n_heads, head_dim] (5.2(c.3-4));
    * ``idx_q``: rope -> hadamard -> fp4_fq on [q, index_n_heads, index_head_dim] (5.2(f.2-3));
    * ``o``: inverse rope on [q, n_heads, head_dim] (5.2(j), when not fused into ``wo_a``);
    * ``hw``: mul_scalar(index_head_dim^-1/2 * index_n_heads^-1/2) on [q, 1, index_n_heads] (5.2(f.5));
    * ``q_norm``: rms_norm(q_norm) on [q, 1, q_lora_rank] (5.2(c.1));
    * ``kv_ring``: the KV chain with the ring write fused (window ``cfg.window``), for ring writes that need
      not follow the attention (e.g. the DSpark ring, 7.2.1).
    """
    eps, rd, hd = cfg.norm_eps, cfg.rope_dim, cfg.head_dim
    kv_ops = (rms_norm(eps), rope(rd), kv_fq(cfg.nope_dim))
    return {
        "kv": RowChainSpec(1, hd, kv_ops),
        "q": RowChainSpec(cfg.n_heads, hd, (head_rms(eps), rope(rd))),
        "idx_q": RowChainSpec(cfg.index_n_heads, cfg.index_head_dim, (rope(rd), hadamard(), fp4_fq(32))),
        "o": RowChainSpec(cfg.n_heads, hd, (rope(rd, inverse=True),)),
        "hw": RowChainSpec(1, cfg.index_n_heads,
                           (mul_scalar(cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5),)),
        "q_norm": RowChainSpec(1, cfg.q_lora_rank, (rms_norm(eps),)),
        "kv_ring": RowChainSpec(1, hd, kv_ops, ring_window=cfg.window),
    }


# ================================================================================================ grouped
@dataclass(frozen=True)
class GroupedSpec:
    """One grouped ``wo_a`` kernel (all render-time).

    Attributes:
        q: rows (1..5 for decode / verify). heads: H; head_dim: hd; groups: G (divides H); rank: R.
        rope_dim: > 0: fused RoPE prologue on the last rope_dim dims of each head; 0: none.
        rope_inverse: the prologue rotates by -theta (5.2(j)); default True.
        ring_window / kv_width: > 0: fused ring write of kv bf16 [q, kv_width] into ring [ring_window, kv_width].
        ring_undo: with the ring write: save each overwritten ring row into ``ring_undo`` bf16 [q, kv_width]
            first (a verify step's undo; ``runtime/families/undo.py`` restores rejected rows from it).
        pos_mode / pos_dtype: positions (module docstring).
        threads, rows_per_warp, unroll: block size, output rows per warp, 16-byte vectors in flight per row
            and lane.
    """

    q: int
    heads: int
    head_dim: int
    groups: int
    rank: int
    rope_dim: int = 0
    rope_inverse: bool = True
    ring_window: int = 0
    kv_width: int = 0
    ring_undo: bool = False
    pos_mode: str = "base"
    pos_dtype: str = "i32"
    threads: int = 256
    rows_per_warp: int = 4
    unroll: int = 2

    def __post_init__(self) -> None:
        bad = []
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if self.groups < 1 or self.heads % self.groups:
            bad.append(f"groups {self.groups} (expected to divide heads {self.heads})")
        if self.head_dim % 8 or self.head_dim < 8:
            bad.append(f"head_dim {self.head_dim} (expected a positive multiple of 8)")
        if self.rank < 1:
            bad.append(f"rank {self.rank} (expected >= 1)")
        if self.rope_dim < 0 or self.rope_dim % 2 or self.rope_dim > self.head_dim:
            bad.append(f"rope_dim {self.rope_dim} (expected even, <= head_dim)")
        if self.ring_window < 0 or (self.ring_window and (self.kv_width < 8 or self.kv_width % 8)):
            bad.append(f"ring_window {self.ring_window} / kv_width {self.kv_width} (kv_width a multiple of 8)")
        if self.ring_undo and not self.ring_window:
            bad.append("ring_undo without a ring write (ring_window 0)")
        if self.pos_mode not in POS_MODES:
            bad.append(f"pos_mode {self.pos_mode!r} (expected one of {POS_MODES})")
        if self.pos_dtype not in POS_DTYPES:
            bad.append(f"pos_dtype {self.pos_dtype!r} (expected one of {tuple(POS_DTYPES)})")
        if self.threads < 64 or self.threads % 64 or self.threads > 1024:
            bad.append(f"threads {self.threads} (expected a multiple of 64 up to 1024)")
        if self.rows_per_warp < 1 or self.unroll < 1:
            bad.append(f"rows_per_warp {self.rows_per_warp} / unroll {self.unroll} (expected >= 1)")
        if bad:
            raise RenderError(f"GroupedSpec: bad {'; '.join(bad)}")
        if self.smem_bytes() > STATIC_SMEM_LIMIT:
            raise RenderError(f"GroupedSpec: {self.smem_bytes()} bytes of shared memory (q {self.q} x K "
                              f"{self.k} bf16) exceed {STATIC_SMEM_LIMIT}")

    @property
    def k(self) -> int:
        """Reduction length per group: (H/G) * hd."""
        return self.heads // self.groups * self.head_dim

    @property
    def needs_pos(self) -> bool:
        return self.rope_dim > 0 or self.ring_window > 0

    @property
    def label(self) -> str:
        pro = f"+irope{self.rope_dim}" if self.rope_dim and self.rope_inverse else (
            f"+rope{self.rope_dim}" if self.rope_dim else "")
        ring = f"+ring{self.ring_window}" if self.ring_window else ""
        return f"wo_a q{self.q} H{self.heads}x{self.head_dim} G{self.groups} R{self.rank}{pro}{ring}"

    def smem_bytes(self) -> int:
        return self.q * self.k * 2 + (self.q * self.rope_dim * 4 if self.rope_dim else 0)

    def rows_per_block(self, target: Target) -> int:
        return self.threads // target.wave * self.rows_per_warp

    def args(self) -> list[Arg]:
        """Kernel arguments in order: o, w, z, pos (rope or ring), freqs (rope), kv, ring (ring write)."""
        H, hd, G, R = self.heads, self.head_dim, self.groups, self.rank
        out = [Arg("o", "const u16* DS4C_RESTRICT o", f"bf16 [q={self.q}, {H}, {hd}] attention output"),
               Arg("w", "const u16* DS4C_RESTRICT w", f"bf16 [{G * R}, {self.k}] wo_a, group-major"),
               Arg("z", "u16* DS4C_RESTRICT z", f"bf16 [q={self.q}, {G}, {R}]")]
        if self.needs_pos:
            ct = POS_DTYPES[self.pos_dtype][0]
            shape = "[q]: row i at pos[i]" if self.pos_mode == "rows" else "[1]: row i at pos[0] + i"
            out.append(Arg("pos", f"const {ct}* DS4C_RESTRICT pos", f"{self.pos_dtype} {shape}"))
        if self.rope_dim:
            out.append(Arg("freqs", "const float* DS4C_RESTRICT freqs", f"fp32 [{self.rope_dim // 2}] rope frequencies"))
        if self.ring_window:
            out.append(Arg("kv", "const u16* DS4C_RESTRICT kv", f"bf16 [q={self.q}, {self.kv_width}] this step's KV rows"))
            out.append(Arg("ring", "u16* DS4C_RESTRICT ring",
                           f"bf16 [{self.ring_window}, {self.kv_width}] window ring (updated in place)"))
        if self.ring_undo:
            out.append(Arg("ring_undo", "u16* DS4C_RESTRICT ring_undo",
                           f"bf16 [>= q={self.q}, {self.kv_width}] the ring rows this step overwrites, saved"))
        return out

    def params(self) -> dict[str, Any]:
        return {"rows": self.q, "groups": self.groups, "heads_per_group": self.heads // self.groups,
                "head_dim": self.head_dim, "rank": self.rank, "rope_dim": self.rope_dim,
                "rope_inverse": self.rope_inverse, "threads": self.threads, "rows_per_warp": self.rows_per_warp,
                "unroll": self.unroll, "ring_window": self.ring_window, "kv_width": self.kv_width,
                "ring_undo": self.ring_undo,
                "pos_mode": self.pos_mode, "args": [a.__dict__ for a in self.args()]}


def render_grouped(spec: GroupedSpec, target: Target, name: str) -> KernelSource:
    """The rendered grouped ``wo_a`` kernel of ``spec`` for ``target``.

    Raises:
        RenderError: the rows per block (threads / wave * rows_per_warp) do not divide the rank, or a
            template parameter is missing.
    """
    rpb = spec.rows_per_block(target)
    if spec.rank % rpb:
        raise RenderError(f"grouped {name}: {rpb} rows per block ({spec.threads} threads / wave {target.wave} x "
                          f"{spec.rows_per_warp}) do not divide rank {spec.rank}")
    return render(GROUPED_TEMPLATE, name, FAMILY, target, spec.params())


def grouped_launch(spec: GroupedSpec, target: Target) -> Launch:
    """Grid (G*R / rows_per_block(target)), block (threads); rows per block depend on the wave size."""
    grid = spec.groups * spec.rank // spec.rows_per_block(target)
    return Launch((grid, 1, 1), (spec.threads, 1, 1))


def grouped_args(spec: GroupedSpec) -> list[Arg]:
    return spec.args()


def grouped_reference(spec: GroupedSpec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the grouped kernel computes, by the reference's functions: ``apply_rope(o, positions, freqs,
    inverse)`` (when rope_dim), then per group ``linear_bf16(o_g, w_g)`` (the IR's ``grouped_linear``);
    the ring write as the IR's ``ring_write``.

    Returns:
        ``{"z": bf16 [q, G, R]}`` plus ``{"ring": the updated ring copy}`` when the ring write is fused.
    """
    from ds4c.reference import primitives as P

    o, w = inputs["o"], inputs["w"]
    q, G, R = spec.q, spec.groups, spec.rank
    pos = _positions(inputs["pos"], q, spec.pos_mode) if spec.needs_pos else None
    if spec.rope_dim:
        o = P.apply_rope(o, pos, inputs["freqs"].to(F32), inverse=spec.rope_inverse)
    og = o.reshape(q, G, -1)
    wg = w.to(F32).view(G, R, -1)
    out = {"z": torch.stack([P.linear_bf16(og[:, g], wg[g]) for g in range(G)], dim=1)}
    if spec.ring_window:
        ring = inputs["ring"].clone()
        undo = inputs["ring_undo"].clone() if spec.ring_undo else None
        for i, p in enumerate(pos.tolist()):
            if undo is not None:
                undo[i] = ring[p % spec.ring_window]
            ring[p % spec.ring_window] = inputs["kv"][i]
        out["ring"] = ring
        if undo is not None:
            out["ring_undo"] = undo
    return out


def make_grouped_inputs(spec: GroupedSpec, *, pos: int = 1000, freqs: torch.Tensor | None = None,
                        generator: torch.Generator | None = None, device: str | torch.device = "cpu"
                        ) -> dict[str, torch.Tensor]:
    """Random inputs by argument name: o ~ N(0, 1), w ~ N(0, 1/K) (bf16), positions ``pos ..``, frequencies
    (default: the YaRN table of a compressing layer, P6), kv / ring ~ N(0, 1); ``z`` NaN-poisoned."""
    from ds4c.reference import primitives as P

    gen = generator or torch.Generator().manual_seed(0)
    q, H, hd, G, R = spec.q, spec.heads, spec.head_dim, spec.groups, spec.rank
    res: dict[str, torch.Tensor] = {
        "o": torch.randn(q, H, hd, generator=gen).to(BF16),
        "w": (torch.randn(G * R, spec.k, generator=gen) * spec.k ** -0.5).to(BF16),
        "z": torch.full((q, G, R), float("nan"), dtype=BF16),
    }
    if spec.needs_pos:
        ptype = POS_DTYPES[spec.pos_dtype][1]
        res["pos"] = (torch.arange(q, dtype=ptype) + pos) if spec.pos_mode == "rows" else torch.tensor([pos], dtype=ptype)
    if spec.rope_dim:
        f = freqs if freqs is not None else P.rope_freqs(spec.rope_dim, 160000.0, True, 16.0, 65536, 32.0, 1.0)
        res["freqs"] = f.to(F32).clone()
    if spec.ring_window:
        res["kv"] = torch.randn(q, spec.kv_width, generator=gen).to(BF16)
        res["ring"] = torch.randn(spec.ring_window, spec.kv_width, generator=gen).to(BF16)
        if spec.ring_undo:
            res["ring_undo"] = torch.full((q, spec.kv_width), float("nan"), dtype=BF16)
    return {k: v.to(device) for k, v in res.items()}


def decode_grouped(cfg: Any, q: int, rope_prologue: bool = True, ring: bool = False) -> GroupedSpec:
    """The ``wo_a`` kernel of ``cfg`` (a :class:`ds4c.config.Ds4Config`) for ``q`` rows, with the fused
    inverse-RoPE prologue (5.2(j)) and optionally the fused ring write (5.2(h.1))."""
    return GroupedSpec(q=q, heads=cfg.n_heads, head_dim=cfg.head_dim, groups=cfg.o_groups, rank=cfg.o_lora_rank,
                       rope_dim=cfg.rope_dim if rope_prologue else 0,
                       ring_window=cfg.window if ring else 0, kv_width=cfg.head_dim if ring else 0)


# ================================================================================================ generic
def reference(spec: RowChainSpec | GroupedSpec, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The CPU/GPU reference of either kernel family (dispatch on the spec type)."""
    if isinstance(spec, RowChainSpec):
        return rowchain_reference(spec, inputs)
    return grouped_reference(spec, inputs)


def outputs(spec: RowChainSpec | GroupedSpec) -> tuple[str, ...]:
    """Argument names the kernel writes."""
    if isinstance(spec, RowChainSpec):
        return ("out", "ring") if spec.ring_window else ("out",)
    return ("z", "ring") if spec.ring_window else ("z",)


def ordered_args(args: Sequence[Arg], inputs: dict[str, Any]) -> list[Any]:
    """The launch argument list: ``inputs[name]`` for every argument in kernel order."""
    missing = [a.name for a in args if a.name not in inputs]
    if missing:
        raise RenderError(f"missing kernel arguments {missing}")
    return [inputs[a.name] for a in args]
