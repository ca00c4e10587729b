"""GPU check of the compressor family (runtime/families/compressor.py, templates/compressor/compress.cu.j2).

For every launch shape (ratio 4 main d=512 + indexer d=128 fused, ratio 128 d=512, the tiny preset's ratio 4
d=192 + indexer and ratio 16 d=192; q = 1 and 5; one launch with the fake-quants off) and positions whose step
flushes 0, 1 and 2 times where the ratio allows: random inputs and random state (finite scores, or -inf / kv 0
for slots no earlier position could have written), compressed rows poisoned with NaN where the step must
write and random elsewhere; one launch; compare with :func:`ds4c.runtime.families.compressor.reference`:

* the fp32 state must be bit-identical (copies and one fp32 add);
* rows the step must not write must be bit-identical;
* written rows: no NaN, relative error (L2) < 1e-2, every element within one quantization step (a generous
  bound: ``|got - want| <= max(|got|, |want|) / 2 + step``), and at most 0.5% of the elements bitwise
  different, or 2 (a boundary flip of one RoPE pair in a 192-wide row is 1%); over the whole run the
  fraction must stay below 0.5% (``main`` checks it).

Then the launch is timed with CUDA events (graph replay of back-to-back launches, at the same position).
``run(arch) -> list[dict]`` with ``spec, rel_err, ok, us, GBps`` (plus ``mismatches``, ``checked``,
``state_exact``, ``flushes``); ``python tests/gpu_checks/compressor.py [--arch sm_90]`` prints a table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4c.quant import pow2_ceil_scale  # noqa: E402
from ds4c.reference import primitives as P  # noqa: E402
from ds4c.runtime.families import compressor as C  # noqa: E402
from gpu_checks.common import compile_source, load, standalone  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
ROPE_BASE, ROPE_FACTOR, ORIG_LEN, BETA_FAST, BETA_SLOW = 160000.0, 16.0, 65536, 32.0, 1.0
MISMATCH_FRAC = 0.005  # bitwise-different elements of written rows, per check and over the whole run
MISMATCH_MIN = 2  # always tolerated per check (one RoPE pair of a 128/192-wide row flipping by one ulp is 1%)
REL_TOL = 1e-2


def _official(q: int, emulate: bool = True) -> list[C.CompressorSpec]:
    return [C.CompressorSpec(4, 512, False, emulate, 448, 64, q), C.CompressorSpec(4, 128, True, emulate, 0, 64, q)]


def cases() -> list[tuple[str, list[C.CompressorSpec]]]:
    """(label, compressors of one launch) for every checked launch shape."""
    out: list[tuple[str, list[C.CompressorSpec]]] = []
    for q in (1, 5):
        out.append((f"csa-official q{q}", _official(q)))
        out.append((f"hca-official q{q}", [C.CompressorSpec(128, 512, False, True, 448, 64, q)]))
        out.append((f"csa-tiny q{q}", [C.CompressorSpec(4, 192, False, True, 128, 64, q),
                                       C.CompressorSpec(4, 128, True, True, 0, 64, q)]))
        out.append((f"hca-tiny q{q}", [C.CompressorSpec(16, 192, False, True, 128, 64, q)]))
    out.append(("csa-official q5 no-emulation", _official(5, emulate=False)))
    return out


def positions(spec: C.CompressorSpec) -> list[int]:
    """Step positions to check: 0, 1 and 2 flushes where the ratio and q allow, and one far position (large
    RoPE angles, a high compressed-row index)."""
    r, q = spec.ratio, spec.q
    want = {0: None, 1: None, 2: None}
    for p in range(0, 3 * r):
        n = len(spec.flushes(p))
        if n in want and want[n] is None:
            want[n] = p
    out = [p for p in want.values() if p is not None]
    if q > 2:
        out.append(r - 2)  # a flush in the middle of the step: later rows overwrite slots after it
    far = 1000 * r + r - min(q, 2)  # block 1000 ends at the step's first or second row
    return sorted(set(out + [far]))


def freqs_for(spec: C.CompressorSpec) -> torch.Tensor:
    """The compressing layers' RoPE table (P6, YaRN)."""
    return P.rope_freqs(spec.rope_dim, ROPE_BASE, True, ROPE_FACTOR, ORIG_LEN, BETA_FAST, BETA_SLOW)


def make_inputs(spec: C.CompressorSpec, pos: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """CPU inputs of one compressor at ``pos`` (in kernel argument order, without ``pos``)."""
    q, r, d, w, slots = spec.q, spec.ratio, spec.d, spec.state_width, spec.state_slots

    def rn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F32) * scale

    kv, score = rn(slots, w), rn(slots, w, scale=2.0)
    # slots no earlier position wrote hold the initial kv 0 / score -inf
    if r == 4:
        if pos < 4:
            kv[:4], score[:4] = 0.0, float("-inf")
            kv[4 + pos:], score[4 + pos:] = 0.0, float("-inf")
    elif pos < r:
        kv[pos:], score[pos:] = 0.0, float("-inf")
    n_rows = (pos + q) // r + 2
    rows = rn(n_rows, d).to(BF16)
    for i in spec.flushes(pos):
        rows[(pos + i) // r] = float("nan")  # poison: the step must write it
    return {"v": rn(q, w), "g": rn(q, w, scale=2.0), "ape": rn(r, w, scale=0.5),
            "norm": (1.0 + rn(d, scale=0.2)).to(BF16).to(F32), "kv": kv, "score": score, "rows": rows,
            "freqs": freqs_for(spec)}


def expected(spec: C.CompressorSpec, inp: dict[str, torch.Tensor], pos: int) -> dict[str, torch.Tensor]:
    kv, score, rows = C.reference(spec, inp["v"], inp["g"], inp["ape"], inp["norm"], inp["kv"], inp["score"],
                                  inp["rows"], pos, inp["freqs"])
    return {"kv": kv, "score": score, "rows": rows}


def _steps(spec: C.CompressorSpec, want: torch.Tensor) -> torch.Tensor:
    """Per-element absolute quantization step bound of written rows ``want`` (fp32 [n, d])."""
    step = torch.zeros_like(want)
    if not spec.emulate:
        return step
    if spec.indexer:
        blk = want.reshape(want.shape[0], -1, 32)
        s = pow2_ceil_scale(blk.abs().amax(-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126), 6.0)
        return (2.0 * s).expand_as(blk).reshape(want.shape)  # scale may move one step: 2s covers the 0.5s grid
    n = spec.nope
    blk = want[:, :n].reshape(want.shape[0], -1, 64)
    s = pow2_ceil_scale(blk.abs().amax(-1, keepdim=True).clamp(min=1e-4), 448.0)
    step[:, :n] = (2.0 * s * 2.0 ** -9).expand_as(blk).reshape(want.shape[0], n)
    return step


def compare(spec: C.CompressorSpec, inp: dict[str, torch.Tensor], pos: int, got: dict[str, torch.Tensor],
            want: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Compare one compressor's outputs ``got`` (CPU tensors kv, score, rows) with the reference."""
    want = want or expected(spec, inp, pos)
    state_exact = all(torch.equal(got[k], want[k]) for k in ("kv", "score"))
    fin = torch.isfinite(want["score"])
    st_err = 0.0
    for k, m in (("kv", None), ("score", fin)):
        a, b = got[k].double(), want[k].double()
        if m is not None:
            a, b = a[m], b[m]
        st_err = max(st_err, float((a - b).norm() / b.norm().clamp(min=1e-30)))
    if not torch.equal(torch.isfinite(got["score"]), fin):
        st_err = float("inf")
    idx = sorted({(pos + i) // spec.ratio for i in spec.flushes(pos)})
    keep = torch.ones(want["rows"].shape[0], dtype=torch.bool)
    keep[idx] = False
    untouched_ok = torch.equal(got["rows"][keep].view(torch.int16), want["rows"][keep].view(torch.int16))
    res: dict[str, Any] = {"state_exact": state_exact, "state_rel_err": st_err, "untouched_ok": untouched_ok,
                           "flushes": len(idx), "mismatches": 0, "checked": 0, "rel_err": 0.0, "within_step": True}
    if idx:
        g, w = got["rows"][idx].float(), want["rows"][idx].float()
        nan = bool(torch.isnan(g).any())
        diff = (g - w).abs()
        bound = torch.maximum(g.abs(), w.abs()) * 0.5 + _steps(spec, w)
        res["mismatches"] = int((got["rows"][idx].view(torch.int16) != want["rows"][idx].view(torch.int16)).sum())
        res["checked"] = g.numel()
        res["rel_err"] = float("nan") if nan else float((g - w).double().norm() / w.double().norm().clamp(min=1e-30))
        res["within_step"] = (not nan) and bool((diff <= bound).all())
    frac_ok = res["mismatches"] <= max(MISMATCH_MIN, int(MISMATCH_FRAC * res["checked"]))
    res["ok"] = bool((state_exact or st_err < 1e-6) and untouched_ok and res["within_step"] and frac_ok
                     and res["rel_err"] < REL_TOL)
    return res


def launch_args(specs: Sequence[C.CompressorSpec], inps: Sequence[dict[str, torch.Tensor]],
                pos_t: torch.Tensor) -> list[torch.Tensor]:
    args = [pos_t]
    for inp in inps:
        args += [inp[a] for a in C.ARGS_PER_COMPRESSOR]
    return args


def _time(fn: Any, n: int = 20, reps: int = 5) -> float:
    """Microseconds per call: CUDA-graph replay of ``n`` back-to-back calls (events), else a plain loop."""
    fn()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):  # launches go on torch's current (capturing) stream
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        run = g.replay
        per = n
    except Exception:  # no graph capture: time plain launches
        run, per = fn, 1
        reps = n * reps
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        run()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (reps * per)


def run(arch: str = "sm_90") -> list[dict]:
    """Every case at every position on the current CUDA device; one dict per (case, position)."""
    from ds4c.runtime.targets import target

    t = target(arch)
    dev = torch.device("cuda")
    rows_out: list[dict] = []
    gen = torch.Generator().manual_seed(1234)
    with tempfile.TemporaryDirectory(prefix="ds4c-compressor-") as tmp:
        for ci, (label, specs) in enumerate(cases()):
            name = "compress_" + "".join(c if c.isalnum() else "_" for c in label)
            src = C.render_compressor(specs, t, name)
            wd = Path(tmp) / name
            wd.mkdir()
            t0 = time.perf_counter()
            kern = load(compile_source(src, wd)[0]).function(src.entry)
            compile_s = time.perf_counter() - t0
            shape = C.launch_shape(specs)
            for pos in positions(specs[0]):
                inps = [make_inputs(s, pos, gen) for s in specs]
                wants = [expected(s, inp, pos) for s, inp in zip(specs, inps)]
                dinps = [{k: v.to(dev).contiguous() for k, v in inp.items()} for inp in inps]
                pos_t = torch.tensor([pos], dtype=torch.int64, device=dev)
                args = launch_args(specs, dinps, pos_t)
                kern(shape.grid, shape.block, args)
                torch.cuda.synchronize()
                res = [compare(s, inp, pos, {k: di[k].cpu() for k in ("kv", "score", "rows")}, w)
                       for s, inp, di, w in zip(specs, inps, dinps, wants)]
                us = _time(lambda: kern(shape.grid, shape.block, args))
                nbytes = sum(s.bytes_moved(pos) for s in specs)
                rows_out.append({
                    "spec": f"{label} pos{pos} ({res[0]['flushes']} flush)",
                    "rel_err": max(r["rel_err"] for r in res), "ok": all(r["ok"] for r in res), "us": us,
                    "GBps": nbytes / (us * 1e-6) / 1e9, "mismatches": sum(r["mismatches"] for r in res),
                    "checked": sum(r["checked"] for r in res), "state_exact": all(r["state_exact"] for r in res),
                    "flushes": res[0]["flushes"], "compile_s": compile_s, "detail": res,
                    "threads": shape.block[0]})
    return rows_out


def run_mismatch_ok(rows: list[dict]) -> bool:
    """The run-level bound: bitwise-different elements of the written rows over every case below
    ``MISMATCH_FRAC`` of those checked (each case also has its own bound, with a ``MISMATCH_MIN`` floor)."""
    return sum(r["mismatches"] for r in rows) < MISMATCH_FRAC * sum(r["checked"] for r in rows)


def print_table(rows: list[dict]) -> None:
    """The check's table, the failed cases' details and the mismatch count over the run."""
    print(f"{'ok':3s} {'rel_err':>9s} {'mism':>9s} {'state':>5s} {'us':>8s} {'GB/s':>8s}  spec")
    for r in rows:
        print(f"{'yes' if r['ok'] else 'NO ':3s} {r['rel_err']:9.2e} {r['mismatches']:4d}/{r['checked']:<4d} "
              f"{'exact' if r['state_exact'] else 'DIFF':>5s} {r['us']:8.2f} {r['GBps']:8.1f}  {r['spec']}")
    for r in rows:
        if not r["ok"]:
            print("FAILED", r["spec"], r["detail"])
    mism, checked = sum(r["mismatches"] for r in rows), sum(r["checked"] for r in rows)
    print(f"mismatched elements over the run: {mism}/{checked} ({100.0 * mism / max(checked, 1):.3f}%, "
          f"limit {100 * MISMATCH_FRAC:.1f}%)")


def main() -> int:
    return standalone(run, print_table, run_mismatch_ok)


if __name__ == "__main__":
    sys.exit(main())
