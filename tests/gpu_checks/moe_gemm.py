#!/usr/bin/env python3
"""GPU check of the grouped experts GEMM family (runtime/families/moe_gemm.py, templates/moe_gemm/moe_gemm.cu.j2):
the routed experts of one MoE layer over a prefill chunk, six launches (route, actq_x, up, actq_h, down,
combine).

Cases (:func:`cases`): a tiny uneven routing (C = 77, D = 256, I = 128, E = 16, k = 3: one expert in ~90% of
the rows, two tiles; one expert unused), the flash shapes (D = 4096, I = 2048, E = 256, k = 6, MXFP4) at
C = 512, 2048 and 4096 with uniformly random routing, C = 2048 with a skewed (Zipf-like) routing, C = 512
with Q8_0 down weights, and the two options the prefill lowering uses (runtime/lower_prefill.py
``lower_routed_experts``): the shared expert as a ``dense`` call at flash shapes (C = 2048, D = 4096, I = 2048,
E = 1, k = 1, Q8_0: four launches, no routing; ``out`` bf16 against ``expert_ffn`` per row) and the routed call
with ``shared`` (moe_sum fused into the combine: ``out`` bf16 = bf16(routed sum + fp32(shared)), C = 2048).
The 128-wide tile (``MoeGemmSpec.bn = 128``, 256 threads; ``DS4C_PREFILL_MOE_BN=128``) at C = 2048 for MXFP4, Q3_K
and the dense Q8_0 shared expert (cases ``*_bn128``, next to their 64-wide twins, so one run times both widths on
the same card: ``DS4C_MG_CASES=c2048`` selects the pairs; a filter matches case-name substrings, or with a leading
``=`` one name exactly: :func:`picked`), and the 3-stage
cp.async pipeline (``MoeGemmSpec.stages = 3``; ``DS4C_PREFILL_STAGES=3``) at both widths (cases ``*_st3``), and the
up / down phases on wgmma (``MoeGemmSpec.mma``, cases ``*_wg``: compared with their twin by relative L2), the
activations staged as e4m3 codes (``MoeGemmSpec.xfmt``, cases ``*_x8``: bit for bit) and the MXFP4 products on fp8
``mma.sync`` (cases ``*_f8``: by relative L2). Every
case draws its inputs from a generator seeded by its name less the variant suffixes (:func:`_base`), so a variant
has its twin's inputs; when the twin ran first, the variant's ``out`` must equal the twin's bit for bit
(``twin_equal``, part of ``ok``).

Per case: fresh random inputs (``moe_gemm.random_inputs``), every workspace and the output poisoned with NaN
(``perm`` / ``tiles`` with 0x7f7f7f7f), the six launches in order, then: the routing tables equal the torch
ones (``moe_gemm.routing_tables``), every hbuf / ybuf / out element written (finite), ``out`` against
``moe_gemm.reference`` (``ds4c.reference.blocks.routed_sum`` per row, on the GPU in fp32, TF32 off) on up to
:data:`REF_ROWS` sampled rows: relative L2 below :data:`TOL`, a second call bit-identical (deterministic), and
the median of CUDA-event timings per launch and of the whole call (``common.median_us``). Reported: us per
launch, TFLOP/s of the call and of up + down (``2 * C*k * 3 * D * I`` useful FLOPs), the tile slots used.

Usage: ``python tests/gpu_checks/moe_gemm.py [--arch sm_90]``. Needs a CUDA GPU (sm_89+), torch, cuda-python and
nvcc (or NVRTC); compiles and loads through tests/gpu_checks/common.py. :func:`cases` and :func:`case_buffers`
also run on the CPU (tests/test_moe_gemm_family.py builds them).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import moe_gemm as MG
from ds4c.runtime.targets import target as make_target

ITERS = 20
WARMUP = 3
#: relative L2 of out vs the reference on the sampled rows: the CPU emulation sees 0 (MXFP4, small K) to 1.4e-4
#: (Q8_0 gate/up at D = 1024, I = 512: 61 flipped bf16 h elements, each moving all D outputs of its pair); the
#: floor grows with K and the hardware MMA's fp32 accumulation flips a few more roundings; a wrong expert, row or
#: scale gives O(1)
TOL = 2e-3
#: rows of a case compared with the per-row reference (all when C is smaller)
REF_ROWS = 96
TINY = dict(hidden=256, inter=128, k=3, n_experts=16)


def cases() -> list[tuple[str, MG.MoeGemmSpec, str]]:
    """Every case as ``(name, spec, routing)``, routing ``uniform`` | ``skew`` | ``uneven``."""
    return [("tiny_uneven_c77", MG.MoeGemmSpec(77, **TINY), "uneven"),
            ("tiny_q8_c77", MG.MoeGemmSpec(77, fmt="q8_0", **TINY), "uneven"),
            ("flash_c512", MG.MoeGemmSpec(512), "uniform"),
            ("flash_c2048", MG.MoeGemmSpec(2048), "uniform"),
            ("flash_c4096", MG.MoeGemmSpec(4096), "uniform"),
            ("flash_skew_c2048", MG.MoeGemmSpec(2048), "skew"),
            ("flash_q8down_c512", MG.MoeGemmSpec(512, down_fmt="q8_0"), "uniform"),
            ("flash_shexp_dense_c2048", MG.MoeGemmSpec(2048, k=1, n_experts=1, fmt="q8_0", dense=True), "dense"),
            ("flash_shared_c2048", MG.MoeGemmSpec(2048, shared=True), "uniform"),
            ("q3k_c77", MG.MoeGemmSpec(77, fmt="q3_k", hidden=512, inter=512, k=3, n_experts=16), "uneven"),
            ("flash_q3k_c2048", MG.MoeGemmSpec(2048, fmt="q3_k"), "uniform"),
            # the 128-wide tile (bn 128: 256 threads, up 64 W1 + 64 W3 rows, down 128 W2 rows per CTA) next to the
            # 64-wide twins above (the case name without _bn128): the same inputs, bit-identical outputs expected
            ("flash_c2048_bn128", MG.MoeGemmSpec(2048, bn=128), "uniform"),
            ("flash_q3k_c2048_bn128", MG.MoeGemmSpec(2048, fmt="q3_k", bn=128), "uniform"),
            ("flash_shexp_dense_c2048_bn128", MG.MoeGemmSpec(2048, k=1, n_experts=1, fmt="q8_0", dense=True, bn=128),
             "dense"),
            # the 3-stage cp.async pipeline at both widths, the same twins
            ("flash_c2048_st3", MG.MoeGemmSpec(2048, stages=3), "uniform"),
            ("flash_c2048_bn128_st3", MG.MoeGemmSpec(2048, bn=128, stages=3), "uniform"),
            ("flash_q3k_c2048_st3", MG.MoeGemmSpec(2048, fmt="q3_k", stages=3), "uniform"),
            ("flash_shexp_dense_c2048_st3", MG.MoeGemmSpec(2048, k=1, n_experts=1, fmt="q8_0", dense=True, stages=3),
             "dense"),
            # the up / down phases on sm_90a's wgmma (MoeGemmSpec.mma, docs/perf.md Optimisation 19), next to their
            # mma.sync twins: the same inputs; not bit-identical (another fp32 summation order), so compared with the
            # reference like every case and with the twin by relative L2 (twin_rel)
            ("tiny_uneven_c77_wg", MG.MoeGemmSpec(77, mma="wgmma", **TINY), "uneven"),
            ("flash_c512_wg", MG.MoeGemmSpec(512, mma="wgmma"), "uniform"),
            ("flash_c2048_wg", MG.MoeGemmSpec(2048, mma="wgmma"), "uniform"),
            ("flash_c4096_wg", MG.MoeGemmSpec(4096, mma="wgmma"), "uniform"),
            ("flash_skew_c2048_wg", MG.MoeGemmSpec(2048, mma="wgmma"), "skew"),
            ("flash_shared_c2048_wg", MG.MoeGemmSpec(2048, shared=True, mma="wgmma"), "uniform"),
            # the L2 prefetch qualifier on the cp.async copies (MoeGemmSpec.prefetch): the same bits as the twin
            ("flash_c2048_st3_pf256", MG.MoeGemmSpec(2048, stages=3, prefetch=256), "uniform"),
            ("flash_c2048_wg_pf256", MG.MoeGemmSpec(2048, mma="wgmma", prefetch=256), "uniform"),
            ("flash_c2048_wg_pf128", MG.MoeGemmSpec(2048, mma="wgmma", prefetch=128), "uniform"),
            ("flash_q3k_c2048_st3_pf256", MG.MoeGemmSpec(2048, fmt="q3_k", stages=3, prefetch=256), "uniform"),
            # the grid with the column blocks first (MoeGemmSpec.cols_first): a tile's CTAs side by side
            ("flash_c2048_cf", MG.MoeGemmSpec(2048, cols_first=True), "uniform"),
            ("flash_c2048_wg_cf", MG.MoeGemmSpec(2048, mma="wgmma", cols_first=True), "uniform"),
            ("flash_c2048_wg_pf256_cf", MG.MoeGemmSpec(2048, mma="wgmma", prefetch=256, cols_first=True), "uniform"),
            ("flash_q3k_c2048_st3_cf", MG.MoeGemmSpec(2048, fmt="q3_k", stages=3, cols_first=True), "uniform"),
            # wgmma with 2 and 4 warpgroups a CTA on one tile (bn 128 / 256: the activation tile staged once for 2 / 4x
            # the outputs; docs/perf.md Optimisation 20)
            ("flash_c2048_wg_bn128", MG.MoeGemmSpec(2048, mma="wgmma", bn=128), "uniform"),
            ("flash_c2048_wg_bn256", MG.MoeGemmSpec(2048, mma="wgmma", bn=256), "uniform"),
            ("flash_c2048_wg_bn128_cf", MG.MoeGemmSpec(2048, mma="wgmma", bn=128, cols_first=True), "uniform"),
            ("flash_c2048_wg_bn256_cf", MG.MoeGemmSpec(2048, mma="wgmma", bn=256, cols_first=True), "uniform"),
            ("flash_shared_c2048_wg_bn128", MG.MoeGemmSpec(2048, shared=True, mma="wgmma", bn=128), "uniform"),
            # the activations staged as one-byte e4m3 codes (MoeGemmSpec.xfmt, docs/perf.md Optimisation 21): half the
            # bytes a K step, the same MMAs on the same values, so the twin's bits (routed, fused shared combine,
            # K-quant, the dense shared expert, the wide tile, the pipeline)
            ("flash_c2048_x8", MG.MoeGemmSpec(2048, xfmt="e4m3"), "uniform"),
            ("flash_shared_c2048_x8", MG.MoeGemmSpec(2048, shared=True, xfmt="e4m3"), "uniform"),
            ("flash_q3k_c2048_x8", MG.MoeGemmSpec(2048, fmt="q3_k", xfmt="e4m3"), "uniform"),
            ("flash_shexp_dense_c2048_x8", MG.MoeGemmSpec(2048, k=1, n_experts=1, fmt="q8_0", dense=True, xfmt="e4m3"),
             "dense"),
            ("flash_c2048_bn128_x8", MG.MoeGemmSpec(2048, bn=128, xfmt="e4m3"), "uniform"),
            ("flash_c2048_st3_x8", MG.MoeGemmSpec(2048, stages=3, xfmt="e4m3"), "uniform"),
            # and the MXFP4 products on mma.sync m16n8k32 e4m3 (MoeGemmSpec.mma fp8): another summation inside a block,
            # compared with the mma.sync twin by relative L2 (twin_rel), and with the reference like every case
            ("tiny_uneven_c77_f8", MG.MoeGemmSpec(77, mma="fp8", xfmt="e4m3", **TINY), "uneven"),
            ("flash_c2048_f8", MG.MoeGemmSpec(2048, mma="fp8", xfmt="e4m3"), "uniform"),
            ("flash_skew_c2048_f8", MG.MoeGemmSpec(2048, mma="fp8", xfmt="e4m3"), "skew"),
            ("flash_shared_c2048_f8", MG.MoeGemmSpec(2048, shared=True, mma="fp8", xfmt="e4m3"), "uniform"),
            ("flash_c2048_bn128_f8", MG.MoeGemmSpec(2048, bn=128, mma="fp8", xfmt="e4m3"), "uniform"),
            ("flash_c2048_st3_f8", MG.MoeGemmSpec(2048, stages=3, mma="fp8", xfmt="e4m3"), "uniform"),
            # the FP8 wgmma (MoeGemmSpec.mma wgmma8, docs/perf.md Optimisation 23): e4m3 A and B, one promotion a K
            # step, 1 / 2 / 4 warpgroups; compared with the mma.sync twin by relative L2
            ("tiny_uneven_c77_w8", MG.MoeGemmSpec(77, mma="wgmma8", xfmt="e4m3", **TINY), "uneven"),
            ("flash_c2048_w8", MG.MoeGemmSpec(2048, mma="wgmma8", xfmt="e4m3"), "uniform"),
            ("flash_c2048_bn128_w8", MG.MoeGemmSpec(2048, mma="wgmma8", xfmt="e4m3", bn=128), "uniform"),
            ("flash_c2048_bn256_w8", MG.MoeGemmSpec(2048, mma="wgmma8", xfmt="e4m3", bn=256), "uniform"),
            ("flash_skew_c2048_bn256_w8", MG.MoeGemmSpec(2048, mma="wgmma8", xfmt="e4m3", bn=256), "skew"),
            ("flash_shared_c2048_bn256_w8", MG.MoeGemmSpec(2048, shared=True, mma="wgmma8", xfmt="e4m3", bn=256),
             "uniform"),
            # every other K-quant: Q4_K gate / up with Q6_K down (a Q4_K_M file's experts), Q2_K / Q5_K and IQ4_XS
            ("flash_q4k_q6k_c2048", MG.MoeGemmSpec(2048, fmt="q4_k", down_fmt="q6_k"), "uniform"),
            ("q2k_q5k_c77", MG.MoeGemmSpec(77, fmt="q2_k", down_fmt="q5_k", hidden=512, inter=512, k=3, n_experts=16),
             "uneven"),
            ("iq4xs_c77", MG.MoeGemmSpec(77, fmt="iq4_xs", hidden=512, inter=512, k=3, n_experts=16), "uneven")]


def picked(all_cases: list, filt: str) -> list:
    """The cases ``DS4C_MG_CASES`` (``filt``, comma-separated) selects: each word a substring of case names, or with a
    leading ``=`` one name exactly (``=flash_c2048_wg_bn128``: that case alone, e.g. under Nsight Compute); empty: all."""
    words = [w for w in filt.split(",") if w]
    return [c for c in all_cases if not words or any(c[0] == w[1:] if w.startswith("=") else w in c[0] for w in words)]


def _uneven_ids(C: int, k: int, E: int, g: torch.Generator) -> torch.Tensor:
    rows = []
    for r in range(C):
        pick = [5] if r % 11 != 3 else []
        pool = [e for e in torch.randperm(E, generator=g).tolist() if e not in (5, 9) and e not in pick]
        row = torch.tensor(pick + pool[:k - len(pick)])
        rows.append(row[torch.randperm(k, generator=g)])
    return torch.stack(rows).to(torch.int64)


def case_buffers(spec: MG.MoeGemmSpec, g: torch.Generator, device: str = "cuda", routing: str = "uniform"
                 ) -> dict[str, torch.Tensor]:
    """Every argument of the call (:func:`moe_gemm.arg_shapes` names) on ``device``: the inputs
    (``random_inputs``; ``g`` a CPU generator; dense: no ids / weights; shared: + ``shared``), the workspaces
    (:func:`moe_gemm.workspaces`) and ``out`` poisoned (NaN; int32 0x7f7f7f7f)."""
    inp = MG.random_inputs(spec, g, device, skew=routing == "skew")
    if routing == "uneven":
        inp["ids"] = _uneven_ids(spec.rows, spec.k, spec.n_experts, g).to(device)
    for n in MG.workspaces(spec) + ("out",):
        shape, dt = MG.arg_shapes(spec)[n]
        inp[n] = (torch.full(shape, 0x7f7f7f7f, dtype=dt, device=device) if dt == torch.int32
                  else torch.full(shape, float("nan"), dtype=dt, device=device))
    return inp


def _median_us(fn: Any) -> float:
    from gpu_checks.common import median_us

    return median_us(fn, ITERS, WARMUP)


_VARIANT = r"(_bn128|_bn256|_st3|_wg|_pf128|_pf256|_cf|_x8|_f8|_w8)+$"
#: relative L2 a wgmma or fp8 case's out may differ from its mma.sync twin's (another fp32 summation order; a few bf16
#: roundings of g, u, h or y flip: observed 1.1-1.5e-4 on the flash shapes with wgmma)
WG_TWIN_TOL = 1e-3


def _base(name: str) -> str:
    """The measured kernel a variant case derives from: its name less the variant suffixes ``_bn128`` / ``_bn256`` /
    ``_st3`` / ``_wg`` / ``_pf128`` / ``_pf256`` / ``_cf`` / ``_x8`` / ``_f8`` / ``_w8`` (64 wide, 2 stages, mma.sync,
    f16 tiles); its inputs are the variant's."""
    return re.sub(_VARIANT, "", name)


def _twin(name: str) -> str:
    """The case a variant is compared with: a wgmma variant of the width, prefetch or grid order with the plain
    wgmma case (``<base>_wg``: bit for bit, the same MMAs), the plain wgmma case, the fp8 ones and every mma.sync
    variant with the base (wgmma and fp8 by relative L2, :data:`WG_TWIN_TOL`; the others bit for bit)."""
    base = _base(name)
    return base + "_wg" if "_wg" in name and name != base + "_wg" else base


def _seed(name: str) -> int:
    """The input seed of case ``name``: a variant case (:func:`_base`) draws the inputs of its twin."""
    return zlib.crc32(_base(name).encode())


def _case(name: str, spec: MG.MoeGemmSpec, routing: str, kerns: list, use: dict, g: torch.Generator,
          tgt: Any, outs: dict[str, torch.Tensor] | None = None) -> dict:
    """One case (module docstring). ``outs`` (None: no twin check): the ``out`` (CPU) of the 64-wide twins run so
    far, by name: a variant case is compared with its twin's when present (``twin_equal``; None without one),
    another case adds its own."""
    launches = MG.launch_shapes(spec, tgt)
    names = MG.arg_names(spec)
    b = case_buffers(spec, g, "cuda", routing)

    def call(buf: dict[str, torch.Tensor]) -> None:
        for k, ln in zip(kerns, launches):
            k(ln.grid, ln.block, [buf[n] for n in names[ln.kernel]], ln.smem)

    call(b)
    torch.cuda.synchronize()
    if spec.dense:  # no routing: tile t = rows [64 t, 64 t + 64)
        tables, tiles = True, torch.tensor([[0, 0, 1, 0]] * MG.tile_slots(spec))
    else:
        perm, tiles = MG.routing_tables(spec, b["ids"])
        tables = torch.equal(b["perm"].cpu(), perm) and torch.equal(b["tiles"].cpu(), tiles)
    written = all(bool(torch.isfinite(b[n].float()).all()) for n in ("hbuf", "ybuf", "out") if n in b)
    rows = torch.arange(spec.rows) if spec.rows <= REF_ROWS else torch.randperm(spec.rows, generator=g)[:REF_ROWS]
    rd = rows.to("cuda")
    if spec.dense:
        want = MG.reference(spec, b["x"][rd], w1=b["w1"], w3=b["w3"], w2=b["w2"])
    else:
        want = MG.reference(spec, b["x"][rd], b["ids"][rd], b["weights"][rd], b["w1"], b["w3"], b["w2"],
                            shared=b["shared"][rd] if spec.shared else None)
    e = MG.rel_l2(b["out"][rd], want)
    b2 = dict(b, out=torch.full_like(b["out"], float("nan")))
    if "ybuf" in b:
        b2["ybuf"] = torch.full_like(b["ybuf"], float("nan"))
    call(b2)
    torch.cuda.synchronize()
    same = torch.equal(b["out"].view(torch.uint8), b2["out"].view(torch.uint8))
    twin = twin_rel = None
    if outs is not None:
        tw = _twin(name)
        if tw == name or name == _base(name) + "_wg":  # the twin of later variants
            outs[name] = b["out"].cpu()
        if tw != name and tw in outs:
            if spec.mma != "sync" and "_wg" not in tw:  # another summation order: compared by relative L2
                twin_rel = MG.rel_l2(b["out"].cpu().float(), outs[tw].float())
                twin = twin_rel < WG_TWIN_TOL
            else:
                twin = torch.equal(b["out"].cpu().view(torch.uint8), outs[tw].view(torch.uint8))
    ok = tables and written and same and e < TOL and twin is not False
    per = {}
    for k, ln in zip(kerns, launches):
        args = [b[n] for n in names[ln.kernel]]
        per[ln.kernel] = _median_us(lambda k=k, ln=ln, args=args: k(ln.grid, ln.block, args, ln.smem))
    us = _median_us(lambda: call(b))
    fl = MG.flops(spec)
    return {"spec": f"{name:18s}", "detail": spec.short() + f" {routing}", "ok": ok, "tables_ok": tables,
            "all_written": written, "deterministic": same, "rel_err": e, "us": us, "per_us": per,
            "TFLOPs": fl / (us * 1e-6) / 1e12, "TFLOPs_gemm": fl / ((per["up"] + per["down"]) * 1e-6) / 1e12,
            "tiles_used": int((tiles[:, 2] > 0).sum()), "tile_slots": tiles.shape[0], "twin_equal": twin,
            "twin_rel": twin_rel,
            "regs": {kn: u.get("registers") for kn, u in use.items()},
            "spills": any(u.get("spills") for u in use.values())}


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case (keys of :func:`_case`, or ``error``)."""
    from gpu_checks.common import compile_source, load

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tgt = make_target(arch)
    tmp = Path(tempfile.mkdtemp(prefix="ds4c-moe-gemm-"))
    specs = {n: (s, r) for n, s, r in picked(cases(), os.environ.get("DS4C_MG_CASES", ""))}
    srcs = {n: MG.render_moe_gemm(s, tgt, f"mg_{n}") for n, (s, _) in specs.items()}
    jobs = [(n, i, k) for n, ks in srcs.items() for i, k in enumerate(ks)]

    def job(item: tuple[str, int, Any]) -> tuple[tuple[str, int], Any]:
        n, i, k = item
        d = tmp / k.entry
        d.mkdir()
        try:
            return (n, i), compile_source(k, d)
        except Exception as e:  # reported per case
            return (n, i), e

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        built = dict(ex.map(job, jobs))
    compile_s = time.perf_counter() - t0
    rows: list[dict] = []
    outs: dict[str, torch.Tensor] = {}  # the twins' out, for their variant cases
    twins = {_twin(n) for n in specs if _twin(n) != n}
    for n, (spec, routing) in specs.items():
        g = torch.Generator().manual_seed(_seed(n))
        try:
            kerns, use = [], {}
            for i, (src, ln) in enumerate(zip(srcs[n], MG.launch_shapes(spec, tgt))):
                bb = built[(n, i)]
                if isinstance(bb, Exception):
                    raise bb
                kerns.append(load(bb[0]).function(src.entry, ln.smem))
                use[ln.kernel] = bb[1]
            rows.append(_case(n, spec, routing, kerns, use, g, tgt,
                              outs if n in twins or _twin(n) != n else None))
        except Exception as ex:
            traceback.print_exc()
            rows.append({"spec": n, "detail": spec.short(), "ok": False, "error": repr(ex)[:300],
                         "rel_err": float("nan"), "us": float("nan")})
        torch.cuda.empty_cache()
    for r in rows:
        r["compile_total_s"] = compile_s
    return rows


def print_table(rows: list[dict]) -> None:
    """A header, then one line per case (per-launch us in launch order after the call's)."""
    print(f"{'ok':3s} {'rel_err':>9s} {'us':>9s} {'TFLOP/s':>7s} {'gemm':>6s}  per launch us "
          f"(route actq_x up actq_h down combine)  spec")
    for r in rows:
        per = " ".join(f"{v:.1f}" for v in r.get("per_us", {}).values())
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r.get('rel_err', float('nan')):9.2e} {r.get('us', float('nan')):9.1f} "
              f"{r.get('TFLOPs', float('nan')):7.1f} {r.get('TFLOPs_gemm', float('nan')):6.1f}  [{per}]  "
              f"{r['spec']}  {r.get('detail', '')}  tiles {r.get('tiles_used', '?')}/{r.get('tile_slots', '?')} "
              f"regs {r.get('regs', {})}"
              + (f"  ERROR {r['error']}" if "error" in r else "")
              + ("" if r.get("tables_ok", True) else "  (routing tables differ)")
              + ("" if r.get("all_written", True) else "  (unwritten outputs)")
              + ("" if r.get("deterministic", True) else "  (not deterministic)")
              + ("" if r.get("twin_equal") is not False else "  (differs from its twin)")
              + ("" if r.get("twin_rel") is None else f"  twin rel {r['twin_rel']:.1e}"))


def main() -> int:
    from gpu_checks.common import standalone

    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
