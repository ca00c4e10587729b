"""Tests of the content-addressed kernel cache (ds4c.runtime.cache) and ``ds4c cache list|show|clear``.

Mechanics (keys, hits, corrupt entries, races, compile_many) use a fake toolchain that writes a small valid
ELF and counts its compiles in a file (so counts add up across processes); one end-to-end test per installed
compiler (nvcc sm_90, clang gfx942 / gfx1151) compiles the selftest kernel for real and checks that a hit
runs no compiler.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4c import __version__
from ds4c.cli import main
from ds4c.runtime import render as render_mod
from ds4c.runtime import toolchain as tcm
from ds4c.runtime.cache import CacheError, KernelCache, _load_entry, cache_key, canonical_json, key_inputs
from ds4c.runtime.render import KernelSource, render
from ds4c.runtime.targets import target
from kernel_compile import toolchain_or_skip
from ds4c.runtime.toolchain import CompileError, CompileResult, Toolchain

PARAMS = {"threads": 256, "per_thread": 4}


def axpy(arch: str = "sm_90", name: str = "selftest.axpy", **params) -> KernelSource:
    return render("selftest/axpy.cu.j2", name, "selftest", target(arch), {**PARAMS, **params})


_ACTIVE = [0, 0]  # (now, peak) concurrent fake compiles in this process
_ACTIVE_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class FakeToolchain(Toolchain):
    """A CUDA 'compiler' that sleeps ``delay`` seconds and writes an ELF with e_machine EM_CUDA whose body is
    the source digest; appends one line per compile to ``counter``; fails on sources with ``fail`` in params."""

    counter: str = ""
    delay: float = 0.0

    @property
    def vendor(self) -> str:
        return "cuda"

    def flags(self, target) -> list[str]:
        return ["-fake", f"-arch={target.arch}"]

    def compile(self, src: KernelSource, workdir: Path) -> CompileResult:
        with _ACTIVE_LOCK:
            _ACTIVE[0] += 1
            _ACTIVE[1] = max(_ACTIVE)
        try:
            with open(self.counter, "a") as f:
                f.write(f"{os.getpid()} {src.name}\n")
            time.sleep(self.delay)
            if src.params.get("fail"):
                raise CompileError(src.name, src.target, ["fake"], "kernel.cu(1): error: asked to fail")
            binary = b"\x7fELF" + bytes(12) + (2).to_bytes(2, "little") + (190).to_bytes(2, "little") \
                + src.digest().encode()
            (Path(workdir) / f"kernel{src.ext}").write_text(src.source)
            (Path(workdir) / "kernel.cubin").write_bytes(binary)
            log = (f"ptxas info    : Compiling entry function '{src.entry}' for '{src.target.arch}'\n"
                   f"ptxas info    : Function properties for {src.entry}\n"
                   "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                   "ptxas info    : Used 22 registers, used 1 barriers, 32 bytes smem\n")
            return CompileResult(binary, "cubin", log, self.delay, ("fake",))
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE[0] -= 1


@pytest.fixture
def fake(tmp_path) -> FakeToolchain:
    return FakeToolchain("fake", "1.0", "/opt/fake/bin/fakecc", counter=str(tmp_path / "compiles.txt"))


def compiles(tc: FakeToolchain) -> int:
    return len(Path(tc.counter).read_text().splitlines()) if Path(tc.counter).exists() else 0


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "cache")


# ------------------------------------------------------------------------------------------------ keys
NVCC = Toolchain("nvcc", "13.0.88", "/usr/local/cuda/bin/nvcc")


def test_every_key_input_changes_the_key():
    src = axpy()
    k = cache_key(src, NVCC)
    assert len(k) == 64 and int(k, 16) >= 0
    assert cache_key(axpy(), NVCC) == k  # deterministic
    variants = {
        "source": cache_key(dataclasses.replace(src, source=src.source + "// x\n"), NVCC),
        "template text": cache_key(dataclasses.replace(
            src, templates={**src.templates, "prelude/common.h.j2": src.templates["prelude/common.h.j2"] + " "}),
            NVCC),
        "param": cache_key(dataclasses.replace(src, params={**src.params, "unused": 1}), NVCC),
        "param value": cache_key(dataclasses.replace(src, params={**src.params, "threads": 128}), NVCC),
        "arch": cache_key(dataclasses.replace(src, target=target("sm_80")), NVCC),
        "wave": cache_key(dataclasses.replace(src, target=dataclasses.replace(src.target, wave=64)), NVCC),
        "toolchain version": cache_key(src, Toolchain("nvcc", "13.1.0", NVCC.path)),
        "toolchain name": cache_key(src, Toolchain("nvrtc", "13.0.88")),
        "ds4c version": cache_key(src, NVCC, version=__version__ + ".post1"),
        "kernel name": cache_key(dataclasses.replace(src, name="selftest.other"), NVCC),
        "entry": cache_key(dataclasses.replace(src, entry="other"), NVCC),
    }
    for what, v in variants.items():
        assert v != k, what
    assert len(set(variants.values())) == len(variants)


def test_flags_change_the_key(monkeypatch):
    src = axpy()
    k = cache_key(src, NVCC)
    real = Toolchain.flags
    monkeypatch.setattr(Toolchain, "flags", lambda self, t: real(self, t) + ["-lineinfo"])
    assert cache_key(src, NVCC) != k


def test_absolute_paths_do_not_change_the_key(tmp_path, monkeypatch):
    src = axpy()
    k = cache_key(src, NVCC)
    # the toolchain installed elsewhere
    assert cache_key(src, Toolchain("nvcc", NVCC.version, "/elsewhere/cuda/bin/nvcc")) == k
    # the templates (a moved venv / checkout) in two other places
    keys = []
    for where in ("a", "b/deeper"):
        d = tmp_path / where / "templates"
        shutil.copytree(render_mod.TEMPLATE_DIR, d)
        monkeypatch.setattr(render_mod, "TEMPLATE_DIR", d)
        s = axpy()
        keys.append(cache_key(s, NVCC))
        assert str(tmp_path) not in canonical_json(key_inputs(s, NVCC))
    assert keys == [k, k]
    assert str(render_mod.TEMPLATE_DIR) not in canonical_json(key_inputs(src, NVCC))


def test_path_params_are_refused():
    src = dataclasses.replace(axpy(), params={"file": Path("/tmp/x")})
    with pytest.raises(CacheError, match="path"):
        cache_key(src, NVCC)


# ----------------------------------------------------------------------------------- hits and layout
def test_miss_then_hit_compiles_once(cache, fake):
    src = axpy()
    e = cache.get_or_compile(src, toolchain=fake)
    assert not e.hit and compiles(fake) == 1
    key = cache_key(src, fake)
    assert e.key == key
    assert e.path == cache.root / __version__ / "cuda-sm_90" / f"selftest.axpy-{key[:12]}"
    assert sorted(p.name for p in e.path.iterdir()) == ["compile.log", "kernel.cu", "kernel.cubin", "meta.json"]
    assert e.source_path.read_text() == src.source and e.binary() == (e.path / "kernel.cubin").read_bytes()
    meta = json.loads((e.path / "meta.json").read_text())
    assert meta["key"] == key
    assert meta["templates"] == src.templates and meta["params"] == PARAMS
    assert meta["toolchain"] == {"name": "fake", "version": "1.0"} and meta["flags"] == fake.flags(src.target)
    assert meta["resources"][src.entry]["registers"] == 22
    assert src.source not in (e.path / "meta.json").read_text()  # the source lives beside it
    e2 = cache.get_or_compile(src, src.target, fake)
    assert e2.hit and e2.path == e.path and compiles(fake) == 1
    assert cache.lookup(src, fake).key == key
    assert cache.lookup(axpy(per_thread=2), fake) is None


def test_target_mismatch_is_an_error(cache, fake):
    with pytest.raises(CacheError, match="rendered for cuda-sm_90, not for cuda-sm_80"):
        cache.get_or_compile(axpy(), target("sm_80"), fake)


def test_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4C_CACHE", str(tmp_path / "env-root"))
    assert KernelCache().root == tmp_path / "env-root"
    monkeypatch.delenv("DS4C_CACHE")
    assert KernelCache().root == Path.home() / ".cache" / "ds4c" / "kernels"


def test_failed_compile_publishes_nothing(cache, fake):
    with pytest.raises(CompileError, match="asked to fail"):
        cache.get_or_compile(axpy(fail=True), toolchain=fake)
    assert cache.list() == []
    d = cache.root / __version__ / "cuda-sm_90"
    assert [p.name for p in d.iterdir() if not p.name.startswith(".locks")] == []


# ---------------------------------------------------------------------------------------- corruption
@pytest.mark.parametrize("damage", ["delete binary", "truncate meta", "empty binary", "meta hash mismatch",
                                    "edit source", "delete meta"])
def test_corrupt_entry_is_a_miss_and_is_recompiled(cache, fake, damage):
    src = axpy()
    e = cache.get_or_compile(src, toolchain=fake)
    meta = e.path / "meta.json"
    if damage == "delete binary":
        e.binary_path.unlink()
    elif damage == "truncate meta":
        meta.write_text(meta.read_text()[:40])
    elif damage == "empty binary":
        e.binary_path.write_bytes(b"")
    elif damage == "meta hash mismatch":
        m = json.loads(meta.read_text())
        m["params"]["threads"] = 512
        meta.write_text(json.dumps(m))
    elif damage == "edit source":
        e.source_path.write_text(src.source + "// edited\n")
    elif damage == "delete meta":
        meta.unlink()
    assert cache.lookup(src, fake) is None
    e2 = cache.get_or_compile(src, toolchain=fake)
    assert not e2.hit and compiles(fake) == 2 and e2.path == e.path
    assert _load_entry(e2.path, e2.key) is not None
    assert cache.get_or_compile(src, toolchain=fake).hit and compiles(fake) == 2


def test_leftover_temp_folders_are_ignored(cache, fake):
    e = cache.get_or_compile(axpy(), toolchain=fake)
    (e.path.parent / ".tmp-selftest.axpy-deadbeef-crashed").mkdir()
    (e.path.parent / f"selftest.axpy-{'0' * 12}").mkdir()  # a half-made folder with no meta
    assert [x.key for x in cache.list()] == [e.key]
    assert cache.get_or_compile(axpy(), toolchain=fake).hit


# ------------------------------------------------------------------------------------------- races
def _race_worker(root: str, counter: str, barrier, queue) -> None:
    tc = FakeToolchain("fake", "1.0", None, counter=counter, delay=0.5)
    src = axpy()
    barrier.wait()
    e = KernelCache(root).get_or_compile(src, toolchain=tc)
    queue.put((str(e.path), e.key, e.binary().hex()))


def test_two_processes_compiling_one_key_both_get_a_valid_entry(tmp_path, fake):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    root = str(tmp_path / "cache")
    procs = [ctx.Process(target=_race_worker, args=(root, fake.counter, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert compiles(fake) == 2  # both missed and compiled: the rename decided who published
    (path0, key0, bin0), (path1, key1, bin1) = results
    assert path0 == path1 and key0 == key1 and bin0 == bin1
    entry_dir = Path(path0)
    assert _load_entry(entry_dir, key0) is not None
    siblings = [p.name for p in entry_dir.parent.iterdir() if p.name != ".locks"]
    assert siblings == [entry_dir.name]  # no temp folder left behind
    assert bytes.fromhex(bin0) == entry_dir.joinpath("kernel.cubin").read_bytes()


# ------------------------------------------------------------------------------------- compile_many
def test_compile_many_is_parallel_and_prints_a_progress_line(cache, tmp_path, capsys):
    tc = FakeToolchain("fake", "1.0", None, counter=str(tmp_path / "n.txt"), delay=0.3)
    srcs = [axpy(arch, name=f"selftest.axpy{n}", per_thread=n) for arch in ("sm_90", "sm_80") for n in (1, 2, 4)]
    cache.get_or_compile(srcs[0], toolchain=tc)  # one already cached
    _ACTIVE[1] = 0
    entries = cache.compile_many(srcs + [srcs[1]], jobs=4, toolchain=tc)
    err = capsys.readouterr().err
    assert "cuda-sm_90: 3 distinct kernels, compiling 2, 1 cached" in err
    assert "cuda-sm_80: 3 distinct kernels, compiling 3, 0 cached" in err
    assert compiles(tc) == 6  # 1 before + 5 misses; the repeated source compiled once
    assert _ACTIVE[1] >= 2, "compiles did not overlap"
    assert [e.name for e in entries] == [s.name for s in srcs] + [srcs[1].name]
    assert [e.target for e in entries[:6]] == [s.target for s in srcs]
    assert entries[0].hit and not any(e.hit for e in entries[1:6])
    again = cache.compile_many(srcs, toolchain=tc)
    assert compiles(tc) == 6 and all(e.hit for e in again)
    assert [e.path for e in again] == [e.path for e in entries[:6]]
    assert "cuda-sm_90: 3 distinct kernels, compiling 0, 3 cached" in capsys.readouterr().err
    cache.compile_many(srcs, toolchain=tc, progress=False)
    assert capsys.readouterr().err == ""


def test_compile_many_raises_the_compile_error(cache, fake):
    srcs = [axpy(), axpy(name="selftest.bad", fail=True)]
    with pytest.raises(CompileError, match="selftest.bad"):
        cache.compile_many(srcs, jobs=2, toolchain=fake, progress=False)
    assert [e.name for e in cache.list()] == ["selftest.axpy"]


# --------------------------------------------------------------------------------- real compilers
@pytest.mark.parametrize("arch", ["sm_90", "gfx942", "gfx1151"])
def test_real_compile_is_cached(arch, cache, monkeypatch):
    tc = toolchain_or_skip(arch)
    if tc.name == "nvrtc":
        pytest.skip("only the nvcc path runs a subprocess to count")
    calls = []
    real = tcm._run
    monkeypatch.setattr(tcm, "_run", lambda *a, **k: calls.append(a) or real(*a, **k))
    src = axpy(arch)
    e = cache.get_or_compile(src, toolchain=tc)
    assert len(calls) == 1 and not e.hit
    assert e.binary_path.name == ("kernel.cubin" if arch.startswith("sm_") else "kernel.hsaco")
    assert e.resources[src.entry]["registers"] > 0
    assert e.meta["compile_seconds"] > 0 and (e.path / "compile.log").read_text().startswith("$ ")
    e2 = cache.get_or_compile(src, toolchain=tc)
    assert e2.hit and len(calls) == 1 and e2.binary() == e.binary()
    assert cache.compile_many([src], progress=False)[0].path == e.path and len(calls) == 1


# ---------------------------------------------------------------------------------------------- CLI
def cli(root: Path, *args: str):
    return CliRunner().invoke(main, ["cache", *args], env={"DS4C_CACHE": str(root)}, catch_exceptions=False)


def test_cli_list_show_clear(tmp_path, fake):
    root = tmp_path / "cache"
    c = KernelCache(root)
    e1 = c.get_or_compile(axpy(), toolchain=fake)
    e2 = c.get_or_compile(axpy("sm_80", name="selftest.axpy80"), toolchain=fake)
    (root / "unrelated").mkdir()  # not a cache folder: clear leaves it alone
    (root / "unrelated" / "keep.txt").write_text("x")

    r = cli(root, "list")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert any(ln.startswith("cuda-sm_90") and "selftest.axpy " in ln and e1.key[:12] in ln for ln in lines)
    assert any(ln.startswith("cuda-sm_80") and "selftest.axpy80" in ln and e2.key[:12] in ln for ln in lines)
    assert lines[-2].startswith("2 entries in ")
    assert lines[-1] == "temporary folders: 0 of compiles in progress, 0 stale left; 0 stale removed on opening the cache"

    r = cli(root, "show", e1.key[:8])
    assert r.exit_code == 0, r.output
    assert e1.key in r.stdout and str(e1.source_path) in r.stdout and "registers 22" in r.stdout
    assert '"flags"' in r.stdout and "selftest/axpy.cu.j2" in r.stdout

    r = cli(root, "show", "ffffzzzz")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.startswith("ds4c: error: no cache entry matches key 'ffffzzzz'")

    r = cli(root, "clear")
    assert r.exit_code == 0 and "removed 2 cache entries" in r.stdout
    assert cli(root, "list").stdout.startswith("0 entries")
    assert (root / "unrelated" / "keep.txt").exists()


def test_show_ambiguous_prefix(tmp_path, fake):
    c = KernelCache(tmp_path / "cache")
    entries = [c.get_or_compile(axpy(name=f"k{i}", per_thread=i), toolchain=fake) for i in range(1, 40)]
    first = {}
    for e in entries:
        first.setdefault(e.key[0], []).append(e)
    dup = next(v for v in first.values() if len(v) > 1)
    with pytest.raises(CacheError, match="ambiguous"):
        c.show(dup[0].key[0])
    assert c.show(dup[0].key).key == dup[0].key
    assert c.show(dup[0].path.name).key == dup[0].key


def test_a_cache_root_that_is_a_file_is_an_error(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(CacheError, match="is not a directory"):
        KernelCache(f)
    with pytest.raises(CacheError, match="cannot be created"):
        KernelCache(f / "sub").check_writable()
