"""The content-addressed kernel cache (docs/codegen.md, "Cache, artifacts, runtime").

Key: the sha256 of a canonical JSON (sorted keys, no whitespace) of the rendered source, the text of every
template used, the render parameters, the kernel's name / family / entry, vendor + arch + wave, the toolchain's
name and version, its flags for the target, and the ds4c version. No absolute path enters the key (templates
are keyed by their name under ``templates/``, the toolchain by name and version, not by where it is), so a
moved virtualenv or CUDA install keeps every entry.

Layout: ``<root>/<ds4c-version>/<vendor>-<arch>/<kernel-name>-<hash12>/`` with

* ``meta.json``: the whole key except the source text (so a miss can be explained), the full hash, the
  binary's size and sha256, the compile time, the toolchain path used, and ``resources`` (registers,
  spills, shared memory, stack: :func:`ds4c.runtime.toolchain.resource_usage`);
* ``kernel.cu`` / ``kernel.hip``: the rendered source; ``kernel.cubin`` / ``kernel.hsaco``: the binary;
  ``compile.log``: the command line and everything the compiler printed.

Root: ``$DS4C_CACHE``, else ``~/.cache/ds4c/kernels``.

Publication is atomic: an entry is compiled in a temporary folder ``.<kernel-name>-<hash12>.tmp-<pid>-<host>-<random>``
beside its final one (locked by its writer, see :mod:`ds4c.tempfiles`; the compiler's own temp files go into it
too, never to /tmp) and renamed into place; when the final folder already exists (another process won the
race), ours is discarded and theirs used. Opening the cache removes the temporaries whose writer was killed
(:meth:`KernelCache.sweep`); ``ds4c cache list`` counts the ones left. An
entry with a missing or unreadable ``meta.json``, a missing binary, or a hash mismatch is a miss: it is removed
(under a per-key file lock, so a valid entry published meanwhile is never removed) and compiled again.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import shutil
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Iterable, Sequence

from ds4c import settings
from ds4c.version import __version__
from ds4c.errors import Ds4cError
from ds4c.runtime.render import KernelSource
from ds4c.runtime.targets import Target
from ds4c.runtime.toolchain import Toolchain, find_toolchain, is_valid_binary, resource_usage
from ds4c.progress import progress_bar
from ds4c.tempfiles import TMP_TAG, OwnedTemp, find_leftovers, owner_tag, remove_stale
from ds4c.write_errors import write_error_text

META = "meta.json"
_KEY_FIELDS = ("ds4c_version", "kernel", "templates", "params", "target", "toolchain", "flags")
LOG = "compile.log"
_TRASH_TAG = ".trash-"
_TEMP_TAGS = (TMP_TAG, _TRASH_TAG)
_LOCKS = ".locks"


class CacheError(Ds4cError):
    """A cache lookup by key found nothing (or several entries), a key input cannot be hashed, or an entry cannot
    be written (a full disk: ``no space left on device``, naming the entry)."""


def cache_root() -> Path:
    """``$DS4C_CACHE`` if set, else ``~/.cache/ds4c/kernels`` (:func:`ds4c.settings.kernel_cache_root`)."""
    return settings.kernel_cache_root()


def _canon(obj: Any) -> Any:
    """JSON-able form of a render parameter (tuples/sets as lists, dataclasses as dicts, enums by value,
    numpy scalars as Python numbers). Paths are refused: they would put a location into the key."""
    if isinstance(obj, PurePath):
        raise CacheError(f"render parameter {obj!r} is a path: cache keys must not depend on file locations")
    if isinstance(obj, enum.Enum):
        return _canon(obj.value)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return obj.item()
    raise CacheError(f"render parameter {obj!r} of type {type(obj).__name__} cannot be put into a cache key "
                     f"(expected JSON values: numbers, strings, bools, lists, dicts)")


def canonical_json(obj: Any) -> str:
    """The canonical JSON text hashed for a key (sorted keys, compact separators, UTF-8 kept)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=_canon,
                      allow_nan=True)


def key_inputs(src: KernelSource, toolchain: Toolchain, version: str = __version__) -> dict[str, Any]:
    """Everything a compile depends on, as a JSON-able dict (the source under ``"source"``)."""
    t = src.target
    return {
        "ds4c_version": version,
        "kernel": {"name": src.name, "family": src.family, "entry": src.entry},
        "source": src.source,
        "templates": dict(src.templates),
        "params": json.loads(canonical_json(src.params)),
        "target": {"vendor": t.vendor, "arch": t.arch, "wave": t.wave},
        "toolchain": {"name": toolchain.name, "version": toolchain.version},
        "flags": toolchain.flags(t),
    }


def hash_inputs(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()


def cache_key(src: KernelSource, toolchain: Toolchain, version: str = __version__) -> str:
    """The full (64 hex digit) key of compiling ``src`` with ``toolchain`` under ds4c ``version``."""
    return hash_inputs(key_inputs(src, toolchain, version))


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "kernel"


@dataclass(frozen=True)
class CacheEntry:
    """A complete cache entry. ``path`` is its folder, ``key`` the full hash, ``meta`` the parsed meta.json;
    ``hit`` is True when it was found in the cache (False when this call compiled it)."""

    path: Path
    key: str
    name: str
    target: Target
    meta: dict[str, Any]
    hit: bool = True

    @property
    def kind(self) -> str:
        return self.meta["binary"]["kind"]

    @property
    def binary_path(self) -> Path:
        return self.path / self.meta["binary"]["file"]

    @property
    def source_path(self) -> Path:
        return self.path / self.meta["source"]["file"]

    @property
    def log_path(self) -> Path:
        return self.path / LOG

    @property
    def entry(self) -> str:
        """The ``extern "C"`` function to load from the binary."""
        return self.meta["kernel"]["entry"]

    @property
    def resources(self) -> dict[str, dict[str, Any]]:
        """Per-function resource use (see :func:`ds4c.runtime.toolchain.resource_usage`)."""
        return self.meta.get("resources", {})

    @property
    def size(self) -> int:
        """Bytes of the binary."""
        return int(self.meta["binary"]["bytes"])

    @property
    def created(self) -> float:
        return float(self.meta.get("created", 0.0))

    def binary(self) -> bytes:
        return self.binary_path.read_bytes()

    def source(self) -> str:
        return self.source_path.read_text()


def _load_entry(path: Path, key: str | None = None, check_binary: bool = True) -> CacheEntry | None:
    """The entry in ``path`` if it is complete and consistent, else None.

    Always checked: ``meta.json`` parses, its ``key`` matches the folder name (and ``key`` if given), the source
    and the binary exist. With ``check_binary`` (every lookup before use) also: the key recomputed from meta's
    key fields and the saved source equals ``key``, and the binary's size and sha256 are as recorded."""
    try:
        meta = json.loads((path / META).read_text())
        h = meta["key"]
        if not path.name.endswith("-" + h[:12]) or (key is not None and h != key):
            return None
        t = meta["target"]
        tgt = Target(t["vendor"], t["arch"], int(t["wave"]))
        b = meta["binary"]
        src_path = path / meta["source"]["file"]
        bin_path = path / b["file"]
        if check_binary:
            inputs = {f: meta[f] for f in _KEY_FIELDS}
            inputs["source"] = src_path.read_text()
            if hash_inputs(inputs) != h:
                return None
            data = bin_path.read_bytes()
            if len(data) != b["bytes"] or hashlib.sha256(data).hexdigest() != b["sha256"] \
                    or not is_valid_binary(data, b["kind"]):
                return None
        elif not (src_path.is_file() and bin_path.is_file()):
            return None
        return CacheEntry(path, h, meta["kernel"]["name"], tgt, meta)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _is_target_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink() and p.name.split("-", 1)[0] in ("cuda", "hip")


class KernelCache:
    """The on-disk kernel cache under ``root`` (default :func:`cache_root`) for ds4c ``version``.

    Thread-safe and multi-process-safe: every entry is published by an atomic rename.
    """

    def __init__(self, root: str | os.PathLike | None = None, version: str = __version__):
        self.root = Path(root) if root is not None else cache_root()
        self.version = version
        self._toolchains: dict[Target, Toolchain] = {}
        if self.root.exists() and not self.root.is_dir():
            raise CacheError(f"the kernel cache {self.root} is not a directory (set $DS4C_CACHE to a folder)")
        self.swept = self.sweep()
        """How many stale temporaries (of killed compiles) opening the cache removed."""

    # ------------------------------------------------------------------------------------- leftovers
    def sweep(self) -> int:
        """Remove the temporary entry folders (with the compiler temp files inside them) and the trash that
        killed compiles left under every target folder; returns how many. Live compiles' folders are kept
        (:mod:`ds4c.tempfiles`)."""
        return sum(len(remove_stale(t, None, _TEMP_TAGS)) for t in self._target_dirs())

    def temporaries(self) -> tuple[int, int]:
        """``(live, stale)`` counts of the temporary entry folders under the root (``ds4c cache list``)."""
        found = [lo.stale for t in self._target_dirs() for lo in find_leftovers(t, None, _TEMP_TAGS)]
        return len(found) - sum(found), sum(found)

    def check_writable(self) -> None:
        """Raises CacheError when entries cannot be published under the root (checked before compiling)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheError(f"the kernel cache {self.root} cannot be created ({e.strerror}); set $DS4C_CACHE to "
                             f"a writable folder") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise CacheError(f"the kernel cache {self.root} is not writable; set $DS4C_CACHE to a writable folder")

    # ------------------------------------------------------------------------------------------ keys
    def toolchain_for(self, target: Target, toolchain: Toolchain | None = None) -> Toolchain:
        """``toolchain`` (checked against the vendor) or the one :func:`find_toolchain` picks (memoized)."""
        if toolchain is not None:
            toolchain.flags(target)  # raises ToolchainError on a vendor mismatch
            return toolchain
        if target not in self._toolchains:
            self._toolchains[target] = find_toolchain(target)
        return self._toolchains[target]

    def key(self, src: KernelSource, toolchain: Toolchain) -> str:
        return cache_key(src, toolchain, self.version)

    def entry_dir(self, src: KernelSource, key: str) -> Path:
        return self.root / self.version / src.target.slug / f"{_safe_name(src.name)}-{key[:12]}"

    # ------------------------------------------------------------------------------------- lookup
    def lookup(self, src: KernelSource, toolchain: Toolchain | None = None) -> CacheEntry | None:
        """The cached entry of ``src`` (compiled by ``toolchain``), or None on a miss. Never compiles."""
        tc = self.toolchain_for(src.target, toolchain)
        key = self.key(src, tc)
        return _load_entry(self.entry_dir(src, key), key)

    def get_or_compile(self, src: KernelSource, target: Target | None = None,
                       toolchain: Toolchain | None = None) -> CacheEntry:
        """The entry of ``src``: from the cache, or compiled now and published.

        ``target`` (optional) must equal ``src.target``; ``toolchain`` defaults to :func:`find_toolchain`'s.

        Raises:
            CacheError: ``target`` differs from the source's target; the entry cannot be written (a full disk,
                also when the compiler exited 0 on it; nothing is published).
            ToolchainError: no compiler for the target.
            CompileError: the compile failed (nothing is published).
        """
        if target is not None and target != src.target:
            raise CacheError(f"kernel {src.name!r} was rendered for {src.target.slug}, not for {target.slug}")
        tc = self.toolchain_for(src.target, toolchain)
        inputs = key_inputs(src, tc, self.version)
        key = hash_inputs(inputs)
        final = self.entry_dir(src, key)
        hit = _load_entry(final, key)
        if hit is not None:
            return hit
        if final.exists():
            self._remove_corrupt(final, key)
        return self._compile_and_publish(src, tc, inputs, key, final)

    def _lock(self, final: Path):
        from filelock import FileLock

        d = final.parent / _LOCKS
        d.mkdir(parents=True, exist_ok=True)
        return FileLock(str(d / (final.name + ".lock")))

    def _remove_corrupt(self, final: Path, key: str) -> None:
        """Remove an incomplete or inconsistent entry, unless a valid one replaced it meanwhile."""
        with self._lock(final):
            if final.exists() and _load_entry(final, key) is None:
                trash = final.parent / f".{final.name}{_TRASH_TAG}{owner_tag()}-{time.monotonic_ns()}"
                try:
                    os.rename(final, trash)
                except FileNotFoundError:
                    return
                shutil.rmtree(trash, ignore_errors=True)

    def _compile_and_publish(self, src: KernelSource, tc: Toolchain, inputs: dict[str, Any], key: str,
                             final: Path) -> CacheEntry:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            owned = OwnedTemp.create(final.parent, "." + final.name, TMP_TAG, is_dir=True)
        except OSError as e:
            raise self._write_error(e, final) from None
        tmp = owned.path
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a published entry is as readable as its siblings
            res = tc.compile(src, tmp)
            src_file = f"kernel{src.ext}"
            bin_file = f"kernel.{res.kind}"
            if not (tmp / src_file).is_file():
                (tmp / src_file).write_text(src.source)
            if not (tmp / bin_file).is_file():
                (tmp / bin_file).write_bytes(res.binary)
            cmd = " ".join(res.command)
            (tmp / LOG).write_text(f"$ {cmd}\n{res.log}")
            meta = {k: v for k, v in inputs.items() if k != "source"}
            meta.update({
                "key": key,
                "source": {"file": src_file, "sha256": hashlib.sha256(src.source.encode()).hexdigest(),
                           "bytes": len(src.source.encode())},
                "binary": {"file": bin_file, "kind": res.kind, "bytes": len(res.binary),
                           "sha256": hashlib.sha256(res.binary).hexdigest()},
                "resources": resource_usage(res, src.target),
                "compile_seconds": round(res.seconds, 4),
                "toolchain_path": tc.path,  # informational only: not part of the key
                "created": time.time(),
            })
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True, default=_canon) + "\n")
            for _ in range(5):
                try:
                    os.rename(tmp, final)
                    break
                except OSError:
                    if not final.exists():
                        raise
                    # another process published first: use theirs (if valid), discard ours
                    theirs = _load_entry(final, key)
                    if theirs is not None:
                        return theirs
                    self._remove_corrupt(final, key)
            else:  # pragma: no cover - a folder keeps reappearing corrupt
                raise CacheError(f"cannot publish cache entry {final}: a corrupt folder keeps reappearing there")
            entry = _load_entry(final, key, check_binary=False)
            if entry is None:  # pragma: no cover - removed by someone else right after publication
                raise CacheError(f"cache entry {final} vanished right after it was written")
            return dataclasses.replace(entry, hit=False)
        except OSError as e:  # a full disk (the compiler's output or ours): nothing is published
            raise self._write_error(e, final) from None
        finally:
            owned.discard()  # after a publication only the lock is left to drop

    def _write_error(self, e: OSError, final: Path) -> CacheError:
        """The one-line error of a failed write of the entry ``final`` (``no space left on device`` when full)."""
        return CacheError(f"{write_error_text(e, f'the kernel cache entry {final}')}; free space under {self.root} "
                          f"or set $DS4C_CACHE to a folder on another device")

    # -------------------------------------------------------------------------------- compile many
    def compile_many(self, sources: Sequence[KernelSource], jobs: int | None = None, progress: bool = True,
                     toolchain: Toolchain | None = None) -> list[CacheEntry]:
        """Entries of ``sources`` (in order), compiling the misses in parallel with ``jobs`` threads
        (default ``os.cpu_count()``; compilers are subprocesses, so threads are enough).

        First prints one line per target to stderr, e.g. ``cuda-sm_90: 37 distinct kernels, compiling 25, 12 cached``,
        then a progress bar over the
        compiles (plain lines when stderr is not a terminal, :func:`ds4c.progress.progress_bar`; ``progress=False``
        prints neither). Hits compile nothing; a source given twice is compiled
        once.

        Raises:
            ToolchainError, CompileError: as :meth:`get_or_compile` (the first failure, after the other
                compiles in flight finish).
        """
        jobs = max(1, jobs or os.cpu_count() or 1)
        keyed: list[tuple[str, Path]] = []
        by_key: dict[tuple[str, Path], KernelSource] = {}
        tcs: dict[Target, Toolchain] = {}
        for s in sources:
            tc = tcs.setdefault(s.target, self.toolchain_for(s.target, toolchain))
            k = self.key(s, tc)
            kk = (k, self.entry_dir(s, k))
            keyed.append(kk)
            by_key.setdefault(kk, s)
        done: dict[tuple[str, Path], CacheEntry] = {}
        per_target: OrderedDict[Target, list[int]] = OrderedDict()
        for kk, s in by_key.items():
            e = _load_entry(kk[1], kk[0])
            counts = per_target.setdefault(s.target, [0, 0])
            counts[0] += 1
            if e is not None:
                done[kk] = e
                counts[1] += 1
        todo = [kk for kk in by_key if kk not in done]
        if progress:
            for t, (n, cached) in per_target.items():
                print(f"{t.slug}: {n} distinct kernel{'s' if n != 1 else ''}, compiling {n - cached}, "
                      f"{cached} cached", file=sys.stderr, flush=True)
        if todo:
            self.check_writable()
            with progress_bar(len(todo), "compile", "kernel", disable=not progress) as bar, ThreadPoolExecutor(max_workers=min(jobs, len(todo))) as ex:
                futs = {ex.submit(self.get_or_compile, by_key[kk], None, tcs[by_key[kk].target]): kk
                        for kk in todo}
                first_err: BaseException | None = None
                for f in as_completed(futs):
                    try:
                        done[futs[f]] = f.result()
                    except BaseException as e:  # noqa: BLE001 - re-raised below, once the pool is drained
                        if first_err is None:
                            first_err = e
                            for g in futs:
                                g.cancel()
                    bar.update(1)
            if first_err is not None:
                raise first_err
        return [done[kk] for kk in keyed]

    # -------------------------------------------------------------------------------- inspection
    def _target_dirs(self, all_versions: bool = True) -> Iterable[Path]:
        """``<root>/<version>/<vendor>-<arch>`` folders (only those: nothing else under root is touched)."""
        if not self.root.is_dir():
            return
        vers = sorted(self.root.iterdir()) if all_versions else [self.root / self.version]
        for v in vers:
            if v.is_dir() and not v.is_symlink() and not v.name.startswith("."):
                yield from (t for t in sorted(v.iterdir()) if _is_target_dir(t))

    def _entry_dirs(self, all_versions: bool = True) -> Iterable[Path]:
        for t in self._target_dirs(all_versions):
            yield from (e for e in sorted(t.iterdir()) if e.is_dir() and not e.name.startswith("."))

    def list(self, all_versions: bool = True) -> list[CacheEntry]:
        """Every complete entry (of every ds4c version unless ``all_versions=False``), sorted by target and
        name. Incomplete folders are skipped (they are misses)."""
        out = [e for d in self._entry_dirs(all_versions) if (e := _load_entry(d, check_binary=False))]
        return sorted(out, key=lambda e: (e.target.slug, e.name, e.key))

    def show(self, key_prefix: str) -> CacheEntry:
        """The one entry whose key starts with ``key_prefix`` (or whose folder name is ``key_prefix``).

        Raises:
            CacheError: no entry or several entries match.
        """
        p = key_prefix.strip().lower()
        if not p:
            raise CacheError("expected a cache key (a hash prefix from `ds4c cache list`), found an empty string")
        entries = self.list()
        hits = [e for e in entries if e.key.startswith(p) or e.path.name.lower() == p]
        if not hits:
            raise CacheError(f"no cache entry matches key {key_prefix!r} under {self.root} "
                             f"({len(entries)} entries; `ds4c cache list` shows them)")
        if len(hits) > 1:
            raise CacheError(f"key {key_prefix!r} is ambiguous: it matches "
                             + ", ".join(f"{e.name}-{e.key[:12]}" for e in hits[:10])
                             + ("..." if len(hits) > 10 else "") + "; give more digits")
        return hits[0]

    def clear(self) -> int:
        """Remove every entry of every ds4c version (with temporary, corrupt and lock files); returns how
        many complete entries there were. Only ``<root>/<version>/<vendor>-<arch>/`` folders are removed, and
        then the version folders they leave empty."""
        n = len(self.list())
        for t in list(self._target_dirs()):
            shutil.rmtree(t, ignore_errors=True)
            try:
                t.parent.rmdir()
            except OSError:
                pass
        return n
