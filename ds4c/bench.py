"""``ds4c bench``: one decode or verify step of a model, timed in one run through the compiled step (CUDA
graph replay), the reference in torch eager, ``torch.compile`` of the reference and (when importable) the
``transformers`` port, next to the step's HBM roofline.

For every (width q, context c) the sequence is filled up to position ``c - 5`` (so every width's step ends
inside the bucket ``c``), then the same step (same tokens, same state) is timed repeatedly:

* compiled: the (q, c) CUDA graph replayed back to back; per-replay CUDA-event times, median.
* eager / torch.compile: the reference from the compiled step's state (copied), one step, synchronised,
  rolled back by its undo journal; median of ``ref_repeats``.
* split (with ``--devices`` / ``--layer-split``): the same step through the layer split
  (:class:`~ds4c.runtime.sharded.ShardedStep`, its state copied from the unsplit step's), every shard's
  graph and the boundary copies replayed back to back; ``split - ours`` is the cost of the boundaries.
* roofline: the bytes the step must read over the measured device-to-device copy bandwidth. Bytes = every
  weight the step's kernels read in stored form (routed experts: only the distinct experts the step's rows
  were routed to, read back from the compiled step) + the state it reads (window ring, compressor state,
  indexer keys of every live block, the CSA rows the indexer selected (q x top-k, at most the live rows), HCA
  rows of every live block). Activations are not counted.

On a machine without CUDA the compiled step, the roofline and the transformers port are reported as not run
(with the reason) and the reference columns are timed on the CPU.

Data flows one way: this module consumes the model file, the reference, the passes' kernel plan and the
runtime; nothing imports it but the CLI.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ds4c.buckets import BucketSpec
from ds4c.config import Ds4Config
from ds4c.errors import Ds4cError
from ds4c.gguf_file import ModelFile
from ds4c.reference import MAX_WIDTH, Reference, ReferenceWeights

# Targets of the performance issue (flash-l4 on an H200).
TARGETS = {"roofline_q1": 0.70, "roofline_q5": 0.60, "vs_compile": 3.0, "vs_transformers": 20.0,
           "kernels_per_layer_q1": 12}
FLASH_LAYERS = 43
#: torch.compile modes (torch's own list)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class BenchError(Ds4cError):
    """A benchmark request that cannot run (bad widths or contexts for the model, no device)."""


@dataclass
class StepRow:
    """One (width, context) row of the benchmark. Times in milliseconds; None = not run (see ``notes``)."""

    width: int
    context: int
    pos: int
    ours_ms: float | None = None
    eager_ms: float | None = None
    compile_ms: float | None = None
    transformers_ms: float | None = None
    weight_bytes: int = 0
    state_bytes: int = 0
    roofline_ms: float | None = None
    kernels_per_layer: int = 0
    launches: int = 0
    families: dict[str, dict[str, float]] = field(default_factory=dict)
    projected_flash_ms: float | None = None
    split_ms: float | None = None
    """The same step through the layer split (``--devices`` / ``--layer-split``), graph replays back to back."""
    llama_ms: float | None = None
    """llama.cpp's time for the same step on the same file (``--llama-bench``): q = 1 its ``tg`` per token, q = 5
    its ``pp5`` batch (:func:`llama_step_ms`); None for other widths or without it."""
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.state_bytes

    def ratio(self, other: float | None) -> float | None:
        return None if other is None or self.ours_ms is None else other / self.ours_ms


@dataclass
class BenchReport:
    """Everything one ``ds4c bench`` run measured (``as_dict`` is the --json record)."""

    model: str
    model_file: str
    device: str
    copy_gbps: float | None
    compile_mode: str | None
    compile_modes: dict[str, str]
    transformers: str
    cold_compile_s: float | None
    artifact_load_s: float | None
    rows: list[StepRow]
    prepare: dict[str, Any] = field(default_factory=dict)
    """The compiled step's start (``CompiledStep.prepare_all``): graphs, seconds per phase, weight GB/s, capture
    ms per (width x context) graph, the GPU memory the graphs take."""
    llama_bench: dict[str, Any] = field(default_factory=dict)
    """With ``--llama-bench PATH``: llama.cpp's ``llama-bench`` on the same file and GPU, ``tg`` tokens/s per
    context (``-p 0 -n 128 -d CTX -ngl 99``) or why it failed, and the command."""
    e2e: list[dict[str, Any]] = field(default_factory=list)
    """Per context, as a user runs it (weights resident, graphs ready): ``ttft_ms`` for a prompt of
    ``prompt_tokens`` (prefill + first token), ``loop_tok_s`` of the generate loop over ``new_tokens`` (device
    sampling, host-free) next to ``replay_tok_s`` (1000 / the q=1 graph replay ms)."""
    split: str | None = None
    """The layer split timed in ``StepRow.split_ms`` (``ShardPlan.describe``), None when none was asked."""

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, rd in zip(self.rows, d["rows"]):
            rd.update(total_bytes=r.total_bytes, eager_over_ours=r.ratio(r.eager_ms),
                      compile_over_ours=r.ratio(r.compile_ms), transformers_over_ours=r.ratio(r.transformers_ms),
                      roofline_fraction=r.ratio(r.roofline_ms))
        return d


# ---------------------------------------------------------------------------------------------- bytes
def state_read_bytes(cfg: Ds4Config, end: int, q: int) -> int:
    """Bytes of sequence state one step of ``q`` rows ending at position ``end`` (exclusive) reads (spec
    section 4 layouts): per layer the window ring; for compressing layers the compressor state; ratio-4
    layers the indexer keys of every live block, the indexer compressor state and the selected CSA rows
    (``q * index_topk``, at most the live blocks); HCA layers every live compressed row."""
    total = 0
    for i in range(cfg.n_layers):
        r = cfg.ratio(i)
        total += min(end, cfg.window) * cfg.head_dim * 2
        if not r:
            continue
        c = 2 if r == 4 else 1
        slots = 8 if r == 4 else r
        total += 2 * slots * c * cfg.head_dim * 4
        live = end // r
        if r == 4:
            total += live * cfg.index_head_dim * 2 + 2 * 8 * 2 * cfg.index_head_dim * 4
            total += min(live, q * cfg.index_topk) * cfg.head_dim * 2
        else:
            total += live * cfg.head_dim * 2
    return total


def plan_weight_bytes(mf: ModelFile, width: int, context: int, capacity: int,
                      experts_per_layer: dict[int, int] | None) -> tuple[int, int, dict[str, int]]:
    """(stored weight bytes the step's kernels read, kernels per layer at most, bytes per plan kernel name).

    ``experts_per_layer`` gives the distinct routed experts per layer (default: ``width x n_active``, capped
    at the expert count)."""
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.passes.partition import kernel_plan, plan_weight_types

    cfg = mf.config
    types = plan_weight_types(cfg, {name: mf.ggml_type(name) for name in mf.specs})
    g = run_pipeline(build_step(cfg, width, capacity), "default", context=context).graph
    base, one = kernel_plan(g, types, 0), kernel_plan(g, types, 1)
    per_kernel = {}
    for k0, k1 in zip(base.kernels, one.kernels):
        per_expert = k1.weight_bytes - k0.weight_bytes
        n = (experts_per_layer or {}).get(k0.layer, min(width * cfg.n_active_experts, cfg.n_experts))
        per_kernel[k0.name] = k0.weight_bytes + per_expert * n
    per_layer = max(len(ks) for layer, ks in base.per_layer().items() if layer >= 0)
    return sum(per_kernel.values()), per_layer, per_kernel


def family_table(prof: list[dict[str, Any]], per_kernel: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per kernel family: launches, microseconds (each launch timed alone), the weight bytes its kernels read
    and the GB/s that gives. ``prof``: :meth:`CompiledStep.time_launches` rows; ``per_kernel``: bytes per plan
    kernel name (:func:`plan_weight_bytes`)."""
    fam: dict[str, dict[str, float]] = {}
    seen: set[str] = set()
    for r in prof:
        f = fam.setdefault(r["family"], {"launches": 0, "us": 0.0, "bytes": 0})
        f["launches"] += 1
        f["us"] += r["us"]
        if r["kernel"] not in seen:  # a kernel of several launches reads its weights once
            seen.add(r["kernel"])
            f["bytes"] += per_kernel.get(r["kernel"], 0)
    for f in fam.values():
        f["GBps"] = f["bytes"] / (f["us"] * 1e3) if f["us"] else 0.0
    return fam


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes (median of ``repeats``)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ts = []
    for _ in range(repeats + 2):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(ts[2:]) / 1e9


# ---------------------------------------------------------------------------------------------- timing
def _time_host(fn: Callable[[], Any], repeats: int, sync: bool) -> float:
    """Median wall milliseconds of ``fn()`` (synchronising the GPU around it when ``sync``)."""
    ts = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _routed_experts(ex: Any, width: int, context: int) -> dict[int, int]:
    """Distinct routed experts per layer in the last run of the (width, context) graph."""
    vals = ex.values(width, context)
    return {i: int(torch.unique(vals[f"l{i}.route.ids"][:width]).numel())
            for i in range(ex.cfg.n_layers) if f"l{i}.route.ids" in vals}


def _copy_state_into_reference(ex: Any, ref: Reference, pos: int) -> None:
    from ds4c.ir.interpreter import state_to_inputs

    for name, buf in state_to_inputs(ref.state).items():
        buf.copy_(ex.state[name])
    ref.state.pos = pos


def _reference_step_ms(stepper: Any, tokens: list[int], pos: int, repeats: int, sync: bool) -> float:
    """Median ms of one verify step of ``stepper`` (the reference or its compiled form) from its current
    state, rolled back by its undo journal after each run."""
    def once() -> None:
        stepper.verify(tokens, pos)
        stepper.rollback(0)

    once()  # warm-up: loads (and caches) the routed experts of these tokens; compiles
    return _time_host(once, repeats, sync)


#: the transformers port's prefill is one forward with dense attention masks: longer contexts are not tried
HF_MAX_CONTEXT = 8192


def _time_transformers(mf: ModelFile, rows: list[StepRow], toks_of: dict[int, list[int]], repeats: int,
                       say: Callable[[str], None]) -> str:
    """Fill ``transformers_ms`` of ``rows`` with the transformers port (bf16, eager, the same weights, the
    same prefill and step tokens). Returns the line the report prints about the port."""
    from ds4c import hf_port

    ok, why = hf_port.available()
    if not ok:
        return f"transformers port not run: {why}"
    t0 = time.perf_counter()
    try:
        model = hf_port.load_hf_model(mf, "cuda", torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
        return f"transformers port ({why}) failed to load: {type(e).__name__}: {str(e)[:200]}"
    line = f"transformers port: {why}, bf16 eager, loaded in {time.perf_counter() - t0:.0f} s"
    say(line)
    try:
        for c in sorted({r.context for r in rows}):
            mine = [r for r in rows if r.context == c]
            if c > HF_MAX_CONTEXT:
                for r in mine:
                    r.notes.append(f"transformers port not run above context {HF_MAX_CONTEXT} (one-forward "
                                   f"prefill with dense masks)")
                continue
            toks, pos = toks_of[c], mine[0].pos
            try:
                ms = hf_port.time_hf_widths(model, toks[:pos], toks[pos:pos + MAX_WIDTH],
                                            sorted({r.width for r in mine}), repeats)
            except Exception as e:  # noqa: BLE001
                for r in mine:
                    r.notes.append(f"transformers port failed at context {c}: {type(e).__name__}: {str(e)[:160]}")
                torch.cuda.empty_cache()
                continue
            for r in mine:
                r.transformers_ms = ms[r.width]
            say(f"transformers port, context {c}: " + ", ".join(f"q={q} {v:.1f} ms" for q, v in sorted(ms.items())))
    finally:
        del model
        torch.cuda.empty_cache()
    return line


# ---------------------------------------------------------------------------------------------- run
def check_llama_bench(mf: ModelFile, exe: str | os.PathLike | None) -> str | None:
    """``--llama-bench``: llama.cpp's ``llama-bench`` as the absolute path checked and then run (never looked up
    on PATH), or None when not given.

    Raises:
        BenchError: ``exe`` is not an executable file; ``mf`` has no GGUF file to hand to it (a synthetic model
            whose tensors are generated on the device).
    """
    if exe is None:
        return None
    exe = os.path.abspath(exe)
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise BenchError(f"--llama-bench {exe}: expected llama.cpp's llama-bench executable "
                         f"(built with llama.cpp, https://github.com/ggml-org/llama.cpp), found no executable file")
    if mf.generates_on_device:
        raise BenchError(f"--llama-bench reads a GGUF file; {mf.path} has none (write it with ds4c make-model)")
    return exe


def run_bench(mf: ModelFile, device: str = "cuda", widths: tuple[int, ...] = (1, 2, 3, 4, 5),
              contexts: tuple[int, ...] = (4096,), repeats: int = 50, ref_repeats: int = 5,
              compile_modes: tuple[str, ...] = ("reduce-overhead", "default"),
              artifact: str | None = None, arch: str | None = None, seed: int = 0, transformers: bool = True,
              llama_bench: str | None = None, devices: str | None = None, layer_split: str | None = None,
              reference: bool = True, end_to_end: bool = True,
              say: Callable[[str], None] = print) -> BenchReport:
    """Benchmark one model (module docstring says what is measured).

    Args:
        mf: the model file.
        device: ``cuda`` (every column) or ``cpu`` (reference columns only).
        widths: verify widths, each in 1..5.
        contexts: step end positions (each >= 8, at most the model's context length).
        repeats: graph replays per (width, context); ``ref_repeats``: reference steps.
        compile_modes: ``torch.compile`` modes tried in order; the fastest that works is reported, the others
            with their result or error in ``compile_modes``. Empty: torch.compile not run.
        artifact: an artifact folder from ``ds4c compile`` (default: one is compiled here into a temporary
            folder with an empty kernel cache, and that time is the cold compile time).
        arch: the CUDA arch (default: the device's).
        transformers: time the transformers port when it is importable (False: reported as not asked for).
        llama_bench: path of llama.cpp's ``llama-bench``: its token-generation rate at each context on the same
            file, next to ours (:func:`llama_bench_tg`).
        devices, layer_split: also time every step through this layer split (``ds4c.engine.shard_plan``; cuda
            only): the split column and the boundary cost.
        reference: time the reference columns (eager, torch.compile). False (cuda only): the reference's
            weights are not loaded at all, for a model whose compiled step leaves too little device memory
            for a second copy of its weights (the 43-layer flash on one H200).
        end_to_end: run ``generate`` at each context after the step timings (TTFT, the loop's tokens/s);
            False skips it (its prompt is prefilled from scratch: minutes at 32K on the 43-layer model).

    Returns:
        BenchReport (times in ms; bytes; copy bandwidth in GB/s).

    Raises:
        BenchError: a width outside 1..5, a context under 8 or past the model's context length, widths or
            contexts not increasing, an unknown torch.compile mode, an artifact with ``device='cpu'``,
            ``device='cuda'`` without a CUDA device, ``reference=False`` with ``device='cpu'``, or a
            ``llama_bench`` that :func:`check_llama_bench` refuses.
    """
    llama_bench = check_llama_bench(mf, llama_bench)
    cfg = mf.config
    if not widths or any(not 1 <= w <= MAX_WIDTH for w in widths):
        raise BenchError(f"widths must be in 1..{MAX_WIDTH}, found {list(widths)}")
    if list(widths) != sorted(set(widths)):
        raise BenchError(f"widths must be increasing without repeats, found {list(widths)}")
    if not contexts or any(c < 8 or c > cfg.max_position for c in contexts):
        raise BenchError(f"contexts must be in 8..{cfg.max_position} (the model's context length), "
                         f"found {list(contexts)}")
    if list(contexts) != sorted(set(contexts)):
        raise BenchError(f"contexts must be increasing without repeats, found {list(contexts)}")
    bad_modes = [m for m in compile_modes if m not in COMPILE_MODES]
    if bad_modes:
        raise BenchError(f"torch.compile modes must be among {list(COMPILE_MODES)}, found {bad_modes}")
    if artifact is not None and device != "cuda":
        raise BenchError("--artifact is used only by the compiled step (--device cuda)")
    if not reference and device != "cuda":
        raise BenchError("--no-reference leaves nothing to time with --device cpu (the cpu bench is the reference)")
    if not end_to_end and device != "cuda":
        say("note: --no-generate changes nothing with --device cpu (generate end to end runs on the compiled "
            "step only)")
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device (torch.cuda.is_available() is False); use --device cpu "
                         "for the reference columns alone")
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    compiled = device == "cuda"
    ex, cold_s, load_s, copy_gbps = None, None, None, None
    max_ctx = max(contexts)
    buckets = BucketSpec.build(cfg, tuple(range(1, MAX_WIDTH + 1)), max_ctx)
    opened, open_s = None, 0.0  # an artifact given: loaded and verified once, the time counted in the load time
    if artifact is not None:  # the artifact's own buckets (it serves only those), checked to cover the bench
        from ds4c.runtime.artifact_manifest import manifest_buckets, open_artifact

        t0 = time.perf_counter()
        opened = open_artifact(artifact)
        open_s = time.perf_counter() - t0
        buckets = manifest_buckets(opened.manifest)
        if not set(widths) <= set(buckets.widths) or max_ctx > buckets.max_ctx:
            raise BenchError(f"--artifact {artifact} serves widths {list(buckets.widths)} up to max_ctx "
                             f"{buckets.max_ctx}, the bench asks for widths {list(widths)} up to {max_ctx}")
    if compiled:
        from ds4c.runtime.artifact import build_artifact
        from ds4c.runtime.cache import KernelCache
        from ds4c.runtime.step import CompiledStep, device_arch
        from ds4c.runtime.targets import target

        arch = arch or device_arch()
        if artifact is None:
            tmp = Path(tempfile.mkdtemp(prefix="ds4c-bench-"))
            say(f"compiling an artifact for {arch} (cold kernel cache, {os.cpu_count()} CPUs) ...")
            t0 = time.perf_counter()
            types = {name: mf.ggml_type(name) for name in mf.specs}
            build_artifact(cfg, [target(arch)], buckets, tmp / "artifact", KernelCache(tmp / "cache"),
                           progress=False, weight_types=types)
            cold_s = time.perf_counter() - t0
            artifact = str(tmp / "artifact")
        t0 = time.perf_counter()
        ex = CompiledStep(mf, buckets, arch, artifact=opened or artifact)
        prep = ex.prepare_all(progress=False)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0 + open_s
        w = prep["weights"]
        say(f"artifact loaded and every graph ready in {load_s:.1f} s: {prep['graphs']} graphs (build "
            f"{prep['build_s']:.1f} s, load {prep['load_s']:.1f} s with weights {w['bytes'] / 1e9:.2f} GB at "
            f"{w['gb_per_s']:.1f} GB/s, capture {prep['capture_s']:.1f} s); graphs take "
            f"{prep['graph_bytes'] / 2**20:.0f} MiB")
        copy_gbps = copy_bandwidth_gbps(dev)
    split, plan = None, None
    if devices is not None or layer_split is not None:
        if not compiled:
            raise BenchError("--devices / --layer-split: bench times the compiled step's split only (--device cuda "
                             "with cuda devices); the reference's split is checked by generate --devices cpu,cpu")
        from ds4c.engine import shard_plan
        from ds4c.runtime.sharded import ShardedStep

        plan = shard_plan(mf, "cuda", devices, layer_split, buckets)
        if plan is None or not plan.is_split:
            raise BenchError(f"--devices / --layer-split: expected a split of at least two shards, found "
                             f"{plan.describe() if plan else 'none'}")
        say(f"preparing the layer split {plan.describe()} (kernels through the kernel cache) ...")
        split = ShardedStep(mf, buckets, plan, arch)
        split.prepare_all(progress=False)
    capacity = ex.capacity if ex is not None else buckets.contexts[-1]
    n_routed_total = cfg.n_layers * MAX_WIDTH * cfg.n_active_experts
    ref = (Reference(ReferenceWeights.load(mf, dev, cache_experts=n_routed_total + 8), max_ctx=capacity)
           if reference else None)
    modes_used: dict[str, str] = {}
    best_mode, compiled_ref = None, None
    rows: list[StepRow] = []
    toks_of: dict[int, list[int]] = {}
    for c in contexts:
        pos = c - MAX_WIDTH
        toks = toks_of[c] = torch.randint(0, cfg.vocab_size, (c,), generator=gen).tolist()
        say(f"filling the sequence to position {pos} ...")
        if ex is not None:
            ex.reset()
            p = 0
            while p < pos:
                q = min(MAX_WIDTH, pos - p)
                ex.step(toks[p:p + q], p)
                p += q
            snap = ex.snapshot()
        else:
            ref.reset()
            for p in range(0, pos, MAX_WIDTH):
                ref.verify(toks[p:min(p + MAX_WIDTH, pos)], p)
            ref_snap = ref.snapshot()
        for w in widths:
            step_toks = toks[pos:pos + w]
            row = StepRow(w, c, pos)
            bucket = buckets.bucket(pos, w)
            routed = None
            if ex is not None:
                ex.restore(snap)
                row.ours_ms = ex.time_replays(step_toks, pos, repeats)
                routed = _routed_experts(ex, w, bucket)
                prof = ex.time_launches(step_toks, pos, repeats=5)
                row.launches = len(prof)
                head_us = sum(r["us"] for r in prof if r["layer"] < 0)
                layer_ms = max(row.ours_ms - head_us / 1e3, 0.0) / cfg.n_layers
                row.projected_flash_ms = layer_ms * FLASH_LAYERS + head_us / 1e3
                if ref is not None:
                    _copy_state_into_reference(ex, ref, pos)
                if split is not None:
                    for sh in split.shards:  # the same sequence state, by buffer name
                        for name, buf in sh.state.items():
                            buf.copy_(ex.state[name])
                        sh.pos = ex.pos
                    row.split_ms = split.time_replays(step_toks, pos, repeats)
            else:
                ref.restore(ref_snap)
                row.notes.append("compiled step not run: needs a CUDA device")
            row.weight_bytes, row.kernels_per_layer, per_kernel = plan_weight_bytes(mf, w, bucket, capacity, routed)
            if ex is not None:
                row.families = family_table(prof, per_kernel)
            row.state_bytes = state_read_bytes(cfg, pos + w, w)
            if copy_gbps:
                row.roofline_ms = row.total_bytes / (copy_gbps * 1e9) * 1e3
            if ref is None:
                row.notes.append("reference not run: --no-reference")
                rows.append(row)
                say(format_row(row))
                continue
            row.eager_ms = _reference_step_ms(ref, step_toks, pos, ref_repeats, compiled)
            if compile_modes:
                if compiled_ref is None and not modes_used:
                    best_mode, compiled_ref, modes_used = _pick_compile_mode(ref, compile_modes, step_toks, pos,
                                                                             ref_repeats, compiled, say)
                if compiled_ref is not None:
                    compiled_ref.restore(ref.snapshot())
                    row.compile_ms = _reference_step_ms(compiled_ref, step_toks, pos, ref_repeats, compiled)
            rows.append(row)
            say(format_row(row))
    llama = llama_bench_tg(llama_bench, mf.path, contexts, say) if llama_bench else {}
    for row in rows:
        row.llama_ms = llama_step_ms(llama, row.width, row.context)
    if split is not None:
        del split
        torch.cuda.empty_cache()
    e2e = (_end_to_end(ex, rows, toks_of, contexts, say, llama.get("tg_tok_s", {}))
           if ex is not None and end_to_end else [])
    if not transformers or not reference:
        tf_line = ("transformers port not run: not asked for (--no-transformers)" if not transformers else
                   "transformers port not run: --no-reference")
    elif compiled:
        del ref, compiled_ref
        torch.cuda.empty_cache()
        tf_line = _time_transformers(mf, rows, toks_of, ref_repeats, say)
    else:
        tf_line = "transformers port not run: needs a CUDA device"
    return BenchReport(cfg.name, str(mf.path), torch.cuda.get_device_name() if compiled else "cpu", copy_gbps,
                       best_mode, modes_used, tf_line, cold_s, load_s, rows, prep if ex is not None else {}, llama,
                       e2e, None if plan is None else plan.describe())


def llama_records(exe: str, model: str | os.PathLike, args: list[str], timeout: float = 1800) -> list[dict[str, Any]]:
    """One ``llama-bench -m MODEL ARGS`` run (``-o json`` among ``args``): its JSON list of test records.

    Raises:
        ValueError: it exited non-zero (its last stderr line), printed no JSON or not a list of records (what it
            printed, shortened), ran past ``timeout`` seconds, or could not be started; one line each.
    """
    import json
    import subprocess

    try:
        r = subprocess.run([str(exe), "-m", str(model)] + args, capture_output=True, text=True, errors="replace",
                           timeout=timeout)
    except OSError as e:
        raise ValueError(f"cannot run {exe}: {e.strerror or e}") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"{exe} ran past {timeout:.0f} s") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise ValueError(f"llama-bench exited {r.returncode}: {last}")
    try:
        recs = json.loads(r.stdout)
    except json.JSONDecodeError:
        head = (r.stdout.strip().splitlines() or ["(nothing)"])[0][:80]
        raise ValueError(f"expected llama-bench's JSON (-o json) on stdout, found {head!r}") from None
    if not (isinstance(recs, list) and all(isinstance(x, dict) for x in recs)):
        raise ValueError(f"expected llama-bench's JSON list of test records, found {type(recs).__name__} "
                         f"{str(recs)[:60]}")
    return recs


def llama_bench_tg(exe: str, model: str | os.PathLike, contexts: tuple[int, ...], say: Callable[[str], None] = print,
                   n_gen: int = 128, reps: int = 3, pp: int = 5) -> dict[str, Any]:
    """llama.cpp's decode and small-batch rates on ``model``: ``llama-bench -m MODEL -p PP -n N_GEN -d CTX -r REPS
    -ngl 99 -o json`` for every context: its ``tg`` test (one token per step) and its ``pp5`` test (a batch of
    ``pp`` = 5 prompt tokens, the peer of our q = 5 verify step) at that depth; llama.cpp's own timing, host
    work included.

    Returns:
        ``{"cmd": str, "tg_tok_s": {ctx: tokens/s}, "pp_tok_s": {ctx: tokens/s}, "pp": pp, "errors": {ctx: one
        line}}``; a failing run (llama.cpp cannot load the file, no such binary) is recorded per context, never
        raised (a run with tg but no pp result keeps the tg).
    """
    args = ["-p", str(pp), "-n", str(n_gen), "-d", "CTX", "-r", str(reps), "-ngl", "99", "-o", "json"]
    out: dict[str, Any] = {"cmd": " ".join([str(exe), "-m", "MODEL"] + args), "tg_tok_s": {}, "pp_tok_s": {},
                           "pp": pp, "errors": {}}
    for c in contexts:
        try:
            recs = llama_records(exe, model, [str(c) if a == "CTX" else a for a in args])
            tg = [x for x in recs if x.get("n_gen") == n_gen and x.get("n_depth") == c]
            ppr = [x for x in recs if x.get("n_prompt") == pp and not x.get("n_gen") and x.get("n_depth") == c]
            if not tg:
                raise ValueError(f"expected a test record with n_gen {n_gen} and n_depth {c}, found {len(recs)} "
                                 f"record(s): {str(recs)[:80]}")
            out["tg_tok_s"][c] = record_rate(tg[0])
            if ppr:
                out["pp_tok_s"][c] = record_rate(ppr[0])
            say(f"llama.cpp tg{n_gen} at depth {c}: {out['tg_tok_s'][c]:.1f} tokens/s; pp{pp}: "
                f"{_f(out['pp_tok_s'].get(c), '.1f')} tokens/s")
        except ValueError as e:
            out["errors"][c] = str(e).splitlines()[0]
            say(f"llama.cpp at depth {c}: {out['errors'][c]}")
    return out


def record_rate(rec: dict[str, Any]) -> float:
    """A llama-bench record's ``avg_ts`` (tokens/s); ValueError unless a positive finite number."""
    try:
        ts = float(rec["avg_ts"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"a test record without a numeric avg_ts: {str(rec)[:80]}") from None
    if not (math.isfinite(ts) and ts > 0):
        raise ValueError(f"a test record with avg_ts {ts} (expected a positive rate)")
    return ts


def llama_step_ms(llama: dict[str, Any], width: int, context: int) -> float | None:
    """ms of llama.cpp's step of ``width`` rows at ``context`` from :func:`llama_bench_tg`'s result: q = 1 is
    ``1000 / tg``, q = ``pp`` (5) is ``pp * 1000 / pp5``; None otherwise or when not measured."""
    if width == 1:
        ts = llama.get("tg_tok_s", {}).get(context)
    elif width == llama.get("pp"):
        ts = llama.get("pp_tok_s", {}).get(context)
    else:
        return None
    return None if not ts else width * 1e3 / ts


def _end_to_end(ex: Any, rows: list[StepRow], toks_of: dict[int, list[int]], contexts: tuple[int, ...],
                say: Callable[[str], None], llama_tg: dict[int, float] | None = None,
                new_tokens: int = 128) -> list[dict[str, Any]]:
    """Per context: the generate loop as a user runs it on the prepared compiled step (see BenchReport.e2e)."""
    from ds4c.generate import generate

    out = []
    captures = ex.captures
    for c in contexts:
        n_new = min(new_tokens, ex.max_ctx - 1)
        prompt = toks_of[c][: max(1, min(c, ex.max_ctx) - n_new)]
        res = generate(ex, prompt, n_new)
        q1 = next((r.ours_ms for r in rows if r.context == c and r.width == 1), None)
        # the first token: the prefill, then its sampling (decode_s less the decode steps)
        ttft_s = res.prefill_s + res.decode_s - sum(res.step_s)
        rec = {"context": c, "prompt_tokens": len(prompt), "new_tokens": n_new, "ttft_ms": ttft_s * 1e3,
               "prefill_tok_s": res.prefill_tokens_per_s, "loop_tok_s": res.decode_tokens_per_s,
               "replay_tok_s": None if q1 is None else 1e3 / q1,
               "max_step_over_median": (max(res.step_s) / statistics.median(res.step_s)) if res.step_s else None}
        rec["loop_over_replay"] = (rec["loop_tok_s"] / rec["replay_tok_s"]
                                   if rec["loop_tok_s"] and rec["replay_tok_s"] else None)
        rec["llama_tg_tok_s"] = (llama_tg or {}).get(c)
        rec["loop_over_llama"] = (rec["loop_tok_s"] / rec["llama_tg_tok_s"]
                                  if rec["loop_tok_s"] and rec["llama_tg_tok_s"] else None)
        out.append(rec)
        say(f"generate at {c}: prompt {len(prompt)} tokens, TTFT {rec['ttft_ms']:.0f} ms; decode loop "
            f"{_f(rec['loop_tok_s'], '.1f')} tokens/s vs graph replay {_f(rec['replay_tok_s'], '.1f')} "
            f"({_f(rec['loop_over_replay'], '.3f')}); slowest step {_f(rec['max_step_over_median'], '.2f')}x the median")
    if ex.captures != captures:
        say(f"warning: {ex.captures - captures} CUDA graphs captured during generation")
    return out


def _pick_compile_mode(ref: Reference, modes: tuple[str, ...], tokens: list[int], pos: int, repeats: int,
                       sync: bool, say: Callable[[str], None]) -> tuple[str | None, Any, dict[str, str]]:
    """Try each torch.compile mode on this step (from ``ref``'s state); keep the fastest that works.
    Returns (mode, stepper, {mode: what happened})."""
    from ds4c.reference.compiled import compile_reference

    notes: dict[str, str] = {}
    best: tuple[float, str, Any] | None = None
    for mode in modes:
        t0 = time.perf_counter()
        try:
            cr = compile_reference(ref, mode=mode)
            cr.restore(ref.snapshot())
            cr.verify(tokens, pos)  # compiles
            cr.rollback(0)
            compile_s = time.perf_counter() - t0
            ms = _reference_step_ms(cr, tokens, pos, repeats, sync)
        except Exception as e:  # noqa: BLE001 - a mode that fails is reported, not fatal
            notes[mode] = f"failed after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {str(e)[:200]}"
            say(f"torch.compile mode {mode}: {notes[mode]}")
            continue
        notes[mode] = f"ok: first step (compile) {compile_s:.1f} s, step {ms:.2f} ms, graphs {cr.graphs}"
        say(f"torch.compile mode {mode}: {notes[mode]}")
        if best is None or ms < best[0]:
            best = (ms, mode, cr)
    return (best[1], best[2], notes) if best else (None, None, notes)


# ---------------------------------------------------------------------------------------------- output
def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def format_row(r: StepRow) -> str:
    return (f"q={r.width} ctx={r.context}: ours {_f(r.ours_ms)} ms, eager {_f(r.eager_ms, '.1f')} ms, "
            f"torch.compile {_f(r.compile_ms, '.1f')} ms, roofline {_f(r.roofline_ms)} ms "
            f"({r.total_bytes / 1e9:.3f} GB)")


def format_report(rep: BenchReport) -> str:
    """The printed table: per-family time shares, per-row times, then the ratios, the cold compile and warm
    artifact load times, and the notes (why a column was not run) last."""
    out = [f"model {rep.model} on {rep.device}; copy bandwidth "
           f"{_f(rep.copy_gbps and rep.copy_gbps / 1e3, '.2f')} TB/s; torch.compile mode: {rep.compile_mode or 'none'}"]
    for mode, note in rep.compile_modes.items():
        out.append(f"  torch.compile {mode}: {note}")
    out.append(f"  {rep.transformers}")
    for r in rep.rows:
        if r.families:
            tot = sum(f["us"] for f in r.families.values()) or 1.0
            shares = ", ".join(f"{k} {100 * v['us'] / tot:.0f}% ({v['GBps']:.0f} GB/s)" for k, v in
                               sorted(r.families.items(), key=lambda kv: -kv[1]["us"]))
            out.append(f"q={r.width} ctx={r.context} time share (GB/s) by family, launches timed alone: {shares}")
    out.append(f"{'q':>2s} {'ctx':>6s} {'ours ms':>9s} {'eager ms':>9s} {'compile':>9s} {'transf.':>8s} "
               f"{'llama ms':>8s} {'GB read':>8s} {'roof ms':>8s} {'k/layer':>7s} {'43L ms':>7s} {'tok/s':>7s}")
    for r in rep.rows:
        tps = None if r.projected_flash_ms is None else 1e3 / r.projected_flash_ms
        out.append(f"{r.width:2d} {r.context:6d} {_f(r.ours_ms):>9s} {_f(r.eager_ms, '.2f'):>9s} "
                   f"{_f(r.compile_ms, '.2f'):>9s} {_f(r.transformers_ms, '.2f'):>8s} {_f(r.llama_ms, '.2f'):>8s} "
                   f"{r.total_bytes / 1e9:8.3f} {_f(r.roofline_ms):>8s} {r.kernels_per_layer:7d} "
                   f"{_f(r.projected_flash_ms, '.2f'):>7s} {_f(tps, '.0f'):>7s}")
    out.append("speed-ups (x) and roofline fraction (llama: q=1 its tg, q=5 its pp5 at the same depth):")
    out.append(f"{'q':>2s} {'ctx':>6s} {'eager/ours':>10s} {'compile/ours':>12s} {'transf/ours':>11s} "
               f"{'llama/ours':>10s} {'roof/ours':>9s}")
    for r in rep.rows:
        out.append(f"{r.width:2d} {r.context:6d} {_f(r.ratio(r.eager_ms), '.1f'):>10s} "
                   f"{_f(r.ratio(r.compile_ms), '.1f'):>12s} {_f(r.ratio(r.transformers_ms), '.1f'):>11s} "
                   f"{_f(r.ratio(r.llama_ms), '.2f'):>10s} {_f(r.ratio(r.roofline_ms), '.2f'):>9s}")
    out.append(f"cold compile (artifact, this machine): {_f(rep.cold_compile_s, '.1f')} s; "
               f"warm artifact load (every graph ready): {_f(rep.artifact_load_s, '.2f')} s")
    if rep.prepare:
        p, w = rep.prepare, rep.prepare.get("weights", {})
        caps = sorted(p.get("capture_ms", {}).values())
        out.append(f"start: {p['graphs']} graphs, weights {w.get('bytes', 0) / 1e9:.2f} GB at "
                   f"{w.get('gb_per_s', 0):.1f} GB/s, capture {p['capture_s']:.2f} s (per graph "
                   f"{_f(caps[0] if caps else None, '.1f')}..{_f(caps[-1] if caps else None, '.1f')} ms), "
                   f"graphs take {p['graph_bytes'] / 2**20:.0f} MiB")
    if rep.split is not None:
        out.append(f"layer split {rep.split}: the same step through the shards (graph replays and boundary copies)")
        out.append(f"{'q':>2s} {'ctx':>6s} {'unsplit ms':>10s} {'split ms':>9s} {'boundary ms':>11s} {'split/unsplit':>13s}")
        for r in rep.rows:
            d = None if r.split_ms is None or r.ours_ms is None else r.split_ms - r.ours_ms
            out.append(f"{r.width:2d} {r.context:6d} {_f(r.ours_ms):>10s} {_f(r.split_ms):>9s} {_f(d):>11s} "
                       f"{_f(r.ratio(r.split_ms), '.3f'):>13s}")
    if rep.e2e:
        out.append(f"{'ctx':>6s} {'prompt':>7s} {'TTFT ms':>9s} {'prefill t/s':>11s} {'loop t/s':>9s} "
                   f"{'replay t/s':>10s} {'loop/replay':>11s} {'max/median':>10s} {'llama tg':>9s} {'loop/llama':>10s}")
        for e in rep.e2e:
            out.append(f"{e['context']:6d} {e['prompt_tokens']:7d} {e['ttft_ms']:9.1f} "
                       f"{_f(e['prefill_tok_s'], '.0f'):>11s} {_f(e['loop_tok_s'], '.1f'):>9s} "
                       f"{_f(e['replay_tok_s'], '.1f'):>10s} {_f(e['loop_over_replay'], '.3f'):>11s} "
                       f"{_f(e['max_step_over_median'], '.2f'):>10s} {_f(e.get('llama_tg_tok_s'), '.1f'):>9s} "
                       f"{_f(e.get('loop_over_llama'), '.2f'):>10s}")
    if rep.llama_bench:
        out.append(f"llama.cpp: {rep.llama_bench['cmd']}")
        out += [f"  llama.cpp at {c}: {msg}" for c, msg in rep.llama_bench.get("errors", {}).items()]
    notes = sorted({n for r in rep.rows for n in r.notes})
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)
