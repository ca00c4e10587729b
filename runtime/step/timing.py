"""Timings of the compiled step with CUDA events: every launch of a step on its own, and a captured step graph
replayed back to back. The sequence state is snapshotted and restored around them, so the sequence is unchanged."""

from __future__ import annotations

from typing import Any

import torch

from ds4c.errors import StepError
from ds4c.runtime.lower_step import ROLLBACK_KERNEL
from ds4c.runtime.step.driver import StepDriver


def time_launches(driver: StepDriver, tokens: list[int], pos: int, repeats: int = 20,
                  rows: int | None = None) -> list[dict[str, Any]]:
    """Median microseconds of every launch of the step at (``len(tokens)``, bucket of ``pos``), or of the prefill
    chunk graph of ``rows`` rows, over ``repeats`` eager runs (``CompiledStep.time_launches``).

    Raises:
        StepError: as a step; ``rows`` not a prepared chunk size, or fewer than ``len(tokens)``.
    """
    seq = driver.sequence
    if rows is None:
        sg = driver.begin(tokens, pos)
    else:
        if rows not in driver.prefill_chunks or len(tokens) > rows or pos != seq.pos:
            raise StepError(f"time_launches: expected a chunk of {list(driver.prefill_chunks)} rows holding "
                            f"{len(tokens)} tokens at the next position {seq.pos}, found rows={rows} pos={pos}")
        sg = driver.begin_chunk(tokens, pos, rows)
    snap = seq.snapshot()
    out = time_bound_launches(sg, repeats, lambda: seq.restore(snap))
    seq.restore(snap)
    return out


def time_bound_launches(sg: Any, repeats: int = 20, before: Any = None) -> list[dict[str, Any]]:
    """Median microseconds of every launch of a bound step graph ``sg`` (a ``StepGraph``: the one-sequence step's,
    a chunk graph or a lanes graph) over ``repeats`` eager runs, calling ``before()`` ahead of each run (to restore
    the state the launches write). One dict per launch: kernel, family, layer, entry, us."""
    pairs = [(k, la) for k in sg.kernels if k.name != ROLLBACK_KERNEL for la in k.launches]  # as sg.launches
    assert len(pairs) == len(sg.launches), (len(pairs), len(sg.launches))
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(len(pairs) + 1)] for _ in range(repeats)]
    for r in range(repeats):
        if before is not None:
            before()
        evs[r][0].record()
        for i, b in enumerate(sg.launches):
            b.kernel(b.grid, b.block, b.args, smem=b.smem)
            evs[r][i + 1].record()
    torch.cuda.synchronize()
    out = []
    for i, (k, la) in enumerate(pairs):
        ts = sorted(evs[r][i].elapsed_time(evs[r][i + 1]) * 1e3 for r in range(repeats))
        out.append({"kernel": k.name, "family": k.family, "layer": k.layer, "entry": la.kernel.entry,
                    "us": ts[len(ts) // 2]})
    return out


def time_replays(driver: StepDriver, tokens: list[int], pos: int, repeats: int = 50) -> float:
    """Median milliseconds of the step's CUDA graph replayed ``repeats`` times back to back
    (``CompiledStep.time_replays``).

    Raises:
        StepError: as a step, or ``use_graphs`` is off.
    """
    if not driver.use_graphs:
        raise StepError("time_replays needs use_graphs=True")
    seq = driver.sequence
    snap = seq.snapshot()
    driver.step(tokens, pos)  # captures the graph on first use; uploads this step's scalars
    seq.restore(snap)
    sg = driver.graphs.by_key[(len(tokens), driver.buckets.bucket(pos, len(tokens)))]
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    evs[0].record()
    for i in range(repeats):
        sg.cuda_graph.replay()
        evs[i + 1].record()
    torch.cuda.synchronize()
    seq.restore(snap)
    ts = sorted(evs[i].elapsed_time(evs[i + 1]) for i in range(repeats))
    return ts[len(ts) // 2]
