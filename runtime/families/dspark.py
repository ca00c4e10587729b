"""The DSpark head kernel family: the ``markov_chain`` (docs/model.md 7.3.3, greedy) and
``dspark_confidence`` (7.3.4) IR ops. Template: ``templates/dspark/markov.cu.j2`` (its header describes the
block layout).

Launches of one draft, in order (:func:`launch_shapes`):

* ``depth`` x B (the same binary, the depth an int argument): grid ``ceil(V / rows_per_block)`` blocks; each
  block finds ``out_i`` (the anchor ``tokens[0]`` at depth 0, else the argmax of the previous depth's per-block
  partials), computes ``logits[i, v] = base[i, v] + w2[v] . w1[out_i]`` (fp32) for its vocabulary rows and writes
  its best (value, id) to the workspace. The chain is sequential, and the argmax needs every row, so a depth is one
  launch (no grid barrier exists in the vendor preludes); at V = 129280, rank 256 each depth streams the 66 MB of
  ``w2`` once.
* ``final``: one block: the last depth's argmax -> ``drafts[B-1]``.
* ``conf`` (with the confidence head): grid B: ``conf[i] = proj . [hx_i ; w1[prev_i]] (+ bias)``.

Sampling (``MarkovSpec.sampled``): the ``depth`` kernel reads ``out_i`` from ``drafts[i-1]`` instead of reducing
partials; between two depths the runtime draws ``out_{i+1}`` from ``logits[i]`` on the device
(:meth:`ds4c.runtime.sampler.DeviceSampler.sample_with_probs`, captured in the same CUDA graph) and keeps the
distribution ``q_i``.

Kernel arguments (:func:`arg_names`): ``base`` f32 [B, V]; ``w1`` / ``w2`` bf16 [V, R] (the stored BF16 bits);
``tokens`` i64 (device, ``tokens[0]`` = the anchor); ``part`` the workspace (:func:`workspace_bytes`); ``logits`` f32
[B, V]; ``drafts`` i64 [B]; ``depth`` int; ``hx`` bf16 [B, D]; ``proj`` f32 [D + R]; ``bias`` f32 [1]; ``conf`` f32
[B]. Pointers are 16-byte aligned device pointers of contiguous tensors.

Numerics: fp32 dot products summed in another order than torch's matmul (logits and confidence within fp32
tolerance of :func:`reference`); the argmax is exact for the logits the kernel computed (ties to the lower id), so
the drafts equal the reference's except where two logits are closer than the summation error (near-ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds4c.runtime.families import Launch
from ds4c.runtime.render import KernelSource, RenderError, render
from ds4c.runtime.targets import Target

TEMPLATE = "dspark/markov.cu.j2"
FAMILY = "dspark"
PARTS = ("depth", "final", "conf")


@dataclass(frozen=True)
class MarkovSpec:
    """One DSpark head configuration (all render-time).

    Attributes:
        rows: B, the block's rows (1..5). vocab: V. rank: R (a multiple of 8). hidden: D (the confidence input).
        confidence: render the ``conf`` kernel; bias: it adds ``conf_proj.bias``.
        threads: block size (a multiple of 64: suits waves of 32 and 64). rows_per_block: vocabulary rows per
            ``depth`` block (0 = 256).
        sampled: the sampling chain's ``depth`` kernel: ``out_i`` is read from ``drafts[i-1]`` (drawn on the device
            between the launches, ``tokens[0]`` at depth 0) and only the logits are written (no partials).
    """

    rows: int
    vocab: int
    rank: int
    hidden: int
    confidence: bool = True
    bias: bool = False
    threads: int = 256
    rows_per_block: int = 0
    sampled: bool = False

    def __post_init__(self) -> None:
        bad = []
        if not 1 <= self.rows <= 5:
            bad.append(f"rows {self.rows} (expected 1..5)")
        if self.vocab < 1 or self.hidden < 1:
            bad.append(f"vocab {self.vocab} / hidden {self.hidden} (expected >= 1)")
        if self.rank < 8 or self.rank % 8:
            bad.append(f"rank {self.rank} (expected a positive multiple of 8)")
        if self.threads < 64 or self.threads % 64 or self.threads > 1024:
            bad.append(f"threads {self.threads} (expected a multiple of 64 in 64..1024)")
        if self.rows_per_block < 0:
            bad.append(f"rows_per_block {self.rows_per_block} (expected >= 0)")
        if bad:
            raise RenderError(f"MarkovSpec: bad {'; '.join(bad)}")

    @property
    def rpb(self) -> int:
        return self.rows_per_block or 256

    @property
    def n_blocks(self) -> int:
        """Blocks of a ``depth`` launch."""
        return -(-self.vocab // self.rpb)

    def params(self, part: str) -> dict[str, Any]:
        return {"part": part, "rows": self.rows, "vocab": self.vocab, "rank": self.rank, "hidden": self.hidden,
                "threads": self.threads, "rows_per_block": self.rpb, "bias": bool(self.bias),
                "sampled": bool(self.sampled)}


def render_markov(spec: MarkovSpec, target: Target, name: str) -> dict[str, KernelSource]:
    """The rendered kernels of ``spec`` for ``target`` by part: ``depth``, ``final`` and (with ``confidence``)
    ``conf``, named ``name + "_" + part``.

    Raises:
        RenderError: the block size is not a multiple of the target's wave, or a template parameter is missing.
    """
    if spec.threads % target.wave:
        raise RenderError(f"dspark head {name}: block size {spec.threads} is not a multiple of {target.slug}'s wave "
                          f"{target.wave}")
    parts = PARTS if spec.confidence else PARTS[:2]
    return {p: render(TEMPLATE, f"{name}_{p}", FAMILY, target, spec.params(p)) for p in parts}


def launch_shapes(spec: MarkovSpec) -> dict[str, Launch]:
    """Launch shape per part (``depth`` is launched once per depth, ``rows`` times)."""
    out = {"depth": Launch((spec.n_blocks, 1, 1), (spec.threads, 1, 1), kernel="depth"),
           "final": Launch((1, 1, 1), (spec.threads, 1, 1), kernel="final")}
    if spec.confidence:
        out["conf"] = Launch((spec.rows, 1, 1), (spec.threads, 1, 1), kernel="conf")
    return out


def arg_names(spec: MarkovSpec) -> dict[str, list[str]]:
    """Kernel argument names in order, per part."""
    out = {"depth": ["base", "w1", "w2", "tokens", "part", "logits", "drafts", "depth"],
           "final": ["part", "drafts"]}
    if spec.confidence:
        out["conf"] = ["hx", "w1", "proj"] + (["bias"] if spec.bias else []) + ["tokens", "drafts", "conf"]
    return out


def workspace_bytes(spec: MarkovSpec) -> int:
    """The ``part`` workspace: per depth and block a value (f32 bits) and an id (u32)."""
    return 8 * spec.rows * spec.n_blocks


def reference(base: torch.Tensor, t0: int, w1: torch.Tensor, w2: torch.Tensor, hx: torch.Tensor | None = None,
              proj: torch.Tensor | None = None, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What the kernels compute, by the IR ops' own code (``markov_chain``, ``dspark_confidence``, which equal
    :meth:`ds4c.drafters.dspark_model.DSparkModel.markov`): ``(drafts i64 [B], logits f32 [B, V], conf f32 [B] or
    None)``. base f32 [B, V]; w1, w2 [V, R] (any float dtype, used as fp32); hx bf16 [B, D]; proj [1, D + R]."""
    from ds4c.ir.ops import OPS

    f32 = torch.float32
    tok = torch.tensor([int(t0)] * base.shape[0], dtype=torch.int64)
    drafts, logits = OPS["markov_chain"].run(None, [base.to(f32), tok, w1.to(f32), w2.to(f32)], {})
    conf = None
    if proj is not None and hx is not None:
        ins = [hx, tok, drafts, w1.to(f32), proj.to(f32).reshape(1, -1)] + ([bias.to(f32)] if bias is not None else [])
        (conf,) = OPS["dspark_confidence"].run(None, ins, {})
    return drafts, logits, conf
