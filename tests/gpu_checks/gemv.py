#!/usr/bin/env python3
"""GPU check of the multi-output GEMV family (runtime/families/gemv.py) and gemv_argmax.

Cases (each at q = 1 and 5): the official projection shapes wq_a (4096 -> 1024, Q8_0, fp8act), wkv (4096 -> 512),
wq_b (1024 -> 32768), one routed expert (4096 -> 2048 MXFP4, fp8act) and its w2 (2048 -> 4096), the head
(4096 -> 129280, bf16 weights, f32 mode), the 7-output attention-input fusion (wq_a, wkv, compressor wkv / wgate,
indexer weights_proj and compressor wkv / wgate), plus two checks with fp32 output of an fp8act product (Q8_0
and MXFP4), whose 1e-4 tolerance sees a single mis-quantized activation or mis-decoded weight, one with the
activation quantization off, gemv_argmax on the head's logits (with planted ties), and the K-quant / IQ4_XS
cases (wq_a with fp32 output and wq_b per format, the head in Q6_K, a bf16-mode Q4_K, a mixed attention input).

Per case: fresh random inputs (x with per-128-block magnitudes from 1e-2 to 1e2, and a row of magnitude 1e-6
that exercises the 1e-4 amax floor; weights as random valid stored
bytes: int8 codes + fp16 scales for Q8_0, nibbles + exponents 118..124 for MXFP4, random super-blocks with
sane fp16 d / dmin for the K-quants), every output poisoned with NaN
before the launch, then: every element written, relative error ||y - ref|| / ||ref|| (worst q row) against
``gemv.reference`` (computed on the GPU in fp32, TF32 off) below 1e-2 for bf16 outputs and 1e-4 for fp32
outputs, and the median of 50 CUDA-event timings after warm-up, cycling through enough weight copies that
the set is larger than L2 (so GB/s is HBM bandwidth, not cache). GB/s counts weight bytes only.

Usage: ``python tests/gpu_checks/gemv.py [--arch sm_90]`` (prints a table), or through
``python tests/gpu_checks`` (every family). Needs a CUDA GPU, torch, cuda-python (cuda.bindings) and nvcc (or NVRTC
through ds4c's toolchain); compiles and loads through tests/gpu_checks/common.py.
Runs in well under 2 minutes on an H200.
"""

from __future__ import annotations

import itertools
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

from ds4c.runtime.families import gemv as G
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_source, load, median_us, standalone

O = G.GemvOutput
QS = (1, 5)
ITERS = 50
WARMUP = 5
ROTATE_BYTES = 256 << 20  # weight copies cycled while timing: > 4x the H200's 60 MB L2
TOL = {"bf16": 1e-2, "f32": 1e-4}


def _attn_input(k: int = 4096) -> list[G.GemvOutput]:
    return [O(1024, "q8_0", "fp8act"), O(512, "q8_0", "fp8act"), O(1024, "bf16", "f32"), O(1024, "bf16", "f32"),
            O(64, "bf16", "bf16"), O(256, "bf16", "f32"), O(256, "bf16", "f32")]


CASES: list[tuple[str, int, list[G.GemvOutput], bool]] = [
    ("wq_a", 4096, [O(1024, "q8_0", "fp8act")], True),
    ("wkv", 4096, [O(512, "q8_0", "fp8act")], True),
    ("wq_b", 1024, [O(32768, "q8_0", "fp8act")], True),
    ("expert_w1", 4096, [O(2048, "mxfp4", "fp8act")], True),
    ("expert_w2", 2048, [O(4096, "mxfp4", "fp8act")], True),
    ("head", 4096, [O(129280, "bf16", "f32")], True),
    ("attn_in7", 4096, _attn_input(), True),
    ("q8_f32out", 4096, [O(1024, "q8_0", "fp8act", "f32")], True),
    ("mxfp4_f32out", 4096, [O(2048, "mxfp4", "fp8act", "f32")], True),
    ("wq_a_noaq", 4096, [O(1024, "q8_0", "fp8act")], False),
    # K-quants / IQ4_XS (a Q4_K_M / Q3_K_M file's non-expert matrices): wq_a and wq_b in each format, fp32 output
    # of the fp8act product (tolerance 1e-4 sees a mis-decoded scale or code), the head in Q6_K (llama.cpp's
    # output type in the K mixes) and a bf16-mode shared-expert-sized GEMV; wq_b (K = 1024) in Q3_K / Q6_K has
    # rows of 440 / 840 bytes, not 16-byte multiples
    *[(f"wq_a_{f}", 4096, [O(1024, f, "fp8act", "f32")], True) for f in G.KQUANTS],
    *[(f"wq_b_{f}", 1024, [O(32768, f, "fp8act")], True) for f in G.KQUANTS],
    ("head_q6_k", 4096, [O(129280, "q6_k", "f32")], True),
    ("shexp_q4_k_bf16", 4096, [O(2048, "q4_k", "bf16")], True),
    ("attn_in_q4_k", 4096, [O(1024, "q4_k", "fp8act"), O(512, "q4_k", "fp8act"), O(64, "bf16", "bf16")], True),
]


# ------------------------------------------------------------------------------------------------ helpers
def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst over the q rows of ||got - want|| / ||want|| (rows of x differ in magnitude by 1e6)."""
    g, w = got.double(), want.double()
    d = (g - w).nan_to_num(float("inf")).norm(dim=-1)
    return float((d / w.norm(dim=-1).clamp(min=1e-300)).max())


def _time(fn: Any, n_variants: int) -> float:
    """Median microseconds of ITERS event-timed calls (``common.median_us``); call i uses weight copy
    i % n_variants, so consecutive calls read different copies."""
    calls = itertools.count()
    return median_us(lambda: fn(next(calls) % n_variants), ITERS, WARMUP)


def _random_x(spec: G.GemvSpec, g: torch.Generator) -> torch.Tensor:
    """bf16 [q, K]: N(0, 1) times a per-128-block magnitude 10^U(-2, 2) (varied fp8 scales); with q > 1, row 1
    has magnitude 1e-6 (every block's amax under the 1e-4 floor of the fp8 scale)."""
    mag = 10.0 ** (torch.rand(spec.q, spec.k // 128, 1, generator=g, device="cuda") * 4 - 2)
    if spec.q > 1:
        mag[1] = 1e-6
    x = torch.randn(spec.q, spec.k // 128, 128, generator=g, device="cuda") * mag
    return x.reshape(spec.q, spec.k).to(torch.bfloat16)


# ------------------------------------------------------------------------------------------------ the check
def case_buffers(spec: G.GemvSpec, g: torch.Generator) -> tuple[torch.Tensor, list, list, list]:
    """(x, weights, weight copies cycled while timing (L2 cold; the first is ``weights``), NaN-poisoned
    outputs) of one case on the GPU."""
    x = _random_x(spec, g)
    ws = [G.random_weight(o, spec.k, g, device="cuda") for o in spec.outputs]
    copies = max(1, min(64, -(-ROTATE_BYTES // G.weight_bytes(spec))))
    wsets = [ws] + [[w.clone() for w in ws] for _ in range(copies - 1)]
    ys = [torch.full((spec.q, o.n), float("nan"), dtype=o.torch_out_dtype, device="cuda") for o in spec.outputs]
    return x, ws, wsets, ys


def _gemv_case(name: str, spec: G.GemvSpec, kern: Any, use: dict, csec: float, g: torch.Generator,
               tgt: Any = None) -> dict:
    grid, block, smem = G.launch_shape(spec, tgt)
    x, ws, wsets, ys = case_buffers(spec, g)
    wbytes, copies = G.weight_bytes(spec), len(wsets)
    kern(grid, block, [x, *ws, *ys], smem)
    torch.cuda.synchronize()
    want = G.reference(spec, x, ws)
    errs, written, ok = [], True, True
    for o, y, ref in zip(spec.outputs, ys, want):
        wr = not bool(torch.isnan(y).any())
        e = _rel(y, ref)
        errs.append(e)
        written &= wr
        ok &= wr and e < TOL[o.out_dtype]
    # a second launch on the same inputs must give identical bits (no race, deterministic order)
    ys2 = [torch.full_like(y, float("nan")) for y in ys]
    kern(grid, block, [x, *ws, *ys2], smem)
    torch.cuda.synchronize()
    same = all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32))
               for a, b in zip(ys, ys2))
    ok &= same

    def launch(i: int) -> None:
        kern(grid, block, [x, *wsets[i], *ys], smem)

    us = _time(launch, copies)
    return {"spec": f"{name:13s} q={spec.q}", "detail": spec.short(), "ok": ok, "all_written": written,
            "deterministic": same, "rel_err": max(errs), "errs": errs, "us": us,
            "GBps": wbytes / (us * 1e-6) / 1e9, "bytes": wbytes, "grid": grid[0], "smem": smem,
            "regs": use.get("registers"), "spills": use.get("spills"), "compile_s": csec}


def _argmax_case(q: int, head_kern: Any, am_kern: Any, g: torch.Generator, tgt: Any = None) -> dict:
    spec = G.GemvSpec(4096, q, [O(129280, "bf16", "f32")])
    grid, block, smem = G.launch_shape(spec, tgt)
    x = _random_x(spec, g)
    w = G.random_weight(spec.outputs[0], 4096, g, device="cuda")
    logits = torch.full((q, 129280), float("nan"), device="cuda")
    head_kern(grid, block, [x, w, logits], smem)
    # planted ties: row 1's maximum copied to an earlier and a later index (the earliest must win);
    # a run of +inf in the last row
    if q > 1:
        m = int(logits[1].argmax())
        logits[1, 7] = logits[1, m]
        logits[1, 129279] = logits[1, m]
    logits[q - 1, 100:110] = float("inf")
    am = G.ArgmaxSpec(129280, q)
    out = torch.full((q,), -1, dtype=torch.int32, device="cuda")
    ag, ab, _ = G.argmax_launch_shape(am)
    am_kern(ag, ab, [logits, out])
    torch.cuda.synchronize()
    want = G.argmax_reference(logits)
    ok = torch.equal(out, want)
    us = _time(lambda i: am_kern(ag, ab, [logits, out]), 1)
    nbytes = logits.numel() * 4
    return {"spec": f"{'argmax':13s} q={q}", "detail": f"argmax over [{q}, 129280] fp32 (ties planted)",
            "ok": ok, "all_written": bool((out >= 0).all()), "deterministic": True, "rel_err": 0.0 if ok else 1.0,
            "errs": [], "us": us, "GBps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes, "grid": q, "smem": 0,
            "regs": None, "spills": None, "compile_s": 0.0}


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, detail, ok, all_written, deterministic, rel_err (worst output),
    errs (per output), us (median), GBps (weight bytes / us), bytes, grid, smem, regs, spills, compile_s."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tgt = make_target(arch)
    tmp = Path(tempfile.mkdtemp(prefix="ds4c-gemv-"))
    specs = {f"gemv_{n}_q{q}": G.GemvSpec(k, q, outs, aq) for n, k, outs, aq in CASES for q in QS}
    srcs = [G.render_gemv(s, tgt, e) for e, s in specs.items()]
    srcs += [G.render_argmax(G.ArgmaxSpec(129280, q), tgt, f"gemv_argmax_q{q}") for q in QS]

    def job(k: Any) -> tuple[str, Any]:
        d = tmp / k.entry
        d.mkdir()
        try:
            return k.entry, compile_source(k, d)
        except Exception as e:  # reported per case
            return k.entry, e

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        built = dict(ex.map(job, srcs))
    compile_s = time.perf_counter() - t0
    smem = {e: G.launch_shape(s, tgt)[2] for e, s in specs.items()}
    kernels: dict[str, Any] = {}
    for e, b in built.items():
        if isinstance(b, Exception):
            kernels[e] = b
            continue
        img, use, secs = b
        try:
            kernels[e] = (load(img).function(e, smem.get(e, 0)), use, secs)
        except Exception as ex:
            kernels[e] = ex

    g = torch.Generator(device="cuda").manual_seed(1234)
    rows: list[dict] = []
    for e, spec in specs.items():
        k = kernels[e]
        try:
            if isinstance(k, Exception):
                raise k
            rows.append(_gemv_case(e[5:-3], spec, *k, g, tgt))
        except Exception as ex:
            traceback.print_exc()
            rows.append({"spec": e, "detail": spec.short(), "ok": False, "error": repr(ex)[:300],
                         "rel_err": float("nan"), "us": float("nan"), "GBps": float("nan")})
    for q in QS:
        hk, ak = kernels[f"gemv_head_q{q}"], kernels[f"gemv_argmax_q{q}"]
        try:
            for kk in (hk, ak):
                if isinstance(kk, Exception):
                    raise kk
            rows.append(_argmax_case(q, hk[0], ak[0], g, tgt))
        except Exception as ex:
            traceback.print_exc()
            rows.append({"spec": f"argmax q={q}", "ok": False, "error": repr(ex)[:300], "rel_err": float("nan"),
                         "us": float("nan"), "GBps": float("nan")})
    for r in rows:
        r["compile_total_s"] = compile_s
    return rows


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'us':>9s} {'GB/s':>7s} {'MB':>8s} {'grid':>5s} {'smem':>6s} {'regs':>4s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r.get('rel_err', float('nan')):9.2e} "
              f"{r.get('us', float('nan')):9.1f} {r.get('GBps', float('nan')):7.0f} {r.get('bytes', 0) / 1e6:8.2f} "
              f"{r.get('grid', 0):5d} "
              f"{r.get('smem', 0):6d} {str(r.get('regs')):>4s}  {r['spec']}  {r.get('detail', '')}"
              + (f"  ERROR {r['error']}" if "error" in r else "")
              + ("" if r.get("all_written", True) else "  (unwritten outputs)")
              + ("" if r.get("deterministic", True) else "  (not deterministic)"))


def main() -> int:
    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
