#!/usr/bin/env python3
"""GPU check of the row-chain and grouped ``wo_a`` families (runtime/families/rowchain.py): every row chain of a
decode step (KV, q, indexer q, inverse-RoPE output, head weights, q_norm, KV + ring write; plus an in-place KV
chain and int64 per-row positions) and the grouped ``wo_a`` kernel (plain, with the fused inverse-RoPE
prologue, with prologue + ring write), official (H 64, hd 512, G 8, R 1024) and tiny (H 4, hd 192, G 2, R 64)
shapes, q = 1 and 5, at a large position (angles of ~1e5 rad).

Per case: fresh random inputs, outputs poisoned with NaN (rings random: the rows not written must stay), one
launch, then against the family's ``reference`` (the ds4c reference functions, on the CPU):

* every output written (no NaN left), rings bit-exact (they are copies);
* chains without fake-quant and the grouped kernel: relative (Frobenius) error < 1e-2 (expected: bit-exact or
  1-ulp differences from fp32 summation order / cos-sin implementations);
* chains with fake-quant: no element further than one quantization step from the reference (the step at the
  element's magnitude under its block's scale, which is computed from the reference's pre-quant values),
  and relative error < 2e-2;

and the time per launch of 50 back-to-back launches between two CUDA events (queued behind a GPU sleep, so host
launch time is not measured; the official grouped kernel rotates over 3 weight copies so its 64 MiB weight is not
served from L2). GB/s = bytes the launch must move (inputs read + outputs written) / time.

Usage: ``python tests/gpu_checks/rowchain.py [--arch sm_90]`` (prints a table), or through
``python tests/gpu_checks`` (every family). Needs a CUDA GPU, torch, cuda-python (cuda.bindings) and nvcc; compiles and
loads through tests/gpu_checks/common.py.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.config import preset
from ds4c.runtime.families import rowchain as R
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_all, compile_source, load, rel_err, standalone

_compile, _load = compile_source, load  # the names a local tuning script imports from here

ITERS = 50
TOL = 1e-2
TOL_FQ = 2e-2
POS = 98765  # large angles: fp32(pos) * f_0 ~ 1e5 rad
L2_ROTATE_BYTES = 150 << 20  # rotate weight copies until this many bytes are touched per rotation


# --------------------------------------------------------------------------------------------- cases
def _cases() -> list[tuple[str, Any, int, bool]]:
    """(name, spec, q, in_place) per case."""
    out: list[tuple[str, Any, int, bool]] = []
    for cname, short in (("flash", "official"), ("tiny", "tiny")):
        cfg = preset(cname)
        chains = R.decode_chains(cfg)
        for q in (1, 5):
            for n, s in chains.items():
                out.append((f"{short}.{n}", s, q, False))
            out.append((f"{short}.kv_inplace", chains["kv"], q, True))
            out.append((f"{short}.wo_a_plain", R.decode_grouped(cfg, q, rope_prologue=False), q, False))
            out.append((f"{short}.wo_a_irope", R.decode_grouped(cfg, q), q, False))
            out.append((f"{short}.wo_a_irope_ring", R.decode_grouped(cfg, q, ring=True), q, False))
        if cname == "flash":
            rows = R.RowChainSpec(1, cfg.head_dim, chains["kv"].ops, ring_window=cfg.window, pos_mode="rows",
                                  pos_dtype="i64")
            out.append((f"{short}.kv_ring_rows_i64", rows, 5, False))
    return out


def _entry(name: str, spec: Any) -> str:
    tag = f"q{spec.q}" if isinstance(spec, R.GroupedSpec) else ""
    return "rc_" + re.sub(r"\W", "_", name) + tag


# ------------------------------------------------------------------------------------- fake-quant steps
def _e4m3_spacing(a: torch.Tensor) -> torch.Tensor:
    """Spacing of the e4m3 grid at magnitude a (in units of the block scale)."""
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -6)))
    return torch.where(a < 2.0 ** -6, torch.full_like(a, 2.0 ** -9), torch.exp2(e - 3))


def _e2m1_spacing(a: torch.Tensor) -> torch.Tensor:
    return torch.where(a < 2, torch.full_like(a, 0.5), torch.where(a < 4, torch.ones_like(a), torch.full_like(a, 2.0)))


def _bf16_spacing(a: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -126)))
    return torch.exp2(e - 7)


def _steps_over(spec: R.RowChainSpec, inp: dict, got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements further than one quantization step from the reference (fake-quant chains; the last fake-quant
    op's step, its scale from the reference's values entering that op; elements it leaves alone: one bf16
    ulp)."""
    k = max(i for i, op in enumerate(spec.ops) if op.kind in ("kv_fq", "fp4_fq"))
    op = spec.ops[k]
    pre = R.RowChainSpec(spec.groups, spec.width, spec.ops[:k], pos_mode=spec.pos_mode,
                         pos_dtype=spec.pos_dtype) if k else None
    u = (R.rowchain_reference(pre, inp)["out"] if pre else inp["x"]).float()
    g, w = got.float(), want.float()
    mag = torch.maximum(g.abs(), w.abs())
    step = _bf16_spacing(mag)
    n_q = op.nope if op.kind == "kv_fq" else spec.width
    qmax, floor = (448.0, 1e-4) if op.kind == "kv_fq" else (6.0, 6.0 * 2.0 ** -126)
    blocks = u[..., :n_q].unflatten(-1, (n_q // op.block, op.block))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=floor)
    s = _pow2_ceil(amax / qmax).expand_as(blocks).flatten(-2)
    a = mag[..., :n_q] / s
    sp = _e4m3_spacing(a) if op.kind == "kv_fq" else _e2m1_spacing(a)
    step[..., :n_q] = sp * s
    return int(((g - w).abs() > step * 1.0001).sum())


def _pow2_ceil(y: torch.Tensor) -> torch.Tensor:
    from ds4c.quant import pow2_ceil_scale

    return pow2_ceil_scale(y, 1.0)


# ------------------------------------------------------------------------------------------------ the check
def _time(launch, n: int = ITERS) -> float:
    """Microseconds per launch of ``n`` back-to-back launches (queued while the GPU sleeps, so the host's
    launch time is hidden; the per-launch gap of the hardware is included)."""
    for i in range(3):
        launch(i)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)
    e0.record()
    for i in range(n):
        launch(i)
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / n


def _ulps(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """(elements whose bits differ, max difference in bf16 ulps at the reference's magnitude)."""
    diff = got.float() - want.float()
    ne = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    ulp = _bf16_spacing(torch.maximum(got.float().abs(), want.float().abs()))
    return ne, int(torch.nan_to_num((diff.abs() / ulp), nan=1e9).max().ceil()) if diff.numel() else 0


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, ok, rel_err, us, GBps, and diagnostics (bits_differ,
    max_ulp, steps_over, all_written, regs, compile_s)."""
    tgt = make_target(arch)
    cases = _cases()
    srcs: dict[str, Any] = {}
    for name, spec, q, _ in cases:
        e = _entry(name, spec)
        if e not in srcs:
            srcs[e] = (R.render_rowchain(spec, tgt, e) if isinstance(spec, R.RowChainSpec)
                       else R.render_grouped(spec, tgt, e))
    kernels, compile_s = compile_all(list(srcs.values()), "ds4c-rowchain-")  # each source's entry is its key

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(4321)
    rows: list[dict] = []
    for name, spec, q, in_place in cases:
        fn, use, secs = kernels[_entry(name, spec)]
        chain = isinstance(spec, R.RowChainSpec)
        if chain:
            inp = R.make_rowchain_inputs(spec, q, pos=POS, generator=gen)
            launch_shape = R.rowchain_launch(spec, q)
            outs = R.outputs(spec)
        else:
            inp = R.make_grouped_inputs(spec, pos=POS, generator=gen)
            launch_shape = R.grouped_launch(spec, tgt)
            outs = R.outputs(spec)
        want = R.reference(spec, inp)
        gd = {k: v.to(dev).contiguous() for k, v in inp.items()}
        if in_place:
            gd["out"] = gd["x"]
        args = R.ordered_args(spec.args(), gd)
        fn(launch_shape.grid, launch_shape.block, args)
        torch.cuda.synchronize()
        main = outs[0]
        got = gd[main].cpu()
        written = not bool(torch.isnan(got).any())
        w = want[main]
        rel = rel_err(got, w)
        bits_differ, max_ulp = _ulps(got, w)
        ring_ok = True
        if "ring" in outs:
            ring_ok = torch.equal(gd["ring"].cpu().view(torch.int16), want["ring"].view(torch.int16))
        fq = chain and bool({"kv_fq", "fp4_fq"} & set(spec.kinds))
        steps = _steps_over(spec, inp, got, w) if fq and written else 0
        ok = written and ring_ok and rel < (TOL_FQ if fq else TOL) and steps == 0

        # ---- timing
        if chain:
            nbytes = 2 * got.numel() * 2 + sum(gd[a.name].numel() * 4 for a in spec.args() if a.name.startswith("w")) \
                + (got.numel() * 2 if spec.ring_window else 0)
            launch = lambda i: fn(launch_shape.grid, launch_shape.block, args)  # noqa: E731
        else:
            wbytes = gd["w"].numel() * 2
            copies = max(1, math.ceil(L2_ROTATE_BYTES / wbytes)) if wbytes > (8 << 20) else 1
            ws = [gd["w"]] + [gd["w"].clone() for _ in range(copies - 1)]
            arg_sets = []
            for wc in ws:
                arg_sets.append(R.ordered_args(spec.args(), {**gd, "w": wc}))
            nbytes = wbytes + gd["o"].numel() * 2 + gd["z"].numel() * 2 + \
                (2 * gd["kv"].numel() * 2 if spec.ring_window else 0)
            launch = lambda i: fn(launch_shape.grid, launch_shape.block, arg_sets[i % len(arg_sets)])  # noqa: E731
        us = _time(launch)
        label = spec.label if chain else spec.label
        rows.append({
            "spec": f"{name} q={q} {label}", "ok": ok, "rel_err": rel, "us": us,
            "GBps": nbytes / (us * 1e-6) / 1e9, "bits_differ": bits_differ, "numel": got.numel(),
            "max_ulp": max_ulp, "steps_over": steps, "all_written": written, "ring_ok": ring_ok,
            "regs": use.get("registers"), "compile_s": secs, "compile_total_s": compile_s,
        })
    return rows


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'differ':>13s} {'ulp':>4s} {'step>1':>6s} {'us':>8s} {'GB/s':>7s} "
          f"{'regs':>4s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r['rel_err']:9.2e} {r['bits_differ']:>6d}/{r['numel']:<6d} "
              f"{r['max_ulp']:>4d} {r['steps_over']:>6d} {r['us']:8.2f} {r['GBps']:7.1f} {str(r['regs']):>4s}  "
              f"{r['spec']}")


def main() -> int:
    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
