#!/usr/bin/env python3
"""GPU check of the experts family (runtime/families/experts.py): all routed experts + the shared expert of
one MoE layer, official (D 4096, F 2048, E 256, k 6; MXFP4 routed, Q8_0 shared) at q = 1..5 with the ``mma``
engine, q = 1 and 5 with the ``simt`` engine (the vendor-neutral body the HIP builds use), tiny (D 256,
F 128, E 16, k 4) at q = 1 and 5 with both engines, and variants (shared expert in bf16, activation quant
off, Q8_0 routed / MXFP4 shared).

Per case: fresh random valid expert bytes on the GPU (``experts.random_inputs``: MXFP4 random nibbles with
exponent bytes 118..124, Q8_0 random int8 with fp16 scales, bf16 ~N(0, .05)), x ~N(0, 1), ids distinct per row
with some experts shared between rows (the dedup path), weights as the router makes them (``s[ids] / sum *
1.5``), ids and weights in device memory; hbuf and out poisoned with NaN; both launches; then:

* every element of hbuf and out written (no NaN left);
* ``rel_err`` = ||out - ref|| / ||ref|| against ``experts.reference`` (ds4c.reference ``routed_sum`` +
  ``expert_ffn`` on the dequantized weights, run on the GPU), ok when < 2e-2 (bf16 intermediates g, u, h, y
  may round the other way: the GEMV sums are in another order);
* time: the median of 30 CUDA-event timings of the two launches, each after an L2 flush (a 256 MB write),
  so weights come from HBM; ``GBps`` = expert weight bytes actually read (distinct routed experts + the
  shared expert, ``experts.bytes_read``) / time. ``us_up`` / ``us_down``: the phases alone.

One extra case captures both launches in a CUDA graph, then writes new x, ids and weights into the same
device buffers and replays (routing comes from device memory, never by value).

Usage: ``python tests/gpu_checks/experts.py [--arch sm_90]`` (prints a table;
``DS4C_XP_CASES='mma  q=1$,q=5'`` keeps the cases whose label contains one of the comma-separated substrings,
``$`` marking the label's end, e.g. to profile them under ``ncu``; ``DS4C_XP_STAGES_SWEEP=1`` adds every
cp.async ring depth at q = 1..5), or through
``python tests/gpu_checks`` (every family). Needs a CUDA GPU, torch and nvcc (or NVRTC through ds4c's toolchain).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: tests/, for gpu_checks.common
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ds4c.runtime.families import experts as X
from ds4c.runtime.targets import target as make_target
from gpu_checks.common import compile_all, rel_err, standalone

TOL = 2e-2
ITERS = 30
FLUSH_BYTES = 256 << 20
POISON_BF16 = 0x7FC1  # a NaN
OFFICIAL = dict(hidden=4096, inter=2048, n_experts=256, k=6)
TINY = dict(hidden=256, inter=128, n_experts=16, k=4)


def _cases() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"official mma  q={q}", dict(OFFICIAL, q=q, engine="mma")) for q in (1, 2, 3, 4, 5)]
    # the register double buffer the cp.async ring replaced (ExpertsSpec.stages = 0), for the A/B in one run
    out += [(f"official mma  q={q} register path", dict(OFFICIAL, q=q, engine="mma", stages=0)) for q in (1, 5)]
    # x and h quantized once per call (ExpertsSpec.prequant: four launches), for the A/B in one run
    out += [(f"official mma  q={q} prequant", dict(OFFICIAL, q=q, engine="mma", prequant=True)) for q in (1, 3, 5)]
    # the lanes step's shape (issue 30): 8 rows of distinct requests, every row its own 6 experts (up to 48 + the
    # shared one streamed), as the engine's decode lanes route; each phase's time shows which one scales
    out += [(f"official mma  q={q} prequant distinct", dict(OFFICIAL, q=q, engine="mma", prequant=True,
                                                             distinct=True)) for q in (1, 8)]
    # ... with the down phase's jobs split over G groups of blocks (ExpertsSpec.down_split; a third launch sums)
    out += [(f"official mma  q={q} prequant distinct split {n}", dict(OFFICIAL, q=q, engine="mma", prequant=True,
                                                                       distinct=True, down_split=n))
            for q, ns in ((1, (2, 4)), (5, (2, 4, 8)), (8, (2, 4, 8, 16))) for n in ns]
    if os.environ.get("DS4C_XP_STAGES_SWEEP"):  # every ring depth at q = 1..5 (the stage choice's data)
        out += [(f"official mma  q={q} stages {n}", dict(OFFICIAL, q=q, engine="mma", stages=n))
                for q in (1, 2, 3, 4, 5) for n in (2, 3, 4, 6)]
    out += [(f"official simt q={q}", dict(OFFICIAL, q=q, engine="simt")) for q in (1, 5)]
    out += [(f"tiny {e:4s} q={q}", dict(TINY, q=q, engine=e)) for e in ("mma", "simt") for q in (1, 5)]
    out += [("official mma  q=5 shared bf16", dict(OFFICIAL, q=5, engine="mma", shared_fmt="bf16")),
            ("official mma  q=3 act_quant off", dict(OFFICIAL, q=3, engine="mma", act_quant=False)),
            ("tiny mma  q=5 routed q8_0 shared mxfp4", dict(TINY, q=5, engine="mma", routed_fmt="q8_0",
                                                          shared_fmt="mxfp4"))]
    # K-quant / IQ4_XS banks (issue 14 part 2): each routed format at the official shape, both engines, q = 1
    # and 5 (the bench's byte model reads the achieved bandwidth per format from these timings)
    out += [(f"official {e:4s} q={q} routed {f}", dict(OFFICIAL, q=q, engine=e, routed_fmt=f))
            for f in X.KQUANTS for e in ("mma", "simt") for q in (1, 5)]
    return out


def _spec_kw(kw: dict[str, Any]) -> dict[str, Any]:
    """A case's ExpertsSpec fields (``distinct``: rows route to distinct experts, not a spec field)."""
    return {k: v for k, v in kw.items() if k != "distinct"}


def _compile(specs: dict[str, X.ExpertsSpec], tgt: Any) -> tuple[dict[str, Any], float]:
    """{spec key: ([up, down] kernels, [Launch], {entry: usage}, compile seconds)}, wall seconds."""
    srcs = {key: X.render_experts(s, tgt, f"xp_{key}") for key, s in specs.items()}
    launches = {key: X.launch_shapes(s, tgt) for key, s in specs.items()}
    smem = {k.entry: ln.smem for key, ks in srcs.items() for k, ln in zip(ks, launches[key])}
    built, wall = compile_all([k for ks in srcs.values() for k in ks], "ds4c-experts-", smem)
    out = {key: ([built[k.entry][0] for k in ks], launches[key], {k.entry: built[k.entry][1] for k in ks},
                 sum(built[k.entry][2] for k in ks)) for key, ks in srcs.items()}
    return out, wall


def _bufs(spec: X.ExpertsSpec, inp: dict[str, torch.Tensor], hbuf: torch.Tensor, out: torch.Tensor) -> dict:
    """Every kernel argument by name: the inputs, the outputs, and prequant's workspaces (NaN-poisoned)."""
    dev = hbuf.device
    ws = {n: torch.full(shape, float("nan"), dtype=dt, device=dev)
          for n, (shape, dt) in X.arg_shapes(spec).items() if n in ("xq", "xs", "hq", "hs", "ybuf")}
    return {**inp, **ws, "hbuf": hbuf, "out": out}


def _launch(fns: list, launches: list, args: list[list[torch.Tensor]]) -> None:
    for fn, la, a in zip(fns, launches, args):
        fn(la.grid, la.block, a, la.smem)


def _arg_lists(spec: X.ExpertsSpec, tgt: Any, launches: list, bufs: dict) -> list[list[torch.Tensor]]:
    names = X.arg_names(spec, tgt)
    return [[bufs[n] for n in names[la.kernel]] for la in launches]


def _poison(*ts: torch.Tensor) -> None:
    for t in ts:
        t.view(torch.int16).fill_(POISON_BF16)


def _time(fn_list: list, flush: torch.Tensor) -> float:
    """Median microseconds of ITERS event-timed runs of the callables, each after an L2 flush."""
    for _ in range(3):
        for f in fn_list:
            f()
    ts = []
    for _ in range(ITERS):
        flush.zero_()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for f in fn_list:
            f()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(ts)


def run(arch: str = "sm_90") -> list[dict]:
    """Run every case; one dict per case: spec, ok, rel_err, all_written, us, us_up, us_down, GBps, bytes,
    regs, smem, compile_s."""
    tgt = make_target(arch)
    cases = _cases()
    pick = [c for c in os.environ.get("DS4C_XP_CASES", "").split(",") if c]  # substrings of case labels
    if pick:
        cases = [c for c in cases if any(p in c[0] + "$" for p in pick)]  # "$" marks the end
    specs = {X.ExpertsSpec(**_spec_kw(kw)).key() + "_" + kw["engine"]: X.ExpertsSpec(**_spec_kw(kw))
             for _, kw in cases}
    built, wall = _compile(specs, tgt)
    print(f"[experts] compiled {2 * len(specs)} kernels in {wall:.1f} s", flush=True)
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)
    g = torch.Generator().manual_seed(11)
    rows: list[dict] = []
    graph_done = False
    for label, kw in cases:
        spec = X.ExpertsSpec(**_spec_kw(kw))
        key = spec.key() + "_" + kw["engine"]
        fns, launches, use, csecs = built[key]
        inp = X.random_inputs(spec, g, device=dev, shared_rows=not kw.get("distinct", False))
        hbuf = torch.empty(spec.q, spec.k + 1, spec.inter, dtype=torch.bfloat16, device=dev)
        out = torch.empty(spec.q, spec.hidden, dtype=torch.bfloat16, device=dev)
        _poison(hbuf, out)
        bufs = _bufs(spec, inp, hbuf, out)
        args = _arg_lists(spec, tgt, launches, bufs)
        _launch(fns, launches, args)
        torch.cuda.synchronize()
        written = bool(torch.isfinite(hbuf.float()).all() and torch.isfinite(out.float()).all())
        ref = X.reference(spec, **inp)
        err = rel_err(out, ref)
        us = _time([lambda: _launch(fns, launches, args)], flush)
        # each phase with its activation quant launch (a prequant call's actq_x / actq_h) timed alone
        ph = {"up": [i for i, la in enumerate(launches) if la.kernel in ("actq_x", "up")],
              "down": [i for i, la in enumerate(launches) if la.kernel in ("actq_h", "down", "sum")]}
        us_up, us_dn = (_time([lambda sel=sel: _launch([fns[i] for i in sel], [launches[i] for i in sel],
                                                       [args[i] for i in sel])], flush) for sel in ph.values())
        nbytes = X.bytes_read(spec, inp["ids"])
        regs = "/".join(str(u.get("registers", "?")) for u in use.values())
        rows.append({"spec": f"{label} ({spec.short()})", "ok": written and err < TOL, "rel_err": err,
                     "all_written": written, "us": us, "us_up": us_up, "us_down": us_dn,
                     "GBps": nbytes / (us * 1e3), "bytes": nbytes, "regs": regs,
                     "smem": "/".join(str(la.smem) for la in launches), "compile_s": csecs})
        print(f"  {label:40s} rel_err {err:.2e} written {written} {us:8.1f} us (up {us_up:.1f}, down {us_dn:.1f}) "
              f"{nbytes / (us * 1e3):7.1f} GB/s regs {regs}", flush=True)
        if not graph_done and spec.hidden == OFFICIAL["hidden"] and spec.q == 5 and kw["engine"] == "mma":
            rows.append(_graph_case(spec, fns, launches, inp, g, tgt))
            graph_done = True
        del inp, hbuf, out
        torch.cuda.empty_cache()
    return rows


def _graph_case(spec: X.ExpertsSpec, fns: list, launches: list, inp: dict[str, torch.Tensor],
                g: torch.Generator, tgt: Any) -> dict:
    """Capture both launches, write new x / ids / weights into the captured buffers, replay, compare."""
    dev = inp["x"].device
    hbuf = torch.empty(spec.q, spec.k + 1, spec.inter, dtype=torch.bfloat16, device=dev)
    out = torch.empty(spec.q, spec.hidden, dtype=torch.bfloat16, device=dev)
    args = _arg_lists(spec, tgt, launches, _bufs(spec, inp, hbuf, out))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _launch(fns, launches, args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _launch(fns, launches, args)
    errs, written = [], True
    for _ in range(2):
        ids, wts = X.random_routing(spec, g)
        inp["ids"].copy_(ids)
        inp["weights"].copy_(wts)
        inp["x"].copy_(torch.randn(spec.q, spec.hidden, generator=g).to(torch.bfloat16))
        _poison(hbuf, out)
        graph.replay()
        torch.cuda.synchronize()
        written &= bool(torch.isfinite(out.float()).all())
        errs.append(rel_err(out, X.reference(spec, **inp)))
    err = max(errs)
    return {"spec": f"official mma  q=5 CUDA-graph replay, new routing ({spec.short()})", "ok": written and err < TOL,
            "rel_err": err, "all_written": written, "us": float("nan"), "GBps": float("nan")}


def print_table(rows: list[dict]) -> None:
    """The check's table: a header, then one line per case."""
    print(f"{'ok':3s} {'rel_err':>9s} {'us':>8s} {'up':>7s} {'down':>7s} {'GB/s':>7s} {'regs':>8s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r['rel_err']:9.2e} {r['us']:8.1f} {r.get('us_up', float('nan')):7.1f} "
              f"{r.get('us_down', float('nan')):7.1f} {r['GBps']:7.1f} {r.get('regs', ''):>8s}  {r['spec']}")


def main() -> int:
    return standalone(run, print_table)


if __name__ == "__main__":
    sys.exit(main())
