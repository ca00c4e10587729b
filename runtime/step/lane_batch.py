"""Lane batching: a lanes step's per-lane launches merged into one launch per kernel over a grid of lanes (issue 30).

A lanes step (``build_step(..., lanes=...)``) lowers each lane's attention, compressor, indexer and ring write as
launches of their own, bound to that lane's state, rows and scalars: L small launches (one or a few blocks each)
where one sequence has one, run one after another. Lanes with the same rows run the same kernel (the same rendered
source, grid, block and shared memory) on arguments that differ only by where they point. This module merges each
such set into one launch:

* **The kernel** (:func:`batched_source`): the rendered source with its entry turned into an inline device function
  and a new entry ``<entry>_lanes`` that takes the same arguments plus one byte stride per pointer argument and
  calls it with every pointer advanced by ``blockIdx.z * stride``; the grid gains ``z`` = the lanes. The kernel
  body is untouched (no template reads ``blockIdx.z``), so each lane computes exactly what its own launch did.
* **The launches** (:func:`batch_lanes`): in each run of consecutive per-lane kernels (those
  :func:`~ds4c.runtime.step.binding.lane_segments` finds independent between lanes), the lanes ``0 .. m-1`` whose
  launch sequences are the same kernels become one :class:`~ds4c.runtime.lowered.Launch` per kernel, in each lane's
  order, carrying every lane's arguments (``Launch.lanes``); a lane of other rows (a prompt lane beside decode
  lanes) keeps its own launches after them.
* **Binding** (``StepGraphs.bind``): each lane's arguments are resolved; every integer must be the same for all
  lanes and every pointer must advance by one constant stride from lane to lane (the lanes step lays out its slot
  state, rows, step scalars and per-lane workspaces so: :class:`~ds4c.runtime.step.lanes.LanesStep`); anything else
  is a StepError, never a silent mis-bind.

On by default (``DS4C_LANE_BATCH``, docs/settings.md): on the H100 its rows are bit-equal to the per-lane launches'
and an 8-lane step takes 2.83 ms against 3.23 in order and 2.89 on streams (docs/perf.md, Optimisation 12).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ds4c.errors import StepError
from ds4c.runtime.lowered import Launch, LoweredKernel
from ds4c.runtime.render import KernelSource, RenderError
from ds4c.runtime.step.binding import lane_of, lane_segments

SUFFIX = "_lanes"
#: the block's z index by vendor (the preludes define no accessor for it: no family kernel reads it)
_LANE_ID = {"cuda": "blockIdx.z", "hip": "__builtin_amdgcn_workgroup_id_z()"}
_HEAD = r"DS4C_GLOBAL\s+void\s+(DS4C_LAUNCH_BOUNDS\([^)]*\)\s+)?{entry}\s*\("


def _params(src: str, entry: str) -> tuple[re.Match, list[str]]:
    m = re.search(_HEAD.format(entry=re.escape(entry)), src)
    if m is None:
        raise RenderError(f"lane batching: no DS4C_GLOBAL signature of {entry}")
    depth, i = 1, m.end()
    while depth:
        if i >= len(src):
            raise RenderError(f"lane batching: unterminated signature of {entry}")
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", src[m.end():i - 1], flags=re.S)
    params = [" ".join(p.split()) for p in text.split(",") if p.strip()]
    return m, params


def batched_source(src: KernelSource) -> KernelSource:
    """``src`` as the lane-batched kernel (module docstring): entry ``<entry>_lanes(args..., i64 stride per pointer
    argument)``, lane ``blockIdx.z``. Raises RenderError when the entry's signature cannot be read."""
    m, params = _params(src.source, src.entry)
    names, casts, strides = [], [], []
    for k, p in enumerate(params):
        name = re.search(r"(\w+)\s*$", p).group(1)
        ctype = p[:len(p) - len(name)].strip()
        names.append(name)
        if "*" in ctype:
            strides.append(f"i64 ds4c_lane_stride{k}")
            casts.append(f"({ctype.replace('DS4C_RESTRICT', '').strip()})((const u8*){name} + lane * ds4c_lane_stride{k})")
        else:
            casts.append(name)
    bounds = m.group(1) or ""
    body = src.source[:m.start()] + f"DS4C_DEVICE void {src.entry}_body(" + src.source[m.end():]
    wrapper = (f"\n// ---- lane batching (runtime/lane_batch.py): lane blockIdx.z, each pointer advanced by its stride\n"
               f"DS4C_GLOBAL void {bounds}{src.entry}{SUFFIX}({', '.join(params + strides)}) {{\n"
               f"  const i64 lane = (i64){_LANE_ID[src.target.vendor]};\n"
               f"  {src.entry}_body({', '.join(casts)});\n"
               f"}}\n")
    return dataclasses.replace(src, entry=src.entry + SUFFIX, source=body + wrapper,
                               params={**src.params, "lane_batched": True})


def _shape(k: LoweredKernel) -> tuple:
    return tuple((la.kernel.digest(), la.grid, la.block, la.smem) for la in k.launches)


def batch_lanes(kernels: list[LoweredKernel]) -> list[LoweredKernel]:
    """The kernel list of a lanes step with each run of per-lane kernels merged over the lanes (module docstring).
    A kernel whose launches belong to more than one lane, or to none, is kept as is; a run in which no two
    lanes share their launch sequence is kept as is."""
    tags = [_kernel_lane(k) for k in kernels]
    out: list[LoweredKernel] = []
    for i, j, parallel in lane_segments(tags):
        if not parallel:
            out += kernels[i:j]
            continue
        by_lane: dict[int, list[LoweredKernel]] = {}
        for k, lane in zip(kernels[i:j], tags[i:j]):
            by_lane.setdefault(lane, []).append(k)
        first = [by_lane[lane] for lane in sorted(by_lane)]
        ref = [_shape(k) for k in first[0]]
        m = 0  # lanes 0 .. m-1 (consecutive from the run's first lane) share lane 0's launch sequence
        lanes = sorted(by_lane)
        while m < len(lanes) and lanes[m] == lanes[0] + m and [_shape(k) for k in first[m]] == ref:
            m += 1
        if m < 2:
            out += kernels[i:j]
            continue
        for pos, k0 in enumerate(first[0]):
            launches = [dataclasses.replace(la, kernel=batched_source(la.kernel), grid=(la.grid[0], la.grid[1], m),
                                            lanes=tuple(first[q][pos].launches[n].args for q in range(m)))
                        for n, la in enumerate(k0.launches)]
            out.append(LoweredKernel(f"{k0.name}@lanes{lanes[0]}-{lanes[0] + m - 1}", k0.family, k0.layer, launches))
        for lane in lanes[m:]:
            out += by_lane[lane]
    return out


def _kernel_lane(k: LoweredKernel) -> int | None:
    """The one lane every launch of ``k`` belongs to, or None."""
    tags = {lane_of(la.args) for la in k.launches}
    return tags.pop() if len(tags) == 1 else None


def bind_lane_args(la: Launch, resolve: Any) -> list[Any]:
    """The bound arguments of a lane-batched launch: the first lane's, then ``("i64", stride)`` per pointer argument
    (bytes from one lane's pointer to the next's). ``resolve(arg, lane)`` binds one argument of lane ``lane``.

    Raises:
        StepError: an integer that differs between lanes, or a pointer whose step between lanes is not constant.
    """
    per_lane = [[resolve(a, q) for a in args] for q, args in enumerate(la.lanes)]
    out, strides = list(per_lane[0]), []
    for n, v0 in enumerate(per_lane[0]):
        vals = [lane[n] for lane in per_lane]
        if isinstance(v0, int):
            if any(v != v0 for v in vals):
                raise StepError(f"lane batching: {la.kernel.entry} argument {n} differs between lanes: {vals}")
            continue
        ptrs = [v.data_ptr() for v in vals]
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        if any(p - ptrs[0] != q * step for q, p in enumerate(ptrs)):
            raise StepError(f"lane batching: {la.kernel.entry} argument {n} ({la.args[n].name}) is not laid out "
                            f"at a constant stride between lanes")
        strides.append(("i64", step))
    return out + strides
