"""Ahead-of-time artifacts (design.md, "Who uses it" 1 and 3): every step graph of a bucket set (and, when asked,
every prefill chunk graph: issue 12, docs/prefill.md), lowered for every target, compiled through the kernel cache, and published as one folder the runtime loads with no
compiler present. Nothing here queries a device: the targets are always explicit input.

Layout of an artifact folder::

    manifest.json
    bin/<vendor>-<arch>/<kernel-name>-<hash12>.<cubin|hsaco>   one file per distinct cache key
    src/<vendor>-<arch>/<kernel-name>-<hash12>.<cu|hip>        its rendered source

``hash12`` is the first 12 hex digits of the kernel's cache key (:func:`ds4c.runtime.cache.cache_key`), so a
kernel that many layers (or graphs) share is stored once.

``manifest.json`` (format :data:`MANIFEST_FORMAT`; compact JSON; targets in the order given, graphs in
``BucketSpec.keys()`` order, kernels in launch order; ``ds4c inspect`` is the readable view)::

    format, ds4c_version
    config, config_hash                  Ds4Config.model_dict() and Ds4Config.hash()
    buckets, buckets_hash                BucketSpec.as_dict() and BucketSpec.hash()
    weight_types, weight_types_hash      {tensor name: GGML type name} the kernels read (default: official)
    taps                                 (only when compiled with taps) the DSpark tap layers every graph records
                                         (spec 5.2(q); ``build_step(..., taps=...)``), in main_hidden order
    record_hc                            (only when compiled with it: true) every graph holding the last layer
                                         records the final HC state for the MTP drafter (spec 7.5;
                                         ``build_step(..., record_hc=True)``)
    prefill_chunks                       (only when compiled with them: ``ds4c compile --prefill 256,2048``) the
                                         prefill chunk sizes C, ascending, each in MIN_PREFILL_CHUNK..max_ctx; the
                                         artifact then also holds one chunk graph per C and context bucket >= C
                                         (``build_step(..., prefill=True)``, key ``p<C>_c<context>``)
    graphs:  {"q<w>_c<context>": {width, context, graph_hash, arena_bytes, memory},
              "p<C>_c<context>": {width (= C, the chunk's rows), context, prefill: true, graph_hash, ...}}
             (target-independent: the pipelined graph's printer hash and its memory plan, meta["memory"]; step
             graphs first, in ``BucketSpec.keys()`` order, then the chunk graphs, by C then context)
    targets: {"<vendor>-<arch>": {vendor, arch, wave, toolchain: {name, version},
              graphs: {"q<w>_c<context>": {width, context, graph_hash, arena_bytes,
                       kernels: [describe(k) whose launches also have "binary" (path in the artifact) and
                                 "key" (full cache key)]}},
              binaries: {"bin/<slug>/<name>-<hash12>.<kind>": {key, kind, bytes, sha256, kernel, family,
                         entry, source, source_sha256, weights, resources}}}}
    build:   {seconds, plan_kernels, launches, unique_binaries, compiled, cached}
    integrity: {algorithm, fields: {top-level field: sha256 of its canonical JSON}, digest}   (always last)

A binary's ``weights`` lists the format each weight argument of its launches is read in (:func:`weight_formats`:
the stored GGML type for weights the kernel decodes itself, F32/BF16/I64 for weights converted on upload), so a
binary rendered for BF16 weights can never be paired with a model that stores MXFP4.

An artifact serves a model only when the config hash, the bucket spec, the taps, ``record_hc`` and the
weight-format table all match, it holds the chunk graphs of every prefill chunk size the caller asks for, and
every binary's recorded formats are those its launches read in the model (:func:`check_serves`, which
``ds4c inspect DIR --model FILE`` runs without a GPU, and the runtime before it loads anything). The manifest
is checked unchanged on every load (:func:`load_manifest`): each top-level field against its digest, the text
byte for byte, then the type, range, hash and cross-reference of every field the runtime reads.

Publication is atomic: the artifact is written into ``<out_dir>.tmp-<pid>-<host>-<random>`` beside ``out_dir``
(locked by the build while it lives, :mod:`ds4c.tempfiles`), then swapped with the old ``out_dir`` in one step
(``renameat2(RENAME_EXCHANGE)``) and the old one deleted; where the file system cannot swap, the old one is
renamed aside to ``<out_dir>.old-<pid>-<host>-<random>/a`` first. A build killed at any moment (SIGKILL
included) leaves the previous complete artifact or the new complete one at ``out_dir``; its temporaries are
removed (and, when the fallback swap was cut between its two renames, the old artifact is put back) by the next
build into the same folder.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ds4c import __version__
from ds4c.buckets import BucketSpec
from ds4c.config import Ds4Config
from ds4c.errors import Ds4cError
from ds4c.runtime.cache import KernelCache, _safe_name, canonical_json
from ds4c.runtime.render import KernelSource
from ds4c.runtime.targets import Target
from ds4c.runtime.toolchain import find_cuda_tool as _find_cuda_tool, is_valid_binary
from ds4c.tempfiles import TMP_TAG, OwnedTemp, remove_stale
from ds4c.write_errors import write_error_text

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
_TMP_TAG = TMP_TAG
_OLD_TAG = ".old-"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FORMS = ("raw", "f32", "bf16", "i64")
_ARG_KINDS = ("value", "weight", "step", "workspace", "int")


class ArtifactError(Ds4cError):
    """An artifact folder is missing, incomplete, corrupt, of another ds4c version, or cannot be written
    where asked; or a graph, target or kernel asked of it does not exist."""


def graph_key(width: int, context: int, shard: int | None = None, prefill: bool = False) -> str:
    """The manifest key of the step graph of verify width ``width`` and context bucket ``context``
    (``q5_c4096``); of shard ``shard`` of a layer split: ``s1_q5_c4096``; with ``prefill``, of the prefill chunk
    graph of ``width`` = C rows: ``p256_c4096`` (chunk graphs are unsplit: ``shard`` must be None)."""
    if prefill:
        if shard is not None:
            raise ArtifactError(f"graph_key: a prefill chunk graph has no shard, found shard {shard}")
        return f"p{width}_c{context}"
    return f"q{width}_c{context}" if shard is None else f"s{shard}_q{width}_c{context}"


def prefill_keys(chunks: Iterable[int], contexts: Iterable[int]) -> list[tuple[int, int]]:
    """``[(C, context)]`` of the prefill chunk graphs an artifact (or a ``CompiledStep``) holds for chunk sizes
    ``chunks`` and context buckets ``contexts``: every chunk size with every context bucket >= it (a chunk's rows
    must fit its context), by C then context."""
    ctx = list(contexts)
    return [(n, c) for n in chunks for c in ctx if n <= c]


def manifest_prefill_chunks(man: dict[str, Any]) -> tuple[int, ...]:
    """The prefill chunk sizes an artifact holds chunk graphs for (ascending; empty when compiled without
    ``--prefill``), from a :func:`load_manifest` result."""
    return tuple(man.get("prefill_chunks", ()))


def _chunks_text(chunks: Iterable[int]) -> str:
    return ",".join(map(str, chunks))


def split_ranges(cfg: Ds4Config, layer_split: Iterable[int] | None) -> list[tuple[int | None, tuple[int, int] | None]]:
    """``[(shard index, layer range)]`` of an artifact's layer split (``[(None, None)]`` unsplit: one split of one
    shard is the unsplit step)."""
    counts = list(layer_split or ())
    if len(counts) <= 1:
        return [(None, None)]
    out, a = [], 0
    for k, n in enumerate(counts):
        out.append((k, (a, a + n)))
        a += n
    return out


def manifest_keys(man: dict[str, Any]) -> list[str]:
    """Every graph key an artifact must have, in manifest order: per shard of its layer split (if any), per
    (width, context); then per prefill chunk size and context bucket >= it (:func:`prefill_keys`)."""
    b = man["buckets"]
    split = man.get("layer_split")
    shards = [None] if not split or len(split) <= 1 else list(range(len(split)))
    steps = [graph_key(w, x, k) for k in shards for w in b["widths"] for x in b["contexts"]]
    return steps + [graph_key(n, x, prefill=True) for n, x in prefill_keys(man.get("prefill_chunks", ()),
                                                                           b["contexts"])]


def _lower_graph(g: Any, cfg: Ds4Config, target: Target, weight_types: dict | None) -> list:
    from ds4c.runtime import lower

    fn = getattr(lower, "lower_graph", None)
    if fn is None:
        raise ArtifactError("ds4c.runtime.lower.lower_graph is not available in this build of ds4c")
    return fn(g, cfg, target) if weight_types is None else fn(g, cfg, target, weight_types)


def effective_weight_types(cfg: Ds4Config, weight_types: dict | None = None) -> dict[str, str]:
    """``{tensor name: GGML type name}`` the kernels are compiled for: ``weight_types`` (e.g. a GGUF file's
    ``{name: mf.ggml_type(name)}``) or, when None, the official formats of ``cfg``."""
    from ds4c.tensors import storage_types

    types = weight_types or storage_types(cfg, "official")
    return {k: getattr(v, "name", str(v)) for k, v in sorted(types.items())}


def weight_types_hash(types: dict[str, str]) -> str:
    """sha256 of the canonical JSON of :func:`effective_weight_types`' result."""
    return hashlib.sha256(canonical_json(types).encode()).hexdigest()


def weight_formats(args: Iterable[Any], types: dict[str, str]) -> list[str]:
    """The format each weight argument of one launch is read in, in argument order: the stored GGML type name
    (from ``types``, ``{tensor name: type name}``; ``"absent"`` when the tensor is not there) for ``raw``
    weights, whose bytes the kernel decodes itself; ``F32`` / ``BF16`` / ``I64`` for weights the runtime converts
    on upload (the kernel then does not depend on the stored type). ``args`` are :class:`~ds4c.runtime.lower.Arg`
    objects or their manifest records (dicts with ``kind``, ``name``, ``form``)."""
    out = []
    for a in args:
        kind, name, form = (a.get("kind"), a.get("name"), a.get("form")) if isinstance(a, dict) else \
            (a.kind, a.name, a.form)
        if kind == "weight":
            form = form or "f32"
            out.append(types.get(name, "absent") if form == "raw" else form.upper())
    return out


def first_format_difference(expected: dict[str, str], found: dict[str, str]) -> tuple[str, str, str, int] | None:
    """``(tensor, expected type, found type, number of tensors that differ)`` of the first tensor (by name) whose
    format differs between two ``{tensor name: GGML type name}`` tables (``"absent"`` where one lacks it), or
    None when they are equal."""
    names = sorted(set(expected) | set(found))
    diff = [n for n in names if expected.get(n) != found.get(n)]
    if not diff:
        return None
    n = diff[0]
    return n, expected.get(n, "absent"), found.get(n, "absent"), len(diff)


def _source_id(src: KernelSource) -> tuple:
    """Identity of a rendered kernel for de-duplication before keying (same source, params and names
    give the same cache key)."""
    return (src.target, src.name, src.family, src.entry, src.digest(), canonical_json(src.params))


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def build_artifact(cfg: Ds4Config, targets: list[Target], buckets: BucketSpec, out_dir: str | os.PathLike,
                   cache: KernelCache, jobs: int | None = None, progress: bool = True,
                   weight_types: dict | None = None, layer_split: Iterable[int] | None = None,
                   taps: Iterable[int] = (), record_hc: bool = False, prefill_chunks: Iterable[int] = ()) -> Path:
    """Compile every step graph of ``buckets`` (and every prefill chunk graph of ``prefill_chunks``) for every
    target in ``targets`` and publish the artifact at ``out_dir`` (layout and manifest: module docstring).
    Returns ``out_dir`` as an absolute path.

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
    from ds4c.ir import build_step
    from ds4c.ir.printer import graph_hash
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import describe

    from ds4c.ir.builder import check_taps
    from ds4c.buckets import check_prefill_chunks

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
            raise ArtifactError(f"prefill chunk graphs ({_chunks_text(chunks)}) are compiled for the unsplit step "
                                f"without taps or record_hc (a drafter's tapped chunk graphs are built at start instead: "
                                f"generate --draft D --prefill C,C without --artifact); "
                                f"found {', '.join(others)}")
        long = [n for n in chunks if n > buckets.max_ctx]
        if long:
            raise ArtifactError(f"prefill chunk {long[0]} is longer than max_ctx {buckets.max_ctx}: its rows never "
                                f"fit the context; ask for chunks <= max_ctx or a larger max_ctx")
    out = Path(out_dir).expanduser().absolute()
    _check_replaceable(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ArtifactError(f"cannot write the artifact {out}: a part of {out.parent} is a file, not a "
                            f"directory") from None
    try:  # a real probe (os.access says yes to root on read-only or virtual file systems such as /proc)
        OwnedTemp.create(out.parent, out.name, _TMP_TAG, is_dir=True).discard()
    except OSError as e:
        raise ArtifactError(f"cannot write the artifact {out}: the folder {out.parent} is not writable "
                            f"({e.strerror or e})") from None
    _clean_leftovers(out)

    # ---- pipeline + lowering
    split = None
    if layer_split is not None and len(list(layer_split)) > 1:
        from ds4c.shard_plan import ShardPlan, validate

        counts = tuple(layer_split)
        split = list(validate(ShardPlan(("cuda",) * len(counts), counts), cfg.n_layers).layers)
    shards = split_ranges(cfg, split)
    keys = [(k, r, w, x) for k, r in shards for w, x in buckets.keys()]
    n_chunk = len(prefill_keys(chunks, buckets.contexts))
    _say(progress, f"lowering {len(keys)} graph{'s' * (len(keys) != 1)}"
                   + (f" + {n_chunk} prefill chunk graph{'s' * (n_chunk != 1)} (chunks {_chunks_text(chunks)})"
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
            lowered[(t.slug, gk)] = _lower_graph(g, cfg, t, weight_types)
    for rows, context in prefill_keys(chunks, buckets.contexts):
        from ds4c.runtime.lower import LoweringError

        gk = graph_key(rows, context, prefill=True)
        g = run_pipeline(build_step(cfg, rows, buckets.contexts[-1], prefill=True), "default", context=context).graph
        mem = dict(g.meta.get("memory", {}))
        graphs[gk] = {"width": rows, "context": context, "prefill": True, "graph_hash": graph_hash(g),
                      "arena_bytes": int(mem.get("arena_bytes", 0)), "memory": mem}
        for t in targets:
            try:
                lowered[(t.slug, gk)] = _lower_graph(g, cfg, t, weight_types)
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
    owned = OwnedTemp.create(out.parent, out.name, _TMP_TAG, is_dir=True)
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
        manifest["integrity"] = _integrity(manifest)
        (tmp / MANIFEST).write_text(_manifest_text(manifest))
        _publish(tmp, out)
    except OSError as e:  # a full disk: name the artifact, not the cache file a copy read (the previous one stays)
        raise ArtifactError(f"{write_error_text(e, f'the artifact {out}')}; nothing was written") from None
    finally:
        owned.discard()  # after the publication, only the previous artifact (if swapped here) or nothing
    return out


def _sha256_file(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _manifest_text(man: dict[str, Any]) -> str:
    """The exact text of ``manifest.json`` (compact JSON in key order, one trailing newline)."""
    return json.dumps(man, separators=(",", ":")) + "\n"


def _ordered_json(v: Any) -> str:
    """Compact JSON keeping key order (so a reordering changes the digest, unlike ``canonical_json``)."""
    return json.dumps(v, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _integrity(man: dict[str, Any]) -> dict[str, Any]:
    """The manifest's record of its own content: per top-level field (in file order) the sha256 of its compact
    JSON in key order, and the sha256 of that list of field digests (``digest``)."""
    fields = {k: hashlib.sha256(_ordered_json(v).encode()).hexdigest() for k, v in man.items() if k != "integrity"}
    return {"algorithm": _INTEGRITY_ALGORITHM, "fields": fields,
            "digest": hashlib.sha256(_ordered_json(fields).encode()).hexdigest()}


_INTEGRITY_ALGORITHM = "sha256 of the compact key-ordered JSON of each top-level field"


# -------------------------------------------------------------------------------------------- publication
def _is_artifact_dir(p: Path) -> bool:
    return p.is_dir() and (p / MANIFEST).is_file()


def _check_replaceable(out: Path) -> None:
    """``out`` may be replaced: absent, an empty folder, or a ds4c artifact (never some other folder)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a folder: choose another output folder (-o)")
    if not _is_artifact_dir(out) and any(out.iterdir()):
        raise ArtifactError(f"{out} exists and is not a ds4c artifact (no {MANIFEST}); refusing to replace it: "
                            f"remove it or choose another output folder (-o)")


def _clean_leftovers(out: Path) -> None:
    """Remove what killed builds into ``out`` left behind (temporary and set-aside folders whose owner is gone,
    :mod:`ds4c.tempfiles`); if one died between the two renames of the fallback swap (``out`` gone, the previous
    artifact set aside), put the previous artifact back first."""

    def rescue(p: Path) -> bool:
        if p.name.startswith(out.name + _OLD_TAG) and not out.exists() and _is_artifact_dir(p / "a"):
            try:
                os.rename(p / "a", out)
            except OSError:
                pass
        return False

    remove_stale(out.parent, out.name, (_OLD_TAG, _TMP_TAG), keep=rescue)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the folders ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). Returns False
    when this system or file system cannot (then the caller falls back to two renames).

    Raises:
        OSError: the swap failed for another reason (e.g. ``b`` vanished: FileNotFoundError).
    """
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _publish(tmp: Path, out: Path) -> None:
    """Put ``tmp`` in place as ``out``. When ``out`` exists, the two are swapped in one atomic step, so ``out``
    is at every moment the old or the new complete artifact, and the old one (now at ``tmp``) is deleted with
    it. Where the system cannot swap atomically: ``out`` is renamed aside into ``<out>.old-<owner>/a``, ``tmp``
    renamed in, and the old one deleted; a kill between those two renames is repaired by the next build
    (:func:`_clean_leftovers`)."""
    for _ in range(10):
        old: OwnedTemp | None = None
        if out.exists() or out.is_symlink():
            _check_replaceable(out)
            try:
                if _exchange(tmp, out):
                    shutil.rmtree(tmp, ignore_errors=True)  # the previous artifact
                    return
            except FileNotFoundError:  # another build moved it meanwhile
                continue
            old = OwnedTemp.create(out.parent, out.name, _OLD_TAG, is_dir=True)
            try:
                os.rename(out, old.path / "a")  # rename into a fresh folder: no clash with another build
            except FileNotFoundError:  # another build moved it meanwhile
                old.discard()
                old = None
        try:
            os.rename(tmp, out)
        except OSError:
            if old is not None:  # put the previous artifact back, unless someone published meanwhile
                try:
                    os.rename(old.path / "a", out)
                except OSError:
                    pass
                old.discard()
            if out.exists():
                continue  # another build published between our renames: replace theirs
            raise
        if old is not None:
            old.discard()
        return
    raise ArtifactError(f"cannot publish the artifact at {out}: another build keeps replacing it")


# ------------------------------------------------------------------------------------------------ loading
def load_manifest(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """The parsed ``manifest.json`` of the artifact folder ``path``, checked complete and unchanged.

    Checked, in order: the manifest parses; it was written by this ds4c version (and manifest format); it was
    not changed after it was written (each top-level field against its digest in ``integrity``, then the
    text byte for byte against the form ds4c writes); every field the runtime reads has the expected type and
    range, every hash equals its recomputation from the field it covers, and every reference (a launch's
    binary, a binary's source, a target's graphs) points at an entry that exists; every binary and source it
    lists exists with its recorded size (with ``verify``: also their sha256, and the binary is a valid ELF of its
    kind).

    Raises:
        ArtifactError: a missing folder or manifest, a corrupt or edited manifest, a manifest of another ds4c
            version, or a listed binary or source missing or not as recorded. The message is one line that
            names the file and field and says to rebuild with ``ds4c compile``.
    """
    d = Path(path)
    if not d.is_dir():
        raise ArtifactError(f"no artifact folder at {d} (build one with `ds4c compile ... -o {d}`)")
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{d} is not a ds4c artifact: {MANIFEST} is missing (build one with `ds4c compile`)")
    try:
        text = mpath.read_bytes().decode("utf-8")
        man = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArtifactError(f"corrupt artifact manifest {mpath}: {msg}; rebuild it with `ds4c compile`") from None
    if not isinstance(man, dict):
        raise ArtifactError(f"corrupt artifact manifest {mpath}: expected a JSON object, found "
                            f"{type(man).__name__}; rebuild it with `ds4c compile`")
    ver = man.get("ds4c_version")
    if ver != __version__:
        by = f"ds4c {_short(ver)}" if isinstance(ver, str) else "an unknown ds4c version (no ds4c_version field)"
        raise ArtifactError(f"artifact {d} was built by {by}, this is ds4c {__version__}: rebuild it "
                            f"with `ds4c compile`")
    if type(man.get("format")) is not int or man.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"artifact {d} has manifest format {_short(man.get('format'))}, this ds4c reads format "
                            f"{MANIFEST_FORMAT}: rebuild it with `ds4c compile`")
    need = ("config", "config_hash", "buckets", "buckets_hash", "weight_types", "weight_types_hash", "graphs",
            "targets", "build", "integrity")
    missing = [k for k in need if k not in man]
    if missing:
        raise ArtifactError(f"corrupt artifact manifest {mpath}: missing {', '.join(missing)}; rebuild it with "
                            f"`ds4c compile`")
    _check_integrity(man, text, mpath)
    _validate(man, mpath)
    for slug, t in man["targets"].items():
        for rel, b in t["binaries"].items():
            for f_rel, size, sha, what in ((rel, b["bytes"], b["sha256"], "binary"),
                                           (b["source"], None, b["source_sha256"], "source")):
                f = d / f_rel
                if not f.is_file():
                    raise ArtifactError(f"artifact {d} is incomplete: {what} {f_rel} ({b['kernel']} for {slug}) "
                                        f"is missing; rebuild it with `ds4c compile`")
                if size is not None and f.stat().st_size != size:
                    raise ArtifactError(f"artifact {d}: binary {f_rel} has {f.stat().st_size} bytes, the manifest "
                                        f"says {size}; rebuild it with `ds4c compile`")
                if verify:
                    data = f.read_bytes()
                    if hashlib.sha256(data).hexdigest() != sha or (what == "binary"
                                                                    and not is_valid_binary(data, b["kind"])):
                        raise ArtifactError(f"artifact {d}: {what} {f_rel} does not match its manifest entry "
                                            f"(sha256{' or ELF header' if what == 'binary' else ''}); rebuild it "
                                            f"with `ds4c compile`")
    return man


def _short(v: Any, n: int = 60) -> str:
    """``v`` for a message: printable strings as they are, anything else as its repr; at most ``n`` chars."""
    r = v if isinstance(v, str) and v.isprintable() else repr(v)
    return r if len(r) <= n else r[: n - 3] + "..."


def _changed(mpath: Path, what: str) -> ArtifactError:
    return ArtifactError(f"{mpath.name} was changed after it was written: {what} ({mpath}); rebuild the artifact "
                         f"with `ds4c compile`")


def _check_integrity(man: dict[str, Any], text: str, mpath: Path) -> None:
    rec = man["integrity"]
    if not (isinstance(rec, dict) and list(rec) == ["algorithm", "fields", "digest"]
            and rec["algorithm"] == _INTEGRITY_ALGORITHM and isinstance(rec["fields"], dict)
            and isinstance(rec["digest"], str)):
        raise _changed(mpath, "its integrity record is not the one ds4c writes")
    fields = rec["fields"]
    try:
        recorded = hashlib.sha256(_ordered_json(fields).encode()).hexdigest()
        now = _integrity(man)["fields"]
    except ValueError:  # NaN / Infinity, which ds4c never writes
        raise _changed(mpath, "it holds NaN or Infinity") from None
    if recorded != rec["digest"]:
        raise _changed(mpath, "its integrity record was edited")
    for k in list(now) + [k for k in fields if k not in now]:
        if k not in fields:
            raise _changed(mpath, f"field {_short(k, 40)} was added")
        if k not in now:
            raise _changed(mpath, f"field {_short(k, 40)} was removed")
        if fields[k] != now[k]:
            raise _changed(mpath, f"field {k!r} differs from what was written")
    if list(fields) != list(now):
        raise _changed(mpath, "its top-level fields were reordered")
    if text != _manifest_text(man):
        raise _changed(mpath, "its text is not byte for byte what ds4c wrote (reformatted or re-encoded)")


class _Schema:
    """Type and range checks of manifest fields; the first failure is an ArtifactError naming the field."""

    def __init__(self, mpath: Path):
        self.mpath = mpath

    def fail(self, where: str, expected: str, found: Any) -> None:
        raise ArtifactError(f"invalid artifact manifest {self.mpath}: {where}: expected {expected}, found "
                            f"{_short(found)}; rebuild it with `ds4c compile`")

    def obj(self, v: Any, where: str, keys: Iterable[str] = ()) -> dict:
        if not isinstance(v, dict):
            self.fail(where, "an object", v)
        for k in keys:
            if k not in v:
                self.fail(f"{where}.{k}", "a value", "nothing")
        return v

    def number(self, v: Any, where: str) -> float:
        if type(v) not in (int, float) or not v >= 0:
            self.fail(where, "a number >= 0", v)
        return v

    def integer(self, v: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            self.fail(where, f"an integer in {lo}..{'' if hi is None else hi}", v)
        return v

    def string(self, v: Any, where: str, pattern: re.Pattern | None = None, choices: tuple = ()) -> str:
        if not isinstance(v, str) or (pattern is not None and not pattern.fullmatch(v)) or \
                (choices and v not in choices):
            self.fail(where, f"one of {list(choices)}" if choices else
                      f"a string matching {pattern.pattern}" if pattern is not None else "a string", v)
        return v

    def integers(self, v: Any, where: str, n: int | None = None, lo: int = 0, hi: int | None = None) -> list[int]:
        if not isinstance(v, list) or not v or (n is not None and len(v) != n):
            self.fail(where, f"a list of {n or 'one or more'} integers", v)
        return [self.integer(x, f"{where}[{i}]", lo, hi) for i, x in enumerate(v)]

    def hash(self, v: Any, where: str, of: Any) -> None:
        """``v`` is the sha256 of ``json.dumps(of, sort_keys=True)`` (as Ds4Config.hash / BucketSpec.hash)."""
        self.string(v, where, _HEX64)
        want = hashlib.sha256(json.dumps(of, sort_keys=True).encode()).hexdigest()
        if v != want:
            self.fail(where, f"the sha256 of the field it covers ({want[:12]}...)", v)


def _validate(man: dict[str, Any], mpath: Path) -> None:
    """Every field the runtime and ``ds4c inspect`` read: types, ranges, recomputed hashes, references."""
    from ds4c.quant import GGMLType

    c = _Schema(mpath)
    c.obj(man["config"], "config", ("name", "n_layers", "hidden_size", "vocab_size"))
    c.hash(man["config_hash"], "config_hash", man["config"])
    b = c.obj(man["buckets"], "buckets", ("widths", "contexts", "max_ctx"))
    widths = c.integers(b["widths"], "buckets.widths", lo=1, hi=5)
    contexts = c.integers(b["contexts"], "buckets.contexts", lo=1)
    c.integer(b["max_ctx"], "buckets.max_ctx", 1, contexts[-1])
    if widths != sorted(set(widths)) or contexts != sorted(set(contexts)):
        c.fail("buckets", "increasing widths and contexts", b)
    c.hash(man["buckets_hash"], "buckets_hash", b)
    wt = c.obj(man["weight_types"], "weight_types")
    type_names = tuple(t.name for t in GGMLType)
    for k, v in wt.items():
        c.string(v, f"weight_types[{_short(k, 40)}]", choices=type_names)
    c.string(man["weight_types_hash"], "weight_types_hash", _HEX64)
    if man["weight_types_hash"] != weight_types_hash(wt):
        c.fail("weight_types_hash", "the sha256 of weight_types", man["weight_types_hash"])
    split = man.get("layer_split")
    ranges: dict[int, list[int]] = {}
    if split is not None:
        counts = c.integers(split, "layer_split", lo=1)
        if len(counts) < 2 or sum(counts) != man["config"]["n_layers"]:
            c.fail("layer_split", f"at least 2 layer counts summing to n_layers = {man['config']['n_layers']}", split)
        a = 0
        for k, n in enumerate(counts):
            ranges[k] = [a, a + n]
            a += n
    if "taps" in man:
        taps = c.integers(man["taps"], "taps", lo=0, hi=man["config"]["n_layers"] - 1)
        if not taps or len(set(taps)) != len(taps):
            c.fail("taps", "a non-empty list of distinct layer ids", taps)
    if "record_hc" in man and man["record_hc"] is not True:
        c.fail("record_hc", "true (absent: not recorded)", man["record_hc"])
    if "prefill_chunks" in man:
        from ds4c.buckets import MIN_PREFILL_CHUNK

        chunks = c.integers(man["prefill_chunks"], "prefill_chunks", lo=MIN_PREFILL_CHUNK, hi=b["max_ctx"])
        if chunks != sorted(set(chunks)):
            c.fail("prefill_chunks", "increasing chunk sizes", chunks)
        if split is not None or "taps" in man or "record_hc" in man:
            c.fail("prefill_chunks", "no layer_split, taps or record_hc with them (chunk graphs are unsplit, "
                   "without taps)", [k for k in ("layer_split", "taps", "record_hc") if k in man])
    keys = manifest_keys(man)
    graphs = c.obj(man["graphs"], "graphs")
    if list(graphs) != keys:
        c.fail("graphs", f"the graphs of the buckets {keys}", list(graphs))
    for gk, g in graphs.items():
        c.obj(g, f"graphs.{gk}", ("width", "context", "graph_hash", "arena_bytes"))
        if "prefill" in g and (g["prefill"] is not True or "shard" in g):
            c.fail(f"graphs.{gk}.prefill", "true on an unsplit graph (absent: a step graph)", g["prefill"])
        if _entry_key(g) != gk:
            c.fail(f"graphs.{gk}", f"width, context, shard and prefill of {gk}",
                   (g["width"], g["context"], g.get("shard"), g.get("prefill", False)))
        if "shard" in g and g.get("layers") != ranges.get(g["shard"]):
            c.fail(f"graphs.{gk}.layers", f"the layer range of shard {g['shard']} {ranges.get(g['shard'])}",
                   g.get("layers"))
        c.string(g["graph_hash"], f"graphs.{gk}.graph_hash", _HEX64)
        c.integer(g["arena_bytes"], f"graphs.{gk}.arena_bytes")
    build = c.obj(man["build"], "build", ("seconds", "plan_kernels", "launches", "unique_binaries", "compiled",
                                          "cached"))
    c.number(build["seconds"], "build.seconds")
    for f in ("plan_kernels", "launches", "unique_binaries", "compiled", "cached"):
        c.integer(build[f], f"build.{f}")
    targets = c.obj(man["targets"], "targets")
    if not targets:
        c.fail("targets", "at least one target", targets)
    for slug, t in targets.items():
        w = f"targets.{_short(slug, 30)}"
        c.obj(t, w, ("vendor", "arch", "wave", "toolchain", "graphs", "binaries"))
        vendor = c.string(t["vendor"], f"{w}.vendor", choices=("cuda", "hip"))
        c.string(t["arch"], f"{w}.arch", re.compile(r"[a-z0-9_]+"))
        if slug != f"{vendor}-{t['arch']}":
            c.fail(w, f"the name {vendor}-{t['arch']}", slug)
        if type(t["wave"]) is not int or t["wave"] not in (32, 64):
            c.fail(f"{w}.wave", "32 or 64", t["wave"])
        tc = c.obj(t["toolchain"], f"{w}.toolchain", ("name", "version"))
        c.string(tc["name"], f"{w}.toolchain.name")
        c.string(tc["version"], f"{w}.toolchain.version")
        kind = "cubin" if vendor == "cuda" else "hsaco"
        ext = ".cu" if vendor == "cuda" else ".hip"
        bins = c.obj(t["binaries"], f"{w}.binaries")
        bin_pat = re.compile(rf"bin/{re.escape(slug)}/[A-Za-z0-9._-]+-[0-9a-f]{{12}}\.{kind}")
        src_pat = re.compile(rf"src/{re.escape(slug)}/[A-Za-z0-9._-]+-[0-9a-f]{{12}}{re.escape(ext)}")
        for rel, r in bins.items():
            wb = f"{w}.binaries[{_short(rel, 60)}]"
            c.string(rel, f"{w}.binaries key", bin_pat)
            c.obj(r, wb, ("key", "kind", "bytes", "sha256", "kernel", "family", "entry", "source", "source_sha256",
                          "weights", "resources"))
            c.string(r["key"], f"{wb}.key", _HEX64)
            if not rel.endswith(f"-{r['key'][:12]}.{kind}"):
                c.fail(f"{wb}.key", f"a key starting with the file's hash {rel[-18:-6]}", r["key"])
            c.string(r["kind"], f"{wb}.kind", choices=(kind,))
            c.integer(r["bytes"], f"{wb}.bytes", 1)
            c.string(r["sha256"], f"{wb}.sha256", _HEX64)
            for f in ("kernel", "family", "entry"):
                c.string(r[f], f"{wb}.{f}")
            c.string(r["source"], f"{wb}.source", src_pat)
            c.string(r["source_sha256"], f"{wb}.source_sha256", _HEX64)
            if not isinstance(r["weights"], list):
                c.fail(f"{wb}.weights", "a list of formats", r["weights"])
            for i, x in enumerate(r["weights"]):
                c.string(x, f"{wb}.weights[{i}]", choices=type_names + ("I64", "absent"))
            for fn, use in c.obj(r["resources"], f"{wb}.resources").items():
                for k, v in c.obj(use, f"{wb}.resources[{_short(fn, 40)}]").items():
                    if type(v) not in (int, float, bool):
                        c.fail(f"{wb}.resources[{_short(fn, 40)}].{_short(k, 30)}", "a number", v)
        tg = c.obj(t["graphs"], f"{w}.graphs")
        if list(tg) != keys:
            c.fail(f"{w}.graphs", f"the graphs of the buckets {keys}", list(tg))
        for gk, g in tg.items():
            wg = f"{w}.graphs.{gk}"
            c.obj(g, wg, ("width", "context", "graph_hash", "arena_bytes", "kernels"))
            for f in ("width", "context", "prefill", "graph_hash", "arena_bytes", "shard", "layers"):
                if (f in g) != (f in graphs[gk]) or (f in g and _ordered_json(g[f]) != _ordered_json(graphs[gk][f])):
                    c.fail(f"{wg}.{f}", f"graphs.{gk}.{f} = {_short(graphs[gk].get(f, 'absent'), 20)}",
                           g.get(f, "nothing"))  # (type-exact: true is not 1; absent on one side is a difference)
            if not isinstance(g["kernels"], list) or not g["kernels"]:
                c.fail(f"{wg}.kernels", "a list of plan kernels", g["kernels"])
            for i, k in enumerate(g["kernels"]):
                wk = f"{wg}.kernels[{i}]"
                c.obj(k, wk, ("name", "family", "layer", "launches"))
                c.string(k["name"], f"{wk}.name")
                c.string(k["family"], f"{wk}.family")
                c.integer(k["layer"], f"{wk}.layer", -1)
                if not isinstance(k["launches"], list) or not k["launches"]:
                    c.fail(f"{wk}.launches", "a list of launches", k["launches"])
                for j, ld in enumerate(k["launches"]):
                    _validate_launch(c, ld, f"{wk}.launches[{j}]", bins)


def _entry_key(g: dict[str, Any]) -> str:
    """The graph key a manifest graph entry's fields describe (a malformed entry gives a key no graph has)."""
    if type(g.get("width")) is not int or type(g.get("context")) is not int:
        return "?"
    try:
        return graph_key(g["width"], g["context"], g.get("shard"), g.get("prefill") is True)
    except ArtifactError:
        return "?"


def _validate_launch(c: _Schema, ld: Any, w: str, bins: dict[str, Any]) -> None:
    c.obj(ld, w, ("entry", "kernel", "grid", "block", "smem", "args", "binary", "key"))
    c.string(ld["entry"], f"{w}.entry")
    c.string(ld["kernel"], f"{w}.kernel")
    c.integers(ld["grid"], f"{w}.grid", 3, 1, 2**31 - 1)
    block = c.integers(ld["block"], f"{w}.block", 3, 1, 1024)
    if block[0] * block[1] * block[2] > 1024:
        c.fail(f"{w}.block", "at most 1024 threads", block)
    c.integer(ld["smem"], f"{w}.smem", 0, 1 << 20)
    if not isinstance(ld["args"], list):
        c.fail(f"{w}.args", "a list of arguments", ld["args"])
    for i, a in enumerate(ld["args"]):
        wa = f"{w}.args[{i}]"
        c.obj(a, wa, ("kind", "name"))
        kind = c.string(a["kind"], f"{wa}.kind", choices=_ARG_KINDS)
        c.string(a["name"], f"{wa}.name")
        if "nbytes" in a:
            c.integer(a["nbytes"], f"{wa}.nbytes")
        if "form" in a:
            c.string(a["form"], f"{wa}.form", choices=_FORMS)
        if kind == "int":
            c.integer(a.get("value"), f"{wa}.value", -(2**31), 2**31 - 1)
        elif "value" in a:
            c.fail(f"{wa}.value", "no value (only int arguments have one)", a["value"])
    rel = c.string(ld["binary"], f"{w}.binary")
    if rel not in bins:
        c.fail(f"{w}.binary", "a binary listed under the target's binaries", rel)
    rec = bins[rel]
    for f in ("key", "entry", "kernel"):
        if ld[f] != rec[f]:
            c.fail(f"{w}.{f}", f"the binary's {f} {_short(rec[f], 30)}", ld[f])
    n_weights = len(weight_formats(ld["args"], {}))
    if n_weights != len(rec["weights"]):
        c.fail(f"{w}.args", f"{len(rec['weights'])} weight arguments (as the binary records)", n_weights)


def manifest_buckets(man: dict[str, Any]) -> BucketSpec:
    """The :class:`~ds4c.buckets.BucketSpec` an artifact was built for (from a :func:`load_manifest` result)."""
    b = man["buckets"]
    return BucketSpec(tuple(b["widths"]), tuple(b["contexts"]), int(b["max_ctx"]))


def check_serves(man: dict[str, Any], artifact: str | os.PathLike, cfg: Ds4Config, weight_types: dict,
                 buckets: BucketSpec | None = None, layer_split: Iterable[int] | None = None,
                 taps: Iterable[int] = (), record_hc: bool = False, prefill_chunks: Iterable[int] = ()) -> None:
    """Check that the artifact ``man`` (:func:`load_manifest` of ``artifact``) serves a model: its config hash,
    its bucket spec (when ``buckets`` is given) and its weight-format table all equal the model's, and every
    binary was rendered for the formats its launches read in this model. ``weight_types`` is the model's
    ``{tensor name: GGMLType}`` (e.g. ``{n: mf.ggml_type(n) for n in mf.specs}``). ``layer_split``: the layers
    per shard the caller runs (None or one count: unsplit) must be the artifact's. ``taps``: the DSpark tap layers
    the caller's step records (empty: none) must be the artifact's (manifest ``taps``; none when absent): the tap
    kernel is part of every graph. ``record_hc``: whether the caller's step records the final HC state (the MTP
    drafter's input) must be the artifact's (manifest ``record_hc``). ``prefill_chunks``: the prefill chunk sizes
    the caller's step runs (ints; empty: none) must be among the artifact's (manifest ``prefill_chunks``): an
    artifact holding more chunk sizes serves a step that uses fewer. Needs no GPU.

    Raises:
        ArtifactError: the first mismatch, in one line: another config (both hashes), another bucket spec
            (both), another layer split, other taps (both, and the compile option that builds them), another
            ``record_hc`` (likewise), prefill chunks the artifact lacks (what it was compiled with, what was asked,
            the ``--prefill`` that builds them), or the
            first tensor whose format differs (the artifact's type vs the model's, and how many tensors differ).
    """
    where = f"artifact {artifact} does not serve this model"
    if man["config_hash"] != cfg.hash():
        raise ArtifactError(f"{where}: it was built for another config (hash {man['config_hash'][:12]}, "
                            f"{man['config'].get('name')}; this model {cfg.hash()[:12]}, {cfg.name}); rebuild it "
                            f"with `ds4c compile` for this model")
    if buckets is not None and man["buckets_hash"] != buckets.hash():
        raise ArtifactError(f"{where}: it was built for buckets {man['buckets']}, asked for {buckets.as_dict()}")
    if isinstance(layer_split, str) or not all(type(n) is int for n in (layer_split or ())):
        raise ArtifactError(f"check_serves: layer_split must be layer counts (ints) or None, found {layer_split!r}")
    want = list(layer_split or ())
    want = want if len(want) > 1 else None
    have = man.get("layer_split")
    if want != have:
        def split_name(x: list | None) -> str:
            return "the unsplit step" if x is None else f"layer split {','.join(map(str, x))}"

        how = "without --layer-split" if want is None else f"with --layer-split {','.join(map(str, want))}"
        raise ArtifactError(f"artifact {artifact} was compiled for {split_name(have)}, asked to serve "
                            f"{split_name(want)}; compile one {how} (`ds4c compile`)")
    want_taps, have_taps = [int(t) for t in taps], list(man.get("taps", ()))
    if want_taps != have_taps:
        def taps_name(x: list) -> str:
            return f"the DSpark taps {','.join(map(str, x))}" if x else "no DSpark taps"

        how = f"with --taps {','.join(map(str, want_taps))}" if want_taps else "without --taps / --draft"
        raise ArtifactError(f"artifact {artifact} was compiled with {taps_name(have_taps)}, asked to serve a step "
                            f"with {taps_name(want_taps)}; compile one {how} (`ds4c compile`)")
    if bool(record_hc) != bool(man.get("record_hc", False)):
        def rec_name(x: bool) -> str:
            return "the final HC state recorded (the MTP drafter's input)" if x else "no final HC state recorded"

        how = "with --draft mtp" if record_hc else "without --draft mtp"
        raise ArtifactError(f"artifact {artifact} was compiled with {rec_name(bool(man.get('record_hc')))}, asked to "
                            f"serve a step with {rec_name(bool(record_hc))}; compile one {how} (`ds4c compile`)")
    if isinstance(prefill_chunks, str) or not all(type(n) is int for n in (prefill_chunks or ())):
        raise ArtifactError(f"check_serves: prefill_chunks must be chunk sizes (ints), found {prefill_chunks!r}")
    want_chunks = sorted(set(prefill_chunks or ()))
    have_chunks = list(manifest_prefill_chunks(man))
    lacking = [n for n in want_chunks if n not in have_chunks]
    if lacking:
        had = f"with --prefill {_chunks_text(have_chunks)}" if have_chunks else "without --prefill (no chunk graphs)"
        raise ArtifactError(f"artifact {artifact} was compiled {had}; asked for {_chunks_text(want_chunks)} (it "
                            f"lacks the chunk graphs of {_chunks_text(lacking)}): compile one with --prefill "
                            f"{_chunks_text(sorted(set(have_chunks) | set(want_chunks)))} (`ds4c compile`) or ask "
                            f"for {'a subset of its chunks' if have_chunks else 'no prefill chunks'}")
    types = effective_weight_types(cfg, weight_types)
    diff = first_format_difference(man["weight_types"], types)
    if diff is not None:
        name, want, got, n = diff
        raise ArtifactError(f"{where}: tensor {name} is {want} in the artifact's weight formats, {got} in the "
                            f"model ({n} tensor{'s' * (n != 1)} differ); rebuild it with `ds4c compile` from this "
                            f"model file")
    for slug, t in man["targets"].items():
        for g in t["graphs"].values():
            for k in g["kernels"]:
                for ld in k["launches"]:
                    _check_launch_formats(ld["args"], t["binaries"][ld["binary"]], ld["binary"], types, where)


def check_lowering(man: dict[str, Any], artifact: str | os.PathLike, cfg: Ds4Config, weight_types: dict) -> int:
    """Pair every graph of every target of the artifact with this model's lowering, as the runtime does before it
    loads a graph (:func:`launch_binaries`): the same plan kernels and launches in the same order, each binary
    rendered for the formats its launch reads. Runs the pass pipeline and the lowering for each (width,
    context) step graph and each prefill chunk graph (CPU only; seconds for a 43-layer model). Returns the number
    of launches checked.

    Raises:
        ArtifactError: the first graph whose kernels, launches or weight formats differ.
    """
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline

    b = manifest_buckets(man)
    n = 0
    taps, rec = tuple(man.get("taps", ())), bool(man.get("record_hc", False))
    todo = [(shard, layers, width, context, False) for shard, layers in split_ranges(cfg, man.get("layer_split"))
            for width, context in b.keys()]
    todo += [(None, None, rows, context, True) for rows, context in prefill_keys(manifest_prefill_chunks(man),
                                                                                b.contexts)]
    for shard, layers, width, context, chunk in todo:
        g = run_pipeline(build_step(cfg, width, b.contexts[-1], layers, taps=taps, record_hc=rec, prefill=chunk),
                         "default", context=context).graph
        for slug, t in man["targets"].items():
            tgt = Target(t["vendor"], t["arch"], t["wave"])
            n += len(launch_binaries(man, artifact, slug, width, context, _lower_graph(g, cfg, tgt, weight_types),
                                     weight_types, shard, prefill=chunk))
    return n


def _check_launch_formats(args: list, rec: dict[str, Any], rel: str, types: dict[str, str], where: str) -> None:
    """The binary ``rel`` (record ``rec``) was rendered for the formats a launch with ``args`` reads."""
    found = weight_formats(args, types)
    if found == rec["weights"]:
        return
    names = [a["name"] if isinstance(a, dict) else a.name for a in args
             if (a["kind"] if isinstance(a, dict) else a.kind) == "weight"]
    i = next((i for i, (x, y) in enumerate(zip(rec["weights"], found)) if x != y), min(len(found), len(rec["weights"])))
    name = names[i] if i < len(names) else "?"
    want = rec["weights"][i] if i < len(rec["weights"]) else "absent"
    got = found[i] if i < len(found) else "absent"
    raise ArtifactError(f"{where}: binary {rel} was rendered for tensor {name} as {want}, the model has {got}; "
                        f"rebuild it with `ds4c compile` from this model file")


def find_target(man: dict[str, Any], arch: str | None) -> str:
    """The target slug of ``arch`` (``sm_90`` or ``cuda-sm_90``) in the manifest; the first one when None.

    Raises:
        ArtifactError: the artifact has no such target.
    """
    slugs = list(man["targets"])
    if arch is None:
        return slugs[0]
    for s in slugs:
        if arch in (s, man["targets"][s]["arch"]):
            return s
    raise ArtifactError(f"the artifact has no target {arch!r}: it has {', '.join(slugs)}")


def find_graph(man: dict[str, Any], slug: str, key: str | None) -> str:
    """The graph key ``key`` of target ``slug`` (the first when None).

    Raises:
        ArtifactError: no such graph.
    """
    keys = list(man["targets"][slug]["graphs"])
    if key is None:
        return keys[0]
    if key not in keys:
        raise ArtifactError(f"the artifact has no graph {key!r}: it has {', '.join(keys)}")
    return key


def find_binaries(man: dict[str, Any], slug: str, graph: str, name: str) -> list[tuple[str, dict[str, Any]]]:
    """The binaries ``(path in the artifact, manifest record)`` that ``name`` designates for target ``slug``:
    a plan kernel of ``graph`` (e.g. ``l0.multi_gemv``: each of its launches' binaries), a rendered kernel's
    name or entry used in ``graph``, or a binary file name (with or without extension) of the target.

    Raises:
        ArtifactError: nothing matches (the message lists some names that exist).
    """
    t = man["targets"][slug]
    bins = t["binaries"]
    kernels = t["graphs"][graph]["kernels"]
    out: list[str] = []
    for k in kernels:
        if k["name"] == name:
            out += [ld["binary"] for ld in k["launches"]]
    if not out:
        for k in kernels:
            out += [ld["binary"] for ld in k["launches"] if name in (ld["kernel"], ld["entry"])]
    if not out:
        out = [rel for rel in bins if name in (Path(rel).name, Path(rel).stem)]
    if not out:
        names = [k["name"] for k in kernels]
        raise ArtifactError(f"no kernel {name!r} in graph {graph} for {slug}: plan kernels are "
                            f"{', '.join(names[:12])}{', ...' if len(names) > 12 else ''} (`ds4c inspect DIR "
                            f"--kernels` lists them)")
    return [(rel, bins[rel]) for rel in dict.fromkeys(out)]


def disassembler(kind: str, arch: str) -> tuple[list[str], str, dict[str, str] | None]:
    """``(command without the file, tool name, environment or None)`` that disassembles a binary of ``kind``
    for ``arch``.

    cubin: ``cuobjdump -sass`` (which runs ``nvdisasm``: both must be installed), else ``nvdisasm -c``;
    hsaco: ``llvm-objdump-19 -d --mcpu=ARCH`` (else another ``llvm-objdump-N``, or ``llvm-objdump``).

    Raises:
        ArtifactError: the tools are not installed (the message names what is missing and where it comes from).
    """
    if kind == "cubin":
        cuobjdump, nvdisasm = _find_cuda_tool("cuobjdump"), _find_cuda_tool("nvdisasm")
        if cuobjdump and nvdisasm:
            env = {**os.environ, "NVDISASM_PATH": str(Path(nvdisasm).parent)}
            return [cuobjdump, "-sass"], "cuobjdump", env
        if nvdisasm:
            return [nvdisasm, "-c"], "nvdisasm", None
        missing = "nvdisasm (cuobjdump -sass runs it)" if cuobjdump else "cuobjdump and nvdisasm"
        raise ArtifactError(f"--sass needs {missing} from the CUDA toolkit, not found on PATH (nor in "
                            f"$CUDA_HOME/bin or /usr/local/cuda/bin); pip: nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    names = ["llvm-objdump-19"] + [f"llvm-objdump-{v}" for v in range(30, 18, -1) if v != 19] + ["llvm-objdump"]
    for n in names:
        c = shutil.which(n)
        if c:
            return [c, "-d", f"--mcpu={arch}"], n, None
    raise ArtifactError("--sass needs llvm-objdump (llvm-objdump-19 or newer, or an llvm-objdump with the AMDGPU "
                        "target) to disassemble an hsaco, and none is on PATH (Debian/Ubuntu: apt-get install "
                        "llvm-19)")


def disassemble(artifact: str | os.PathLike, rel: str, record: dict[str, Any], arch: str) -> str:
    """The machine code (SASS / AMDGPU ISA) of binary ``rel`` of an artifact, as the disassembler prints it.

    Raises:
        ArtifactError: no disassembler (see :func:`disassembler`), or it failed.
    """
    import subprocess

    cmd, tool, env = disassembler(record["kind"], arch)
    f = Path(artifact) / rel
    try:
        p = subprocess.run([*cmd, str(f)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           errors="replace", timeout=300, stdin=subprocess.DEVNULL, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ArtifactError(f"{tool} could not run on {f}: {e}") from None
    if p.returncode != 0:
        tail = " | ".join(p.stdout.strip().splitlines()[-3:])
        raise ArtifactError(f"{tool} failed on {f} (exit {p.returncode}): {tail}")
    return p.stdout


def launch_binaries(man: dict[str, Any], artifact: str | os.PathLike, arch: str, width: int, context: int,
                    kernels: list, weight_types: dict, shard: int | None = None,
                    prefill: bool = False) -> list[Path]:
    """The binary of every launch of ``kernels`` (``lower_graph`` of the (width, context) graph for ``arch``),
    in launch order, from an artifact: the runtime's path that needs no compiler. ``shard``: the graph of that
    shard of the artifact's layer split. ``prefill``: the prefill chunk graph of ``width`` = C rows (key
    ``p{C}_c{context}``; ``CompiledStep`` passes it for its ``prefill_chunks`` keys).

    The lowering is deterministic, so the manifest lists the same plan kernels and launches in the same order;
    each pairing is checked by plan-kernel name and entry point, and by the weight formats each launch reads in
    this model (``weight_types``: ``{tensor name: GGMLType}``) against those its binary was rendered for.

    Raises:
        ArtifactError: the artifact has no binaries for ``arch``, no graph for (width, context) — the message
            names the missing key — or its launches do not match the lowering (built by another ds4c or for
            another model), or a binary was rendered for other weight formats (naming the tensor).
    """
    types = {k: getattr(v, "name", str(v)) for k, v in weight_types.items()}
    slug = find_target(man, arch)
    key = graph_key(width, context, shard, prefill)
    graphs = man["targets"][slug]["graphs"]
    if key not in graphs:
        what = f"prefill chunk graph {key} ({width} rows" if prefill else f"step graph {key} (width {width}"
        raise ArtifactError(f"the artifact has no {what}, context {context}"
                            f"{'' if shard is None else f', shard {shard}'}) for {slug}: it has {', '.join(graphs)}")
    listed = graphs[key]["kernels"]
    if [k["name"] for k in listed] != [k.name for k in kernels]:
        raise ArtifactError(f"artifact graph {key} for {slug} lists other plan kernels than this model's lowering; "
                            f"rebuild it with `ds4c compile` for this model")
    out = []
    for k, rec in zip(kernels, listed):
        if [l["entry"] for l in rec["launches"]] != [la.kernel.entry for la in k.launches]:
            raise ArtifactError(f"artifact kernel {k.name} ({key}, {slug}) has other launches than the lowering")
        for l, la in zip(rec["launches"], k.launches):
            _check_launch_formats(la.args, man["targets"][slug]["binaries"][l["binary"]], l["binary"], types,
                                  f"artifact {artifact} does not serve this model")
        out += [Path(artifact) / l["binary"] for l in rec["launches"]]
    return out
