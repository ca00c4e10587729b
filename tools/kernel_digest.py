#!/usr/bin/env python3
"""A digest of every kernel source ds4c emits, to prove a refactor left the rendered kernels byte-identical.

Renders, without compiling anything (no GPU, no compiler, no kernel cache), every graph the compiled engines and
``ds4c compile`` lower, the way they lower them (``build_step`` -> the ``default`` pass pipeline ->
``ds4c.runtime.lower.lower_graph``; the DSpark drafter's graphs through their own pipelines, plus the sampled
Markov kernels ``ds4c.runtime.dspark_exec.sampling_sources`` renders), over the matrix :data:`MATRIX`:

* presets ``tiny``, ``tiny-128``, ``flash-l4`` and ``flash``;
* the step graphs of widths 1..5 at several context buckets (official weight formats); the bf16 formats and the two
  K-quant mixes of tests/test_kquant.py; the DSpark taps (the synthetic drafter's default tap layers) and
  ``record_hc``; each shard of a two-shard layer split (also with taps and ``record_hc``); prefill chunk graphs of
  several sizes and contexts, also with taps, with ``record_hc`` and with ``all_logits`` (a plan kernel whose C-row
  kernel is pending is listed as ``pending``);
* the synthetic DSpark drafter (block size 5; and 4 with the confidence bias): its commit graphs of 1..5 rows, its
  draft graph and the sampled Markov depth kernels;
* the graphs every kernel path hangs on on every arch of ``ds4c.runtime.targets`` (sm_80, sm_90, sm_90a, sm_100a,
  gfx90a, gfx942, gfx1100, gfx1151, gfx1201), the variants on one arch per prelude path (sm_80, sm_90, gfx942,
  gfx1151) or on sm_90 and gfx942 (layer splits, flash's 43 layers).

Every ``DS4C_*`` environment variable is removed before ds4c is imported, so the kernels are the defaults'.

Output: one line per (preset, arch, graph key, plan kernel)::

    <preset> <arch> <graph key> <plan kernel> <sha256>

where the sha256 covers, per launch in order, the rendered source text and its launch record
(``ds4c.runtime.lowered.describe``: entry, kernel name, grid, block, dynamic shared memory, argument bindings);
then a last line ``total <sha256 of every line before it> (<N> kernels)``. Two runs on two checkouts are
compared with ``diff`` (or ``tail -1``); a difference names the first (preset, arch, graph, kernel) that changed.

Usage::

    .venv/bin/python tools/kernel_digest.py [-o FILE] [--presets tiny,flash-l4] [--archs sm_90,gfx942]

Takes under a minute on one free core (progress and the time on stderr).
"""

from __future__ import annotations

import os
import sys

for _k in [k for k in os.environ if k.startswith("DS4C_")]:  # the defaults' kernels (read at import time)
    del os.environ[_k]

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterator  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4c.config import preset  # noqa: E402
from ds4c.drafters.dspark_source import SyntheticDSpark  # noqa: E402
from ds4c.drafters.dspark_synth import dspark_options  # noqa: E402
from ds4c.ir import build_step  # noqa: E402
from ds4c.ir.dspark import COMMIT_PIPELINE, DRAFT_PIPELINE, build_dspark_commit, build_dspark_draft  # noqa: E402
from ds4c.passes.manager import run_pipeline  # noqa: E402
from ds4c.quant import GGMLType as G  # noqa: E402
from ds4c.runtime.dspark_exec import SHARED, sampling_sources  # noqa: E402
from ds4c.runtime.lower import lower_graph  # noqa: E402
from ds4c.runtime.lowered import describe  # noqa: E402
from ds4c.runtime.targets import CUDA_ARCHS, HIP_ARCHS, target  # noqa: E402
from ds4c.tensors import FORMATS, ROLE_BF16, ROLE_FP4, ROLE_FP8, storage_types  # noqa: E402

ALL = CUDA_ARCHS + tuple(HIP_ARCHS)
#: one arch per code path of the preludes: no PDL or fp8 (sm_80), PDL and fp8 (sm_90), wave 64 (gfx942), wave 32
FOUR = ("sm_80", "sm_90", "gfx942", "gfx1151")
TWO = ("sm_90", "gfx942")
#: the K-quant role tables of tests/test_kquant.py (files "a" and "b")
KQUANT = {
    "kq_a": {**FORMATS["official"], ROLE_FP4: G.Q3_K, ROLE_FP8: G.Q6_K, ROLE_BF16: G.Q5_K},
    "kq_b": {**FORMATS["official"], ROLE_FP4: G.IQ4_XS, ROLE_FP8: G.Q2_K, ROLE_BF16: G.Q4_K},
}
#: preset -> (capacity = build_step's max_ctx, [(graph keys, archs)]). A key: ``q<w>_c<context>`` (step),
#: ``p<C>_c<context>`` (prefill chunk), ``s<k>_`` before it (shard k of a two-shard layer split), ``+bf16`` /
#: ``+kq_a`` / ``+kq_b`` (weight formats), ``+taps`` (the synthetic drafter's default taps), ``+record_hc``,
#: ``+all_logits``; ``dspark_b5_<graph>`` / ``dspark_b4_bias_<graph>`` (the synthetic drafter of block size 5 /
#: 4 with the confidence bias; ``commit1..5``, ``draft``).
_B5, _B4 = "dspark_b5_", "dspark_b4_bias_"
MATRIX: dict[str, tuple[int, list[tuple[list[str], tuple[str, ...]]]]] = {
    "tiny": (128, [
        ([f"q{w}_c128" for w in range(1, 6)] + ["p16_c128", _B5 + "commit5", _B5 + "draft"], ALL),
        ([f"q{w}_c{c}" for w in range(1, 6) for c in (32, 64)]
         + [f"q{w}_c128+{f}" for w in (1, 5) for f in ("bf16", "kq_a", "kq_b")]
         + [f"q{w}_c128+{f}" for w in (1, 3) for f in ("taps", "record_hc")]
         + ["p16_c32", "p16_c64", "p24_c64", "p24_c128", "p64_c64", "p64_c128"]
         + [f"p16_c128+{f}" for f in ("taps", "record_hc", "all_logits")]
         + [_B5 + f"commit{n}" for n in range(1, 5)] + [_B4 + f"commit{n}" for n in range(1, 6)] + [_B4 + "draft"],
         FOUR),
        ([f"s{k}_q{w}_c128{f}" for k in (0, 1) for w in (1, 2) for f in ("", "+taps+record_hc")], TWO),
    ]),
    "tiny-128": (256, [
        ([f"q{w}_c256" for w in range(1, 6)] + ["q1_c128", "p16_c256", "p64_c128", _B5 + "commit5", _B5 + "draft"],
         FOUR),
    ]),
    "flash-l4": (4096, [
        ([f"q{w}_c4096" for w in range(1, 6)] + ["p256_c4096"], ALL),
        (["q1_c256", "q5_c256", "p256_c256", "p2048_c4096"]
         + [f"q{w}_c4096+{f}" for w in (1, 5) for f in ("bf16", "kq_a", "kq_b")], FOUR),
        ([f"q{w}_c4096+{f}" for w in (1, 3) for f in ("taps", "record_hc")]
         + [f"s{k}_q{w}_c4096{f}" for k in (0, 1) for w in (1, 2) for f in ("", "+taps+record_hc")]
         + [f"p256_c4096+{f}" for f in ("taps", "record_hc", "all_logits")] + [_B5 + "commit5", _B5 + "draft"],
         TWO),
    ]),
    "flash": (4096, [(["q1_c4096", "q5_c4096", "p256_c4096", _B5 + "commit5", _B5 + "draft"], TWO)]),
}


def _types(cfg: Any, fmt: str) -> dict:
    return storage_types(cfg, KQUANT.get(fmt, fmt))


def build_graph(name: str, key: str, cap: int) -> tuple[Any, Any, dict]:
    """``(pipelined graph, config, weight types)`` of graph ``key`` (:data:`MATRIX`) of preset ``name``, built as
    the compiled step (``CompiledStep``, ``ds4c compile``) or the compiled DSpark drafter (``CompiledDSpark``, for
    a target of official formats) builds it."""
    cfg = preset(name)
    if key.startswith("dspark_"):
        tag, graph = key[len("dspark_"):].rsplit("_", 1)
        f = SyntheticDSpark(name, **({"block_size": 4, "conf_bias": True} if tag == "b4_bias" else {}))
        stage = f.config.replace(quant_emulation=cfg.quant_emulation)
        types = {n: f.ggml_type(n) for n in f.specs}
        types.update({n: t for n, t in _types(cfg, "official").items() if n in SHARED})
        if graph == "draft":
            g = build_dspark_draft(stage, f.block_size, f.markov_rank, f.has_confidence, f.has_conf_bias)
            return run_pipeline(g, DRAFT_PIPELINE, context=stage.window).graph, stage, types
        n = int(graph[len("commit"):])
        return run_pipeline(build_dspark_commit(stage, len(f.taps), n), COMMIT_PIPELINE).graph, stage, types
    base, *opts = key.split("+")
    shard = None
    if base.startswith("s"):
        k, base = base.split("_", 1)
        half = cfg.n_layers // 2
        shard = ((0, half), (half, cfg.n_layers))[int(k[1:])]
    width, context = (int(x[1:]) for x in base.split("_"))
    fmt = next((o for o in opts if o in ("bf16",) + tuple(KQUANT)), "official")
    g = build_step(cfg, width, cap, shard, prefill=base.startswith("p"), all_logits="all_logits" in opts,
                   taps=dspark_options(cfg)[0] if "taps" in opts else (), record_hc="record_hc" in opts)
    return run_pipeline(g, "default", context=context).graph, cfg, _types(cfg, fmt)


def kernel_sha(launches: list[tuple[Any, dict]]) -> str:
    """sha256 over ``(source, launch record)`` pairs, in order."""
    h = hashlib.sha256()
    for src, rec in launches:
        for part in (src.source, json.dumps(rec, sort_keys=True)):
            b = part.encode()
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()


def digest_lines(presets: list[str], archs: list[str] | None) -> Iterator[str]:
    """The output lines but the total (module docstring), preset by preset."""
    for name in presets:
        t0 = time.perf_counter()
        n = 0
        cap, rows = MATRIX[name]
        for keys, key_archs in rows:
            use = [a for a in key_archs if archs is None or a in archs]
            for key in keys:
                g, cfg, types = build_graph(name, key, cap)
                for arch in use:
                    pending: list = []
                    ks = lower_graph(g, cfg, target(arch), types, pending)
                    for k in ks:
                        d = describe(k)
                        yield f"{name} {arch} {key} {k.name} " + kernel_sha(
                            [(la.kernel, rec) for la, rec in zip(k.launches, d["launches"])])
                        n += 1
                    for p in pending:
                        yield f"{name} {arch} {key} {p.name} pending"
                    if key.startswith("dspark_") and key.endswith("_draft"):
                        sampled = sampling_sources(ks, target(arch))
                        yield f"{name} {arch} {key} markov_chain.sampled " + kernel_sha([(s, {}) for s in sampled])
                        n += 1
        print(f"kernel_digest: {name}: {n} kernels in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--out", help="write the digest here (default: stdout)")
    ap.add_argument("--presets", default=",".join(MATRIX), help="comma-separated subset of " + ",".join(MATRIX))
    ap.add_argument("--archs", default=None, help="comma-separated subset of the archs (default: each preset's)")
    a = ap.parse_args(argv)
    presets = [p for p in a.presets.split(",") if p]
    bad = [p for p in presets if p not in MATRIX]
    if bad:
        ap.error(f"unknown preset {bad[0]!r}: expected one of {', '.join(MATRIX)}")
    archs = None if a.archs is None else [x for x in a.archs.split(",") if x]
    total = hashlib.sha256()
    lines = []
    for line in digest_lines(presets, archs):
        total.update(line.encode() + b"\n")
        lines.append(line)
    lines.append(f"total {total.hexdigest()} ({sum(not l.endswith(' pending') for l in lines)} kernels)")
    text = "\n".join(lines) + "\n"
    if a.out:
        Path(a.out).write_text(text)
        print(lines[-1])
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
