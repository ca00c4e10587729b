"""Helpers shared by the per-family GPU checks (tests/gpu_checks/<family>.py).

* :func:`compile_source`: one kernel source to a binary through ds4c's toolchain layer (nvcc, else NVRTC).
* :func:`load`: a binary loaded with ds4c.runtime.launch (cuda.bindings).
* :func:`compile_all`: compile many sources in parallel and load them.
* :func:`median_us`: the median of CUDA-event timings of a launch.
* :func:`rel_err`: Frobenius relative error, infinite when the result is not finite.
* :func:`standalone`: the ``main`` of a check run on its own (``--arch``, the table, the RESULT line).

A check whose comparison or timing differs (per-row errors, L2 flushes, graph replay, back-to-back bursts)
keeps its own helper; these are only the ones that were the same in every file that had them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ds4c.runtime import toolchain as TC
from ds4c.runtime.launch import CudaModule

ITERS = 50
WARMUP = 5


def compile_source(src: Any, workdir: Path) -> tuple[bytes, dict, float]:
    """(binary, resource usage of ``src.entry`` (``{}`` when the log has none), compile seconds)."""
    res = TC.find_toolchain(src.target).compile(src, workdir)
    return res.binary, TC.resource_usage(res, src.target).get(src.entry, {}), res.seconds


def load(image: bytes) -> CudaModule:
    """A loaded cubin (makes torch's primary CUDA context current first)."""
    return CudaModule(image)


def compile_all(srcs: Sequence[Any], prefix: str,
                smem: Mapping[str, int] | None = None) -> tuple[dict[str, tuple[Any, dict, float]], float]:
    """Compile in parallel (8 threads, one fresh directory per entry) and load:
    ({entry: (kernel, usage, seconds)}, wall seconds of the compiles). ``smem``: dynamic shared bytes to
    allow per entry (default 0)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))

    def job(k: Any) -> tuple[str, tuple[bytes, dict, float]]:
        d = tmp / k.entry
        d.mkdir()
        return k.entry, compile_source(k, d)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        built = dict(ex.map(job, srcs))
    wall = time.perf_counter() - t0
    smem = smem or {}
    return {e: (load(img).function(e, smem.get(e, 0)), use, secs) for e, (img, use, secs) in built.items()}, wall


def median_us(fn: Callable[[], None], iters: int = ITERS, warmup: int = WARMUP) -> float:
    """Median microseconds of ``iters`` event-timed calls of ``fn`` after ``warmup`` calls, queued behind a GPU
    sleep so that no event pair includes host launch time."""
    for _ in range(warmup):
        fn()
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda._sleep(20_000_000)
    for e0, e1 in evs:
        e0.record()
        fn()
        e1.record()
    torch.cuda.synchronize()
    return statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in evs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, fp32); ``inf`` when ``got`` holds a NaN or an infinity."""
    g, w = got.float(), want.float()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    return float((g - w).norm() / w.norm().clamp(min=1e-30))


def standalone(run: Callable[[str], list[dict]], print_table: Callable[[list[dict]], None],
               run_ok: Callable[[list[dict]], bool] | None = None) -> int:
    """Run one family's check as a script: ``--arch`` (default sm_90), the family's table, the compile and
    total seconds, and ``RESULT PASS|FAIL: n/m ok``. Returns the exit status (0 when every case is ok and,
    given ``run_ok``, the family's bound over the whole run holds)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    t0 = time.perf_counter()
    rows = run(a.arch)
    print_table(rows)
    bad = [r for r in rows if not r["ok"]]
    print(f"compile (parallel) {rows[0].get('compile_total_s', 0) if rows else 0:.1f} s; "
          f"total {time.perf_counter() - t0:.1f} s")
    ok = not bad and (run_ok is None or run_ok(rows))
    print(f"RESULT {'PASS' if ok else 'FAIL'}: {len(rows) - len(bad)}/{len(rows)} ok")
    return 0 if ok else 1
