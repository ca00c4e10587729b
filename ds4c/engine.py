"""The one place that picks the engine that runs a model's steps.

:func:`open_engine` returns a *stepper*: an :class:`~ds4c.engine_protocol.Engine` (``reset()``,
``verify(tokens, pos)``, ``decode(token, pos)``, ``rollback(accepted)``, ``pos``, ``max_ctx``, ``cfg``) that
:func:`ds4c.generate.generate` drives. Engines:

* ``reference``: the eager PyTorch reference (:class:`ds4c.reference.Reference`), on ``cpu`` or ``cuda``;
* ``compiled``: the compiled step (:class:`ds4c.runtime.step.CompiledStep`: kernels + CUDA graph replay),
  on ``cuda`` only, its kernels compiled through the kernel cache or taken from an AOT ``artifact``;
* ``auto``: ``compiled`` on ``cuda``, ``reference`` on ``cpu``.

A drafter's needs (:class:`~ds4c.engine_protocol.EngineNeeds`: the DSpark taps, the MTP drafter's final HC state) are
resolved here when the engine opens (:func:`resolve_needs`): the compiled step records them in its graphs, so they are
part of how it is built; the reference records them on request.

A layer split (``devices`` / ``layer_split``, :func:`shard_plan`; ``ds4c.shard_plan``) runs either engine shard
by shard: :class:`ds4c.runtime.sharded.ShardedStep` or :class:`ds4c.reference.sharded.ShardedReference`.

Both :class:`ds4c.api.Model` and ``ds4c generate`` open their engine here, and the rules of what runs with what
live here once, for both: which engines prefill chunk graphs run on (:func:`check_prefill_request`), what a
drafter needs of its target (:func:`resolve_needs`), the memory plan of a model (:func:`plan_memory`, ``ds4c info
--plan``). Error messages name the choices by their command-line spelling (``--device cuda``, ``--engine
compiled``, ``--artifact``), which map one to one onto these functions' keyword arguments.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ds4c.buckets import DEFAULT_PREFILL_CHUNKS, BucketSpec, check_prefill_chunks
from ds4c.engine_protocol import Drafter, EngineNeeds, drafter_name, drafter_needs
from ds4c.errors import Ds4cError
from ds4c.gguf_file import ModelFile
from ds4c.shard_plan import ShardPlan, ShardPlanError, parse_counts, parse_plan

DEVICES = ("cpu", "cuda")
ENGINES = ("auto", "reference", "compiled")
#: Widths the compiled step serves when it compiles its own kernels (prefill runs verify steps of width 5).
COMPILED_WIDTHS = (1, 2, 3, 4, 5)


def resolve_engine(device: str, engine: str = "auto", dataflow: str = "bf16") -> str:
    """The engine ``auto`` stands for on ``device`` (``compiled`` on cuda, ``reference`` on cpu); other names
    are returned unchanged once checked.

    Raises:
        Ds4cError: an unknown device, engine or dataflow, ``compiled`` on the cpu, ``cuda`` without a CUDA
            device, the fp32 dataflow with the compiled engine.
    """
    if device not in DEVICES:
        raise Ds4cError(f"unknown device {device!r}: expected one of {', '.join(DEVICES)}")
    if engine not in ENGINES:
        raise Ds4cError(f"unknown engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "compiled" and device != "cuda":
        raise Ds4cError(f"the compiled engine (--engine compiled) runs on device 'cuda' only, found device {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise Ds4cError("device 'cuda' (--device cuda): no CUDA device is available (torch.cuda.is_available() is "
                        "False)")
    if dataflow not in ("bf16", "fp32"):
        raise Ds4cError(f"dataflow must be 'bf16' or 'fp32', found {dataflow!r}")
    name = ("compiled" if device == "cuda" else "reference") if engine == "auto" else engine
    if name == "compiled" and dataflow != "bf16":
        raise Ds4cError("the fp32 dataflow (--dataflow fp32) is the reference engine's only (the compiled step "
                        "keeps the spec's bf16 activations): use the reference engine (--engine reference)")
    return name


def shard_plan(mf: ModelFile, device: str, devices: str | list[str] | None = None,
               layer_split: str | list[int] | None = None, buckets: Any = None,
               parts: Any = None) -> ShardPlan | None:
    """The layer split ``devices`` / ``layer_split`` (``--devices`` / ``--layer-split``) describe, or None when
    neither is given (the unsplit step on ``device``).

    ``layer_split`` without ``devices`` splits on ``device`` alone (a virtual split: every shard on the same
    device). ``devices`` without ``layer_split`` places layers automatically: on CUDA from the memory plan
    (:func:`ds4c.runtime.memory_plan.memory_model`, for ``buckets``; from ``parts`` when given:
    :func:`ds4c.runtime.memory_plan.plan_parts`) against each device's free memory, on the CPU evenly.

    Raises:
        ShardPlanError: a malformed or invalid plan, a plan whose devices are not of ``device``'s kind, or an
            automatic placement that does not fit (naming the shard, its device and the shortfall).
    """
    from ds4c.shard_plan import ShardPlanError, parse_counts, parse_plan

    if devices is None and layer_split is None:
        return None
    n = mf.config.n_layers
    if devices is None:
        devices = [device] * len(parse_counts(layer_split))
    memory = free = None
    if layer_split is None and buckets is not None:
        probe = parse_plan(devices, None, n, default_device=device)  # validates the list (even split)
        if probe.kind == "cuda" and probe.is_split:
            from ds4c.runtime.memory_plan import memory_model
            from ds4c.runtime.sharded import free_memory

            memory, free = memory_model(mf, buckets, parts=parts), free_memory(list(probe.devices))
    plan = parse_plan(devices, layer_split, n, default_device=device, memory=memory, free_bytes=free)
    if plan.kind != device:
        raise ShardPlanError(f"--devices {','.join(plan.devices)}: expected {device} devices (--device {device})")
    return plan


def check_memory(mf: ModelFile, buckets: Any, plan: ShardPlan | None, arch: str, parts: Any = None,
                 progress: bool = True) -> Any:
    """The compiled step's :class:`~ds4c.runtime.memory_plan.MemoryPlan` against each device's free memory now
    (:func:`ds4c.runtime.sharded.free_memory`), printed to stderr with ``progress``, checked before any weight
    is loaded.

    Raises:
        ShardPlanError: the plan does not fit (one line: the shard, what it needs, what its device has free, the
            shortfall, what to try).
    """
    import sys

    from ds4c.runtime.memory_plan import memory_plan
    from ds4c.runtime.sharded import free_memory

    mp = memory_plan(mf, buckets, plan, free_memory(["cuda"] if plan is None else list(plan.devices)), arch, parts)
    if progress:
        print(mp.describe(), file=sys.stderr)
    mp.check()
    return mp


def check_prefill_request(chunks: Any, device: str = "cpu", engine: str = "auto", dataflow: str = "bf16",
                          artifact: Any = None, taps: tuple[int, ...] = (), record_hc: bool = False
                          ) -> tuple[int, ...] | None:
    """The prefill chunk sizes asked for (``--prefill`` / ``prefill_chunks``), validated once
    (:func:`~ds4c.buckets.check_prefill_chunks`: a tuple, a list or text such as ``"256,2048"``; empty or
    ``"none"``: none, the prompt runs as verify steps), and checked against what they would run on. None stays
    None (the engine's default, :func:`open_engine`).

    Raises:
        Ds4cError: a malformed list (``--prefill: ...``); chunks with a drafter's taps or final HC recording
            (``taps`` / ``record_hc``) from an ``artifact`` (whose chunk graphs record neither); chunks on an
            engine other than the compiled one (the reference prefills with verify steps); and what
            :func:`resolve_engine` raises.
    """
    if chunks is None:
        return None
    try:
        sizes = check_prefill_chunks(chunks)
    except Ds4cError as e:
        raise Ds4cError(f"--prefill: {e}") from None
    if not sizes:
        return sizes
    text = ",".join(map(str, sizes))
    if (taps or record_hc) and artifact is not None:
        raise Ds4cError(f"--prefill {text} with --draft and --artifact: an artifact's chunk graphs record no taps or "
                        f"final HC state for a drafter; drop --artifact (the chunk graphs are then built here)")
    if resolve_engine(device, engine, dataflow) != "compiled":
        raise Ds4cError(f"--prefill {text}: prefill chunk graphs run on the compiled engine (--device cuda); found "
                        f"--device {device} --engine {engine} (the reference prefills with verify steps)")
    return sizes


def resolve_needs(needs: EngineNeeds, engine: str, split: bool, artifact: Any = None,
                  taps: tuple[int, ...] = (), record_hc: bool = False,
                  name: str | None = None) -> tuple[tuple[int, ...], bool]:
    """What the engine ``engine`` (``reference`` or ``compiled``) is built to record for a drafter's ``needs``
    (:func:`~ds4c.engine_protocol.drafter_needs`), with the caller's own ``taps`` / ``record_hc``: ``(taps,
    record_hc)`` of the compiled step (the union of both), or ``((), False)`` for the reference, which records taps
    and the final HC state on request (the drafter's ``prepare`` asks). The one place that decides what a drafter
    may run on: :func:`open_engine` (``draft=``), :meth:`ds4c.api.Model.generate` (``draft=``) and ``ds4c generate
    --draft`` (before its engine starts) all ask here.

    Args:
        split: the target runs a layer split (``--devices`` / ``--layer-split`` given).
        artifact: the compiled target's kernels come from this artifact.
        name: the drafter as the user named it (``--draft NAME``), the messages' prefix (None: no prefix).

    Raises:
        Ds4cError: needs this engine cannot serve (one line, in the command line's spelling): taps on a layer split
            (the DSpark drafter runs on an unsplit target), taps on a compiled step from an ``artifact`` (the
            compiled DSpark drafter compiles its kernels through the kernel cache), the final HC state on a
            reference layer split, or ``taps`` other than the drafter's.
    """
    who = f"--draft {name}: " if name else ""
    if needs.taps and split:
        raise Ds4cError(f"{who}the DSpark drafter runs on an unsplit target (no --devices / --layer-split)")
    if needs.taps and engine == "compiled" and artifact is not None:
        raise Ds4cError(f"{who}the compiled DSpark drafter is not served from an artifact yet; run without "
                        f"--artifact (the step then compiles with the drafter's taps)")
    if needs.final_hc and split and engine == "reference":
        raise Ds4cError(f"{who}the MTP drafter reads the target's final HC state, which the reference engine records "
                        f"unsplit only (no --devices / --layer-split; the compiled engine records it on a split too)")
    taps = tuple(taps)
    if needs.taps and taps and taps != needs.taps:
        raise Ds4cError(f"{who}taps {list(taps)}: the drafter reads the taps of layers {list(needs.taps)}; give those "
                        f"or none (the drafter's are used)")
    if engine != "compiled":
        return (), False
    return taps or needs.taps, bool(record_hc) or needs.final_hc


def plan_memory(mf: ModelFile, max_ctx: int = 4096, arch: str = "sm_90", devices: str | None = None,
                layer_split: str | None = None, free_gib: float | None = None) -> Any:
    """The compiled step's :class:`~ds4c.runtime.memory_plan.MemoryPlan` for ``mf`` serving ``max_ctx``
    positions on ``arch`` (arithmetic: no GPU needed), unsplit or over the layer split ``devices`` /
    ``layer_split`` (CUDA devices), against ``free_gib`` GiB free on each device (default: the CUDA devices'
    free memory now; without a GPU, unknown). ``devices`` without ``layer_split`` places the layers from the
    memory plan when the free memory is known. Not checked: call its ``check()`` (``ds4c info --plan`` prints
    it first).

    Raises:
        Ds4cError: an MTP-only file; ``max_ctx`` past the model's context length; devices that are not CUDA
            devices; what :func:`~ds4c.shard_plan.parse_plan` raises (a malformed split, one that does not fit).
    """
    # imported when used, as the engines below are (start-up speed: the reference path never loads the runtime)
    from ds4c.runtime.memory_plan import memory_model, memory_plan, plan_parts
    from ds4c.runtime.sharded import free_memory

    if mf.mtp_only:
        raise Ds4cError(f"{mf.path}: an MTP-only file has no compiled step to plan")
    cfg = mf.config
    if max_ctx > cfg.max_position:
        raise Ds4cError(f"--max-ctx {max_ctx}: the model's context length is {cfg.max_position}")
    buckets = BucketSpec.build(cfg, COMPILED_WIDTHS, max_ctx)
    parts = plan_parts(mf, buckets, arch)
    devs = devices or ",".join(["cuda"] * (len(parse_counts(layer_split)) if layer_split else 1))
    probe = parse_plan(devs, layer_split, cfg.n_layers, default_device="cuda")
    if probe.kind != "cuda":
        raise Ds4cError(f"--devices {devs}: the memory plan is the compiled step's (CUDA devices)")
    if free_gib is not None:
        free = [int(free_gib * 2**30)] * probe.n_shards
    elif torch.cuda.is_available():
        free = free_memory(list(probe.devices))
    else:
        free = None
    plan = probe
    if devices and not layer_split and free is not None and probe.is_split:  # automatic placement
        plan = parse_plan(devs, None, cfg.n_layers, default_device="cuda",
                          memory=memory_model(mf, buckets, arch, parts), free_bytes=free)
    return memory_plan(mf, buckets, plan if plan.is_split else None, free, arch, parts)


def default_prefill_tries(max_ctx: int) -> list[tuple[int, ...]]:
    """The chunk sets a compiled engine without an artifact tries in turn, keeping the first whose memory plan
    fits (docs/prefill.md): :data:`~ds4c.buckets.DEFAULT_PREFILL_CHUNKS` no longer than ``max_ctx``, then fewer (the
    largest dropped first), then none (verify steps). E.g. 4096 -> ``[(256, 2048), (256,), ()]``."""
    fit = tuple(c for c in DEFAULT_PREFILL_CHUNKS if c <= max_ctx)
    return [fit[:n] for n in range(len(fit), 0, -1)] + [()]


def fit_prefill_chunks(mf: ModelFile, device: str, devices: Any, layer_split: Any, buckets: BucketSpec, arch: str,
                       tries: list[tuple[int, ...]], progress: bool = True) -> tuple[tuple[int, ...], Any, Any, Any]:
    """The first chunk set of ``tries`` (:func:`default_prefill_tries`, or one explicit set) whose chunk graphs lower
    for ``arch`` and whose memory plan fits: ``(chunks, parts, shard plan, memory plan)``. With several tries (the
    defaults), chunk graphs with a plan kernel no family lowers for this file and target (e.g. expert weights the
    grouped GEMM has no decoder for, or a target it does not build) are dropped with one stderr line and prompts run
    as verify steps; the last try prints its memory plan.

    Raises:
        LoweringError: an explicit chunk set (a single try) whose chunk graphs do not lower.
        ShardPlanError: the last try does not fit.
    """
    from ds4c.runtime.lowered import LoweringError
    from ds4c.runtime.memory_plan import plan_parts

    i, refused = 0, False
    while True:
        chunks, last = tries[i], i == len(tries) - 1
        try:
            parts = plan_parts(mf, buckets, arch, prefill_chunks=chunks)
        except LoweringError as e:
            if last or not chunks:
                raise
            if progress:
                print(f"prefill chunks {list(chunks)}: not built for {arch} ({e}); prompts run as verify steps",
                      file=sys.stderr)
            i, refused = len(tries) - 1, True  # the same weights and target refuse every size: straight to none
            continue
        plan = shard_plan(mf, device, devices, layer_split, buckets, parts=parts)
        try:
            mplan = check_memory(mf, buckets, plan, arch, parts=parts, progress=progress and last)
        except ShardPlanError:
            if last:
                raise
            i += 1
            continue
        if progress and not last:
            print(mplan.describe(), file=sys.stderr)
        if progress and i and not refused:
            print(f"prefill chunks {list(chunks) or 'none'}: the default {list(tries[0])} do not fit the memory "
                  "plan", file=sys.stderr)
        return chunks, parts, plan, mplan


def open_engine(mf: ModelFile, device: str = "cpu", engine: str = "auto", artifact: str | os.PathLike | None = None,
                max_ctx: int | None = 4096, quant_emulation: bool = True, threads: int | None = None,
                dataflow: str = "bf16", prepare: bool = True, progress: bool = True,
                devices: str | list[str] | None = None, layer_split: str | list[int] | None = None,
                taps: tuple[int, ...] = (), record_hc: bool = False, prefill_chunks: Any = None,
                draft: Drafter | None = None) -> Any:
    """Open the stepper that runs ``mf`` on ``device``.

    Args:
        mf: the opened model file. With ``quant_emulation=False`` and the compiled engine, ``mf.config`` is
            replaced by the config without emulation (the compiled step reads the config from the file object).
        device: ``"cpu"`` or ``"cuda"``.
        engine: ``"auto"``, ``"reference"`` or ``"compiled"`` (see the module docstring).
        artifact: compiled engine only: a ``ds4c compile`` folder; its buckets (``manifest_buckets``) are
            served, so nothing is compiled and the context is the artifact's ``max_ctx``.
        max_ctx: positions the sequence state holds (the reference's ``max_ctx``; the compiled step's buckets
            cover it). ``None``: the artifact's ``max_ctx`` with an artifact, else 4096, at most the model's
            context length. With an artifact a larger value than the artifact's is an error.
        quant_emulation: activation FP8, KV FP8 and indexer FP4 emulation (spec); off for comparing with ports.
        threads: ``torch.set_num_threads`` for the CPU reference (process-wide); ``None`` leaves torch's setting.
        prepare: compiled engine: make every (width, bucket) graph up to ``max_ctx`` ready before returning
            (compiled, loaded, weights uploaded, captured: ``CompiledStep.prepare_all``; its timings are the
            step's ``prepare_stats``), so nothing is compiled or captured once generation starts.
        progress: print the compile line and progress bars of that preparation to stderr.
        draft: the drafter that will run on the engine (:class:`~ds4c.engine_protocol.Drafter`): what it needs
            (its ``needs``: taps, the final HC state) is resolved here (:func:`resolve_needs`), so ``taps`` and
            ``record_hc`` need not be given.
        taps: compiled engine: the DSpark tap layers its graphs record (spec 5.2(q); a DSpark drafter file's
            ``taps``; default: those ``draft`` needs), read by the compiled drafter (``CompiledStep(taps=...)``);
            the reference records them on request.
        record_hc: compiled engine: its graphs record the final HC state (spec 7.5's ``X_main``) that the MTP
            drafter (``--draft mtp`` / ``mtp:PATH``, :class:`~ds4c.drafters.mtp.MTPDrafter`) reads
            (``CompiledStep(record_hc=True)``; of a layer split, the last shard; default: whether ``draft`` needs
            it); the unsplit reference records it on request (``Reference.record_final_hc``).
        dataflow: reference only: ``"bf16"`` (the spec) or ``"fp32"`` activations between operations (see
            :class:`~ds4c.reference.Reference`; for token-exact comparisons with ports).
        devices, layer_split: a layer split (:func:`shard_plan`): the stepper runs one shard per device entry,
            the HC state handed from shard to shard.
        prefill_chunks: compiled engine: the prefill chunk graphs' row counts (docs/prefill.md, e.g. ``(256, 2048)`` or
            ``"256,2048"``: :func:`~ds4c.buckets.check_prefill_chunks`); prompts are then prefilled in chunks
            (``CompiledStep.prefill``). Empty: verify steps. ``None`` (the default): with an ``artifact``, the
            chunk sizes it holds (``ds4c compile --prefill``; none when it was compiled without, or with taps,
            ``record_hc`` or a split asked for: chunk graphs serve none of those), so an artifact
            compiled with chunk graphs prefills with them without repeating the sizes; without an artifact,
            :data:`~ds4c.buckets.DEFAULT_PREFILL_CHUNKS` that fit ``max_ctx`` (none with a layer split), fewer
            (the smallest, then none, said on stderr with ``progress``) where the memory plan does not fit with
            them. With an artifact, sizes given explicitly must be among
            its chunk sizes (``ArtifactError`` naming both). The reference engine prefills token-wise (its verify
            steps) and refuses them.

    Returns:
        a :class:`~ds4c.reference.Reference` or a :class:`~ds4c.runtime.step.CompiledStep` (split:
        :class:`~ds4c.reference.sharded.ShardedReference`, :class:`~ds4c.runtime.sharded.ShardedStep`); its
        ``max_ctx`` is the context it serves (a split one's ``plan`` is its :class:`~ds4c.shard_plan.ShardPlan`).
        A compiled one's ``memory_plan`` is its :class:`~ds4c.runtime.memory_plan.MemoryPlan`, checked (and
        printed to stderr with ``progress``) before any weight was loaded (:func:`check_memory`).

    Raises:
        Ds4cError: an unknown device or engine, ``--device cuda`` without a CUDA device, ``--engine compiled`` on
            the cpu, an artifact with the reference engine, prefill chunks that :func:`check_prefill_request`
            refuses or with a layer split, chunks an artifact does not hold, a compiled step that does not fit its devices' free
            memory (``ShardPlanError`` naming the shortfall), ``dataflow="fp32"`` with the compiled engine or an
            unknown dataflow, ``threads`` < 1, ``max_ctx`` outside the model's
            context length or past the artifact's; and what the engines raise (a corrupt artifact, one that
            does not serve this model: ``ArtifactError``); needs of ``draft`` the engine cannot serve
            (:func:`resolve_needs`).
    """
    name = resolve_engine(device, engine, dataflow)
    if draft is not None:
        split = devices is not None or layer_split is not None
        taps, record_hc = resolve_needs(drafter_needs(draft), name, split, artifact, taps, record_hc,
                                        name=drafter_name(draft))
    chunks = check_prefill_request(prefill_chunks, device, engine, dataflow, artifact, taps, record_hc) or ()
    if threads is not None:
        cpus = len(os.sched_getaffinity(0))  # more threads than CPUs only slows the reference (and OpenMP
        # crashes at ~1e5)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= cpus:
            raise Ds4cError(f"threads (--threads) must be an int in 1..{cpus} (the CPUs this process may use), "
                            f"found {threads!r}")
    limit = mf.config.max_position
    if max_ctx is not None:
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or not 1 <= max_ctx <= limit:
            raise Ds4cError(f"max_ctx must be an int in 1..{limit} (the model's context length), found {max_ctx!r}")
    if name == "compiled":
        from ds4c.runtime.step import CompiledStep, device_arch

        cfg = mf.config if quant_emulation else mf.config.replace(quant_emulation=False)
        mf.config = cfg
        art = None
        if artifact is not None:
            from ds4c.runtime.artifact_manifest import manifest_buckets, manifest_prefill_chunks, open_artifact

            art = open_artifact(artifact)  # loaded and verified here only: the steps take it as it is
            man = art.manifest
            buckets = manifest_buckets(man)
            if max_ctx is not None and max_ctx > buckets.max_ctx:
                raise Ds4cError(f"max_ctx {max_ctx} exceeds the artifact's max_ctx {buckets.max_ctx} ({artifact}); "
                                f"compile the artifact with a larger --max-ctx or ask for less")
            if prefill_chunks is None and not (taps or record_hc or devices is not None or layer_split is not None):
                chunks = manifest_prefill_chunks(man)  # the artifact's chunk graphs (explicit: a subset, check_serves)
                if not chunks and progress:
                    print(f"{artifact}: no prefill chunk graphs (compiled without --prefill): prompts run as verify "
                          f"steps; `ds4c compile --prefill {','.join(map(str, DEFAULT_PREFILL_CHUNKS))}` adds them",
                          file=sys.stderr)
        else:
            buckets = BucketSpec.build(cfg, COMPILED_WIDTHS, min(max_ctx or 4096, limit))
        from ds4c.runtime.memory_plan import plan_parts

        arch = device_arch()
        if artifact is None and any(c > buckets.max_ctx for c in chunks):  # rows that could never fit
            long = [c for c in chunks if c > buckets.max_ctx]
            chunks = tuple(c for c in chunks if c <= buckets.max_ctx)
            if progress:
                print(f"prefill chunks {long}: longer than the context ({buckets.max_ctx} positions), not built; "
                      f"{'using ' + str(list(chunks)) if chunks else 'prompts run as verify steps'}", file=sys.stderr)
        tries = [chunks]
        if prefill_chunks is None and artifact is None and devices is None and layer_split is None:
            tries = default_prefill_tries(buckets.max_ctx)
        chunks, parts, plan, mplan = fit_prefill_chunks(mf, device, devices, layer_split, buckets, arch, tries,
                                                        progress)
        if plan is not None and plan.is_split:
            from ds4c.runtime.sharded import ShardedStep

            if chunks:
                raise Ds4cError("prefill chunks run on an unsplit compiled step; found a layer split "
                                f"({plan.describe()})")
            step = ShardedStep(mf, buckets, plan, arch, artifact=art, taps=tuple(taps), record_hc=bool(record_hc))
        else:
            step = CompiledStep(mf, buckets, arch, artifact=art, plan=plan, taps=tuple(taps),
                                record_hc=bool(record_hc), prefill_chunks=chunks)
        step.memory_plan = mplan
        if prepare:
            step.prepare_all(progress=progress)
        return step
    if artifact is not None:
        raise Ds4cError("--artifact is used only by the compiled engine (--device cuda, --engine auto|compiled)")
    from ds4c.reference import Reference, ReferenceWeights

    if threads is not None and device == "cpu":
        torch.set_num_threads(threads)
    plan = shard_plan(mf, device, devices, layer_split)
    ctx = min(max_ctx or 4096, limit)
    if plan is not None and plan.is_split:
        from ds4c.reference.sharded import ShardedReference

        return ShardedReference.load(mf, plan, max_ctx=ctx, dataflow=dataflow, quant_emulation=quant_emulation)
    weights = ReferenceWeights.load(mf, plan.devices[0] if plan is not None else device, dataflow=dataflow)
    if not quant_emulation:
        weights.config = weights.config.replace(quant_emulation=False)
    return Reference(weights, max_ctx=ctx, dataflow=dataflow)
