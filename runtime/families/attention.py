"""The sparse-attention kernel family: the ``sparse_attention`` IR op (docs/model.md P9, 5.2(e),(i) and
section 6's window rule for verify rows) for one layer kind, as one CUDA/HIP kernel (plus a combine kernel
when split-K is on). Template: ``templates/attention/sparse_attention.cu.j2`` (its header describes the
block layout).

What one launch computes, for ``q`` rows at positions ``pos .. pos+q-1`` (``pos`` is read from device memory):
per row ``i`` (position ``p = pos + i``) and head ``h``, P9 over the list

* the window: positions ``max(0, p-W+1) .. p`` in order (ring slot ``t % W`` for ``t < pos``, this step's
  ``kv_new[t - pos]`` otherwise), masked entries after them up to ``W`` entries when ``p < W - 1``;
* the compressed part: ``csa``: ``comp[sel[i, c]]`` in ``sel`` order (``-1`` = masked); ``hca``: ``comp[c]``
  for ``c < cap``, masked from ``min((p+1) // ratio, live)`` on; ``swa``: none;
* masked entries up to a multiple of 64;

kind ``dspark`` (spec 7.2.3, the DSpark drafter's block attention): every row's list is the ring slots ``0 ..
min(W, pos)-1`` in slot order, then all ``q`` rows of ``kv_new`` (the block, non-causally), then masked entries,

in chunks of 64 list entries; fully masked chunks are skipped.

Kernel arguments, in order (see :func:`arg_names`); pointers are device pointers of contiguous tensors,
16-byte aligned; ints are 32-bit:

* main: ``q`` bf16 [q, H, hd]; ``ring`` bf16 [W, hd] (the ring before this step); ``kv_new`` bf16 [q, hd]
  (this step's KV rows); ``comp`` bf16 [cap, hd] (csa, hca); ``sel`` int64 [q, topk] (csa); ``sink`` fp32 [H];
  ``out`` bf16 [q, H, hd] (splits = 1) or ``ws`` fp32 [:func:`workspace_floats`] (splits > 1); ``pos`` int64
  [1] in device memory; ``live`` int64 [1] in device memory (hca: live compressed rows). Per-step scalars are
  read on the device so a captured CUDA graph replays with new values.
* combine (splits > 1): ``ws``; ``sink``; ``out``.

Choosing ``splits`` / ``heads_per_block`` (H200, official shapes, tests/gpu_checks/attention.py, 2026-11-29):
the kernel runs on CUDA cores and is bound by instruction issue (ncu: ~0.5 issued warp-instructions per
scheduler cycle, little DRAM traffic), so sharing KV reads across heads and spreading chunks over blocks both
pay. csa q=5: 76 us (1 head/block, no split), 65 (splits 4), 49 (4 heads/block, splits 4); csa q=1: 35, 21,
20 (4 heads/block, splits 8); swa / hca (<= 3 chunks): 10-25 us, best without split at q=1.

Numerics: fp32 sums in another order than the reference's torch ops (dot products, the p sum, the PV sum);
with ``splits > 1`` the combine also rescales each split's partial sums by ``exp(m_s - M)`` after ``p`` was
rounded to bf16 relative to the split's own running max. Both match :func:`reference` within bf16 tolerance
(relative error ~1e-3), not bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

KINDS = ("swa", "csa", "hca", "dspark")
CHUNK = 64  # list entries per P9 chunk (ds4c.reference.primitives.ATTN_CHUNK)
TEMPLATE = "attention/sparse_attention.cu.j2"
FAMILY = "attention"
STATIC_SMEM_LIMIT = 48 * 1024  # static shared memory (CUDA); also under the 64 KiB LDS of gfx942 / gfx1151


@dataclass(frozen=True)
class AttentionSpec:
    """One sparse-attention kernel configuration (all render-time).

    Attributes:
        kind: ``swa`` | ``csa`` | ``hca``.
        q: rows per launch (verify width, 1..5).
        heads: H (64 for DeepSeek-V4-Flash); head_dim: hd (512), a multiple of 8.
        window: W, ring rows (128).
        cap: rows of the compressed span ``comp`` (csa: bound for ``sel`` ids; hca: the bucket capacity).
        topk: csa: ``sel`` entries per row (512). Ignored otherwise.
        ratio: hca: compression ratio (128); the causal limit of row i is ``(pos+i+1) // ratio``.
        splits: split-K factor; 1 = one block per (head group, row) over the whole list.
        heads_per_block: heads one block computes (they share every KV row read, in registers); divides
            heads. 1 = one block per (head, row).
        threads: main kernel block size; 0 = automatic (:meth:`block_threads`).
        scale: softmax scale; None = ``head_dim ** -0.5``.
    """

    kind: str
    q: int
    heads: int
    head_dim: int
    window: int
    cap: int = 0
    topk: int = 0
    ratio: int = 0
    splits: int = 1
    heads_per_block: int = 1
    threads: int = 0
    scale: float | None = field(default=None)

    def __post_init__(self) -> None:
        bad = []
        if self.kind not in KINDS:
            bad.append(f"kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if self.heads < 1:
            bad.append(f"heads {self.heads} (expected >= 1)")
        if self.head_dim < 8 or self.head_dim % 8:
            bad.append(f"head_dim {self.head_dim} (expected a positive multiple of 8)")
        if self.window < 1:
            bad.append(f"window {self.window} (expected >= 1)")
        if self.splits < 1:
            bad.append(f"splits {self.splits} (expected >= 1)")
        if self.heads_per_block < 1 or self.heads % self.heads_per_block:
            bad.append(f"heads_per_block {self.heads_per_block} (expected a divisor of heads {self.heads})")
        if self.kind == "csa" and (self.topk < 1 or self.cap < 1):
            bad.append(f"csa needs topk >= 1 and cap >= 1 (got topk {self.topk}, cap {self.cap})")
        if self.kind == "hca" and (self.ratio < 1 or self.cap < 1):
            bad.append(f"hca needs ratio >= 1 and cap >= 1 (got ratio {self.ratio}, cap {self.cap})")
        if bad:
            raise RenderError(f"AttentionSpec: bad {'; '.join(bad)}")
        if not bad and self.threads:
            self._check_threads(self.threads)

    # ------------------------------------------------------------------------------------------ derived
    @property
    def units(self) -> int:
        """16-byte units (8 bf16) per KV row."""
        return self.head_dim // 8

    @property
    def comp_len(self) -> int:
        """List entries after the window at render time: 0 (swa), topk (csa), cap (hca)."""
        return {"swa": 0, "csa": self.topk, "hca": self.cap, "dspark": self.q}[self.kind]

    @property
    def list_len(self) -> int:
        """Padded list length (a multiple of 64)."""
        n = self.window + self.comp_len
        return -(-n // CHUNK) * CHUNK

    @property
    def scale_value(self) -> float:
        return float(self.head_dim ** -0.5 if self.scale is None else self.scale)

    def _check_threads(self, n: int) -> None:
        if n % 64 and n % 32:
            raise RenderError(f"AttentionSpec: threads {n} is not a multiple of the wave size")
        if n % self.units or CHUNK % (n // self.units) or n > 1024:
            raise RenderError(f"AttentionSpec: threads {n} must be <= 1024 and a multiple of head_dim/8 = "
                              f"{self.units} with (threads / {self.units}) dividing {CHUNK}")

    def block_threads(self) -> int:
        """Main kernel block size: ``threads`` if set, else the smallest multiple of lcm(head_dim/8, 64) (so it
        suits waves of 32 and 64) that is >= 192 and whose PV group count (threads / (head_dim/8)) divides 64:
        256 for head_dim 512, 192 for head_dim 192."""
        if self.threads:
            return self.threads
        step = math.lcm(self.units, 64)
        n = step
        while n <= 1024:
            if n >= 192 and CHUNK % (n // self.units) == 0:
                return n
            n += step
        raise RenderError(f"AttentionSpec: no block size fits head_dim {self.head_dim}; give threads explicitly")

    def combine_threads(self) -> int:
        """Combine kernel block size: head_dim/8 rounded up to a multiple of 64."""
        return -(-self.units // 64) * 64

    def groups(self) -> int:
        return self.block_threads() // self.units

    def smem_bytes(self) -> int:
        """Static shared memory of the main kernel."""
        hpb = self.heads_per_block
        return (2 * CHUNK * (1 + 2 * hpb) + max(self.groups() - 1, 1) * hpb * self.head_dim
                + (self.topk if self.kind == "csa" else 0)) * 4

    def list_params(self) -> dict[str, Any]:
        """The render parameters of the lists and the scale (shared with the tensor-core chunk kernel)."""
        return {"kind": self.kind, "rows": self.q, "heads": self.heads, "head_dim": self.head_dim,
                "window": self.window, "topk": self.topk if self.kind == "csa" else 0,
                "cap": self.cap if self.kind in ("csa", "hca") else 0, "ratio": self.ratio if self.kind == "hca" else 1,
                "scale": _float_literal(self.scale_value)}

    def params(self) -> dict[str, Any]:
        """Render parameters (without ``part``): the lists and the SIMT kernel's block geometry."""
        return {**self.list_params(), "splits": self.splits, "heads_per_block": self.heads_per_block,
                "threads": self.block_threads(), "combine_threads": self.combine_threads()}


def _float_literal(x: float) -> str:
    """C float literal of fp32(x) (9 significant digits round-trip a float)."""
    return f"{float(torch.tensor(x, dtype=torch.float32)):.9e}f"


# ------------------------------------------------------------------------------------------------- rendering
def render_attention(spec: AttentionSpec, target: Target, name: str) -> list[KernelSource]:
    """Rendered kernels of ``spec`` for ``target``: ``[main]`` (splits = 1) or ``[main, combine]``; the combine
    kernel is named ``name + "_combine"``.

    Raises:
        RenderError: the spec does not fit the target (block size not a multiple of its wave, too much shared
            memory) or a template parameter is missing.
    """
    nt = spec.block_threads()
    if nt % target.wave:
        raise RenderError(f"sparse attention {name}: block size {nt} is not a multiple of {target.slug}'s wave "
                          f"{target.wave}")
    if spec.smem_bytes() > STATIC_SMEM_LIMIT:
        raise RenderError(f"sparse attention {name}: {spec.smem_bytes()} bytes of shared memory exceed "
                          f"{STATIC_SMEM_LIMIT}")
    out = [render(TEMPLATE, name, FAMILY, target, {**spec.params(), "part": "main"})]
    if spec.splits > 1:
        out.append(render(TEMPLATE, f"{name}_combine", FAMILY, target, {**spec.params(), "part": "combine"}))
    return out




def launch_shapes(spec: AttentionSpec) -> list[Launch]:
    """Launches in order: main on grid (H / heads_per_block, q * splits) (block x = head group, y = row * splits
    + split), then, when split, the combine on grid (H, q). Both use static shared memory only."""
    out = [Launch((spec.heads // spec.heads_per_block, spec.q * spec.splits, 1),
                  (spec.block_threads(), 1, 1), kernel="main")]
    if spec.splits > 1:
        out.append(Launch((spec.heads, spec.q, 1), (spec.combine_threads(), 1, 1), kernel="combine"))
    return out


def arg_names(spec: AttentionSpec) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel (``main``, and ``combine`` when split)."""
    main = ["q", "ring", "kv_new"]
    if spec.kind in ("csa", "hca"):
        main.append("comp")
    if spec.kind == "csa":
        main.append("sel")
    main += ["sink", "ws" if spec.splits > 1 else "out", "pos"]
    if spec.kind == "hca":
        main.append("live")
    out = {"main": main}
    if spec.splits > 1:
        out["combine"] = ["ws", "sink", "out"]
    return out


def workspace_floats(spec: AttentionSpec) -> int:
    """fp32 workspace elements of a split launch (0 when splits = 1): partial acc [q, H, splits, hd], then
    (m, l) pairs [q, H, splits, 2]."""
    if spec.splits == 1:
        return 0
    return spec.q * spec.heads * spec.splits * (spec.head_dim + 2)


# ------------------------------------------------------------------------------------------------ reference
def _comp_list(spec: AttentionSpec, comp: torch.Tensor | None, sel: torch.Tensor | None, i: int, p: int,
               live: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if spec.kind == "csa":
        assert comp is not None and sel is not None
        s = sel[i]
        if bool((s >= comp.shape[0]).any()):
            raise ValueError(f"sel row {i} holds ids >= cap {comp.shape[0]}")
        return comp[s.clamp(min=0)], s >= 0
    if spec.kind == "hca":
        assert comp is not None
        lim = min((p + 1) // spec.ratio, live, comp.shape[0])
        return comp, torch.arange(comp.shape[0], device=comp.device) < lim
    return None, None


def reference(spec: AttentionSpec, q: torch.Tensor, ring: torch.Tensor, kv_new: torch.Tensor,
              comp: torch.Tensor | None, sel_or_none: torch.Tensor | None, sink: torch.Tensor, pos: int,
              live: int) -> torch.Tensor:
    """What the kernels compute, by the reference's own code (:func:`ds4c.reference.blocks.attention_row`, as
    the reference model and the IR's ``sparse_attention`` op use it).

    Args:
        q bf16 [q, H, hd]; ring bf16 [W, hd]; kv_new bf16 [q, hd]; comp bf16 [cap, hd] (csa, hca; else None);
        sel_or_none int64 [q, topk] (csa, -1 = masked; else None); sink fp32 [H]; pos: position of row 0;
        live: hca's live compressed rows (ignored otherwise).
    Returns:
        bf16 [q, H, hd].
    """
    from ds4c.reference import blocks as B

    if spec.kind == "dspark":
        return _dspark_reference(spec, q, ring, kv_new, sink, pos)
    outs = []
    for i in range(spec.q):
        p = pos + i
        c, ok = _comp_list(spec, comp, sel_or_none, i, p, live)
        outs.append(B.attention_row(q[i], ring, kv_new, p, pos, spec.window, c, ok, sink, spec.scale_value))
    return torch.stack(outs)


def _dspark_reference(spec: AttentionSpec, q: torch.Tensor, ring: torch.Tensor, kv_new: torch.Tensor,
                      sink: torch.Tensor, pos: int) -> torch.Tensor:
    """Kind ``dspark`` by the reference's P9 (as :class:`ds4c.drafters.dspark_model.DSparkModel` calls it)."""
    from ds4c.reference import primitives as P

    lst = torch.cat((ring[:min(spec.window, pos)], kv_new))
    ok = torch.ones(lst.shape[0], dtype=torch.bool, device=lst.device)
    return torch.stack([P.sparse_attention(q[i], lst, ok, sink, spec.scale_value) for i in range(spec.q)])


def kernel_model(spec: AttentionSpec, q: torch.Tensor, ring: torch.Tensor, kv_new: torch.Tensor,
                 comp: torch.Tensor | None, sel_or_none: torch.Tensor | None, sink: torch.Tensor, pos: int,
                 live: int) -> torch.Tensor:
    """A torch model of the kernels' split-K work division and combine (same lists, chunk ranges per split,
    merge formula; sums in torch's order): for checking the split logic on the CPU. Equals :func:`reference`
    up to fp32 summation order when ``splits = 1``. Returns bf16 [q, H, hd]."""
    from ds4c.reference import blocks as B

    f32 = torch.float32
    qf_all = q.float()
    outs = []
    for i in range(spec.q):
        p = pos + i
        if spec.kind == "dspark":
            lim = min(spec.window, pos)
            kv = torch.cat((ring[:lim], kv_new))
            ok = torch.ones(kv.shape[0], dtype=torch.bool, device=kv.device)
        else:
            kv, ok = B.window_rows(ring, kv_new, p, pos, spec.window)
            c, cok = _comp_list(spec, comp, sel_or_none, i, p, live)
            if c is not None:
                kv, ok = torch.cat((kv, c)), torch.cat((ok, cok))
        # the kernel's list end (masked entries past it are never visited)
        if spec.kind == "dspark":
            n_end = kv.shape[0]
        elif spec.kind == "csa":
            n_end = spec.window + spec.topk
        elif spec.kind == "hca" and min((p + 1) // spec.ratio, live, spec.cap) > 0:
            n_end = spec.window + min((p + 1) // spec.ratio, live, spec.cap)
        else:
            n_end = min(p + 1, spec.window)
        nch = -(-n_end // CHUNK)
        cps = -(-nch // spec.splits)
        pad = -kv.shape[0] % CHUNK
        kvf = torch.cat((kv.to(f32), kv.new_zeros(pad, kv.shape[1], dtype=f32)))
        ok = torch.cat((ok, ok.new_zeros(pad)))
        kvf = torch.where(ok.unsqueeze(-1), kvf, torch.zeros((), dtype=f32))
        H = q.shape[1]
        parts = []
        for s in range(spec.splits):
            m = torch.full((H,), float("-inf"), dtype=f32)
            l = torch.zeros(H, dtype=f32)
            acc = torch.zeros(H, q.shape[2], dtype=f32)
            for ch in range(s * cps, min(nch, (s + 1) * cps)):
                k, v = kvf[ch * CHUNK:(ch + 1) * CHUNK], ok[ch * CHUNK:(ch + 1) * CHUNK]
                if not bool(v.any()):
                    continue
                sc = ((qf_all[i] @ k.T) * spec.scale_value).masked_fill(~v, float("-inf"))
                mn = torch.maximum(m, sc.max(-1).values)
                alpha = torch.exp(m - mn)
                pr = torch.exp(sc - mn.unsqueeze(-1))
                l = l * alpha + pr.sum(-1)
                acc = acc * alpha.unsqueeze(-1) + pr.to(torch.bfloat16).to(f32) @ k
                m = mn
            parts.append((m, l, acc))
        M = torch.stack([m for m, _, _ in parts]).max(0).values
        L = torch.zeros_like(M)
        A = torch.zeros(H, q.shape[2], dtype=f32)
        for m, l, acc in parts:
            w = torch.where(m > float("-inf"), torch.exp(m - M), torch.zeros((), dtype=f32))
            L = L + w * l
            A = A + w.unsqueeze(-1) * acc
        L = L + torch.exp(sink - M)
        outs.append((A / L.unsqueeze(-1)).to(torch.bfloat16))
    return torch.stack(outs)
