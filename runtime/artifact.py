"""Ahead-of-time artifacts (design.md, "Who uses it" 1 and 3): every step graph of a bucket set, lowered for
every target, compiled through the kernel cache, and published as one folder the runtime loads with no
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
    graphs:  {"q<w>_c<context>": {width, context, graph_hash, arena_bytes, memory}}
             (target-independent: the pipelined graph's printer hash and its memory plan, meta["memory"])
    targets: {"<vendor>-<arch>": {vendor, arch, wave, toolchain: {name, version},
              graphs: {"q<w>_c<context>": {width, context, graph_hash, arena_bytes,
                       kernels: [describe(k) whose launches also have "binary" (path in the artifact) and
                                 "key" (full cache key)]}},
              binaries: {"bin/<slug>/<name>-<hash12>.<kind>": {key, kind, bytes, sha256, kernel, family,
                         entry, source, resources}}}}
    build:   {seconds, plan_kernels, launches, unique_binaries, compiled, cached}

Publication is atomic: the artifact is written into ``<out_dir>.tmp-<pid>-<random>`` beside ``out_dir``;
then the old ``out_dir`` (if any) is renamed aside to ``<out_dir>.old-<pid>-<random>/a``, the new one renamed
in, and the old one deleted. An interrupted build leaves the previous artifact (or nothing), never a half-written
one; leftovers of a killed build are cleaned (or, when the swap was cut between its two renames, the old
artifact is put back) by the next build into the same folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
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
from ds4c.runtime.toolchain import is_valid_binary

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_TMP_TAG = ".tmp-"
_OLD_TAG = ".old-"


class ArtifactError(Ds4cError):
    """An artifact folder is missing, incomplete, corrupt, of another ds4c version, or cannot be written
    where asked; or a graph, target or kernel asked of it does not exist."""


def graph_key(width: int, context: int) -> str:
    """The manifest key of the step graph of verify width ``width`` and context bucket ``context``."""
    return f"q{width}_c{context}"


def _lower_graph(g: Any, cfg: Ds4Config, target: Target, weight_types: dict | None) -> list:
    from ds4c.runtime import lower

    fn = getattr(lower, "lower_graph", None)
    if fn is None:
        raise ArtifactError("ds4c.runtime.lower.lower_graph is not available in this build of ds4c")
    return fn(g, cfg, target) if weight_types is None else fn(g, cfg, target, weight_types)


def effective_weight_types(cfg: Ds4Config, weight_types: dict | None = None) -> dict[str, str]:
    """``{tensor name: GGML type name}`` the kernels are compiled for: ``weight_types`` (e.g. a GGUF file's
    ``{name: mf.ggml_type(name)}``) or, when None, the official formats of ``cfg``."""
    from ds4c.tensors import FORMATS, tensor_specs

    types = weight_types or {s.name: FORMATS["official"][s.role] for s in tensor_specs(cfg)}
    return {k: getattr(v, "name", str(v)) for k, v in sorted(types.items())}


def weight_types_hash(types: dict[str, str]) -> str:
    """sha256 of the canonical JSON of :func:`effective_weight_types`' result."""
    return hashlib.sha256(canonical_json(types).encode()).hexdigest()


def _source_id(src: KernelSource) -> tuple:
    """Identity of a rendered kernel for de-duplication before keying (same source, params and names
    give the same cache key)."""
    return (src.target, src.name, src.family, src.entry, src.digest(), canonical_json(src.params))


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def build_artifact(cfg: Ds4Config, targets: list[Target], buckets: BucketSpec, out_dir: str | os.PathLike,
                   cache: KernelCache, jobs: int | None = None, progress: bool = True,
                   weight_types: dict | None = None) -> Path:
    """Compile every step graph of ``buckets`` for every target in ``targets`` and publish the artifact at
    ``out_dir`` (layout and manifest: module docstring). Returns ``out_dir`` as an absolute path.

    For each graph key ``(width, context)`` of ``buckets``: the default pipeline runs on
    ``build_step(cfg, width, buckets.contexts[-1])`` with ``context``; the result is lowered for each target
    (``ds4c.runtime.lower.lower_graph``); all rendered kernels are compiled by ``cache.compile_many`` with
    ``jobs`` threads (cache hits compile nothing; ``progress`` prints what is compiled and a progress bar to
    stderr). ``weight_types`` (``{tensor name: GGMLType}``, e.g. of a GGUF file; default: the official
    formats) picks the weight formats the kernels read; the manifest records them. Never queries a device.

    Raises:
        ConfigError: ``buckets`` does not fit ``cfg``.
        ArtifactError: no target, or ``out_dir`` exists and is not a ds4c artifact (nor an empty folder).
        ToolchainError, CompileError: no compiler for a target, or a kernel failed to compile (the previous
            artifact at ``out_dir``, if any, is left as it was).
    """
    from ds4c.ir import build_step
    from ds4c.ir.printer import graph_hash
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import describe

    t0 = time.perf_counter()
    if not targets:
        raise ArtifactError("expected at least one target, e.g. --arch sm_90,gfx1151")
    buckets.validate(cfg)
    out = Path(out_dir).expanduser().absolute()
    _check_replaceable(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ArtifactError(f"cannot write the artifact {out}: a part of {out.parent} is a file, not a "
                            f"directory") from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"cannot write the artifact {out}: the folder {out.parent} is not writable")
    _clean_leftovers(out)

    # ---- pipeline + lowering
    keys = buckets.keys()
    _say(progress, f"lowering {len(keys)} graph{'s' * (len(keys) != 1)} for "
                   f"{', '.join(t.slug for t in targets)}")
    graphs: dict[str, dict[str, Any]] = {}
    lowered: dict[tuple[str, str], list] = {}  # (slug, graph key) -> [LoweredKernel]
    for width, context in keys:
        gk = graph_key(width, context)
        g = run_pipeline(build_step(cfg, width, buckets.contexts[-1]), "default", context=context).graph
        mem = dict(g.meta.get("memory", {}))
        graphs[gk] = {"width": width, "context": context, "graph_hash": graph_hash(g),
                      "arena_bytes": int(mem.get("arena_bytes", 0)), "memory": mem}
        for t in targets:
            lowered[(t.slug, gk)] = _lower_graph(g, cfg, t, weight_types)

    # ---- compile (each distinct source once)
    uniq: dict[tuple, KernelSource] = {}
    for ks in lowered.values():
        for k in ks:
            for launch in k.launches:
                uniq.setdefault(_source_id(launch.kernel), launch.kernel)
    sources = list(uniq.values())
    entries = cache.compile_many(sources, jobs=jobs, progress=progress)
    entry_of = {sid: e for sid, e in zip(uniq, entries)}

    # ---- write into a temporary folder beside out_dir, then swap it in
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}{_TMP_TAG}{os.getpid()}-", dir=out.parent))
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
                                         "source": rel_src, "resources": e.resources}
                        seen_keys[(slug, e.key)] = seen_keys.get((slug, e.key), False) or not e.hit
                    ld["binary"] = rel_bin
                    ld["key"] = e.key
                    n_launch += 1
                kernels.append(d)
                n_plan += 1
            g = graphs[gk]
            tinfo[slug]["graphs"][gk] = {"width": g["width"], "context": g["context"],
                                        "graph_hash": g["graph_hash"], "arena_bytes": g["arena_bytes"],
                                        "kernels": kernels}
        compiled = sum(seen_keys.values())
        wtypes = effective_weight_types(cfg, weight_types)
        manifest = {
            "format": MANIFEST_FORMAT,
            "ds4c_version": __version__,
            "config": cfg.model_dict(), "config_hash": cfg.hash(),
            "buckets": buckets.as_dict(), "buckets_hash": buckets.hash(),
            "weight_types": wtypes, "weight_types_hash": weight_types_hash(wtypes),
            "graphs": graphs,
            "targets": tinfo,
            "build": {"seconds": round(time.perf_counter() - t0, 3), "plan_kernels": n_plan, "launches": n_launch,
                      "unique_binaries": len(seen_keys), "compiled": compiled, "cached": len(seen_keys) - compiled,
                      "jobs": jobs or os.cpu_count() or 1},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leftovers(out: Path) -> Iterable[tuple[Path, str, int]]:
    """``(path, tag, pid)`` of the temporary / set-aside folders of builds into ``out``."""
    for tag in (_TMP_TAG, _OLD_TAG):
        for p in out.parent.glob(f"{out.name}{tag}*"):
            pid = p.name[len(out.name) + len(tag):].split("-", 1)[0]
            if pid.isdigit():
                yield p, tag, int(pid)


def _clean_leftovers(out: Path) -> None:
    """Remove what killed builds into ``out`` left behind; if one died between its two renames (``out`` gone,
    the previous artifact set aside), put the previous artifact back."""
    for p, tag, pid in sorted(_leftovers(out), key=lambda x: x[1] != _OLD_TAG):
        if pid == os.getpid() or _pid_alive(pid):
            continue
        if tag == _OLD_TAG and not out.exists() and _is_artifact_dir(p / "a"):
            try:
                os.rename(p / "a", out)
            except OSError:
                pass
        shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> None:
    """Swap ``tmp`` in as ``out`` (see module docstring)."""
    for _ in range(10):
        old: Path | None = None
        if out.exists() or out.is_symlink():
            _check_replaceable(out)
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}{_OLD_TAG}{os.getpid()}-", dir=out.parent))
            try:
                os.rename(out, old / "a")  # rename into a fresh folder: no clash with another build
            except FileNotFoundError:  # another build moved it meanwhile
                shutil.rmtree(old, ignore_errors=True)
                old = None
        try:
            os.rename(tmp, out)
        except OSError:
            if old is not None:  # put the previous artifact back, unless someone published meanwhile
                try:
                    os.rename(old / "a", out)
                except OSError:
                    pass
                shutil.rmtree(old, ignore_errors=True)
            if out.exists():
                continue  # another build published between our renames: replace theirs
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    raise ArtifactError(f"cannot publish the artifact at {out}: another build keeps replacing it")


# ------------------------------------------------------------------------------------------------ loading
def load_manifest(path: str | os.PathLike, verify: bool = True) -> dict[str, Any]:
    """The parsed ``manifest.json`` of the artifact folder ``path``, checked complete.

    Checked: the manifest parses and has every top-level key, it was written by this ds4c version (and
    manifest format), and every binary it lists exists with its recorded size (with ``verify``: also its
    sha256, and it is a valid ELF of its kind).

    Raises:
        ArtifactError: a missing folder or manifest, a corrupt manifest, a manifest of another ds4c version,
            or a listed binary missing or not as recorded.
    """
    d = Path(path)
    if not d.is_dir():
        raise ArtifactError(f"no artifact folder at {d} (build one with `ds4c compile ... -o {d}`)")
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(f"{d} is not a ds4c artifact: {MANIFEST} is missing (build one with `ds4c compile`)")
    try:
        man = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"corrupt artifact manifest {mpath}: {e}; rebuild it with `ds4c compile`") from None
    if not isinstance(man, dict):
        raise ArtifactError(f"corrupt artifact manifest {mpath}: expected a JSON object, found "
                            f"{type(man).__name__}; rebuild it with `ds4c compile`")
    ver = man.get("ds4c_version")
    if ver != __version__:
        raise ArtifactError(f"artifact {d} was built by ds4c {ver}, this is ds4c {__version__}: rebuild it with "
                            f"`ds4c compile`")
    if man.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"artifact {d} has manifest format {man.get('format')!r}, this ds4c reads format "
                            f"{MANIFEST_FORMAT}: rebuild it with `ds4c compile`")
    need = ("config", "config_hash", "buckets", "buckets_hash", "graphs", "targets")
    missing = [k for k in need if k not in man]
    if missing:
        raise ArtifactError(f"corrupt artifact manifest {mpath}: missing {', '.join(missing)}; rebuild it with "
                            f"`ds4c compile`")
    try:
        for slug, t in man["targets"].items():
            for rel, b in t["binaries"].items():
                f = d / rel
                if not f.is_file():
                    raise ArtifactError(f"artifact {d} is incomplete: binary {rel} ({b['kernel']} for {slug}) "
                                        f"is missing; rebuild it with `ds4c compile`")
                if f.stat().st_size != b["bytes"]:
                    raise ArtifactError(f"artifact {d}: binary {rel} has {f.stat().st_size} bytes, the manifest "
                                        f"says {b['bytes']}; rebuild it with `ds4c compile`")
                if verify:
                    data = f.read_bytes()
                    if hashlib.sha256(data).hexdigest() != b["sha256"] or not is_valid_binary(data, b["kind"]):
                        raise ArtifactError(f"artifact {d}: binary {rel} does not match its manifest entry "
                                            f"(sha256 or ELF header); rebuild it with `ds4c compile`")
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"corrupt artifact manifest {mpath}: bad or missing field {e}; rebuild it with "
                            f"`ds4c compile`") from None
    return man


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


def _find_cuda_tool(tool: str) -> str | None:
    dirs = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for c in [shutil.which(tool)] + [str(Path(h) / "bin" / tool) for h in dirs if h]:
        if c and os.access(c, os.X_OK):
            return c
    return None


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
                    kernels: list) -> list[Path]:
    """The binary of every launch of ``kernels`` (``lower_graph`` of the (width, context) graph for ``arch``),
    in launch order, from an artifact: the runtime's path that needs no compiler.

    The lowering is deterministic, so the manifest lists the same plan kernels and launches in the same order;
    each pairing is checked by plan-kernel name and entry point.

    Raises:
        ArtifactError: the artifact has no binaries for ``arch``, no graph for (width, context) — the message
            names the missing key — or its launches do not match the lowering (built by another ds4c or for
            another model).
    """
    slug = find_target(man, arch)
    key = graph_key(width, context)
    graphs = man["targets"][slug]["graphs"]
    if key not in graphs:
        raise ArtifactError(f"the artifact has no step graph {key} (width {width}, context {context}) for {slug}: "
                            f"it has {', '.join(graphs)}")
    listed = graphs[key]["kernels"]
    if [k["name"] for k in listed] != [k.name for k in kernels]:
        raise ArtifactError(f"artifact graph {key} for {slug} lists other plan kernels than this model's lowering; "
                            f"rebuild it with `ds4c compile` for this model")
    out = []
    for k, rec in zip(kernels, listed):
        if [l["entry"] for l in rec["launches"]] != [la.kernel.entry for la in k.launches]:
            raise ArtifactError(f"artifact kernel {k.name} ({key}, {slug}) has other launches than the lowering")
        out += [Path(artifact) / l["binary"] for l in rec["launches"]]
    return out
