"""The fused hyper-connection (HC) kernel family: one HC boundary (the ``fused`` ops ``hc_embed_pre``,
``hc_post_pre`` and ``hc_post_head`` of ``passes/fuse_hc.py``) as two launches. Template:
``templates/hc/hc_fused.cu.j2`` (its header describes the block layout).

Variants (docs/model.md 5.1, 5.2(a),(b),(l),(m),(n),(p), 5.4.1, P1, P8):

* ``post_pre``: HC post of a sub-block (``x_new = bf16(post_k out + sum_j comb[j,k] x_j)``), then the next
  HC pre on ``x_new`` (mixing logits, Sinkhorn split, pre-mix) and its RMSNorm. Outputs ``x_new``, ``y``,
  ``post_new``, ``comb_new``.
* ``embed_pre``: embedding row of each token copied into the hc streams (``x``), then HC pre + RMSNorm.
  Outputs ``x``, ``y``, ``post_new``, ``comb_new``.
* ``post_head``: the last HC post, the HC head (sigmoid gate over hc logits, no Sinkhorn) and the final
  RMSNorm. Output ``y`` only; with ``streams`` also ``x_new`` (the last layer's new streams, written by stage
  mix as in ``post_pre``: for a reader outside the boundary, the DSpark tap of spec 5.2(q)).
* ``pre`` (a layer-split shard's first boundary): HC pre + RMSNorm on the incoming HC state ``x``. Outputs
  ``y``, ``post_new``, ``comb_new``.
* ``post_out`` (a shard's last boundary): the HC post alone, one launch (stage mix without mixing sums).
  Output ``x_new``, the HC state handed to the next shard. ``post_out`` then ``pre`` give ``post_pre``'s
  results bit for bit (the same bf16 streams, the same sums over them in the same order).

Why two launches: the mixing GEMV reads ``fn`` [n_mix, hc*D] fp32 (1.5 MB at D = 4096, the whole boundary's
DRAM traffic), so it must run on many blocks; the Sinkhorn split needs its complete sums. Stage ``mix`` (grid
``D / 32`` blocks of 64 threads: 128 blocks at D = 4096) computes the new streams of its 32 dims x hc streams
and the partial logits and square sum over them into the workspace ``ws``; stage ``norm`` reduces ``ws`` in a
fixed order per row; block (r, 0) computes the pre gates, the pre-mix and the RMSNorm of row r while block
(r, 1) runs the Sinkhorn split of row r (pre variants only; one comb row per lane, column sums gathered by
shuffles and added in the reference's order), so the Sinkhorn's 40 dependent fp32 normalisations overlap
the pre-mix instead of preceding it. A single launch
would need a grid-wide barrier (cooperative launch or a last-block-done counter), which the vendor prelude
does not offer; under graph replay the second launch costs ~1-2 us.

Kernel arguments, in order (:func:`arg_names`); pointers are device pointers of contiguous tensors, 16-byte
aligned; ``n_vocab`` is a 32-bit int:

* mix, ``post_pre``:  ``out`` bf16 [q, D], ``x`` bf16 [q, hc, D], ``post`` f32 [q, hc], ``comb`` f32 [q, hc, hc],
  ``fn`` f32 [n_mix, hc*D], ``x_new`` bf16 [q, hc, D], ``ws``.
* mix, ``embed_pre``: ``tokens`` int64 [q], ``table`` bf16 [n_vocab, D], ``n_vocab``, ``fn``, ``x`` bf16
  [q, hc, D] (output), ``ws``.
* mix, ``post_head``: ``out``, ``x``, ``post``, ``comb``, ``fn`` f32 [hc, hc*D], ``ws``; with ``streams``
  ``x_new`` before ``ws``.
* mix, ``pre``: ``x`` bf16 [q, hc, D] (input), ``fn``, ``ws``; norm: as ``embed_pre``.
* mix, ``post_out``: ``out``, ``x``, ``post``, ``comb``, ``x_new`` (no norm stage).
* norm, ``post_pre``: ``x_new``, ``ws``, ``scale`` f32 [3], ``base`` f32 [n_mix], ``norm_w`` f32 [D], ``y`` bf16
  [q, D], ``post_new`` f32 [q, hc], ``comb_new`` f32 [q, hc, hc].
* norm, ``embed_pre``: as ``post_pre`` with ``x`` in place of ``x_new``.
* norm, ``post_head``: ``out``, ``x``, ``post``, ``comb`` (the HC post is recomputed: no x_new buffer),
  ``ws``, ``scale`` f32 [>= 1], ``base`` f32 [hc], ``norm_w``, ``y``.

``ws`` is fp32 [:func:`workspace_floats`] = [q, n_mix + 1, n_blocks]; it needs no initialisation (stage mix
writes all of it). ``x_new`` must not alias ``x``; ``post_new`` / ``comb_new`` may alias ``post`` / ``comb``.
A token id outside ``[0, n_vocab)`` gives NaN rows (never an out-of-bounds read).

Numerics: fp32 everywhere; the GEMV and the square sum are summed in another order than torch's (per thread
2 inputs, a wave reduce-scatter, blocks in index order); everything else follows the reference's op order
(``primitives.hc_post``, ``sinkhorn_split``, ``hc_pre``, ``hc_head``, ``rms_norm``), except that the compiler
may contract ``a*b + c`` into an FMA (nvcc and clang do so by default at -O3) and that exp / sigmoid use
the device's accurate ``expf`` where torch's CPU softmax and sigmoid use a vectorized exp. Expected deviation
from :func:`reference`: post / comb ~1e-6 relative, bf16 outputs within 1 ulp (a few elements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.families import Launch
from ds4c.runtime.targets import Target

VARIANTS = ("post_pre", "embed_pre", "post_head", "pre", "post_out")
TEMPLATE = "hc/hc_fused.cu.j2"
FAMILY = "hc"
STAGES = ("mix", "norm")
MIX_THREADS = 64  # stage mix block: one wave on wave-64 targets, two on wave-32 ones
MIX_VEC = 2  # consecutive dims per thread in stage mix (8-byte fn loads)
NORM_THREADS_MAX = 256


@dataclass(frozen=True)
class HcSpec:
    """One fused HC boundary (all render-time).

    Attributes:
        variant: ``post_pre`` | ``embed_pre`` | ``post_head``.
        q: rows per launch (verify width, 1..5).
        hidden: D (4096 official, 256 tiny), a multiple of 32.
        hc: streams (4); n_mix: mixing logits, ``(2 + hc) * hc`` (24) for the pre variants, ``hc`` for the head.
        iters: Sinkhorn iterations (20: 1 softmax + iters-1 row + iters column normalisations).
        eps: epsilon of the trailing RMSNorm (P1; ``norm_eps`` of the config).
        norm_eps: epsilon of the mixing-logit rsqrt (``rsqrt(mean(xf^2) + norm_eps)``).
        hc_eps: epsilon of the Sinkhorn split / head gate (``hc_eps``).
        streams: ``post_head`` only: stage mix also writes the new streams ``x_new`` (the HC state after the
            last layer, which the head otherwise only recomputes), for a DSpark tap of that layer.
    """

    variant: str
    q: int
    hidden: int
    hc: int = 4
    n_mix: int = 24
    iters: int = 20
    eps: float = 1e-6
    norm_eps: float = 1e-6
    hc_eps: float = 1e-6
    streams: bool = False
    """``post_head`` only: also write the last layer's HC streams to ``x_new`` (the DSpark taps of that layer)."""
    head_out: bool = False
    """``post_head`` only: also write the pre-mix before the RMSNorm to ``y_pre`` bf16 [q, D] (the DSpark
    drafter's confidence input, spec 7.3.4)."""
    row_block: int = 0
    """Stage mix rows per block (a prefill chunk, docs/prefill.md): 0 = every mix block loops over all ``q`` rows (the
    decode / verify kernel, unchanged); ``n`` (1..5, dividing ``q``) = mix grid ``(n_blocks, q / n)``, block row
    ``y`` owning rows ``y*n .. y*n+n-1``: the unrolled row loop and the ``red[NW][n][NV]`` shared array then stay
    at decode size for any ``q`` (at ``q = C`` they would be ``C`` iterations and ``200 C`` bytes: over the 48 KiB
    static limit from C = 246). The per-row arithmetic is the same, so the outputs are the same bits."""

    def __post_init__(self) -> None:
        bad = []
        if self.row_block and not (1 <= self.row_block <= 5 and self.q % self.row_block == 0):
            bad.append(f"row_block {self.row_block} (expected 0 or 1..5 dividing q {self.q})")
        if self.streams and self.variant != "post_head":
            bad.append(f"streams with variant {self.variant!r} (only post_head has the choice: post_pre / embed_pre "
                       f"always write their streams, pre / post_out have fixed outputs)")
        if self.variant not in VARIANTS:
            bad.append(f"variant {self.variant!r} (expected one of {', '.join(VARIANTS)})")
        if self.q < 1:
            bad.append(f"q {self.q} (expected >= 1)")
        if self.hc < 1 or self.hc & (self.hc - 1) or (MIX_THREADS * MIX_VEC) % self.hc:
            bad.append(f"hc {self.hc} (expected a power of two dividing {MIX_THREADS * MIX_VEC})")
        elif self.hidden < 1 or self.hidden % self.dims_per_block:
            bad.append(f"hidden {self.hidden} (expected a positive multiple of {self.dims_per_block})")
        want = self.hc if self.variant == "post_head" else (2 + self.hc) * self.hc
        if self.n_mix != want:
            bad.append(f"n_mix {self.n_mix} (expected {want} for {self.variant} with hc {self.hc})")
        if self.iters < 1:
            bad.append(f"iters {self.iters} (expected >= 1)")
        if self.head_out and self.variant != "post_head":
            bad.append(f"head_out with variant {self.variant!r} (only post_head writes the pre-norm pre-mix)")
        if self.n_mix + 1 > 32:
            bad.append(f"n_mix {self.n_mix} (at most 31 so that n_mix + 1 sums fit one wave-32 reduce-scatter)")
        if bad:
            raise RenderError(f"HcSpec: bad {'; '.join(bad)}")
        self.norm_geometry()  # raises when no block shape fits

    # ------------------------------------------------------------------------------------------ derived
    @property
    def dims_per_block(self) -> int:
        """Dims of each stream one stage-mix block owns (32 for hc = 4)."""
        return MIX_THREADS * MIX_VEC // self.hc

    @property
    def n_blocks(self) -> int:
        """Stage-mix grid size: hidden / dims_per_block (128 at D = 4096, 8 at D = 256)."""
        return self.hidden // self.dims_per_block

    @property
    def npad(self) -> int:
        """n_mix + 1 rounded up to a power of two (values per wave reduce-scatter)."""
        n = 1
        while n < self.n_mix + 1:
            n *= 2
        return n

    def norm_geometry(self) -> tuple[int, int]:
        """(threads, dims per thread per pass) of stage norm: the widest vector (8, 4, 2, 1 bf16) and then the
        most threads (256, 192, 128, 64: multiples of 64 suit waves of 32 and 64) with ``threads * vec``
        dividing hidden. D = 4096: (256, 8), two passes; D = 256: (64, 4).

        Raises:
            RenderError: no shape fits (hidden not a multiple of 64).
        """
        for vec in (8, 4, 2, 1):
            for nt in range(NORM_THREADS_MAX, 63, -64):
                if self.hidden % (nt * vec) == 0:
                    return nt, vec
        raise RenderError(f"HcSpec: hidden {self.hidden} is not a multiple of 64 (stage norm block shape)")

    def params(self, stage: str) -> dict[str, Any]:
        """Render parameters of one stage."""
        nt, vec = self.norm_geometry()
        return {"variant": self.variant, "stage": stage, "q": self.q, "hidden": self.hidden, "hc": self.hc,
                "n_mix": self.n_mix, "npad": self.npad, "iters": self.iters, "threads_mix": MIX_THREADS,
                "vec_mix": MIX_VEC, "threads_norm": nt, "vec_norm": vec, "eps_lit": _float_literal(self.eps),
                "norm_eps_lit": _float_literal(self.norm_eps), "hc_eps_lit": _float_literal(self.hc_eps),
                "streams": self.streams, **({"head_out": True} if self.head_out else {}),
                **({"row_block": self.row_block} if self.row_block else {})}


def _float_literal(x: float) -> str:
    """C hex literal of fp32(x), exact (the same fp32 value torch adds for a Python-float epsilon)."""
    return float(torch.tensor(x, dtype=torch.float32)).hex() + "f"


# ------------------------------------------------------------------------------------------------- rendering
def render_hc(spec: HcSpec, target: Target, name: str) -> list[KernelSource]:
    """Rendered kernels of ``spec`` for ``target``, in launch order: ``[mix, norm]``, named ``name + "_mix"`` and
    ``name + "_norm"``.

    Raises:
        RenderError: a block size is not a multiple of the target's wave, or the spec is not renderable.
    """
    nt, _ = spec.norm_geometry()
    for what, n in (("mix", MIX_THREADS), ("norm", nt)):
        if n % target.wave:
            raise RenderError(f"hc {name}: stage {what} block size {n} is not a multiple of {target.slug}'s wave "
                              f"{target.wave}")
    if spec.npad > target.wave:
        raise RenderError(f"hc {name}: {spec.n_mix + 1} sums per row exceed one wave of {target.wave}")
    stages = ("mix",) if spec.variant == "post_out" else STAGES
    return [render(TEMPLATE, f"{name}_{stage}", FAMILY, target, spec.params(stage)) for stage in stages]




def launch_shapes(spec: HcSpec) -> list[Launch]:
    """Launches in order (the same on every target): mix on grid (hidden / 32) x 64 threads (with ``row_block``
    n: (hidden / 32, q / n)), then norm on
    grid (q, 2) (head: (q, 1)) x 256 threads (64 at D = 256). Both on the same stream; norm reads what mix
    wrote."""
    nt, _ = spec.norm_geometry()
    ny = 1 if spec.variant == "post_head" else 2
    mix = Launch((spec.n_blocks, spec.q // spec.row_block if spec.row_block else 1, 1), (MIX_THREADS, 1, 1),
                 kernel="mix")
    if spec.variant == "post_out":
        return [mix]
    return [mix, Launch((spec.q, ny, 1), (nt, 1, 1), kernel="norm")]


def arg_names(spec: HcSpec) -> dict[str, list[str]]:
    """Kernel argument names in order, per kernel (``mix``, ``norm``); see the module docstring for types."""
    v = spec.variant
    if v == "embed_pre":
        return {"mix": ["tokens", "table", "n_vocab", "fn", "x", "ws"],
                "norm": ["x", "ws", "scale", "base", "norm_w", "y", "post_new", "comb_new"]}
    if v == "post_pre":
        return {"mix": ["out", "x", "post", "comb", "fn", "x_new", "ws"],
                "norm": ["x_new", "ws", "scale", "base", "norm_w", "y", "post_new", "comb_new"]}
    if v == "pre":
        return {"mix": ["x", "fn", "ws"], "norm": ["x", "ws", "scale", "base", "norm_w", "y", "post_new", "comb_new"]}
    if v == "post_out":
        return {"mix": ["out", "x", "post", "comb", "x_new"]}
    return {"mix": ["out", "x", "post", "comb", "fn"] + (["x_new"] if spec.streams else []) + ["ws"],
            "norm": ["out", "x", "post", "comb", "ws", "scale", "base", "norm_w", "y"] + (["y_pre"] if spec.head_out
                                                                                             else [])}


def output_names(spec: HcSpec) -> list[str]:
    """Names of the outputs, as :func:`reference` returns them."""
    return {"embed_pre": ["x", "y", "post_new", "comb_new"], "post_pre": ["x_new", "y", "post_new", "comb_new"],
            "post_head": (["x_new"] if spec.streams else []) + ["y"] + (["y_pre"] if spec.head_out else []),
            "pre": ["y", "post_new", "comb_new"],
            "post_out": ["x_new"]}[spec.variant]


def workspace_floats(spec: HcSpec) -> int:
    """fp32 elements of ``ws``: [q, n_mix + 1, n_blocks] (per row: the partial logits, then the partial square
    sum, each over the stage-mix blocks, contiguous so that stage norm reads them coalesced)."""
    return spec.n_blocks * spec.q * (spec.n_mix + 1)


def arg_shapes(spec: HcSpec, n_vocab: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor argument (``ws`` flat; ``table`` needs ``n_vocab``)."""
    q, D, hc, n = spec.q, spec.hidden, spec.hc, spec.n_mix
    bf, f32 = torch.bfloat16, torch.float32
    return {"tokens": ((q,), torch.int64), "table": ((n_vocab, D), bf), "out": ((q, D), bf),
            "x": ((q, hc, D), bf), "post": ((q, hc), f32), "comb": ((q, hc, hc), f32), "fn": ((n, hc * D), f32),
            "x_new": ((q, hc, D), bf), "ws": ((workspace_floats(spec),), f32),
            "scale": ((1 if spec.variant == "post_head" else 3,), f32), "base": ((n,), f32),
            "norm_w": ((D,), f32), "y": ((q, D), bf), "y_pre": ((q, D), bf), "post_new": ((q, hc), f32),
            "comb_new": ((q, hc, hc), f32)}


def bytes_read(spec: HcSpec) -> int:
    """Compulsory DRAM bytes per boundary (each input once; ws and the x_new read-back are L2-resident and
    not counted): fn, the streams (or embedding rows), out, post, comb, scale, base, norm_w."""
    q, D, hc, n = spec.q, spec.hidden, spec.hc, spec.n_mix
    b = n * hc * D * 4 + n * 4 + 3 * 4 + D * 4
    if spec.variant == "embed_pre":
        return b + q * 8 + q * D * 2
    if spec.variant == "pre":
        return b + q * hc * D * 2
    if spec.variant == "post_out":
        return q * hc * D * 2 + q * D * 2 + q * hc * 4 + q * hc * hc * 4
    return b + q * hc * D * 2 + q * D * 2 + q * hc * 4 + q * hc * hc * 4


# ------------------------------------------------------------------------------------------------ reference
def reference(spec: HcSpec, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the kernels compute, by the reference model's own functions (:mod:`ds4c.reference.primitives`:
    ``hc_post``, ``hc_pre``, ``hc_head``, ``rms_norm``, exactly as ``ds4c.reference.model`` calls them).

    Inputs by name: ``embed_pre``: tokens int64 [q], table bf16 [V, D]; post variants: out bf16 [q, D], x bf16
    [q, hc, D], post f32 [q, hc], comb f32 [q, hc, hc]; all: fn f32 [n_mix, hc*D], scale f32 [3] (head: [>= 1]),
    base f32 [n_mix], norm_w f32 [D].

    Returns:
        ``{name: tensor}`` for :func:`output_names`: x / x_new bf16 [q, hc, D], y bf16 [q, D], post_new f32
        [q, hc], comb_new f32 [q, hc, hc].

    Raises:
        KeyError: a needed input is missing.
    """
    from ds4c.reference import primitives as P

    if spec.variant == "post_out":
        return {"x_new": P.hc_post(inputs["out"], inputs["x"], inputs["post"], inputs["comb"])}
    fn, scale, base, norm_w = inputs["fn"], inputs["scale"], inputs["base"], inputs["norm_w"]
    if spec.variant == "embed_pre":
        e = inputs["table"][inputs["tokens"]]
        x = e.unsqueeze(1).expand(e.shape[0], spec.hc, e.shape[1]).contiguous()
    elif spec.variant == "pre":
        x = inputs["x"]
    else:
        x = P.hc_post(inputs["out"], inputs["x"], inputs["post"], inputs["comb"])
    if spec.variant == "post_head":
        y = P.hc_head(x, fn, scale, base, spec.hc_eps, spec.norm_eps)
        return {**({"x_new": x} if spec.streams else {}), "y": P.rms_norm(y, norm_w, spec.eps),
                **({"y_pre": y} if spec.head_out else {})}
    y, post, comb = P.hc_pre(x, fn, scale, base, spec.iters, spec.hc_eps, spec.norm_eps)
    out = {} if spec.variant == "pre" else {"x" if spec.variant == "embed_pre" else "x_new": x}
    return {**out, "y": P.rms_norm(y, norm_w, spec.eps), "post_new": post, "comb_new": comb}


def random_inputs(spec: HcSpec, generator: torch.Generator | None = None, n_vocab: int = 512,
                  device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Fresh inputs shaped like the synthetic model's (``ds4c.synth``): fn ~ N(0, 1/(hc*D)), scale ~ (0.5, 0.5,
    0.2) + N(0, 0.02), base ~ N(0, 0.2) with +1 on the comb diagonal, norm gain 1 + N(0, 0.05); streams and
    sub-block output ~ N(0, 1) in bf16; post = 2 sigmoid(N(0, 1)); comb a Sinkhorn-normalised matrix."""
    g = generator
    q, D, hc, n = spec.q, spec.hidden, spec.hc, spec.n_mix
    f32, bf = torch.float32, torch.bfloat16

    def rn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=f32)

    out: dict[str, torch.Tensor] = {"fn": rn(n, hc * D) / (hc * D) ** 0.5, "norm_w": 1 + 0.05 * rn(D)}
    if spec.variant == "post_head":
        out["scale"] = torch.tensor([0.5], dtype=f32) + 0.02 * rn(1)
        out["base"] = 0.2 * rn(n)
    else:
        out["scale"] = torch.tensor([0.5, 0.5, 0.2], dtype=f32) + 0.02 * rn(3)
        base = 0.2 * rn(n)
        base[2 * hc:] += torch.eye(hc, dtype=f32).flatten()
        out["base"] = base
    if spec.variant == "embed_pre":
        out["tokens"] = torch.randint(0, n_vocab, (q,), generator=g, dtype=torch.int64)
        out["table"] = rn(n_vocab, D).to(bf)
    else:
        from ds4c.reference import primitives as P

        out["out"] = rn(q, D).to(bf)
        out["x"] = rn(q, hc, D).to(bf)
        out["post"] = 2 * torch.sigmoid(rn(q, hc))
        _, _, comb = P.sinkhorn_split(rn(q, (2 + hc) * hc), torch.tensor([1.0, 1.0, 1.0]),
                                      torch.zeros((2 + hc) * hc), hc, 20, 1e-6)
        out["comb"] = comb.contiguous()
    return {k: v.to(device) for k, v in out.items()}


def kernel_model(spec: HcSpec, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """A torch model of the kernels' work division (per-block partial sums over ``dims_per_block`` dims of every
    stream, reduced in block order; everything else as :func:`reference`): for checking the split geometry on
    the CPU. Equals :func:`reference` up to fp32 summation order."""
    from ds4c.reference import primitives as P

    ref = reference(spec, **inputs)
    if spec.variant == "post_out":
        return ref
    if spec.variant == "embed_pre":
        x = ref["x"]
    elif spec.variant == "post_pre":
        x = ref["x_new"]
    elif spec.variant == "pre":
        x = inputs["x"]
    else:
        x = P.hc_post(inputs["out"], inputs["x"], inputs["post"], inputs["comb"])
    fn, scale, base, norm_w = inputs["fn"], inputs["scale"], inputs["base"], inputs["norm_w"]
    q, D, hc, dpb = spec.q, spec.hidden, spec.hc, spec.dims_per_block
    xf = x.float()
    fnv = fn.view(spec.n_mix, hc, D)
    mix = torch.zeros(q, spec.n_mix)
    ss = torch.zeros(q)
    for b in range(spec.n_blocks):
        sl = slice(b * dpb, (b + 1) * dpb)
        mix = mix + torch.einsum("rcd,ncd->rn", xf[:, :, sl], fnv[:, :, sl])
        ss = ss + xf[:, :, sl].square().sum((1, 2))
    m = mix * torch.rsqrt(ss / (hc * D) + spec.norm_eps).unsqueeze(-1)
    if spec.variant == "post_head":
        pre = torch.sigmoid(m * scale[0] + base) + spec.hc_eps
        y = (pre.unsqueeze(-1) * xf).sum(-2).to(torch.bfloat16)
        return {"y": P.rms_norm(y, norm_w, spec.eps)}
    pre, post, comb = P.sinkhorn_split(m, scale, base, hc, spec.iters, spec.hc_eps)
    y = (pre.unsqueeze(-1) * xf).sum(-2).to(torch.bfloat16)
    out = dict(ref)
    out.update({"y": P.rms_norm(y, norm_w, spec.eps), "post_new": post, "comb_new": comb})
    return out
