#!/usr/bin/env python3
"""GPU check of the fused HC family (runtime/families/hc.py): variants post_pre / embed_pre / post_head at the
official (D 4096) and tiny (D 256) widths, q = 1 and 5.

Per case: fresh random inputs shaped like the synthetic model's HC parameters (fn ~ N(0, 1/(hc*D)), scale ~
(0.5, 0.5, 0.2), base with +1 on the comb diagonal; ``hc.random_inputs``), every output and the workspace
poisoned with NaN before the launch, then: every output written (no NaN left), relative error (max |got - want|
/ max |want|, per output) against ``hc.reference`` (the reference model's own functions) below 1e-2 for the
bf16 outputs (x / x_new, y) and 1e-4 for the fp32 ones (post_new, comb_new), and the median of 50 CUDA-event
timings of the boundary (mix + norm launches; also each alone). GB/s = ``hc.bytes_read`` (fn, the streams or
embedding rows, out, post, comb, norm gain: every input once) / time. One extra case feeds embed_pre an
out-of-range token id and expects NaN rows (never an out-of-bounds read).

Usage: ``python tests/gpu_checks/hc.py [--arch sm_90]`` (prints a table), or through
``python tests/gpu_checks`` (every family). Needs a CUDA GPU, torch, cuda-python (cuda.bindings) and nvcc (or NVRTC
through ds4c's toolchain); compiles and loads through tests/gpu_checks/common.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import hc as H
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_all, median_us, standalone

WIDTHS = {"official": 4096, "tiny": 256}
QS = (1, 5)
N_VOCAB = 1024
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


# ------------------------------------------------------------------------------------------------ the check
def _spec(variant: str, width: str, q: int) -> H.HcSpec:
    return H.HcSpec(variant, q, WIDTHS[width], n_mix=4 if variant == "post_head" else 24)


def _buffers(spec: H.HcSpec, inputs: dict[str, torch.Tensor], dev: torch.device) -> dict[str, Any]:
    """Device inputs plus NaN-poisoned outputs and workspace, by argument name."""
    shapes = H.arg_shapes(spec, n_vocab=N_VOCAB)
    vals: dict[str, Any] = {k: v.to(dev).contiguous() for k, v in inputs.items()}
    vals["n_vocab"] = N_VOCAB
    names = {n for ns in H.arg_names(spec).values() for n in ns}
    for n in names:
        if n not in vals:
            shape, dtype = shapes[n]
            vals[n] = torch.full(shape, float("nan"), dtype=dtype, device=dev)
    return vals


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    d = (got.float() - want.float()).nan_to_num(float("inf")).abs().max()
    return float(d / want.float().abs().max().clamp(min=1e-30))


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, ok, rel_err (worst output, relative to its tolerance's
    output), errs (per output), all_written, us (mix + norm), us_mix, us_norm, GBps, regs, compile_s."""
    tgt = make_target(arch)
    cases = [(v, w, q) for v in H.VARIANTS for w in WIDTHS for q in QS]
    srcs = [k for v, w, q in cases for k in H.render_hc(_spec(v, w, q), tgt, f"hc_{v}_{w}_q{q}")]
    kernels, compile_s = compile_all(srcs, "ds4c-hc-")

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(4321)
    rows: list[dict] = []
    for v, w, q in cases:
        spec = _spec(v, w, q)
        name = f"hc_{v}_{w}_q{q}"
        one = v == "post_out"  # the layer-split boundary's post half: stage mix only
        (kmix, use_mix, s_mix) = kernels[name + "_mix"]
        (knorm, use_norm, s_norm) = (None, {}, 0.0) if one else kernels[name + "_norm"]
        shapes = H.launch_shapes(spec)
        lm, ln = shapes[0], shapes[-1]
        names = H.arg_names(spec)
        inputs = H.random_inputs(spec, g, n_vocab=N_VOCAB)
        want = H.reference(spec, **inputs)
        vals = _buffers(spec, inputs, dev)
        margs, nargs = [vals[n] for n in names["mix"]], [vals[n] for n in names.get("norm", [])]

        def mix() -> None:
            kmix(lm.grid, lm.block, margs)

        def norm() -> None:
            if knorm is not None:
                knorm(ln.grid, ln.block, nargs)

        def both() -> None:
            mix()
            norm()

        both()
        torch.cuda.synchronize()
        errs, written, ok = {}, True, True
        for k, ref in want.items():
            got = vals[k].cpu()
            wr = not bool(torch.isnan(got).any())
            errs[k] = _rel(got, ref)
            written &= wr
            ok &= wr and errs[k] < TOL[ref.dtype]
        us, us_mix, us_norm = median_us(both), median_us(mix), median_us(norm)
        nbytes = H.bytes_read(spec)
        rows.append({
            "spec": f"{v:9s} {w:8s} q={q}", "ok": ok, "all_written": written,
            "rel_err": max(errs.values()), "errs": errs, "us": us, "us_mix": us_mix, "us_norm": us_norm,
            "GBps": nbytes / (us * 1e-6) / 1e9, "bytes": nbytes,
            "regs": f"{use_mix.get('registers')}/{use_norm.get('registers')}", "compile_s": s_mix + s_norm,
        })
    rows.append(_bad_token_case(kernels, dev, g))
    for r in rows:
        r["compile_total_s"] = compile_s
    return rows


def _bad_token_case(kernels: dict, dev: torch.device, g: torch.Generator) -> dict:
    """embed_pre with token ids -1 and n_vocab: the rows come out NaN (the kernel never reads outside the
    table); a valid row beside them is unaffected."""
    spec = _spec("embed_pre", "tiny", 5)
    name = "hc_embed_pre_tiny_q5"
    inputs = H.random_inputs(spec, g, n_vocab=N_VOCAB)
    inputs["tokens"] = torch.tensor([3, -1, N_VOCAB, 7, 0], dtype=torch.int64)
    vals = _buffers(spec, inputs, dev)
    lm, ln = H.launch_shapes(spec)
    names = H.arg_names(spec)
    kernels[name + "_mix"][0](lm.grid, lm.block, [vals[n] for n in names["mix"]])
    kernels[name + "_norm"][0](ln.grid, ln.block, [vals[n] for n in names["norm"]])
    torch.cuda.synchronize()
    y = vals["y"].cpu()
    bad_nan = bool(torch.isnan(y[1]).all() and torch.isnan(y[2]).all())
    good = [0, 3, 4]
    sub = dict(inputs, tokens=inputs["tokens"][good])
    want = H.reference(H.HcSpec("embed_pre", 3, 256), **sub)["y"]
    err = _rel(y[good], want)
    return {"spec": "embed_pre tiny     bad token ids -> NaN rows", "ok": bad_nan and err < 1e-2,
            "all_written": True, "rel_err": err, "errs": {"y": err}, "us": float("nan"), "us_mix": float("nan"),
            "us_norm": float("nan"), "GBps": float("nan"), "bytes": 0, "regs": "", "compile_s": 0.0}


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'us':>7s} {'mix':>6s} {'norm':>6s} {'GB/s':>7s} {'KB read':>8s} {'regs':>7s}  "
          f"spec  (per-output errors)")
    for r in rows:
        errs = " ".join(f"{k}={e:.1e}" for k, e in r["errs"].items())
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r['rel_err']:9.2e} {r['us']:7.2f} {r['us_mix']:6.2f} "
              f"{r['us_norm']:6.2f} {r['GBps']:7.1f} {r['bytes'] / 1024:8.0f} {r['regs']:>7s}  {r['spec']}  ({errs})")


def main() -> int:
    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
