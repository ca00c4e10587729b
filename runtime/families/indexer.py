"""The indexer top-k kernel family: the ``span_mask`` + ``indexer_topk`` IR ops of a CSA layer (docs/model.md
5.2(f.6-7), and section 6's rule for verify rows: row i sees keys ``j < (p_i + 1) // 4``) as two
launches. Template: ``templates/indexer/indexer_topk.cu.j2`` (its header states each stage's contract).

What one call computes, for ``q`` rows (positions ``positions[0..q-1]``, normally ``pos .. pos+q-1``):

* ``nvalid_i = clamp(min((positions[i] + 1) // ratio, live), 0, cap)`` (positions and live are device int64,
  read by the kernels at run time, so a captured graph replays with new values);
* stage ``scores`` (grid ``(ceil(cap / key_tile), q)``): per key ``j < nvalid_i``,
  ``score = bf16(sum_h bf16(relu(bf16(qi_h . K_j)) * hw_h))``: the dot products in fp32 (one FMA chain over
  d = 0..dim-1), the head sum in fp32 over heads 0..H-1 in order; keys ``nvalid_i <= j < cap`` get ``-inf``.
  A block owns ``key_tile`` keys of one row and all heads; blocks whose keys are all masked only write -inf;
* stage ``select`` (grid ``(q)``, one block per row): the ids of the top ``min(topk, nvalid_i)`` scores in
  descending order, ties to the lower id (NaN first, -0 == +0: torch's stable descending sort), then ``-1``
  up to ``kout = min(topk, cap)``. Deterministic: a 16-bit radix select for the threshold key (two bits per
  step, block reductions), a compaction in id order (block scan) that keeps every key above the threshold and
  the lowest-id keys equal to it, then each selected (score, id) pair is placed by its rank among the
  selected (an O(k^2 / threads) count in shared memory).

Why two launches: scoring is parallel over keys (up to 1280 blocks at cap 16384, q 5) while the selection
needs all of a row's scores; one launch would need a grid-wide barrier, which the vendor prelude does not
offer. The scores buffer (bf16 [q, cap], 160 KiB at cap 16384, q 5) is a workspace between them and stays
in L2; it is also what the GPU check compares.

Kernel arguments, in order (:func:`arg_names`); device pointers of contiguous tensors, 16-byte aligned:

* scores: ``qi`` bf16 [q, H, dim]; ``keys`` bf16 [cap, dim]; ``hw`` bf16 [q, H]; ``positions`` int64 [q];
  ``live`` int64 [1]; ``scores`` bf16 [q, cap] (out).
* select: ``scores``; ``positions``; ``live``; ``out`` int64 [q, kout] (out).

Numerics: bit-exact with :func:`kernel_model` for any input. Against :func:`reference` (torch's fp32 matmul
over tiles of 64 keys) the dot products are summed in another order; they are identical whenever every
partial sum is exact in fp32, which holds for the model's inputs (qi and the keys are FP4 fake-quantized,
P4: e2m1 values times a power of two per 32-block), so the ids are identical too. With plain bf16 inputs a
dot can round to a neighbouring bf16 (rarely), and the ids then follow the kernel's own scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

TEMPLATE = "indexer/indexer_topk.cu.j2"
FAMILY = "indexer"
STAGES = ("scores", "select")
STATIC_SMEM_LIMIT = 48 * 1024  # static shared memory (CUDA); also under the 64 KiB LDS of gfx942 / gfx1151
MAX_CAP = 32768  # select packs two counts <= cap into one 32-bit word and ids into 16 bits
THREAD_MULTIPLE = 64  # block sizes are multiples of the largest wave (64) so every target renders the same shape
SELECT_THREADS_MAX = 1024
NEG_INF_BF16 = 0xFF80


@dataclass(frozen=True)
class IndexerSpec:
    """One indexer call (all render-time; ``q`` only changes the launch grids, not the kernels).

    Attributes:
        q: rows per launch (verify width, 1..5).
        heads: H (64 official, 4 tiny), a multiple of 4.
        dim: indexer head dim (128), a multiple of 8.
        topk: ``index_topk`` (512).
        cap: rows of the indexer-key bucket (1 .. 32768).
        ratio: compression ratio of the indexer keys (4).
        key_tile: keys per scores block; 0 = automatic (64 at H = 64; more at small H so that a block has a
            multiple of 64 threads).
        select_threads: select block size; 0 = automatic (:meth:`select_block`).
    """

    q: int
    heads: int = 64
    dim: int = 128
    topk: int = 512
    cap: int = 1024
    ratio: int = 4
    key_tile: int = 0
    select_threads: int = 0

    def __post_init__(self) -> None:
        bad = []
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if self.heads < 4 or self.heads % 4:
            bad.append(f"heads {self.heads} (expected a positive multiple of 4)")
        if self.dim < 8 or self.dim % 8:
            bad.append(f"dim {self.dim} (expected a positive multiple of 8)")
        if self.topk < 1:
            bad.append(f"topk {self.topk} (expected >= 1)")
        if not 1 <= self.cap <= MAX_CAP:
            bad.append(f"cap {self.cap} (expected 1 .. {MAX_CAP})")
        if self.ratio < 1:
            bad.append(f"ratio {self.ratio} (expected >= 1)")
        if self.key_tile and (self.key_tile % 4 or self.key_tile < 4):
            bad.append(f"key_tile {self.key_tile} (expected a positive multiple of 4, or 0)")
        if self.select_threads and (self.select_threads % THREAD_MULTIPLE
                                    or not THREAD_MULTIPLE <= self.select_threads <= SELECT_THREADS_MAX):
            bad.append(f"select_threads {self.select_threads} (expected a multiple of {THREAD_MULTIPLE} up to "
                       f"{SELECT_THREADS_MAX}, or 0)")
        if bad:
            raise RenderError(f"IndexerSpec: bad {'; '.join(bad)}")
        if self.scores_smem_bytes() > STATIC_SMEM_LIMIT:
            raise RenderError(f"IndexerSpec: the scores stage needs {self.scores_smem_bytes()} bytes of shared "
                              f"memory (> {STATIC_SMEM_LIMIT}); use a smaller key_tile")
        if self.select_smem_bytes() > STATIC_SMEM_LIMIT:
            raise RenderError(f"IndexerSpec: the select stage needs {self.select_smem_bytes()} bytes of shared "
                              f"memory (> {STATIC_SMEM_LIMIT}); topk {self.topk} is too large")

    # ------------------------------------------------------------------------------------------ derived
    @property
    def kout(self) -> int:
        """Output ids per row: ``min(topk, cap)``."""
        return min(self.topk, self.cap)

    @property
    def th(self) -> int:
        """Heads per scores thread: 8 (two float4 at 4g and H/2 + 4g) when H % 8 == 0, else 4."""
        return 8 if self.heads % 8 == 0 else 4

    @property
    def kt(self) -> int:
        """Keys per scores block (``key_tile``, or the smallest of 64, 128, ... giving a multiple of 64 threads)."""
        if self.key_tile:
            return self.key_tile
        kt = 64
        while (self.heads // self.th) * (kt // 4) % THREAD_MULTIPLE:
            kt *= 2
        return kt

    @property
    def scores_threads(self) -> int:
        """(H / th) head groups x (kt / 4) key groups (128 at H = 64, kt = 64)."""
        return (self.heads // self.th) * (self.kt // 4)

    @property
    def d_chunk(self) -> int:
        """d per shared-memory chunk of the scores stage: the largest of 64, 32, 16, 8 dividing dim whose
        chunk fits the static shared-memory limit."""
        for dc in (64, 32, 16, 8):
            if self.dim % dc == 0 and 4 * max(dc * (self.heads + self.kt), self.heads * self.kt) <= STATIC_SMEM_LIMIT:
                return dc
        return 8

    @property
    def n_tiles(self) -> int:
        return math.ceil(self.cap / self.kt)

    def scores_smem_bytes(self) -> int:
        return 4 * max(self.d_chunk * (self.heads + self.kt), self.heads * self.kt)

    def select_block(self) -> int:
        """Select block size: ``select_threads``, or ``clamp(pow2ceil(max(cap / 16, 2 * kout)), 128, 1024)``
        (1024 at the official shapes: 16 scores per thread at cap 16384, two threads per rank at kout 512)."""
        if self.select_threads:
            return self.select_threads
        want = max(math.ceil(self.cap / 16), 2 * self.kout)
        return min(SELECT_THREADS_MAX, max(128, 1 << (want - 1).bit_length()))

    @property
    def ept(self) -> int:
        """Scores per select thread: ``ceil(cap / threads)``, rounded up to even (to a multiple of 8 when it
        is > 8, for 16-byte loads)."""
        e = math.ceil(self.cap / self.select_block())
        e += e & 1
        if e > 8:
            e = 8 * math.ceil(e / 8)
        return e

    @property
    def vec(self) -> bool:
        return self.ept % 8 == 0 and self.cap % 8 == 0

    @property
    def rank_split(self) -> int:
        """Threads per selected element in the rank phase (``threads // kout``; 1 = each thread loops)."""
        return max(1, self.select_block() // self.kout)

    def select_smem_bytes(self, wave: int = 32) -> int:
        nw = self.select_block() // wave
        return 4 * (5 * nw + 4 * -(-self.kout // 4) + (self.rank_split * self.kout if self.rank_split > 1 else 0))

    def params(self, stage: str) -> dict[str, Any]:
        """Render parameters of one stage."""
        p = {"stage": stage, "heads": self.heads, "dim": self.dim, "cap": self.cap, "ratio": self.ratio,
             "topk": self.topk, "kout": self.kout}
        if stage == "scores":
            p.update(key_tile=self.kt, d_chunk=self.d_chunk, th=self.th)
        else:
            p.update(threads=self.select_block(), ept=self.ept, rank_split=self.rank_split, vec=self.vec)
        return p

    def kernel_key(self) -> str:
        """Name part that identifies the kernels (q excluded: the same kernels serve every width)."""
        return f"h{self.heads}_d{self.dim}_k{self.topk}_c{self.cap}_r{self.ratio}"


# ------------------------------------------------------------------------------------------------- rendering
def render_indexer(spec: IndexerSpec, target: Target, name: str | None = None) -> list[KernelSource]:
    """Rendered kernels of ``spec`` for ``target``, in launch order: ``[scores, select]``, named
    ``name + "_scores"`` and ``name + "_select"`` (``name`` defaults to ``"indexer_" + spec.kernel_key()``).

    Raises:
        RenderError: a block size is not a multiple of the target's wave, or a template parameter is missing.
    """
    name = name or f"indexer_{spec.kernel_key()}"
    if spec.select_block() % target.wave:
        raise RenderError(f"indexer {name}: select block size {spec.select_block()} is not a multiple of "
                          f"{target.slug}'s wave {target.wave}")
    return [render(TEMPLATE, f"{name}_{stage}", FAMILY, target, spec.params(stage)) for stage in STAGES]




def launch_shapes(spec: IndexerSpec) -> list[Launch]:
    """Launches in order, on one stream: scores on grid (ceil(cap / kt), q) x (H / th * kt / 4) threads
    (128 at H = 64), then select on grid (q) x :meth:`IndexerSpec.select_block` threads."""
    return [Launch((spec.n_tiles, spec.q, 1), (spec.scores_threads, 1, 1), kernel="scores"),
            Launch((spec.q, 1, 1), (spec.select_block(), 1, 1), kernel="select")]


def arg_names(spec: IndexerSpec) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel; see the module docstring for types and shapes."""
    return {"scores": ["qi", "keys", "hw", "positions", "live", "scores"],
            "select": ["scores", "positions", "live", "out"]}


def arg_shapes(spec: IndexerSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every argument (``scores`` is the workspace between the two launches)."""
    q, H, d = spec.q, spec.heads, spec.dim
    bf = torch.bfloat16
    return {"qi": ((q, H, d), bf), "keys": ((spec.cap, d), bf), "hw": ((q, H), bf), "positions": ((q,), torch.int64),
            "live": ((1,), torch.int64), "scores": ((q, spec.cap), bf), "out": ((q, spec.kout), torch.int64)}


def nvalid(spec: IndexerSpec, positions: torch.Tensor, live: int | torch.Tensor) -> list[int]:
    """Visible keys per row: ``clamp(min((p_i + 1) // ratio, live), 0, cap)``."""
    lv = int(live.reshape(-1)[0]) if isinstance(live, torch.Tensor) else int(live)
    return [max(0, min((int(p) + 1) // spec.ratio, lv, spec.cap)) for p in positions.reshape(-1).tolist()]


def bytes_moved(spec: IndexerSpec, positions: torch.Tensor, live: int | torch.Tensor) -> int:
    """DRAM bytes of one call: the visible key rows (the longest row's; L2 serves the other rows), qi, hw,
    positions, the scores written and read back, the ids written."""
    n = max(nvalid(spec, positions, live) + [0])
    return (n * spec.dim * 2 + spec.q * spec.heads * (spec.dim + 1) * 2 + spec.q * 8 + 8
            + 2 * spec.q * spec.cap * 2 + spec.q * spec.kout * 8)


# ------------------------------------------------------------------------------------------------ reference
def _masks(spec: IndexerSpec, positions: torch.Tensor, live: int | torch.Tensor) -> torch.Tensor:
    j = torch.arange(spec.cap)
    return torch.stack([j < n for n in nvalid(spec, positions, live)])


def reference(spec: IndexerSpec, qi: torch.Tensor, keys: torch.Tensor, hw: torch.Tensor, positions: torch.Tensor,
              live: int | torch.Tensor) -> dict[str, torch.Tensor]:
    """The CPU reference of one call: ``{"scores": bf16 [q, cap], "out": int64 [q, kout]}`` from
    :func:`ds4c.reference.primitives.index_scores` and :func:`ds4c.reference.blocks.indexer_select`, with the
    ``span_mask`` of the IR (``j < (p_i + 1) // ratio`` and ``j < live``)."""
    from ds4c.reference import blocks as B
    from ds4c.reference import primitives as P

    qi, keys, hw = qi.cpu(), keys.cpu(), hw.cpu()
    masks = _masks(spec, positions.cpu(), live)
    scores = torch.stack([P.index_scores(qi[i], keys, hw[i], masks[i]) for i in range(qi.shape[0])])
    out = torch.stack([B.indexer_select(keys, masks[i], qi[i], hw[i], spec.topk) for i in range(qi.shape[0])])
    return {"scores": scores, "out": out}


def kernel_scores(spec: IndexerSpec, qi: torch.Tensor, keys: torch.Tensor, hw: torch.Tensor,
                  positions: torch.Tensor, live: int | torch.Tensor) -> torch.Tensor:
    """The scores stage's exact arithmetic on the CPU: fp32 dot products summed over d = 0..dim-1 in order
    (a product of two bf16 is exact in fp32, so FMA and mul+add agree), bf16, ReLU, times hw, bf16, fp32 head
    sum in head order, bf16; -inf past nvalid. bf16 [q, cap]."""
    qf, kf, hf = qi.cpu().float(), keys.cpu().float(), hw.cpu().float()
    out = []
    for i, n in enumerate(nvalid(spec, positions.cpu(), live)):
        acc = torch.zeros(spec.heads, spec.cap)
        for d in range(spec.dim):
            acc = acc + qf[i, :, d:d + 1] * kf[:, d].unsqueeze(0)
        w = (torch.relu(acc.to(torch.bfloat16)).float() * hf[i].unsqueeze(1)).to(torch.bfloat16).float()
        s = w[0].clone()
        for h in range(1, spec.heads):
            s = s + w[h]
        s = s.to(torch.bfloat16)
        s[n:] = float("-inf")
        out.append(s)
    return torch.stack(out)


def _mono(bits: int) -> int:
    """The select stage's 16-bit order key of a bf16 bit pattern (larger = larger score)."""
    if bits & 0x7FFF > 0x7F80:
        return 0xFFFF
    if bits == 0x8000:
        bits = 0
    return (~bits & 0xFFFF) if bits & 0x8000 else (bits | 0x8000)


def kernel_select(spec: IndexerSpec, scores: torch.Tensor, positions: torch.Tensor,
                  live: int | torch.Tensor) -> torch.Tensor:
    """The select stage's algorithm step by step on the CPU (threshold search two bits at a time, compaction
    in id order, rank placement), for testing its logic without a GPU. ``scores`` bf16 [q, cap] -> int64
    [q, kout]."""
    bits = scores.cpu().contiguous().view(torch.int16).to(torch.int32).bitwise_and(0xFFFF)
    out = torch.full((scores.shape[0], spec.kout), -1, dtype=torch.int64)
    for i, n in enumerate(nvalid(spec, positions.cpu(), live)):
        keys = [_mono(int(b)) for b in bits[i, :n].tolist()]
        k = min(spec.topk, n)
        thr = 0
        if k < n:
            for step in range(8):
                sh = 14 - 2 * step
                cnt = [sum(1 for x in keys if x >= (thr | (d << sh))) for d in (1, 2, 3)]
                dsel = 3 if cnt[2] >= k else 2 if cnt[1] >= k else 1 if cnt[0] >= k else 0
                thr |= dsel << sh
        need = k - sum(1 for x in keys if x > thr)
        sel, er = [], 0
        for j, x in enumerate(keys):  # id order = the thread-contiguous order of the kernel
            take = x > thr
            if x == thr and x != 0:
                take, er = er < need, er + 1
            if take:
                sel.append((x << 16) | (0xFFFF - j))
        assert len(sel) == k
        for c in sel:
            out[i, sum(1 for o in sel if o > c)] = 0xFFFF - (c & 0xFFFF)
    return out


def random_inputs(spec: IndexerSpec, generator: torch.Generator | None = None, fp4: bool = True,
                  ties: float = 0.25, pos: int | None = None, live: int | None = None) -> dict[str, torch.Tensor]:
    """Random inputs shaped like the model's: ``qi`` and ``keys`` FP4 fake-quantized (P4, blocks of 32) when
    ``fp4``; ``hw`` of both signs at the model's scale (``128^-1/2 * 64^-1/2`` times ~N(0, 4)); a fraction
    ``ties`` of the key rows are copies of 8 pool rows (exact score ties, also across the top-k cut) and 4 rows
    are zero (score +-0); ``positions`` = ``pos .. pos+q-1`` (default: the last row sees every key) and
    ``live`` (default cap)."""
    from ds4c.quant import fp4_fake_quant

    g = generator or torch.Generator().manual_seed(0)
    q, H, d, cap = spec.q, spec.heads, spec.dim, spec.cap
    qi = torch.randn(q, H, d, generator=g).to(torch.bfloat16)
    keys = torch.randn(cap, d, generator=g).to(torch.bfloat16)
    if fp4 and d % 32 == 0:
        qi, keys = fp4_fake_quant(qi, 32), fp4_fake_quant(keys, 32)
    n_copy = int(cap * ties)
    if n_copy and cap > 8:
        pool = keys[torch.randperm(cap, generator=g)[:8]].clone()
        dst = torch.randperm(cap, generator=g)[:n_copy]
        keys[dst] = pool[torch.randint(8, (n_copy,), generator=g)]
    if cap > 8:
        keys[torch.randperm(cap, generator=g)[:4]] = 0
    hw = (torch.randn(q, H, generator=g) * 2.0 * (d ** -0.5) * (H ** -0.5)).to(torch.bfloat16)
    if pos is None:
        pos = spec.ratio * cap - q  # row q-1: (pos + q) // ratio = cap
    positions = torch.arange(pos, pos + q, dtype=torch.int64)
    return {"qi": qi, "keys": keys, "hw": hw, "positions": positions,
            "live": torch.tensor([cap if live is None else live], dtype=torch.int64)}
