"""The router kernel family: the ``router_scores`` + ``route`` IR ops of an MoE layer (docs/model.md
5.2(o.2-4), P10) as one launch, one block per row. Template: ``templates/router/route.cu.j2``.

Per row r:

* ``s = sqrt(softplus(z))`` (fp32; softplus as torch's, threshold 20: ``z > 20 -> z``, else
  ``log1p(exp(z))``); with ``from_logits=False`` the input already is ``s``;
* ids: ``hash``: ``tid2eid[tokens[r], 0:k]`` (the token id read from device memory, so a captured graph
  replays with new tokens); scored: the top ``k`` of ``s + bias`` (bias only for selection), descending,
  ties to the lower expert id (NaN first, -0 == +0: torch's stable descending sort). Each thread ranks its
  experts against all E in shared memory; the ``k`` of rank < k write their slot;
* weights: ``s[ids_j] / (s[ids_0] + ... + s[ids_{k-1}]) * route_scale`` (fp32, the sum in slot order).

Kernel arguments, in order (:func:`arg_names`); device pointers of contiguous tensors:
``z`` fp32 [q, E]; ``tokens`` int64 [q] (read only by hash routing; any valid pointer otherwise);
``table`` (hash: int64 [V, k] tid2eid; scored: fp32 [E] selection bias); ``ids`` int64 [q, k] (out);
``weights`` fp32 [q, k] (out). A hash-table entry outside ``[0, E)`` is written to ``ids`` as is and gives
NaN weights (never an out-of-bounds read); a token id outside the table is not checked.

Numerics: ``s`` uses the device's accurate ``expf`` / ``log1pf`` / ``sqrtf`` (HIP: the prelude's
``log(1 + x)``), so it can differ from torch's CPU values by an ulp; everything else is bit-for-bit the
reference's op order. The ids are identical to :func:`reference` unless two candidates' ``s + bias`` lie within
an ulp of each other (exact ties, the common case of equal logits, are resolved identically).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

TEMPLATE = "router/route.cu.j2"
FAMILY = "router"
MAX_THREADS = 1024
THREAD_MULTIPLE = 64


def _float_literal(x: float) -> str:
    """C hex literal of fp32(x), exact (the fp32 value torch multiplies by for a Python-float scale)."""
    return float(torch.tensor(x, dtype=torch.float32)).hex() + "f"


@dataclass(frozen=True)
class RouterSpec:
    """One router call (all render-time; ``q`` only changes the grid).

    Attributes:
        q: rows per launch (verify width, 1..5).
        experts: E (256 official, 16 tiny).
        k: experts per token (6 official, 4 tiny).
        hash: hash routing (layers 0-2: ``tid2eid``) instead of scored top-k.
        scale: ``route_scale`` (1.5).
        from_logits: the input is the router logits ``z`` (True) or already ``s`` (False).
        threads: block size; 0 = automatic (E rounded up to a multiple of 64, at most 1024).
    """

    q: int
    experts: int = 256
    k: int = 6
    hash: bool = False
    scale: float = 1.5
    from_logits: bool = True
    threads: int = 0

    def __post_init__(self) -> None:
        bad = []
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if self.experts < 1:
            bad.append(f"experts {self.experts} (expected >= 1)")
        if not 1 <= self.k <= self.experts:
            bad.append(f"k {self.k} (expected 1 .. experts)")
        if self.threads and (self.threads % THREAD_MULTIPLE or not 0 < self.threads <= MAX_THREADS):
            bad.append(f"threads {self.threads} (expected a multiple of {THREAD_MULTIPLE} up to {MAX_THREADS}, or 0)")
        if self.hash and self.k > self.block_threads():
            bad.append(f"k {self.k} larger than the block ({self.block_threads()} threads)")
        if bad:
            raise RenderError(f"RouterSpec: bad {'; '.join(bad)}")

    def block_threads(self) -> int:
        if self.threads:
            return self.threads
        return min(MAX_THREADS, THREAD_MULTIPLE * -(-self.experts // THREAD_MULTIPLE))

    def params(self) -> dict[str, Any]:
        return {"experts": self.experts, "k": self.k, "threads": self.block_threads(), "hash": self.hash,
                "from_logits": self.from_logits, "scale_literal": _float_literal(self.scale)}

    def kernel_key(self) -> str:
        """Name part that identifies the kernel (q excluded)."""
        return (f"{'hash' if self.hash else 'topk'}_e{self.experts}_k{self.k}"
                + ("" if self.from_logits else "_s") + ("" if self.scale == 1.5 else f"_x{self.scale:g}"))


def render_router(spec: RouterSpec, target: Target, name: str | None = None) -> list[KernelSource]:
    """The rendered kernel of ``spec`` for ``target`` (a one-element list, like the other families), named
    ``name`` (default ``"route_" + spec.kernel_key()``).

    Raises:
        RenderError: the block size is not a multiple of the target's wave.
    """
    name = name or f"route_{spec.kernel_key()}".replace(".", "p")
    if spec.block_threads() % target.wave:
        raise RenderError(f"router {name}: block size {spec.block_threads()} is not a multiple of {target.slug}'s "
                          f"wave {target.wave}")
    return [render(TEMPLATE, name, FAMILY, target, spec.params())]




def launch_shapes(spec: RouterSpec) -> list[Launch]:
    """One launch: grid (q) x :meth:`RouterSpec.block_threads` (256 at E = 256)."""
    return [Launch((spec.q, 1, 1), (spec.block_threads(), 1, 1), kernel="route")]


def arg_names(spec: RouterSpec) -> dict[str, list[str]]:
    """Kernel argument names in order (the same for hash and scored routing; ``table`` changes type)."""
    return {"route": ["z", "tokens", "table", "ids", "weights"]}


def arg_shapes(spec: RouterSpec, n_vocab: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every argument (``table`` of hash routing needs ``n_vocab``)."""
    q, E, k = spec.q, spec.experts, spec.k
    table = ((n_vocab, k), torch.int64) if spec.hash else ((E,), torch.float32)
    return {"z": ((q, E), torch.float32), "tokens": ((q,), torch.int64), "table": table,
            "ids": ((q, k), torch.int64), "weights": ((q, k), torch.float32)}


def bytes_moved(spec: RouterSpec) -> int:
    """DRAM bytes of one call: z, the bias (or the q table rows and tokens), ids and weights."""
    q, E, k = spec.q, spec.experts, spec.k
    return q * E * 4 + (q * (k + 1) * 8 if spec.hash else E * 4) + q * k * 12


def reference(spec: RouterSpec, z: torch.Tensor, tokens: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
    """The CPU reference: ``{"ids": int64 [q, k], "weights": fp32 [q, k]}`` from
    :func:`ds4c.reference.primitives.sqrtsoftplus` and :func:`ds4c.reference.blocks.route` (the IR's
    ``router_scores`` then ``route``)."""
    from ds4c.reference import blocks as B
    from ds4c.reference import primitives as P

    z, tokens, table = z.cpu(), tokens.cpu(), table.cpu()
    s = P.sqrtsoftplus(z) if spec.from_logits else z
    if spec.hash:
        ids, w = B.route(s, None, table[tokens], spec.k, spec.scale)
    else:
        ids, w = B.route(s, table, None, spec.k, spec.scale)
    return {"ids": ids, "weights": w}


def random_inputs(spec: RouterSpec, generator: torch.Generator | None = None, n_vocab: int = 1000,
                  ties: bool = True) -> dict[str, torch.Tensor]:
    """Random inputs: logits ~N(0, 2); a bias of both signs, zero on a quarter of the experts (at least
    k + 2) (scored), or a tid2eid table of distinct ids per token (hash); token ids in ``[0, n_vocab)``. With
    ``ties`` (E >= 8), the rows hold exact ties of ``s + bias`` across the top-k cut: equal logits on zero-bias
    experts placed at the top (even rows: k + 2 tied; odd rows: k - 2 distinct leaders, then 4 tied), and the
    last row (q > 1) has all logits equal."""
    g = generator or torch.Generator().manual_seed(0)
    q, E, k = spec.q, spec.experts, spec.k
    z = torch.randn(q, E, generator=g) * 2.0
    zero = torch.randperm(E, generator=g)[: min(E, max(k + 2, E // 4))]
    if spec.hash:
        table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n_vocab)]).to(torch.int64)
    else:
        table = (torch.randn(E, generator=g) * 0.05).to(torch.float32)
        table[zero] = 0.0
    if ties and E >= 8:
        for r in range(q):
            top = float(z[r].max()) + 1.0
            order = zero[torch.randperm(zero.numel(), generator=g)]
            if r == q - 1 and q > 1:
                z[r] = z[r, 0]
            elif r % 2 == 0:
                z[r, order[: k + 2]] = top
            else:
                lead = max(0, k - 2)
                z[r, order[:lead]] = top + 2.0 + 0.5 * torch.arange(lead, dtype=torch.float32)
                z[r, order[lead:lead + 4]] = top
    tokens = torch.randint(n_vocab, (q,), generator=g, dtype=torch.int64)
    return {"z": z, "tokens": tokens, "table": table}
