"""Ahead-of-time artifacts (design.md, "Who uses it" 1 and 3): every step graph of a bucket set (and, when asked,
every prefill chunk graph: issue 12, docs/prefill.md), lowered for every target, compiled through the kernel
cache, and published as one folder the runtime loads with no compiler present. Nothing here queries a device: the
targets are always explicit input.

The parts: this module builds (:func:`build_artifact`); :mod:`ds4c.runtime.artifact_manifest` holds the layout,
the manifest format, its integrity record and schema, and loads it checked; :mod:`ds4c.runtime.artifact_publish`
puts the finished folder in place atomically; :mod:`ds4c.runtime.artifact_serve` checks that an artifact serves a
model and pairs its binaries with the model's lowering; :mod:`ds4c.runtime.artifact_inspect` finds and disassembles
binaries for ``ds4c inspect``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ds4c.version import __version__
from ds4c.buckets import BucketSpec, check_prefill_chunks
from ds4c.config import Ds4Config
from ds4c.ir import build_step
from ds4c.ir.builder import check_taps
from ds4c.ir.printer import graph_hash
from ds4c.passes.manager import run_pipeline
from ds4c.runtime import lower
from ds4c.runtime.artifact_manifest import (MANIFEST, MANIFEST_FORMAT, ArtifactError, chunks_text,
                                            effective_weight_types, graph_key, integrity_record, manifest_text,
                                            prefill_keys, split_ranges, weight_formats, weight_types_hash)
from ds4c.runtime.artifact_publish import check_replaceable, clean_leftovers, publish
from ds4c.runtime.cache import KernelCache, _safe_name, canonical_json
from ds4c.runtime.lowered import LoweringError, describe
from ds4c.runtime.render import KernelSource
from ds4c.runtime.targets import Target
from ds4c.shard_plan import ShardPlan, validate
from ds4c.tempfiles import TMP_TAG, OwnedTemp
from ds4c.write_errors import write_error_text


def build_artifact(cfg: Ds4Config, targets: list[Target], buckets: BucketSpec, out_dir: str | os.PathLike,
                   cache: KernelCache, jobs: int | None = None, progress: bool = True,
                   weight_types: dict | None = None, layer_split: Iterable[int] | None = None,
                   taps: Iterable[int] = (), record_hc: bool = False, prefill_chunks: Iterable[int] = ()) -> Path:
    """Compile every step graph of ``buckets`` (and every prefill chunk graph of ``prefill_chunks``) for every
    target in ``targets`` and publish the artifact at ``out_dir`` (layout and manifest:
    :mod:`ds4c.runtime.artifact_manifest`). Returns ``out_dir`` as an absolute path.

    For each graph key ``(width, context)`` of ``buckets``: the default pipeline runs on
    ``build_step(cfg, width, buckets.contexts[-1])`` with ``context``; the result is lowered for each target
    (``ds4c.runtime.lower.lower_graph``); all rendered kernels are compiled by ``cache.compile_many`` with
    ``jobs`` threads (cache hits compile nothing; ``progress`` prints what is compiled and a progress bar to
    stderr). ``weight_types`` (``{tensor name: GGMLType}``, e.g. of a GGUF file; default: the official
    formats) picks the weight formats the kernels read; the manifest records them. ``layer_split`` (layers
    per shard, ``ds4c.shard_plan``) compiles every shard's graphs instead (keys ``s{k}_q{w}_c{c}``; the
    manifest's ``layer_split``), so the artifact serves that split only. ``taps`` (DSpark tap layers, spec 5.2(q))
    builds every graph with the tap kernel (``build_step(..., taps=...)``; the manifest's ``taps``), so the
    artifact serves a step with those taps only. ``record_hc`` (the final HC state of the MTP drafter, spec 7.5)
    builds every graph with ``build_step(..., record_hc=True)`` (the manifest's ``record_hc``), so the artifact
    serves a step that records it only. ``prefill_chunks`` (issue 12: chunk row counts C, e.g. ``(256, 2048)``;
    :func:`ds4c.buckets.check_prefill_chunks`) also compiles, per C and context bucket ``>= C``, the prefill chunk
    graph ``build_step(cfg, C, buckets.contexts[-1], prefill=True)`` (key ``p{C}_c{context}``; its kernels go
    through the same de-duplicated compile as the step graphs', so a source both use is compiled and stored once;
    the manifest's ``prefill_chunks``), so the artifact serves a ``CompiledStep(prefill_chunks=...)`` of those
    sizes or fewer. Never queries a device.

    Raises:
        StepError: taps that are not distinct layer ids of ``cfg``; prefill chunk sizes that are not distinct ints
            in ``MIN_PREFILL_CHUNK..MAX_PREFILL_ROWS``.
        ConfigError: ``buckets`` does not fit ``cfg``.
        ArtifactError: no target; prefill chunks longer than ``buckets.max_ctx`` or asked for with a layer split,
            taps or ``record_hc``; or ``out_dir`` exists and is not a ds4c artifact (nor an empty folder).
        LoweringError: a graph has a plan kernel with no lowering, e.g. a prefill chunk graph's routed experts
            while their C-row kernel is pending (``PendingLowering``; one line naming the graph key and the plan
            kernel; nothing is written, the previous artifact is left as it was).
        ToolchainError, CompileError: no compiler for a target, or a kernel failed to compile (the previous
            artifact at ``out_dir``, if any, is left as it was).
    """
    t0 = time.perf_counter()
    if not targets:
        raise ArtifactError("expected at least one target, e.g. --arch sm_90,gfx1151")
    buckets.validate(cfg)
    taps = check_taps(cfg, taps)
    chunks = check_prefill_chunks(prefill_chunks if isinstance(prefill_chunks, (str, list, tuple))
                                  else list(prefill_chunks))
    if chunks:
        counts = list(layer_split or ())
        others = [w for w, on in (("a layer split", len(counts) > 1), ("taps", bool(taps)),
                                  ("record_hc", bool(record_hc))) if on]
        if others:
            raise ArtifactError(f"prefill chunk graphs ({chunks_text(chunks)}) are compiled for the unsplit step "
                                f"without taps or record_hc (a drafter's tapped chunk graphs are built at start instead: "
                                f"generate --draft D --prefill C,C without --artifact); "
                                f"found {', '.join(others)}")
        long = [n for n in chunks if n > buckets.max_ctx]
        if long:
            raise ArtifactError(f"prefill chunk {long[0]} is longer than max_ctx {buckets.max_ctx}: its rows never "
                                f"fit the context; ask for chunks <= max_ctx or a larger max_ctx")
    out = Path(out_dir).expanduser().absolute()
    check_replaceable(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ArtifactError(f"cannot write the artifact {out}: a part of {out.parent} is a file, not a "
                            f"directory") from None
    try:  # a real probe (os.access says yes to root on read-only or virtual file systems such as /proc)
        OwnedTemp.create(out.parent, out.name, TMP_TAG, is_dir=True).discard()
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {out}: the folder {out.parent} is not writable "
                            f"({e.strerror or e})") from None
    clean_leftovers(out)

    # ---- pipeline + lowering
    split = None
    if layer_split is not None and len(list(layer_split)) > 1:
        counts = tuple(layer_split)
        split = list(validate(ShardPlan(("cuda",) * len(counts), counts), cfg.n_layers).layers)
    shards = split_ranges(cfg, split)
    keys = [(k, r, w, x) for k, r in shards for w, x in buckets.keys()]
    n_chunk = len(prefill_keys(chunks, buckets.contexts))
    _say(progress, f"lowering {len(keys)} graph{'s' * (len(keys) != 1)}"
                   + (f" + {n_chunk} prefill chunk graph{'s' * (n_chunk != 1)} (chunks {chunks_text(chunks)})"
                      if chunks else "") + f" for {', '.join(t.slug for t in targets)}")
    graphs: dict[str, dict[str, Any]] = {}
    lowered: dict[tuple[str, str], list] = {}  # (slug, graph key) -> [LoweredKernel]
    for shard, layers, width, context in keys:
        gk = graph_key(width, context, shard)
        g = run_pipeline(build_step(cfg, width, buckets.contexts[-1], layers, taps=taps, record_hc=record_hc),
                         "default", context=context).graph
        mem = dict(g.meta.get("memory", {}))
        graphs[gk] = {"width": width, "context": context, "graph_hash": graph_hash(g),
                      "arena_bytes": int(mem.get("arena_bytes", 0)), "memory": mem}
        if shard is not None:
            graphs[gk]["shard"], graphs[gk]["layers"] = shard, list(layers)
        for t in targets:
            lowered[(t.slug, gk)] = lower.lower_graph(g, cfg, t, weight_types)
    for rows, context in prefill_keys(chunks, buckets.contexts):
        gk = graph_key(rows, context, prefill=True)
        g = run_pipeline(build_step(cfg, rows, buckets.contexts[-1], prefill=True), "default", context=context).graph
        mem = dict(g.meta.get("memory", {}))
        graphs[gk] = {"width": rows, "context": context, "prefill": True, "graph_hash": graph_hash(g),
                      "arena_bytes": int(mem.get("arena_bytes", 0)), "memory": mem}
        for t in targets:
            try:
                lowered[(t.slug, gk)] = lower.lower_graph(g, cfg, t, weight_types)
            except LoweringError as e:  # one line naming the chunk graph (nothing is written yet)
                msg = f"prefill chunk graph {gk} ({rows} rows, context {context}) for {t.slug}: {e}"
                try:
                    err = type(e)(msg)
                except Exception:  # an error class with another constructor
                    err = LoweringError(msg)
                raise err from None

    # ---- compile (each distinct source once)
    uniq: dict[tuple, KernelSource] = {}
    for ks in lowered.values():
        for k in ks:
            for launch in k.launches:
                uniq.setdefault(_source_id(launch.kernel), launch.kernel)
    sources = list(uniq.values())
    entries = cache.compile_many(sources, jobs=jobs, progress=progress)
    entry_of = {sid: e for sid, e in zip(uniq, entries)}

    # ---- write into a temporary folder beside out_dir (owned: see ds4c.tempfiles), then swap it in
    owned = OwnedTemp.create(out.parent, out.name, TMP_TAG, is_dir=True)
    tmp = owned.path
    wtypes = effective_weight_types(cfg, weight_types)
    try:
        os.chmod(tmp, 0o755)
        tinfo: dict[str, dict[str, Any]] = {}
        for t in targets:
            tc = cache.toolchain_for(t)
            tinfo[t.slug] = {"vendor": t.vendor, "arch": t.arch, "wave": t.wave,
                             "toolchain": {"name": tc.name, "version": tc.version}, "graphs": {}, "binaries": {}}
        seen_keys: dict[tuple[str, str], bool] = {}  # (slug, key) -> compiled now
        n_plan = n_launch = 0
        for (slug, gk), ks in lowered.items():
            bins = tinfo[slug]["binaries"]
            kernels = []
            for k in ks:
                d = describe(k)
                for ld, launch in zip(d["launches"], k.launches):
                    e = entry_of[_source_id(launch.kernel)]
                    stem = f"{_safe_name(launch.kernel.name)}-{e.key[:12]}"
                    rel_bin = f"bin/{slug}/{stem}.{e.kind}"
                    if rel_bin not in bins:
                        rel_src = f"src/{slug}/{stem}{launch.kernel.ext}"
                        for rel, srcp in ((rel_bin, e.binary_path), (rel_src, e.source_path)):
                            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                            shutil.copyfile(srcp, tmp / rel)
                        b = e.meta["binary"]
                        bins[rel_bin] = {"key": e.key, "kind": e.kind, "bytes": int(b["bytes"]),
                                         "sha256": b["sha256"], "kernel": launch.kernel.name,
                                         "family": launch.kernel.family, "entry": launch.kernel.entry,
                                         "source": rel_src, "source_sha256": _sha256_file(tmp / rel_src),
                                         "weights": weight_formats(launch.args, wtypes),
                                         "resources": e.resources}
                        seen_keys[(slug, e.key)] = seen_keys.get((slug, e.key), False) or not e.hit
                    ld["binary"] = rel_bin
                    ld["key"] = e.key
                    n_launch += 1
                kernels.append(d)
                n_plan += 1
            g = graphs[gk]
            tinfo[slug]["graphs"][gk] = {"width": g["width"], "context": g["context"],
                                        **({"prefill": True} if g.get("prefill") else {}),
                                        "graph_hash": g["graph_hash"], "arena_bytes": g["arena_bytes"],
                                        "kernels": kernels}
            if "shard" in g:
                tinfo[slug]["graphs"][gk].update(shard=g["shard"], layers=g["layers"])
        compiled = sum(seen_keys.values())
        manifest = {
            "format": MANIFEST_FORMAT,
            "ds4c_version": __version__,
            "config": cfg.model_dict(), "config_hash": cfg.hash(),
            "buckets": buckets.as_dict(), "buckets_hash": buckets.hash(),
            "weight_types": wtypes, "weight_types_hash": weight_types_hash(wtypes),
            **({"layer_split": split} if split is not None else {}),
            **({"taps": list(taps)} if taps else {}),
            **({"record_hc": True} if record_hc else {}),
            **({"prefill_chunks": list(chunks)} if chunks else {}),
            "graphs": graphs,
            "targets": tinfo,
            "build": {"seconds": round(time.perf_counter() - t0, 3), "plan_kernels": n_plan, "launches": n_launch,
                      "unique_binaries": len(seen_keys), "compiled": compiled, "cached": len(seen_keys) - compiled,
                      "jobs": jobs or os.cpu_count() or 1},
        }
        manifest["integrity"] = integrity_record(manifest)
        (tmp / MANIFEST).write_text(manifest_text(manifest))
        publish(tmp, out)
    except OSError as e:  # a full disk: name the artifact, not the cache file a copy read (the previous one stays)
        raise ArtifactError(f"{write_error_text(e, f'the artifact {out}')}; nothing was written") from None
    finally:
        owned.discard()  # after the publication, only the previous artifact (if swapped here) or nothing
    return out


def _source_id(src: KernelSource) -> tuple:
    """Identity of a rendered kernel for de-duplication before keying (same source, params and names
    give the same cache key)."""
    return (src.target, src.name, src.family, src.entry, src.digest(), canonical_json(src.params))


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()
