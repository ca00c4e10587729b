"""Tests of AOT artifacts (ds4c.runtime.artifact) and ``ds4c compile`` / ``ds4c inspect``.

Two layers of tests:

* the artifact mechanics (layout, manifest, de-duplication, atomic publication, load errors) with a fake
  ``lower_graph`` that lowers every plan kernel to one launch of the selftest ``axpy`` kernel (two variants,
  so each target compiles two binaries);
* end to end with the real ``ds4c.runtime.lower.lower_graph`` (when it exists): ``ds4c compile --preset tiny``
  for sm_90 + gfx1151, re-run from the cache, every plan kernel listed, ``inspect`` at every level.

Compiles go to one session-scoped kernel cache, so each distinct kernel is compiled once per test run. Tests
that compile skip (with the reason) when a target's compiler is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from ds4c import __version__
from ds4c.buckets import BucketSpec
from ds4c.cli import main
from ds4c.config import preset
from ds4c.errors import ConfigError
from ds4c.ir import build_step
from ds4c.ir.printer import graph_hash
from ds4c.passes.manager import run_pipeline
from ds4c.passes.partition import kernel_plan
from ds4c.runtime import artifact_inspect, artifact_manifest, artifact_publish
from ds4c.runtime import lower as lower_mod
from ds4c.runtime.artifact import build_artifact
from ds4c.runtime.artifact_manifest import ArtifactError, load_manifest
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.lowered import Arg, Launch, LoweredKernel
from ds4c.runtime.render import render
from ds4c.runtime.targets import TargetError, parse_targets
from ds4c.runtime.toolchain import ToolchainError, find_toolchain, is_valid_binary

TINY = preset("tiny")
ARCHS = "sm_90,gfx1151"
HAS_REAL_LOWER = hasattr(lower_mod, "lower_graph")


def _missing_compilers(archs: str) -> list[str]:
    out = []
    for t in parse_targets(archs):
        try:
            find_toolchain(t)
        except ToolchainError as e:
            out.append(f"{t.slug}: {e}")
    return out


needs_compilers = pytest.mark.skipif(bool(_missing_compilers(ARCHS)),
                                     reason="; ".join(_missing_compilers(ARCHS)) or "compilers present")


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kernel cache for the whole session (each distinct kernel is compiled once)."""
    return tmp_path_factory.mktemp("kernel-cache")


@pytest.fixture
def cache_env(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DS4C_CACHE", str(cache_dir))
    return cache_dir


def fake_lower_graph(g, cfg, target, weight_types=None) -> list[LoweredKernel]:
    """Every plan kernel -> one launch of selftest axpy (per_thread 1 for embedding/head kernels, else 2)."""
    out = []
    for k in kernel_plan(g).kernels:
        pt = 1 if k.layer < 0 else 2
        src = render("selftest/axpy.cu.j2", f"selftest.axpy{pt}", "selftest", target,
                     {"threads": 256, "per_thread": pt})
        grid = tuple((list(k.launch.get("grid", [1])) + [1, 1])[:3])
        args = (Arg("value", k.inputs[0] if k.inputs else "x"), Arg("value", k.outputs[0]),
                Arg("step", "pos"), Arg("int", "n", value=256 * pt), Arg("workspace", "total", nbytes=4))
        out.append(LoweredKernel(k.name, k.family, k.layer, [Launch(src, grid, (256, 1, 1), 0, args)]))
    return out


@pytest.fixture
def fake_lower(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(lower_mod, "lower_graph", fake_lower_graph, raising=False)
    return fake_lower_graph


def tiny_buckets(widths=(1,), max_ctx=64, contexts=None) -> BucketSpec:
    return BucketSpec.build(TINY, widths, max_ctx, contexts)


def run(*args: str, env: dict | None = None) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], env=env or {}, catch_exceptions=False)


def assert_error_line(r: Result, *parts: str) -> str:
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ds4c: error: "), lines[0]
    for p in parts:
        assert p in lines[0], (p, lines[0])
    return lines[0]


def summary_counts(out: str) -> tuple[int, int]:
    m = re.search(r"compiled (\d+), cached (\d+)", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name + "."))


# ----------------------------------------------------------------------------------- fake lower: mechanics
@needs_compilers
def test_build_layout_and_manifest(tmp_path, cache_dir, fake_lower):
    targets = parse_targets(ARCHS)
    buckets = tiny_buckets((1, 2), 64)
    out = build_artifact(TINY, targets, buckets, tmp_path / "art", KernelCache(cache_dir), progress=False)
    assert out == (tmp_path / "art").absolute()
    man = load_manifest(out)
    assert man["ds4c_version"] == __version__
    assert man["config"] == TINY.model_dict() and man["config_hash"] == TINY.hash()
    assert man["buckets"] == buckets.as_dict() and man["buckets_hash"] == buckets.hash()
    assert list(man["targets"]) == ["cuda-sm_90", "hip-gfx1151"]
    keys = [f"q{w}_c{c}" for w, c in buckets.keys()]
    assert list(man["graphs"]) == keys
    for (w, c), gk in zip(buckets.keys(), keys):
        g = run_pipeline(build_step(TINY, w, buckets.max_ctx), "default", context=c).graph
        assert man["graphs"][gk]["graph_hash"] == graph_hash(g)
        assert man["graphs"][gk]["arena_bytes"] == g.meta["memory"]["arena_bytes"] > 0
        assert man["graphs"][gk]["memory"]["slots"]
        names = [k.name for k in kernel_plan(g).kernels]
        for slug, t in man["targets"].items():
            tg = t["graphs"][gk]
            assert (tg["width"], tg["context"], tg["graph_hash"]) == (w, c, graph_hash(g))
            assert [k["name"] for k in tg["kernels"]] == names
    for slug, t in man["targets"].items():
        assert t["toolchain"]["name"] and t["toolchain"]["version"]
        kind = "cubin" if slug.startswith("cuda") else "hsaco"
        # two axpy variants per target: every launch points at one of two de-duplicated binaries
        assert len(t["binaries"]) == 2
        used = {ld["binary"] for g in t["graphs"].values() for k in g["kernels"] for ld in k["launches"]}
        assert used == set(t["binaries"])
        for rel, b in t["binaries"].items():
            assert re.fullmatch(rf"bin/{slug}/selftest\.axpy[12]-[0-9a-f]{{12}}\.{kind}", rel), rel
            assert rel.endswith(f"-{b['key'][:12]}.{kind}")
            data = (out / rel).read_bytes()
            assert is_valid_binary(data, kind) and len(data) == b["bytes"]
            assert "axpy" in (out / b["source"]).read_text()
            assert b["entry"] in b["resources"] or not b["resources"]
        ld = t["graphs"][keys[0]]["kernels"][0]["launches"][0]
        assert {"binary", "key", "grid", "block", "smem", "args", "entry"} <= set(ld)
        assert ld["key"] == t["binaries"][ld["binary"]]["key"]
        assert [a["kind"] for a in ld["args"]] == ["value", "value", "step", "int", "workspace"]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [r for t in man["targets"].values() for r in t["binaries"]]
                           + [b["source"] for t in man["targets"].values() for b in t["binaries"].values()])
    assert man["build"]["unique_binaries"] == 4
    assert man["build"]["plan_kernels"] == 2 * sum(len(g["kernels"]) for g in man["targets"]["cuda-sm_90"]["graphs"].values())
    assert leftovers(out) == []


@needs_compilers
def test_rebuild_hits_cache_and_replaces_atomically(tmp_path, cache_dir, fake_lower, monkeypatch):
    cache = KernelCache(cache_dir)
    targets = parse_targets(ARCHS)
    out = build_artifact(TINY, targets, tiny_buckets(), tmp_path / "art", cache, progress=False)
    (out / "stale-file").write_text("from the previous artifact")
    compiled = []
    real = KernelCache.get_or_compile
    monkeypatch.setattr(KernelCache, "get_or_compile", lambda self, *a, **k: compiled.append(a) or real(self, *a, **k))
    out2 = build_artifact(TINY, targets[::-1], tiny_buckets((1,), 128, (64, 128)), tmp_path / "art", cache,
                          progress=False)
    assert out2 == out and compiled == []
    man = load_manifest(out)
    assert man["build"]["compiled"] == 0 and man["build"]["cached"] == 4
    assert man["buckets"]["max_ctx"] == 128
    # targets in the order given, graphs in bucket order (not sorted as strings)
    assert list(man["targets"]) == ["hip-gfx1151", "cuda-sm_90"]
    assert list(man["graphs"]) == list(man["targets"]["cuda-sm_90"]["graphs"]) == ["q1_c64", "q1_c128"]
    assert not (out / "stale-file").exists()  # the whole folder was replaced
    assert leftovers(out) == []


@needs_compilers
def test_interrupted_build_keeps_previous_artifact(tmp_path, cache_dir, fake_lower, monkeypatch):
    cache = KernelCache(cache_dir)
    targets = parse_targets(ARCHS)
    out = build_artifact(TINY, targets, tiny_buckets(), tmp_path / "art", cache, progress=False)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(KernelCache, "compile_many", boom)
    with pytest.raises(KeyboardInterrupt):
        build_artifact(TINY, targets, tiny_buckets((1, 2), 128), out, cache, progress=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert leftovers(out) == []
    load_manifest(out)

    # an interruption while the artifact is being written (after compiling) leaves it intact as well
    monkeypatch.undo()
    monkeypatch.setattr(lower_mod, "lower_graph", fake_lower_graph, raising=False)
    real_copy = shutil.copyfile
    calls = []

    def copy_then_fail(a, b, *k, **kw):
        calls.append(b)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(b))
        return real_copy(a, b, *k, **kw)

    monkeypatch.setattr(shutil, "copyfile", copy_then_fail)
    with pytest.raises(ArtifactError, match="no space left on device: cannot write the artifact .*; nothing was "
                                            "written"):
        build_artifact(TINY, targets, tiny_buckets((1, 2), 128), out, cache, progress=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert leftovers(out) == []

    # a failed first build leaves nothing at all
    with pytest.raises(ArtifactError, match="no space left on device"):
        calls.clear()
        build_artifact(TINY, targets, tiny_buckets(), tmp_path / "new", cache, progress=False)
    assert not (tmp_path / "new").exists() and leftovers(tmp_path / "new") == []


def test_leftovers_of_a_killed_build_are_cleaned(tmp_path, monkeypatch):
    """A killed build's temp folder is removed; an old artifact set aside by a build killed between its two
    renames is put back."""
    from ds4c.tempfiles import host_id

    out = tmp_path / "art"
    dead = 2**22 + 12345  # above the default pid_max of most systems: no such process
    (tmp_path / f"art.tmp-{dead}-{host_id()}-abc").mkdir()
    (tmp_path / f"art.tmp-{dead}-{host_id()}-abc" / "manifest.json").write_text("{}")
    old = tmp_path / f"art.old-{dead}-{host_id()}-xyz" / "a"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text("{}")
    live = tmp_path / f"art.tmp-{os.getpid()}-{host_id()}-live"  # a build in progress (this process) is kept
    live.mkdir()
    artifact_publish.clean_leftovers(out)
    assert (out / "manifest.json").read_text() == "{}"
    assert leftovers(out) == [live.name]


def test_refuses_to_replace_other_folders(tmp_path, cache_dir, fake_lower):
    d = tmp_path / "not-an-artifact"
    d.mkdir()
    (d / "precious.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a ds4c artifact"):
        build_artifact(TINY, parse_targets("sm_90"), tiny_buckets(), d, KernelCache(cache_dir), progress=False)
    assert (d / "precious.txt").read_text() == "keep me"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ArtifactError, match="not a folder"):
        build_artifact(TINY, parse_targets("sm_90"), tiny_buckets(), f, KernelCache(cache_dir), progress=False)


def test_bad_inputs_raise_ds4c_errors(tmp_path, cache_dir, fake_lower):
    with pytest.raises(TargetError, match="sm_91"):
        parse_targets("sm_90,sm_91")
    with pytest.raises(ConfigError, match="1..5"):
        BucketSpec.build(TINY, (1, 6), 64)
    with pytest.raises(ConfigError, match="do not cover"):
        BucketSpec.build(TINY, (1,), 1000, (64, 128))
    with pytest.raises(ArtifactError, match="at least one target"):
        build_artifact(TINY, [], tiny_buckets(), tmp_path / "a", KernelCache(cache_dir), progress=False)


@needs_compilers
def test_load_manifest_errors(tmp_path, cache_dir, fake_lower):
    with pytest.raises(ArtifactError, match="no artifact folder"):
        load_manifest(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_manifest(tmp_path / "empty")
    out = build_artifact(TINY, parse_targets(ARCHS), tiny_buckets(), tmp_path / "art", KernelCache(cache_dir),
                         progress=False)
    good = (out / "manifest.json").read_text()
    man = json.loads(good)

    (out / "manifest.json").write_text(good[: len(good) // 2])
    with pytest.raises(ArtifactError, match="corrupt artifact manifest"):
        load_manifest(out)
    (out / "manifest.json").write_text(json.dumps({**man, "ds4c_version": "0.0.1"}))
    with pytest.raises(ArtifactError, match=r"built by ds4c 0\.0\.1, this is ds4c"):
        load_manifest(out)
    (out / "manifest.json").write_text(json.dumps({k: v for k, v in man.items() if k != "graphs"}))
    with pytest.raises(ArtifactError, match="missing graphs"):
        load_manifest(out)
    (out / "manifest.json").write_text(good)
    rel = next(iter(man["targets"]["hip-gfx1151"]["binaries"]))
    data = (out / rel).read_bytes()
    (out / rel).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(ArtifactError, match="does not match"):
        load_manifest(out)
    load_manifest(out, verify=False)  # sizes still agree
    (out / rel).unlink()
    with pytest.raises(ArtifactError, match=re.escape(f"binary {rel}") + ".*missing"):
        load_manifest(out)


@needs_compilers
def test_cli_compile_and_inspect_fake(tmp_path, cache_env, fake_lower):
    out = tmp_path / "art"
    r = run("compile", "--preset", "tiny", "--arch", ARCHS, "--widths", "1", "--max-ctx", "64", "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1].startswith("seconds:")
    assert "targets:   cuda-sm_90 (nvcc" in r.stdout and "hip-gfx1151" in r.stdout
    compiled, cached = summary_counts(r.stdout)
    assert compiled + cached == 4
    r = run("compile", "--preset", "tiny", "--arch", ARCHS, "--widths", "1", "--max-ctx", "64", "-o", out)
    assert summary_counts(r.stdout) == (0, 4)
    assert "compiling 0, 2 cached" in r.stderr

    r = run("inspect", out)
    assert r.exit_code == 0, r.output
    assert "config:   tiny" in r.stdout and "q1_c64" in r.stdout and "target hip-gfx1151" in r.stdout
    r = run("inspect", out, "--kernels", "--target", "gfx1151")
    assert r.exit_code == 0, r.output
    assert "hip-gfx1151, graph q1_c64" in r.stdout and "l0." in r.stdout and "regs " in r.stdout
    r = run("inspect", out, "--kernel", "selftest.axpy2", "--source")
    assert r.exit_code == 0 and "DS4C_GLOBAL void selftest_axpy2" in r.stdout
    r = run("inspect", out, "--kernel", "selftest_axpy1", "--resources")
    assert r.exit_code == 0 and "registers" in r.stdout

    r = run("inspect", out, "--kernel", "nope")
    assert_error_line(r, "no kernel 'nope'")
    r = run("inspect", out, "--graph", "q9_c64")
    assert_error_line(r, "no graph 'q9_c64'", "q1_c64")
    assert r.stdout == ""  # checked before the summary is printed (issue 28.8)
    r = run("inspect", out, "--target", "sm_80")
    assert_error_line(r, "no target 'sm_80'")
    r = run("inspect", tmp_path / "missing")
    assert_error_line(r, "no artifact folder")


@needs_compilers
def test_cli_compile_from_gguf_records_weight_types(tmp_path, cache_env, tiny_bf16_path, monkeypatch):
    seen = []
    real = fake_lower_graph

    def spy(g, cfg, target, weight_types=None):
        seen.append(weight_types)
        return real(g, cfg, target, weight_types)

    monkeypatch.setattr(lower_mod, "lower_graph", spy, raising=False)
    out = tmp_path / "art"
    r = run("compile", tiny_bf16_path, "--arch", "sm_90", "--widths", "2", "--max-ctx", "64", "-o", out)
    assert r.exit_code == 0, r.output
    man = load_manifest(out)
    assert man["config_hash"] == TINY.hash()
    assert seen and all(w is not None and w["blk.0.attn_q_a.weight"].name == "BF16" for w in seen)
    assert set(man["weight_types"].values()) <= {"BF16", "F32", "I32"}
    assert man["weight_types_hash"] == artifact_manifest.weight_types_hash(man["weight_types"])
    # a preset compiles the official formats
    out2 = tmp_path / "art2"
    assert run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "2", "--max-ctx", "64", "-o",
               out2).exit_code == 0
    man2 = load_manifest(out2)
    assert man2["weight_types"] == artifact_manifest.effective_weight_types(TINY) and "Q8_0" in man2["weight_types"].values()
    assert man2["weight_types_hash"] != man["weight_types_hash"]
    r = run("compile", tiny_bf16_path, "--preset", "tiny", "--arch", "sm_90", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "not both" in r.output


def test_disassembler_missing_tools(monkeypatch):
    monkeypatch.setattr(artifact_inspect, "find_cuda_tool", lambda tool: None)
    with pytest.raises(ArtifactError, match="cuobjdump and nvdisasm"):
        artifact_inspect.disassembler("cubin", "sm_90")
    monkeypatch.setattr(artifact_inspect, "find_cuda_tool", lambda tool: "/x/cuobjdump" if tool == "cuobjdump" else None)
    with pytest.raises(ArtifactError, match=r"needs nvdisasm \(cuobjdump -sass runs it\)"):
        artifact_inspect.disassembler("cubin", "sm_90")
    monkeypatch.setattr(artifact_inspect, "find_cuda_tool", lambda tool: f"/x/{tool}")
    cmd, tool, env = artifact_inspect.disassembler("cubin", "sm_90")
    assert cmd == ["/x/cuobjdump", "-sass"] and env["NVDISASM_PATH"] == "/x"
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ArtifactError, match="needs llvm-objdump"):
        artifact_inspect.disassembler("hsaco", "gfx1151")
    monkeypatch.setattr(shutil, "which", lambda name: "/y/llvm-objdump" if name == "llvm-objdump" else None)
    assert artifact_inspect.disassembler("hsaco", "gfx1151")[0] == ["/y/llvm-objdump", "-d", "--mcpu=gfx1151"]


# --------------------------------------------------------------------------------------- CLI bad inputs
def test_cli_compile_errors(tmp_path, cache_env, fake_lower):
    out = tmp_path / "art"
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90,sm_91", "-o", out), "unknown arch 'sm_91'")
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "1,6", "--max-ctx", "64",
                          "-o", out), "widths must be in 1..5")
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--max-ctx", "1000",
                          "--contexts", "64,128", "-o", out), "do not cover max_ctx=1000")
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--max-ctx", "99999999", "-o", out),
                      "max_ctx must be in")
    r = run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "a", "-o", out)
    assert r.exit_code == 2 and "--widths" in r.output
    assert not out.exists()
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "-o", ""),
                      "-o: expected an artifact folder path, found ''")
    if Path("/proc").is_dir():  # not writable even for root (os.access says it is): refused before compiling
        assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "-o", "/proc/art"),
                          "cannot write the artifact /proc/art: the folder /proc is not writable")


# ------------------------------------------------------------------------------------ real lower_graph
needs_lower = pytest.mark.skipif(not HAS_REAL_LOWER, reason="ds4c.runtime.lower.lower_graph is not written yet")


@pytest.fixture(scope="session")
def real_artifact(tmp_path_factory, cache_dir) -> tuple[Path, Result, Result]:
    """``ds4c compile --preset tiny --arch sm_90,gfx1151 --widths 1,5 --max-ctx 128`` twice (cold, warm)."""
    out = tmp_path_factory.mktemp("real") / "art"
    env = {"DS4C_CACHE": str(cache_dir)}
    args = ("compile", "--preset", "tiny", "--arch", ARCHS, "--widths", "1,5", "--max-ctx", "128", "-o", out)
    first = run(*args, env=env)
    second = run(*args, env=env)
    return out, first, second


@needs_lower
@needs_compilers
def test_real_compile_manifest(real_artifact):
    out, first, second = real_artifact
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    n1, c1 = summary_counts(first.stdout)
    assert summary_counts(second.stdout) == (0, n1 + c1)
    man = load_manifest(out)
    assert list(man["graphs"]) == ["q1_c128", "q5_c128"]
    for gk, g in man["graphs"].items():
        graph = run_pipeline(build_step(TINY, g["width"], 128), "default", context=g["context"]).graph
        assert g["graph_hash"] == graph_hash(graph)
        plan = [k.name for k in kernel_plan(graph).kernels]
        plan += ["rollback"] if g["width"] > 1 else []  # a verify graph's rollback kernel (undo family)
        for slug, t in man["targets"].items():
            listed = [k["name"] for k in t["graphs"][gk]["kernels"]]
            assert sorted(listed) == sorted(plan), (slug, gk)
            for k in t["graphs"][gk]["kernels"]:
                assert k["launches"], k["name"]
                for ld in k["launches"]:
                    assert ld["binary"] in t["binaries"] and ld["key"] == t["binaries"][ld["binary"]]["key"]
    for slug, t in man["targets"].items():
        kind = "cubin" if slug.startswith("cuda") else "hsaco"
        for rel, b in t["binaries"].items():
            assert is_valid_binary((out / rel).read_bytes(), kind), rel
            assert (out / b["source"]).is_file()


@needs_lower
@needs_compilers
def test_real_inspect_levels(real_artifact):
    out, first, _ = real_artifact
    assert first.exit_code == 0, first.output
    man = load_manifest(out)
    r = run("inspect", out)
    assert r.exit_code == 0, r.output
    assert "q1_c128" in r.stdout and "q5_c128" in r.stdout and "L0:" in r.stdout
    for arch in ("sm_90", "gfx1151"):
        r = run("inspect", out, "--kernels", "--target", arch, "--graph", "q5_c128")
        assert r.exit_code == 0, r.output
        assert "L5:" in r.stdout and "grid" in r.stdout and "regs" in r.stdout
    name = man["targets"]["cuda-sm_90"]["graphs"]["q1_c128"]["kernels"][3]["name"]
    for arch in ("sm_90", "gfx1151"):
        r = run("inspect", out, "--kernel", name, "--source", "--target", arch)
        assert r.exit_code == 0 and "extern" in r.stdout, r.output
        r = run("inspect", out, "--kernel", name, "--resources", "--target", arch)
        assert r.exit_code == 0 and "registers" in r.stdout, r.output
        r = run("inspect", out, "--kernel", name, "--sass", "--target", arch)
        try:
            artifact_inspect.disassembler("cubin" if arch.startswith("sm") else "hsaco", arch)
        except ArtifactError as e:
            assert_error_line(r, str(e))
        else:
            assert r.exit_code == 0 and len(r.stdout) > 200, r.output


@needs_lower
@needs_compilers
def test_runtime_finds_every_launch_binary_in_the_artifact(real_artifact):
    """The runtime's no-compiler path: the lowering of each (width, context) graph pairs launch by launch with
    the manifest's binaries; a missing key and another model's config are named errors."""
    from ds4c.config import preset
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.artifact_manifest import ArtifactError, load_manifest
    from ds4c.runtime.artifact_serve import launch_binaries
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.targets import target

    from ds4c.tensors import FORMATS, tensor_specs

    out, first, _ = real_artifact
    assert first.exit_code == 0, first.output
    man = load_manifest(out)
    cfg = preset("tiny")
    official = {s.name: FORMATS["official"][s.role] for s in tensor_specs(cfg)}
    for arch in ("sm_90", "gfx1151"):
        for key, rec in man["graphs"].items():
            w, c = rec["width"], rec["context"]
            g = run_pipeline(build_step(cfg, w, man["buckets"]["contexts"][-1]), "default", context=c).graph
            ks = lower_graph(g, cfg, target(arch))
            paths = launch_binaries(man, out, arch, w, c, ks, official)
            assert len(paths) == sum(len(k.launches) for k in ks) and all(p.is_file() for p in paths)
    with pytest.raises(ArtifactError, match="no step graph q3_c128"):
        launch_binaries(man, out, "sm_90", 3, 128, [], official)
    with pytest.raises(ArtifactError, match="no target 'sm_80'"):
        launch_binaries(man, out, "sm_80", 1, 128, [], official)


def test_an_artifact_under_a_file_is_an_error_before_any_work(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ArtifactError, match="is a file, not a directory"):
        build_artifact(TINY, parse_targets("sm_90"), tiny_buckets(), f / "sub", KernelCache(tmp_path / "c"),
                       progress=False)


# ------------------------------------------------------------------------------------------- layer split
@needs_compilers
def test_split_artifact_manifest_and_serving(tmp_path, cache_dir, fake_lower):
    """``layer_split`` compiles one graph per shard and key (``s{k}_q{w}_c{c}``), records the split, and the
    artifact serves that split only (checked before any GPU work)."""
    from ds4c.runtime.artifact_serve import check_serves

    out = build_artifact(TINY, parse_targets("sm_90"), tiny_buckets((1, 2)), tmp_path / "art", KernelCache(cache_dir),
                         progress=False, layer_split=(2, 4))
    man = load_manifest(out)
    assert man["layer_split"] == [2, 4]
    assert list(man["graphs"]) == ["s0_q1_c64", "s0_q2_c64", "s1_q1_c64", "s1_q2_c64"]
    assert man["graphs"]["s1_q2_c64"]["layers"] == [2, 6] and man["graphs"]["s0_q1_c64"]["shard"] == 0
    check_serves(man, out, TINY, {}, tiny_buckets((1, 2)), (2, 4))
    for asked, says in (((3, 3), "asked to serve layer split 3,3; compile one with --layer-split 3,3"),
                        (None, "asked to serve the unsplit step; compile one without --layer-split"),
                        ((6,), "asked to serve the unsplit step")):
        with pytest.raises(ArtifactError, match=f"compiled for layer split 2,4, {says}"):
            check_serves(man, out, TINY, {}, tiny_buckets((1, 2)), asked)
    with pytest.raises(ArtifactError, match="layer_split must be layer counts"):
        check_serves(man, out, TINY, {}, tiny_buckets((1, 2)), "2,4")
    unsplit = build_artifact(TINY, parse_targets("sm_90"), tiny_buckets((1, 2)), tmp_path / "u",
                             KernelCache(cache_dir), progress=False, layer_split=(6,))
    man_u = load_manifest(unsplit)
    assert "layer_split" not in man_u and list(man_u["graphs"]) == ["q1_c64", "q2_c64"]
    with pytest.raises(ArtifactError, match="compiled for the unsplit step, asked to serve layer split 2,4"):
        check_serves(man_u, unsplit, TINY, {}, tiny_buckets((1, 2)), (2, 4))
    with pytest.raises(Exception, match="expected counts summing to the model's 6 layers"):
        build_artifact(TINY, parse_targets("sm_90"), tiny_buckets(), tmp_path / "bad", KernelCache(cache_dir),
                       progress=False, layer_split=(2, 2))


@needs_compilers
def test_edited_split_is_refused(tmp_path, cache_dir, fake_lower):
    """A manifest whose layer_split or a graph's layer range was edited fails closed."""
    import json as _json

    out = build_artifact(TINY, parse_targets("sm_90"), tiny_buckets(), tmp_path / "art", KernelCache(cache_dir),
                         progress=False, layer_split=(3, 3))
    mpath = out / "manifest.json"
    man = _json.loads(mpath.read_text())
    man["graphs"]["s1_q1_c64"]["layers"] = [2, 6]
    mpath.write_text(_json.dumps(man, separators=(",", ":")) + "\n")
    with pytest.raises(ArtifactError):
        load_manifest(out)


@needs_lower
@needs_compilers
def test_real_compile_of_a_split(tmp_path, cache_dir):
    """``ds4c compile --layer-split``: the shards' kernels are the unsplit step's plus the boundary's
    hc_post_out / hc_pre; check_lowering pairs every shard graph with this model's lowering."""
    from ds4c.runtime.artifact_serve import check_lowering

    out = tmp_path / "split"
    env = {"DS4C_CACHE": str(cache_dir)}
    r = run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "1", "--max-ctx", "64",
            "--layer-split", "2,4", "-o", out, env=env)
    assert r.exit_code == 0, r.output
    assert "layer split 2,4: one graph per shard" in r.stdout
    man = load_manifest(out)
    names0 = [k["name"] for k in man["targets"]["cuda-sm_90"]["graphs"]["s0_q1_c64"]["kernels"]]
    names1 = [k["name"] for k in man["targets"]["cuda-sm_90"]["graphs"]["s1_q1_c64"]["kernels"]]
    assert names0[0] == "l0.hc_embed_pre" and names0[-1] == "l1.hc_post_out"
    assert names1[0] == "l2.hc_pre" and names1[-1] == "linear"
    from ds4c.tensors import FORMATS, tensor_specs

    official = {t.name: FORMATS["official"][t.role] for t in tensor_specs(TINY)}
    assert check_lowering(man, out, TINY, official) > 0
    r = run("inspect", out)
    assert r.exit_code == 0 and "layer split 2,4: s0 [0,2), s1 [2,6)" in r.stdout and "s1_q1_c64" in r.stdout
    r = run("inspect", out, "--kernel", "l3.hc_post_pre", "--source")  # found in shard 1's graph
    assert r.exit_code == 0 and "extern" in r.stdout, r.output
    mpath = tmp_path / "t.gguf"
    assert run("make-model", "--preset", "tiny", "-o", mpath).exit_code == 0
    r = run("inspect", out, "--model", mpath)  # the artifact's own split is what it serves
    assert r.exit_code == 0 and "serves" in r.stdout, r.output
    bad = run("compile", "--preset", "tiny", "--arch", "sm_90", "--layer-split", "2,x", "-o", tmp_path / "b",
              env=env)
    assert_error_line(bad, "--layer-split '2,x'")


# ------------------------------------------------------------------------------------ DSpark taps (issue 13)
@needs_compilers
def test_taps_artifact_manifest_and_serving(tmp_path, cache_dir, fake_lower):
    """``taps`` builds every graph with the dspark_tap kernel and records them; the artifact serves a step with
    exactly those taps (in that order), and an artifact without taps refuses a request for taps, in one line."""
    from ds4c.runtime.artifact_serve import check_lowering, check_serves
    from ds4c.tensors import FORMATS, tensor_specs

    b = tiny_buckets((1, 2))
    out = build_artifact(TINY, parse_targets("sm_90"), b, tmp_path / "taps", KernelCache(cache_dir), progress=False,
                         taps=(3, 4, 5))
    man = load_manifest(out)
    assert man["taps"] == [3, 4, 5]
    names = [k["name"] for k in man["targets"]["cuda-sm_90"]["graphs"]["q2_c64"]["kernels"]]
    assert "l5.dspark_tap" in names
    check_serves(man, out, TINY, {}, b, taps=(3, 4, 5))
    official = {t.name: FORMATS["official"][t.role] for t in tensor_specs(TINY)}
    assert check_lowering(man, out, TINY, official) > 0
    for asked, says in (((), "with no DSpark taps; compile one without --taps / --draft"),
                        ((4, 3, 5), "with the DSpark taps 4,3,5; compile one with --taps 4,3,5")):
        with pytest.raises(ArtifactError, match=f"compiled with the DSpark taps 3,4,5, asked to serve a step {says}"):
            check_serves(man, out, TINY, {}, b, taps=asked)
    plain = build_artifact(TINY, parse_targets("sm_90"), b, tmp_path / "plain", KernelCache(cache_dir), progress=False)
    man_p = load_manifest(plain)
    assert "taps" not in man_p and man_p["graphs"]["q1_c64"]["graph_hash"] != man["graphs"]["q1_c64"]["graph_hash"]
    with pytest.raises(ArtifactError, match="compiled with no DSpark taps, asked to serve a step with the DSpark "
                                            "taps 3,4,5; compile one with --taps 3,4,5") as ei:
        check_serves(man_p, plain, TINY, {}, b, taps=(3, 4, 5))
    assert "\n" not in str(ei.value)
    # a manifest whose taps were edited (digests recomputed, so only the schema can catch it) fails closed
    mpath = out / "manifest.json"
    bad = json.loads(mpath.read_text())
    bad["taps"] = [3, 3]
    bad["integrity"] = artifact_manifest.integrity_record({k: v for k, v in bad.items() if k != "integrity"})
    mpath.write_text(artifact_manifest.manifest_text(bad))
    with pytest.raises(ArtifactError, match=r"taps: expected a non-empty list of distinct layer ids, found \[3, 3\]"):
        load_manifest(out)
    with pytest.raises(Exception, match="taps: expected distinct layer ids in 0..5"):
        build_artifact(TINY, parse_targets("sm_90"), b, tmp_path / "bad", KernelCache(cache_dir), progress=False,
                       taps=(6,))


@needs_compilers
def test_cli_compile_taps_and_draft(tmp_path, cache_env, fake_lower, tiny_path):
    """``ds4c compile --taps L,..`` and ``--draft FILE`` (the drafter's target layers) record the taps; ``inspect``
    shows them; bad values are one-line errors."""
    from ds4c.drafters.dspark_synth import make_dspark

    out = tmp_path / "art"
    r = run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "1", "--max-ctx", "64", "--taps", "3,4,5",
            "-o", out)
    assert r.exit_code == 0, r.output
    assert "taps:      DSpark taps of layers 3,4,5" in r.stdout and load_manifest(out)["taps"] == [3, 4, 5]
    r = run("inspect", out)
    assert r.exit_code == 0 and "taps:     DSpark taps of layers 3,4,5" in r.stdout, r.output
    draft = make_dspark(tiny_path, tmp_path / "d.gguf", seed=0, taps=(5, 2))
    r = run("compile", tiny_path, "--arch", "sm_90", "--widths", "1", "--max-ctx", "64", "--draft", draft, "-o", out)
    assert r.exit_code == 0, r.output
    assert load_manifest(out)["taps"] == [5, 2]
    r = run("inspect", out, "--model", tiny_path)
    assert r.exit_code == 0 and "serves" in r.stdout, r.output
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--taps", "3,9", "-o", out),
                      "--taps", "expected distinct layer ids in 0..5, found [3, 9]")
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--taps", "3", "--draft", draft, "-o", out),
                      "give --taps or --draft")
    assert_error_line(run("compile", "--preset", "tiny", "--arch", "sm_90", "--draft", tmp_path / "none.gguf",
                          "-o", out), "no such drafter file")


# ------------------------------------------------------------------------ the MTP drafter's final HC state
@needs_compilers
def test_record_hc_artifact_manifest_and_serving(tmp_path, cache_dir, fake_lower):
    """``record_hc`` builds every graph with the record_hc kernel after the last layer and records it; the artifact
    serves only a step that records it, a plain one only a step that does not, in one line; an edited manifest value
    fails closed."""
    from ds4c.runtime.artifact_serve import check_lowering, check_serves
    from ds4c.tensors import FORMATS, tensor_specs

    b = tiny_buckets((1, 2))
    out = build_artifact(TINY, parse_targets("sm_90"), b, tmp_path / "rec", KernelCache(cache_dir), progress=False,
                         record_hc=True)
    man = load_manifest(out)
    assert man["record_hc"] is True
    names = [k["name"] for k in man["targets"]["cuda-sm_90"]["graphs"]["q2_c64"]["kernels"]]
    assert "l5.record_hc" in names
    check_serves(man, out, TINY, {}, b, record_hc=True)
    official = {t.name: FORMATS["official"][t.role] for t in tensor_specs(TINY)}
    assert check_lowering(man, out, TINY, official) > 0
    with pytest.raises(ArtifactError, match="compiled with the final HC state recorded .*asked to serve a step with no "
                                            r"final HC state recorded; compile one without --draft mtp \(`ds4c "
                                            "compile`\\)") as ei:
        check_serves(man, out, TINY, {}, b)
    assert "\n" not in str(ei.value)
    plain = build_artifact(TINY, parse_targets("sm_90"), b, tmp_path / "plain", KernelCache(cache_dir), progress=False)
    man_p = load_manifest(plain)
    assert "record_hc" not in man_p and man_p["graphs"]["q1_c64"]["graph_hash"] != man["graphs"]["q1_c64"]["graph_hash"]
    with pytest.raises(ArtifactError, match="compiled with no final HC state recorded, asked to serve a step with the "
                                            "final HC state recorded .*; compile one with --draft mtp") as ei:
        check_serves(man_p, plain, TINY, {}, b, record_hc=True)
    assert "\n" not in str(ei.value)
    mpath = out / "manifest.json"
    bad = json.loads(mpath.read_text())
    bad["record_hc"] = False
    bad["integrity"] = artifact_manifest.integrity_record({k: v for k, v in bad.items() if k != "integrity"})
    mpath.write_text(artifact_manifest.manifest_text(bad))
    with pytest.raises(ArtifactError, match=r"record_hc: expected true \(absent: not recorded\), found False"):
        load_manifest(out)


@needs_compilers
def test_cli_compile_draft_mtp(tmp_path, cache_env, fake_lower, tiny_path):
    """``ds4c compile --draft mtp`` records the final HC state (with --taps too); ``inspect`` shows it and
    ``inspect --model`` pairs it."""
    out = tmp_path / "art"
    r = run("compile", tiny_path, "--arch", "sm_90", "--widths", "1", "--max-ctx", "64", "--draft", "mtp", "-o", out)
    assert r.exit_code == 0, r.output
    assert "final HC:  every graph records the final HC state" in r.stdout
    man = load_manifest(out)
    assert man["record_hc"] is True and "taps" not in man
    r = run("inspect", out)
    assert r.exit_code == 0 and "final HC: recorded" in r.stdout, r.output
    r = run("inspect", out, "--model", tiny_path)
    assert r.exit_code == 0 and "serves" in r.stdout, r.output
    r = run("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "1", "--max-ctx", "64", "--taps", "3,4,5",
            "--draft", "mtp:whatever.gguf", "-o", out)
    assert r.exit_code == 0, r.output
    man = load_manifest(out)
    assert man["record_hc"] is True and man["taps"] == [3, 4, 5]
