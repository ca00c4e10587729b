"""The artifact manifest (``manifest.json``): its format, its integrity record and schema, and loading it checked.
An artifact is the folder :func:`ds4c.runtime.artifact.build_artifact` publishes; the runtime loads it with no
compiler present (:func:`open_artifact`, once per open).

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

The manifest is checked unchanged on every load (:func:`load_manifest`): each top-level field against its digest,
the text byte for byte, then the type, range, hash and cross-reference of every field the runtime reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ds4c.version import __version__
from ds4c.buckets import MIN_PREFILL_CHUNK, BucketSpec
from ds4c.config import Ds4Config
from ds4c.errors import Ds4cError
from ds4c.quant import GGMLType
from ds4c.runtime.cache import canonical_json
from ds4c.runtime.toolchain import is_valid_binary
from ds4c.tensors import storage_types

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2
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


def chunks_text(chunks: Iterable[int]) -> str:
    """Chunk sizes as a message (and ``--prefill``) spells them: ``256,2048``."""
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


def manifest_buckets(man: dict[str, Any]) -> BucketSpec:
    """The :class:`~ds4c.buckets.BucketSpec` an artifact was built for (from a :func:`load_manifest` result)."""
    b = man["buckets"]
    return BucketSpec(tuple(b["widths"]), tuple(b["contexts"]), int(b["max_ctx"]))


def effective_weight_types(cfg: Ds4Config, weight_types: dict | None = None) -> dict[str, str]:
    """``{tensor name: GGML type name}`` the kernels are compiled for: ``weight_types`` (e.g. a GGUF file's
    ``{name: mf.ggml_type(name)}``) or, when None, the official formats of ``cfg``."""
    types = weight_types or storage_types(cfg, "official")
    return {k: getattr(v, "name", str(v)) for k, v in sorted(types.items())}


def weight_types_hash(types: dict[str, str]) -> str:
    """sha256 of the canonical JSON of :func:`effective_weight_types`' result."""
    return hashlib.sha256(canonical_json(types).encode()).hexdigest()


def weight_formats(args: Iterable[Any], types: dict[str, str]) -> list[str]:
    """The format each weight argument of one launch is read in, in argument order: the stored GGML type name
    (from ``types``, ``{tensor name: type name}``; ``"absent"`` when the tensor is not there) for ``raw``
    weights, whose bytes the kernel decodes itself; ``F32`` / ``BF16`` / ``I64`` for weights the runtime converts
    on upload (the kernel then does not depend on the stored type). ``args`` are :class:`~ds4c.runtime.lowered.Arg`
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


def manifest_text(man: dict[str, Any]) -> str:
    """The exact text of ``manifest.json`` (compact JSON in key order, one trailing newline)."""
    return json.dumps(man, separators=(",", ":")) + "\n"


def _ordered_json(v: Any) -> str:
    """Compact JSON keeping key order (so a reordering changes the digest, unlike ``canonical_json``)."""
    return json.dumps(v, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def integrity_record(man: dict[str, Any]) -> dict[str, Any]:
    """The manifest's record of its own content: per top-level field (in file order) the sha256 of its compact
    JSON in key order, and the sha256 of that list of field digests (``digest``)."""
    fields = {k: hashlib.sha256(_ordered_json(v).encode()).hexdigest() for k, v in man.items() if k != "integrity"}
    return {"algorithm": _INTEGRITY_ALGORITHM, "fields": fields,
            "digest": hashlib.sha256(_ordered_json(fields).encode()).hexdigest()}


_INTEGRITY_ALGORITHM = "sha256 of the compact key-ordered JSON of each top-level field"


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


@dataclass(frozen=True, eq=False)
class Artifact:
    """An artifact folder whose manifest was loaded and checked once (:func:`open_artifact`). The engine opens
    it and hands it on (``CompiledStep(artifact=...)``, ``ShardedStep``, every shard), so no one loads and verifies
    the manifest and its binaries' sha256 again."""

    path: str
    """The folder, as given."""
    manifest: dict[str, Any]
    """The :func:`load_manifest` result."""


def open_artifact(path: str | os.PathLike | Artifact, verify: bool = True) -> Artifact:
    """The :class:`Artifact` at ``path``, its manifest loaded and checked by :func:`load_manifest` (``verify``: as
    there); an ``Artifact`` is returned as it is.

    Raises:
        ArtifactError: as :func:`load_manifest`.
    """
    if isinstance(path, Artifact):
        return path
    return Artifact(str(path), load_manifest(path, verify))


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
        now = integrity_record(man)["fields"]
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
    if text != manifest_text(man):
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
