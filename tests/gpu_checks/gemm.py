#!/usr/bin/env python3
"""GPU check of the batched-prefill GEMM family (runtime/families/gemm.py, templates/gemm/gemm.cu.j2).

Cases (:func:`cases`): the official prefill projections at chunk sizes C = 16, 64, 512 and 4096 (wq_a 4096 ->
1024 and wkv 4096 -> 512 Q8_0, wq_b 1024 -> 32768 Q8_0, a routed expert's w1 4096 -> 2048 and w2 2048 -> 4096
MXFP4, all fp8act; a bf16-weight, bf16-mode 4096 -> 4096), the head (4096 -> 129280 bf16, f32 mode; C <= 512:
its fp32 output at C = 4096 is 2 GB), fp32 outputs of fp8act products (Q8_0, MXFP4; their 1e-4 tolerance
sees one mis-quantized activation or mis-decoded weight), act_quant off, partial tiles in both dims (C = 77,
N = 1000), the SIMT engine (the HIP body) on CUDA, and ``x_prequant`` kernels on actq-quantized x (compare
their us with the same shapes' default kernels: the price of the in-kernel e4m3 rounding), and 128-row weight
tiles (``bn=128``, 256 threads) against the default 64. Two "twin" rows run a ``sw_quant`` kernel (software
e4m3 rounding) and its default twin (``cvt.rn.satfinite.e4m3x2.f32``) on the same inputs: the outputs must be
equal bit for bit. ``pq_*`` rows are prequant calls (``GemmSpec.prequant``: the actq launch writes x's e4m3
values as f16 and the per-128 scales once, the GEMM copies its X tiles by cp.async): ``us`` times the two
launches together, ``us_gemm`` the GEMM alone and ``us_actq`` the actq launch alone (printed after the spec);
their workspaces are poisoned with NaN too, and :data:`PQ_TWINS` compares each with its in-tile-quant twin bit
for bit on the same inputs; ``pq_st3_*`` rows the 3-stage cp.async pipeline (``GemmSpec.stages = 3``), which
:data:`ST_TWINS` compares with its 2-stage prequant twin bit for bit.

Per case: fresh random inputs (``gemm.random_x``: per-(row, 128-block) magnitudes 1e-2..1e2 and a row of
magnitude 1e-6 under the 1e-4 amax floor; ``gemm.random_weight``), the output poisoned with NaN and followed
by a guard tile of NaN rows (a write past row C shows), then: every element written, guard untouched, the
worst per-row relative error ||y - ref|| / ||ref|| against ``gemm.reference`` (on the GPU in fp32, TF32 off)
below 1e-2 for bf16 and 1e-4 for fp32 outputs, a second launch bit-identical, and the median of CUDA-event
timings (``common.median_us``). Reported: TFLOP/s (2*C*N*K) and GB/s (weight + x + y bytes; at C >= 64 the
kernel is compute bound, so no L2-cold weight rotation as in the GEMV check).

Usage: ``python tests/gpu_checks/gemm.py [--arch sm_90]`` or ``python tests/gpu_checks --only gemm``;
``DS4C_GM_CASES=kq_,wq_a_c512`` keeps the cases whose name contains one of the comma-separated substrings (and the
twin rows of pairs both kept).
Needs a CUDA GPU, torch, cuda-python and nvcc (or NVRTC); compiles and loads through
tests/gpu_checks/common.py. :func:`cases` and :func:`case_buffers` also run on the CPU (tests build them).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import gemm as GM
from ds4c.runtime.targets import target as make_target

CHUNKS = (16, 64, 512, 4096)
ITERS = 20
WARMUP = 3
TOL = {"bf16": 1e-2, "f32": 1e-4}
#: (name, N, K, fmt, mode, extra GemmSpec fields)
PROJECTIONS: list[tuple[str, int, int, str, str, dict]] = [
    ("wq_a", 1024, 4096, "q8_0", "fp8act", {}),
    ("wkv", 512, 4096, "q8_0", "fp8act", {}),
    ("wq_b", 32768, 1024, "q8_0", "fp8act", {}),
    ("expert_w1", 2048, 4096, "mxfp4", "fp8act", {}),
    ("expert_w2", 4096, 2048, "mxfp4", "fp8act", {}),
    ("bf16_4k", 4096, 4096, "bf16", "bf16", {}),
]


def cases() -> list[tuple[str, GM.GemmSpec]]:
    """Every case as ``(name, spec)`` (module docstring)."""
    out = [(f"{n}_c{c}", GM.GemmSpec(c, nn, k, fmt, mode, **kw)) for n, nn, k, fmt, mode, kw in PROJECTIONS
           for c in CHUNKS]
    out += [(f"head_c{c}", GM.GemmSpec(c, 129280, 4096, "bf16", "f32")) for c in (64, 512)]
    out += [("q8_f32out_c512", GM.GemmSpec(512, 1024, 4096, "q8_0", "fp8act", out_dtype="f32")),
            ("mxfp4_f32out_c512", GM.GemmSpec(512, 2048, 4096, "mxfp4", "fp8act", out_dtype="f32")),
            ("wq_a_noaq_c512", GM.GemmSpec(512, 1024, 4096, "q8_0", "fp8act", act_quant=False)),
            ("partial_mxfp4_c77", GM.GemmSpec(77, 1000, 2048, "mxfp4")),
            ("partial_q8_c77", GM.GemmSpec(77, 1000, 2048, "q8_0", out_dtype="f32")),
            ("simt_q8_c512", GM.GemmSpec(512, 1024, 4096, "q8_0", engine="simt")),
            ("simt_mxfp4_c77", GM.GemmSpec(77, 1000, 2048, "mxfp4", engine="simt")),
            ("simt_bf16_c64", GM.GemmSpec(64, 4096, 4096, "bf16", "bf16", engine="simt")),
            # K-quants / IQ4_XS (a Q4_K_M / Q3_K_M file's projections): wq_a in each format with prequant, a
            # partial tile in fp32 out with the in-tile quant
            *[(f"kq_wq_a_{f}_c2048", GM.GemmSpec(2048, 1024, 4096, f, prequant=True)) for f in GM.KQUANTS],
            ("kq_partial_q6_k_c77", GM.GemmSpec(77, 1000, 2048, "q6_k", out_dtype="f32")),
            # x_prequant: x is actq's output (case_buffers quantizes it), the kernel skips the rounding
            ("xpre_wq_a_c4096", GM.GemmSpec(4096, 1024, 4096, "q8_0", x_prequant=True)),
            ("xpre_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", x_prequant=True)),
            ("xpre_q8_f32out_c77", GM.GemmSpec(77, 1000, 2048, "q8_0", out_dtype="f32", x_prequant=True)),
            # 128-row weight tiles (256 threads): against the same shapes' bn=64 rows above
            ("bn128_wq_a_c4096", GM.GemmSpec(4096, 1024, 4096, "q8_0", bn=128)),
            ("bn128_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", bn=128)),
            ("bn128_wq_b_c512", GM.GemmSpec(512, 32768, 1024, "q8_0", bn=128)),
            ("bn128_partial_mxfp4_c77", GM.GemmSpec(77, 1000, 2048, "mxfp4", bn=128, out_dtype="f32")),
            # the software e4m3 rounding: TWINS compares each bit for bit with its cvt.rn.satfinite twin
            ("swq_wq_a_c512", GM.GemmSpec(512, 1024, 4096, "q8_0", sw_quant=True)),
            ("swq_mxfp4_f32out_c512", GM.GemmSpec(512, 2048, 4096, "mxfp4", "fp8act", out_dtype="f32",
                                                  sw_quant=True)),
            # prequant: actq (f16 e4m3 values + fp32 scales, once) + the GEMM copying its X tiles (cp.async);
            # against the same shapes' in-tile rows above (PQ_TWINS: bit for bit)
            ("pq_wq_a_c512", GM.GemmSpec(512, 1024, 4096, "q8_0", prequant=True)),
            ("pq_wq_a_c4096", GM.GemmSpec(4096, 1024, 4096, "q8_0", prequant=True)),
            ("pq_wq_b_c4096", GM.GemmSpec(4096, 32768, 1024, "q8_0", prequant=True)),
            ("pq_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", prequant=True)),
            ("pq_bn128_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", bn=128, prequant=True)),
            # the prefill chunk's size (2048 rows) at both tile widths (DS4C_PREFILL_GEMM_BN's A/B, perf.md Optimisation 17)
            ("pq_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", prequant=True)),
            ("pq_bn128_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", bn=128, prequant=True)),
            ("pq_wq_b_c2048", GM.GemmSpec(2048, 32768, 1024, "q8_0", prequant=True)),
            ("pq_bn128_wq_b_c2048", GM.GemmSpec(2048, 32768, 1024, "q8_0", bn=128, prequant=True)),
            ("pq_partial_mxfp4_c77", GM.GemmSpec(77, 1000, 2048, "mxfp4", prequant=True)),
            ("pq_partial_q8_c77", GM.GemmSpec(77, 1000, 2048, "q8_0", out_dtype="f32", prequant=True)),
            # the 3-stage cp.async pipeline (GemmSpec.stages 3; DS4C_PREFILL_STAGES=3): ST_TWINS compares each with
            # its 2-stage prequant twin bit for bit
            ("pq_st3_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", prequant=True, stages=3)),
            ("pq_st3_bn128_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", bn=128, prequant=True, stages=3)),
            ("pq_st3_wq_b_c2048", GM.GemmSpec(2048, 32768, 1024, "q8_0", prequant=True, stages=3)),
            ("pq_st3_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", prequant=True, stages=3)),
            ("pq_st3_partial_q8_c77", GM.GemmSpec(77, 1000, 2048, "q8_0", out_dtype="f32", prequant=True, stages=3)),
            # e4m3 X tiles (GemmSpec.xfmt, docs/perf.md Optimisation 22): X8_TWINS compares each with its f16-tile
            # prequant twin bit for bit (the chunk's shapes at 2048 rows, a K-quant, the pipeline, partial tiles)
            ("pq_x8_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", prequant=True, xfmt="e4m3")),
            ("pq_x8_bn128_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", bn=128, prequant=True, xfmt="e4m3")),
            ("pq_x8_wq_b_c2048", GM.GemmSpec(2048, 32768, 1024, "q8_0", prequant=True, xfmt="e4m3")),
            ("pq_x8_expert_w1_c4096", GM.GemmSpec(4096, 2048, 4096, "mxfp4", prequant=True, xfmt="e4m3")),
            ("pq_x8_st3_wq_a_c2048", GM.GemmSpec(2048, 1024, 4096, "q8_0", prequant=True, stages=3, xfmt="e4m3")),
            ("pq_x8_partial_q8_c77", GM.GemmSpec(77, 1000, 2048, "q8_0", out_dtype="f32", prequant=True, xfmt="e4m3")),
            ("kq_x8_wq_a_q3_k_c2048", GM.GemmSpec(2048, 1024, 4096, "q3_k", prequant=True, xfmt="e4m3"))]
    return out


#: (software-rounding case, its default twin): the same inputs must give the same bits (the check that
#: cvt.rn.satfinite.e4m3x2.f32 rounds as the reference does, subnormals and saturation included)
TWINS = [("swq_wq_a_c512", "wq_a_c512"), ("swq_mxfp4_f32out_c512", "mxfp4_f32out_c512")]
#: (prequant case, its in-tile-quant twin): the same values in the same order, so the same bits
PQ_TWINS = [("pq_wq_a_c512", "wq_a_c512"), ("pq_wq_a_c4096", "wq_a_c4096"), ("pq_wq_b_c4096", "wq_b_c4096"),
            ("pq_expert_w1_c4096", "expert_w1_c4096"), ("pq_bn128_expert_w1_c4096", "bn128_expert_w1_c4096"),
            ("pq_partial_mxfp4_c77", "partial_mxfp4_c77"), ("pq_partial_q8_c77", "partial_q8_c77")]
#: (3-stage case, its 2-stage prequant twin): the same MMAs in the same order, so the same bits
ST_TWINS = [("pq_st3_wq_a_c2048", "pq_wq_a_c2048"), ("pq_st3_bn128_wq_a_c2048", "pq_bn128_wq_a_c2048"),
            ("pq_st3_wq_b_c2048", "pq_wq_b_c2048"), ("pq_st3_expert_w1_c4096", "pq_expert_w1_c4096"),
            ("pq_st3_partial_q8_c77", "pq_partial_q8_c77")]
#: (e4m3-tile case, its f16-tile twin): the same MMAs on the same values, so the same bits
X8_TWINS = [("pq_x8_wq_a_c2048", "pq_wq_a_c2048"), ("pq_x8_bn128_wq_a_c2048", "pq_bn128_wq_a_c2048"),
            ("pq_x8_wq_b_c2048", "pq_wq_b_c2048"), ("pq_x8_expert_w1_c4096", "pq_expert_w1_c4096"),
            ("pq_x8_st3_wq_a_c2048", "pq_st3_wq_a_c2048"), ("pq_x8_partial_q8_c77", "pq_partial_q8_c77"),
            ("kq_x8_wq_a_q3_k_c2048", "kq_wq_a_q3_k_c2048")]


def case_buffers(spec: GM.GemmSpec, g: torch.Generator, device: str = "cuda"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, w, ybuf)`` on ``device`` (``g`` lives there): ``ybuf`` is ``[C + 64, N]`` of NaN in ``out_dtype``;
    the kernel gets its first C rows, the rest is the guard. With ``x_prequant`` x is quantized as actq
    does (``act_quant_dequant`` in bf16, exact)."""
    from ds4c.quant import act_quant_dequant

    x = GM.random_x(spec, g, device)
    if spec.x_prequant:
        x = act_quant_dequant(x, 128).to(torch.bfloat16)
    w = GM.random_weight(spec, g, device)
    ybuf = torch.full((spec.rows + GM.BM, spec.n), float("nan"), dtype=spec.torch_out_dtype, device=device)
    return x, w, ybuf


def workspace_buffers(spec: GM.GemmSpec, tgt: Any, device: str = "cuda") -> dict[str, torch.Tensor]:
    """The call's workspaces (:func:`ds4c.runtime.families.gemm.workspaces`: prequant's ``xq``, ``xs``) on
    ``device``, NaN-poisoned (a GEMM reading what actq did not write shows)."""
    return {n: torch.full(sh, float("nan"), dtype=dt, device=device) for n, (sh, dt) in GM.workspaces(spec, tgt).items()}


def _caller(spec: GM.GemmSpec, tgt: Any, kerns: list) -> Any:
    """``go(bufs, only=None)``: launch the call's kernels (:func:`GM.launch_shapes` order; ``only``: that kernel
    alone) on ``bufs`` (argument name -> tensor)."""
    lns, names = GM.launch_shapes(spec, tgt), GM.arg_names(spec, tgt)

    def go(bufs: dict, only: str | None = None) -> None:
        for k, ln in zip(kerns, lns):
            if only is None or ln.kernel == only:
                k(ln.grid, ln.block, [bufs[a] for a in names[ln.kernel]], ln.smem)

    return go


def _rel_rows(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst over the rows of ||got - want|| / ||want|| (rows differ in magnitude by 1e8)."""
    g, w = got.double(), want.double()
    d = (g - w).nan_to_num(float("inf")).norm(dim=-1)
    return float((d / w.norm(dim=-1).clamp(min=1e-300)).max())


def _case(name: str, spec: GM.GemmSpec, kerns: list, use: dict, csec: float, g: torch.Generator, tgt: Any) -> dict:
    ln = GM.launch_shape(spec, tgt)
    go = _caller(spec, tgt, kerns)
    x, w, ybuf = case_buffers(spec, g)
    y = ybuf[:spec.rows]
    bufs = {"x": x, "w": w, "y": y, **workspace_buffers(spec, tgt)}
    go(bufs)
    torch.cuda.synchronize()
    want = GM.reference(spec, x, w)
    written = not bool(torch.isnan(y).any())
    guard = bool(torch.isnan(ybuf[spec.rows:]).all())
    e = _rel_rows(y, want)
    y2 = torch.full_like(y, float("nan"))
    go({**bufs, "y": y2})
    torch.cuda.synchronize()
    iv = torch.int16 if y.dtype == torch.bfloat16 else torch.int32
    same = torch.equal(y.view(iv), y2.view(iv))
    ok = written and guard and same and e < TOL[spec.out_dtype]
    us = _median_us(lambda: go(bufs))
    extra = {}
    if len(kerns) > 1:  # prequant: each launch alone too
        extra = {"us_gemm": _median_us(lambda: go(bufs, "gemm")), "us_actq": _median_us(lambda: go(bufs, "actq"))}
    nbytes = GM.weight_bytes(spec) + x.numel() * 2 + y.numel() * y.element_size()
    return {**extra, "spec": f"{name:18s}", "detail": spec.short(), "ok": ok, "all_written": written, "guard_ok": guard,
            "deterministic": same, "rel_err": e, "us": us, "TFLOPs": GM.flops(spec) / (us * 1e-6) / 1e12,
            "GBps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes, "grid": ln.grid, "smem": ln.smem,
            "regs": use.get("registers"), "spills": use.get("spills"), "compile_s": csec}


def _median_us(fn: Any) -> float:
    from gpu_checks.common import median_us

    return median_us(fn, ITERS, WARMUP)


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, detail, ok, all_written, guard_ok, deterministic, rel_err, us,
    TFLOPs, GBps, bytes, grid, smem, regs, spills, compile_s (prequant cases also us_gemm, us_actq); then one
    per twin pair (:data:`TWINS`, :data:`PQ_TWINS`, :data:`ST_TWINS`, :data:`X8_TWINS`)."""
    from gpu_checks.common import compile_source, load

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tgt = make_target(arch)
    tmp = Path(tempfile.mkdtemp(prefix="ds4c-gemm-"))
    pick = [c for c in os.environ.get("DS4C_GM_CASES", "").split(",") if c]  # substrings of case names
    specs = {n: s for n, s in cases() if not pick or any(c in n for c in pick)}
    # every case's kernels in launch order (a prequant call: actq, then the GEMM)
    srcs = {n: GM.render_call(s, tgt, f"gemm_{n}") for n, s in specs.items()}

    def job(n: str) -> tuple[str, Any]:
        try:
            out = []
            for k in srcs[n]:
                d = tmp / k.entry
                d.mkdir()
                out.append(compile_source(k, d))
            return n, out
        except Exception as e:  # reported per case
            return n, e

    def kernels(n: str) -> list:
        b = built[n]
        if isinstance(b, Exception):
            raise b
        return [load(img).function(k.entry, ln.smem)
                for (img, _, _), k, ln in zip(b, srcs[n], GM.launch_shapes(specs[n], tgt))]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        built = dict(ex.map(job, list(srcs)))
    compile_s = time.perf_counter() - t0
    g = torch.Generator(device="cuda").manual_seed(1234)
    rows: list[dict] = []
    for n, spec in specs.items():
        try:
            ks = kernels(n)
            _, use, secs = built[n][-1]  # the GEMM's resources
            rows.append(_case(n, spec, ks, use, secs + sum(b[2] for b in built[n][:-1]), g, tgt))
        except Exception as ex:
            traceback.print_exc()
            rows.append({"spec": n, "detail": spec.short(), "ok": False, "error": repr(ex)[:300],
                         "rel_err": float("nan"), "us": float("nan"), "GBps": float("nan")})
        torch.cuda.empty_cache()
    for sw, hw in [tw for tw in TWINS + PQ_TWINS + ST_TWINS + X8_TWINS if tw[0] in specs and tw[1] in specs]:
        what = ("software vs cvt e4m3 rounding" if (sw, hw) in TWINS else "prequant vs in-tile quant"
                if (sw, hw) in PQ_TWINS else "3-stage pipeline vs 2 stages" if (sw, hw) in ST_TWINS
                else "e4m3 vs f16 X tiles") + ", bit for bit"
        try:
            spec = specs[sw]
            x, w, ybuf = case_buffers(spec, g)
            y2 = torch.full_like(ybuf[:spec.rows], float("nan"))
            _caller(spec, tgt, kernels(sw))({"x": x, "w": w, "y": ybuf[:spec.rows],
                                              **workspace_buffers(spec, tgt)})
            _caller(specs[hw], tgt, kernels(hw))({"x": x, "w": w, "y": y2, **workspace_buffers(specs[hw], tgt)})
            torch.cuda.synchronize()
            iv = torch.int16 if y2.dtype == torch.bfloat16 else torch.int32
            same = torch.equal(ybuf[:spec.rows].view(iv), y2.view(iv))
            rows.append({"spec": f"twin {sw} = {hw}", "detail": what,
                         "ok": same, "rel_err": _rel_rows(y2, ybuf[:spec.rows]), "us": float("nan"),
                         "GBps": float("nan")})
        except Exception as ex:
            traceback.print_exc()
            rows.append({"spec": f"twin {sw} = {hw}", "ok": False, "error": repr(ex)[:300],
                         "rel_err": float("nan"), "us": float("nan"), "GBps": float("nan")})
    for r in rows:
        r["compile_total_s"] = compile_s
    return rows


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'us':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'smem':>6s} {'regs':>4s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r.get('rel_err', float('nan')):9.2e} "
              f"{r.get('us', float('nan')):9.1f} {r.get('TFLOPs', float('nan')):8.1f} "
              f"{r.get('GBps', float('nan')):7.0f} {r.get('smem', 0):6d} {str(r.get('regs')):>4s}  "
              f"{r['spec']}  {r.get('detail', '')}"
              + (f"  (gemm alone {r['us_gemm']:.1f} us, actq {r['us_actq']:.1f} us)" if "us_gemm" in r else "")
              + (f"  ERROR {r['error']}" if "error" in r else "")
              + ("" if r.get("all_written", True) else "  (unwritten outputs)")
              + ("" if r.get("guard_ok", True) else "  (wrote past row C)")
              + ("" if r.get("deterministic", True) else "  (not deterministic)"))


def main() -> int:
    from gpu_checks.common import standalone

    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
