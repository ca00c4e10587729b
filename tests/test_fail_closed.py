"""Artifacts and caches fail closed (issue: artifacts-fail-closed).

Each finding of the issue is a test here:

1. an artifact built for other weight formats never serves a model (table and per-binary check; the real
   lowering of tiny-bf16 vs tiny; ``ds4c inspect ART --model FILE``);
2. any edit of manifest.json is a clear error (the two edits of the issue, a forger who recomputes the
   integrity record, and a fuzz of random byte flips of the manifest and of a binary);
3. SIGKILL of ``make-model`` at several points leaves the old complete file, and the next one sweeps the
   temporary;
4. SIGKILL of ``compile`` (compiler included) leaves the old complete artifact, no compiler temp files in
   $TMPDIR, and cache temporaries that opening the cache removes; SIGKILL at both publication steps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4c.cli import main
from ds4c.config import preset
from ds4c.sources import open_model
from ds4c.runtime import artifact_manifest
from ds4c.runtime import lower as lower_mod
from ds4c.runtime.artifact import build_artifact
from ds4c.runtime.artifact_manifest import ArtifactError, load_manifest
from ds4c.runtime.artifact_serve import check_serves, launch_binaries
from ds4c.runtime.cache import KernelCache
from ds4c.runtime.lowered import Arg, Launch, LoweredKernel
from ds4c.runtime.render import render
from ds4c.runtime.targets import parse_targets
from ds4c.runtime.toolchain import ToolchainError, find_toolchain
from ds4c.synth import make_model
from ds4c.tempfiles import OwnedTemp, find_leftovers
from ds4c.tensors import FORMATS, tensor_specs

TINY = preset("tiny")
REPO = Path(__file__).resolve().parent.parent


def _have(arch: str) -> str | None:
    try:
        find_toolchain(parse_targets(arch)[0])
        return None
    except ToolchainError as e:
        return str(e)


needs_hip = pytest.mark.skipif(_have("gfx1151") is not None, reason=f"no HIP compiler: {_have('gfx1151')}")


def run(*args, env: dict | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env or {}, catch_exceptions=False)


def one_error_line(r) -> str:
    """The CLI failed with exactly one line on stderr, ``ds4c: error: ...`` (no traceback)."""
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("ds4c: error: "), r.stderr
    return lines[0]


# ------------------------------------------------------------------------------- a fake lowering with weights
def fake_lower_with_weights(g, cfg, target, weight_types=None) -> list[LoweredKernel]:
    """Two kernels: selftest axpy launches whose argument lists read an MXFP4/Q8_0 weight raw (layer 0's routed
    gate experts and q_a projection) and a norm converted to f32. The axpy source does not read them; the
    argument lists are what the artifact records and checks."""
    out = []
    for i, (name, tensor) in enumerate((("l0.experts", "blk.0.ffn_gate_exps.weight"),
                                        ("l0.multi_gemv", "blk.0.attn_q_a.weight"))):
        src = render("selftest/axpy.cu.j2", f"selftest.axpy{i + 1}", "selftest", target,
                     {"threads": 256, "per_thread": i + 1})
        args = (Arg("value", "x"), Arg("weight", tensor, form="raw"), Arg("weight", "blk.0.attn_norm.weight",
                                                                            form="f32"),
                Arg("int", "n", value=256))
        out.append(LoweredKernel(name, "selftest", 0, [Launch(src, (1, 1, 1), (256, 1, 1), 0, args)]))
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fc-cache")


@pytest.fixture
def fake_weights_lower(monkeypatch):
    monkeypatch.setattr(lower_mod, "lower_graph", fake_lower_with_weights, raising=False)


def official_types(cfg=TINY) -> dict:
    return {s.name: FORMATS["official"][s.role] for s in tensor_specs(cfg)}


def bf16_types(cfg=TINY) -> dict:
    return {s.name: FORMATS["bf16"][s.role] for s in tensor_specs(cfg)}


@pytest.fixture
def fake_art(tmp_path, cache_dir, fake_weights_lower) -> Path:
    """A small artifact (fake lowering with weight arguments) for tiny-bf16's weight formats, on gfx1151."""
    if _have("gfx1151"):
        pytest.skip(f"no HIP compiler: {_have('gfx1151')}")
    from ds4c.buckets import BucketSpec

    return build_artifact(TINY, parse_targets("gfx1151"), BucketSpec.build(TINY, (1,), 64), tmp_path / "art",
                          KernelCache(cache_dir), progress=False, weight_types=bf16_types())


# ----------------------------------------------------------------------------------- 1. weight formats
def test_binaries_record_the_formats_they_were_rendered_for(fake_art, tmp_path, cache_dir):
    from ds4c.buckets import BucketSpec

    def formats(art_dir):
        bins = load_manifest(art_dir)["targets"]["hip-gfx1151"]["binaries"].values()
        return {r["kernel"]: r["weights"] for r in bins}

    assert formats(fake_art) == {"selftest.axpy1": ["BF16", "F32"], "selftest.axpy2": ["BF16", "F32"]}
    official = build_artifact(TINY, parse_targets("gfx1151"), BucketSpec.build(TINY, (1,), 64), tmp_path / "off",
                              KernelCache(cache_dir), progress=False)  # default: the official formats
    # raw weights as stored (MXFP4 experts, Q8_0 projection); the norm is converted on upload: F32 either way
    assert formats(official) == {"selftest.axpy1": ["MXFP4", "F32"], "selftest.axpy2": ["Q8_0", "F32"]}



def test_open_artifact_loads_once_and_is_passed_on(fake_art, monkeypatch):
    """open_artifact loads and verifies the manifest (load_manifest, which checks every binary's sha256); the
    Artifact it returns is handed on as it is, not loaded again."""
    loads = []
    real = artifact_manifest.load_manifest
    monkeypatch.setattr(artifact_manifest, "load_manifest", lambda *a, **k: loads.append(a[0]) or real(*a, **k))
    a = artifact_manifest.open_artifact(fake_art)
    assert loads == [fake_art] and a.path == str(fake_art) and a.manifest == real(fake_art)
    assert artifact_manifest.open_artifact(a) is a and len(loads) == 1

def test_an_artifact_for_other_weight_formats_does_not_serve_the_model(fake_art):
    man = load_manifest(fake_art)
    check_serves(man, fake_art, TINY, bf16_types())  # the model it was built for
    with pytest.raises(ArtifactError) as e:
        check_serves(man, fake_art, TINY, official_types())
    msg = str(e.value)
    n_diff = sum(FORMATS["bf16"][s.role] != FORMATS["official"][s.role] for s in tensor_specs(TINY))
    first = min(s.name for s in tensor_specs(TINY) if FORMATS["bf16"][s.role] != FORMATS["official"][s.role])
    assert f"tensor {first} is BF16 in the artifact's weight formats" in msg and f"({n_diff} tensors differ)" in msg
    assert "\n" not in msg
    # another config and other buckets are named too
    with pytest.raises(ArtifactError, match="built for another config"):
        check_serves(man, fake_art, preset("flash-l4"), bf16_types())
    from ds4c.buckets import BucketSpec

    with pytest.raises(ArtifactError, match="built for buckets"):
        check_serves(man, fake_art, TINY, bf16_types(), BucketSpec.build(TINY, (1, 2), 64))


def test_the_pairing_checks_each_binary_even_when_the_table_was_forged(fake_art):
    """Defence in depth: the runtime's pairing (launch_binaries) compares each launch's weight formats in this
    model with its binary's record, so a manifest whose table alone matched would still be refused."""
    man = load_manifest(fake_art)
    g = None
    ks = fake_lower_with_weights(g, TINY, parse_targets("gfx1151")[0])
    assert launch_binaries(man, fake_art, "gfx1151", 1, 64, ks, bf16_types())
    with pytest.raises(ArtifactError, match=r"rendered for tensor blk\.0\.(ffn_gate_exps|attn_q_a)\.weight as BF16, "
                                            r"the model has (MXFP4|Q8_0)"):
        launch_binaries(man, fake_art, "gfx1151", 1, 64, ks, official_types())


def test_inspect_model_says_whether_the_artifact_serves_it(fake_art, tiny_path, tiny_bf16_path):
    r = run("inspect", fake_art, "--model", tiny_bf16_path)
    assert r.exit_code == 0, r.output
    assert "serves" in r.stdout and "2 binaries, 2 launches" in r.stdout
    line = one_error_line(run("inspect", fake_art, "--model", tiny_path))
    assert "does not serve this model" in line and "is BF16 in the artifact's weight formats" in line
    assert "Q8_0 in the model" in line or "MXFP4 in the model" in line
    one_error_line(run("inspect", fake_art, "--model", fake_art / "manifest.json"))  # not a GGUF
    r = run("inspect", fake_art, "--model", tiny_path, "--kernels")
    assert r.exit_code == 2 and "give it alone" in r.output
    assert "launches paired with this model's lowering" in run("inspect", fake_art, "--model", tiny_bf16_path).stdout


def test_inspect_model_pairs_each_graph_with_the_lowering(fake_art, tiny_bf16_path, monkeypatch):
    """A manifest whose plan lost a kernel (integrity recomputed) passes the table checks but not the pairing."""
    mpath = fake_art / "manifest.json"
    man = json.loads(mpath.read_text())
    for t in man["targets"].values():
        for g in t["graphs"].values():
            g["kernels"].pop()
    man.pop("integrity")
    man["integrity"] = artifact_manifest.integrity_record(man)
    mpath.write_text(artifact_manifest.manifest_text(man))
    line = one_error_line(run("inspect", fake_art, "--model", tiny_bf16_path))
    assert "lists other plan kernels than this model's lowering" in line


@needs_hip
def test_real_lowering_tiny_bf16_artifact_refused_for_tiny(tmp_path, cache_dir, tiny_path, tiny_bf16_path):
    """The issue's finding 1 end to end: `ds4c compile tiny-bf16.gguf` pairs with tiny.gguf on today's main (30 of
    111 launches get BF16 binaries); now the artifact does not serve it, and the real pairing names a tensor."""
    from ds4c.ir import build_step
    from ds4c.passes.manager import run_pipeline
    from ds4c.runtime.lower import lower_graph
    from ds4c.runtime.targets import target

    out = tmp_path / "art"
    r = run("compile", tiny_bf16_path, "--arch", "gfx1151", "--widths", "1", "--max-ctx", "64", "-o", out,
            env={"DS4C_CACHE": str(cache_dir)})
    assert r.exit_code == 0, r.output
    assert run("inspect", out, "--model", tiny_bf16_path).exit_code == 0
    line = one_error_line(run("inspect", out, "--model", tiny_path))
    assert "does not serve this model: tensor " in line
    man = load_manifest(out)
    mf = open_model(tiny_path)
    types = {n: mf.ggml_type(n) for n in mf.specs}
    g = run_pipeline(build_step(TINY, 1, 64), "default", context=64).graph
    ks = lower_graph(g, TINY, target("gfx1151"), types)
    with pytest.raises(ArtifactError, match="other plan kernels|rendered for tensor .* as BF16"):
        launch_binaries(man, out, "gfx1151", 1, 64, ks, types)


# ----------------------------------------------------------------------------------------- 2. edits
def _edit(path: Path, fn) -> None:
    man = json.loads(path.read_text())
    fn(man)
    path.write_text(json.dumps(man, separators=(",", ":")) + "\n")


def _first_launch(man: dict) -> dict:
    t = next(iter(man["targets"].values()))
    return next(iter(t["graphs"].values()))["kernels"][0]["launches"][0]


def test_edits_of_the_manifest_are_named_errors(fake_art):
    mpath = fake_art / "manifest.json"
    good = mpath.read_text()

    def flip_hex(man):
        h = man["config_hash"]
        man["config_hash"] = h[:5] + ("0" if h[5] != "0" else "1") + h[6:]

    cases = [
        (flip_hex, "field 'config_hash' differs from what was written"),
        (lambda m: _first_launch(m)["args"][0].__setitem__("kin#", _first_launch(m)["args"][0].pop("kind")),
         "field 'targets' differs from what was written"),
        (lambda m: m.__setitem__("extra", 1), "field extra was added"),
        (lambda m: m.pop("build"), "missing build"),
        (lambda m: m["integrity"].__setitem__("digest", "0" * 64), "its integrity record was edited"),
    ]
    for fn, want in cases:
        mpath.write_text(good)
        _edit(mpath, fn)
        line = one_error_line(run("inspect", fake_art))
        assert want in line, (want, line)
        assert "rebuild" in line
    mpath.write_text(good.replace(",", ", ", 1))  # reformatted only
    assert "not byte for byte what ds4c wrote" in one_error_line(run("inspect", fake_art))
    # reordered keys: inside a field, and of the top level
    man = json.loads(good)
    man["config"] = dict(reversed(list(man["config"].items())))
    mpath.write_text(json.dumps(man, separators=(",", ":")) + "\n")
    assert "field 'config' differs" in one_error_line(run("inspect", fake_art))
    man = json.loads(good)
    mpath.write_text(json.dumps({k: man[k] for k in reversed(list(man))}, separators=(",", ":")) + "\n")
    assert "fields were reordered" in one_error_line(run("inspect", fake_art))
    mpath.write_text(good)
    assert run("inspect", fake_art).exit_code == 0


def test_a_forged_integrity_record_is_caught_by_the_field_checks(fake_art):
    """Someone who edits a field and recomputes the integrity record still gets a named error from the schema
    and hash checks (the runtime never reads an unchecked field)."""
    mpath = fake_art / "manifest.json"
    good = mpath.read_text()

    def forge(fn):
        man = json.loads(good)
        fn(man)
        man.pop("integrity")
        man["integrity"] = artifact_manifest.integrity_record(man)
        mpath.write_text(artifact_manifest.manifest_text(man))
        return one_error_line(run("inspect", fake_art))

    h = json.loads(good)["config_hash"]
    assert "config_hash: expected the sha256 of the field it covers" in \
        forge(lambda m: m.__setitem__("config_hash", h[::-1]))
    assert "kind: expected one of ['value', 'weight'" in \
        forge(lambda m: _first_launch(m)["args"][0].__setitem__("kind", "kin#"))
    assert ".args[0].kind: expected a value, found nothing" in \
        forge(lambda m: _first_launch(m)["args"][0].pop("kind"))
    assert "block[0]: expected an integer in 1..1024" in forge(lambda m: _first_launch(m).__setitem__("block", [0, 1, 1]))
    assert "binary: expected a binary listed" in \
        forge(lambda m: _first_launch(m).__setitem__("binary", "bin/hip-gfx1151/../../etc-000000000000.hsaco"))
    assert "weight_types_hash: expected the sha256 of weight_types" in \
        forge(lambda m: m["weight_types"].__setitem__("blk.0.attn_q_a.weight", "Q8_0"))
    assert "binaries key: expected a string matching" in forge(
        lambda m: m["targets"]["hip-gfx1151"].__setitem__("binaries", {
            "../x.hsaco": v for v in m["targets"]["hip-gfx1151"]["binaries"].values()}))
    assert "expected the graphs of the buckets" in forge(lambda m: m["graphs"].clear())
    rec = lambda m: next(iter(m["targets"]["hip-gfx1151"]["binaries"].values()))  # noqa: E731
    assert "resources[" in forge(lambda m: rec(m).__setitem__("resources", {"f": 3}))
    assert "expected a number" in forge(lambda m: rec(m)["resources"].__setitem__("f", {"registers": "x"}))
    assert "build: expected an object" in forge(lambda m: m.__setitem__("build", []))
    assert "manifest format" in forge(lambda m: m.__setitem__("format", 2.0))
    assert "wave: expected 32 or 64" in forge(lambda m: m["targets"]["hip-gfx1151"].__setitem__("wave", 32.0))
    # a message carrying a newline from the manifest is still one line
    line = forge(lambda m: m["targets"]["hip-gfx1151"].__setitem__("arch", "gfx\n1151"))
    assert "arch" in line


def test_fuzz_random_byte_flips_are_never_accepted(fake_art):
    """Flip 1-3 random bytes of manifest.json (300 times), then of a binary and of a source (30 times each): every
    load is a one-line `ds4c: error:` from `ds4c inspect`, never exit 0, never a traceback."""
    rng = random.Random(20261201)
    mpath = fake_art / "manifest.json"
    good = mpath.read_bytes()
    man = json.loads(good)
    rec_rel, rec = next(iter(man["targets"]["hip-gfx1151"]["binaries"].items()))
    files = [(mpath, 300), (fake_art / rec_rel, 30), (fake_art / rec["source"], 30)]
    seen = set()
    for path, n in files:
        orig = path.read_bytes()
        for _ in range(n):
            data = bytearray(orig)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(data))
                data[i] = (data[i] ^ rng.randint(1, 255)) if rng.random() < 0.5 else data[i] ^ (1 << rng.randrange(8))
            if bytes(data) == orig:
                continue
            path.write_bytes(bytes(data))
            r = CliRunner().invoke(main, ["inspect", str(fake_art)], catch_exceptions=True)
            assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
            line = one_error_line(r)
            seen.add(line.split(":")[2].strip()[:40])
        path.write_bytes(orig)
    assert run("inspect", fake_art).exit_code == 0
    assert len(seen) >= 3  # several kinds of error were met, not one catch-all


# ------------------------------------------------------------------------------------ 3. make-model kills
SLOW_MAKE = r"""
import sys, time
import ds4c.synth as synth
from ds4c.cli import main
real = synth.producer
def slow(cfg, seed):
    p = real(cfg, seed)
    def produce(spec, t):
        print("tensor", spec.name, flush=True)
        time.sleep(0.01)
        yield from p(spec, t)
    return produce
synth.producer = slow
main(["make-model", "--preset", "tiny", "--seed", "3", "-o", sys.argv[1]])
"""


def _kill_after_lines(cmd: list[str], n: int, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    for _ in range(n):
        assert p.stdout.readline(), "the writer ended before the kill point"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    return p


@pytest.mark.parametrize("point", ["first", "middle", "last"])
def test_sigkill_during_make_model_leaves_the_old_file_and_the_next_run_sweeps(tmp_path, point):
    out = tmp_path / "m.gguf"
    make_model(TINY, out, seed=1)
    before = out.read_bytes()
    n = len(tensor_specs(TINY))
    k = {"first": 1, "middle": n // 2, "last": n}[point]
    p = _kill_after_lines([sys.executable, "-c", SLOW_MAKE, str(out)], k)
    left = [x.name for x in tmp_path.iterdir() if x.name != "m.gguf"]
    assert len(left) == 1 and left[0].startswith(f"m.gguf.tmp-{p.pid}-"), left  # owned: pid + host
    assert out.read_bytes() == before  # the old complete result
    # a live writer's temporary (this process) is never swept
    live = OwnedTemp.create(tmp_path, "m.gguf")
    try:
        r = run("make-model", "--preset", "tiny", "--seed", "3", "-o", out)
        assert r.exit_code == 0, r.output
        assert sorted(x.name for x in tmp_path.iterdir()) == sorted(["m.gguf", live.path.name])
    finally:
        live.discard()
    assert open_model(out).config.name == "tiny" and out.read_bytes() != before


# ------------------------------------------------------------------------------------ 4. compile kills
def _wait_for(pred, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` is still running (zombies, which hold nothing, do not count; Linux /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields after "(comm)": state, ppid, pgrp, ...
            return True
    return False


def _cache_temporaries(root: Path) -> list[Path]:
    return [lo.path for t in root.glob("*/*") if t.is_dir() for lo in find_leftovers(t, None, (".tmp-", ".trash-"))]


@needs_hip
def test_sigkill_during_compile_leaves_old_artifact_and_no_compiler_temps(tmp_path):
    """Kill the whole process group (ds4c and the running clang) while a kernel compiles: the previous artifact
    stays complete, nothing lands in $TMPDIR, the cache's temporaries are owned and removed when the cache is
    next opened (`ds4c cache list` counts them), and the re-run leaves no leftovers at all."""
    cache, tmpdir, out = tmp_path / "cache", tmp_path / "tmpdir", tmp_path / "art"
    tmpdir.mkdir()
    env = {"DS4C_CACHE": str(cache), "TMPDIR": str(tmpdir)}
    base = ["compile", "--preset", "tiny", "--arch", "gfx1151", "--max-ctx", "64", "-o", out]
    assert run(*base, "--widths", "1", env=env).exit_code == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    cmd = [sys.executable, "-m", "ds4c.cli", *map(str, base), "--widths", "1,2", "--jobs", "2"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                         env={**os.environ, **env}, start_new_session=True)
    try:
        _wait_for(lambda: any((t / ".cc-tmp").is_dir() for t in _cache_temporaries(cache)))
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    # the killed compilers (the group's other processes) may still be exiting, holding their temporaries as
    # in progress: wait until the whole group is gone, as a later run on a real machine would find it
    _wait_for(lambda: not _group_alive(p.pid), timeout=30.0)
    assert list(tmpdir.iterdir()) == []  # the compilers' temp files went into the cache's temp folders
    temps = _cache_temporaries(cache)
    assert temps and all(f".tmp-{p.pid}-" in t.name for t in temps), temps
    assert {q.relative_to(out): q.read_bytes() for q in out.rglob("*") if q.is_file()} == before
    assert load_manifest(out)["buckets"]["widths"] == [1]

    r = run("cache", "list", env=env)
    assert r.exit_code == 0
    assert f"{len(temps)} stale removed on opening the cache" in r.stdout
    assert _cache_temporaries(cache) == []
    assert run(*base, "--widths", "1,2", env=env).exit_code == 0
    assert load_manifest(out)["buckets"]["widths"] == [1, 2]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art", "cache", "tmpdir"]
    assert list(tmpdir.iterdir()) == [] and _cache_temporaries(cache) == []


PUBLISH_KILL = r"""
import os, signal, sys
from ds4c.runtime import artifact_publish as pub
from ds4c.runtime import lower
sys.path.insert(0, sys.argv[3])
from test_fail_closed import fake_lower_with_weights
lower.lower_graph = fake_lower_with_weights
mode = sys.argv[2]
if mode == "between-renames":
    pub._exchange = lambda a, b: False
    real_rename = os.rename
    def rename(src, dst):
        real_rename(src, dst)
        if str(dst).endswith("/a"):
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
else:
    real_exchange = pub._exchange
    def exchange(a, b):
        assert real_exchange(a, b)
        os.kill(os.getpid(), signal.SIGKILL)
    pub._exchange = exchange
from ds4c.cli import main
main(["compile", "--preset", "tiny", "--arch", "gfx1151", "--widths", "1,2", "--max-ctx", "64", "-o", sys.argv[1]])
"""


@needs_hip
@pytest.mark.parametrize("mode", ["after-exchange", "between-renames"])
def test_sigkill_during_publication(tmp_path, cache_dir, fake_weights_lower, mode):
    """Killed right after the atomic swap, the new artifact is in place and its old copy is swept by the next
    build; killed between the two renames of the fallback swap, the next build puts the old one back first."""
    out = tmp_path / "art"
    env = {"DS4C_CACHE": str(cache_dir)}
    assert run("compile", "--preset", "tiny", "--arch", "gfx1151", "--widths", "1", "--max-ctx", "64", "-o", out,
               env=env).exit_code == 0
    p = subprocess.run([sys.executable, "-c", PUBLISH_KILL, str(out), mode, str(REPO / "tests")], cwd=REPO,
                       env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    left = sorted(x.name for x in tmp_path.iterdir() if x.name != "art")
    if mode == "after-exchange":
        assert load_manifest(out)["buckets"]["widths"] == [1, 2]  # the new complete artifact
        assert len(left) == 1 and left[0].startswith("art.tmp-")  # holding the old one
    else:
        assert not out.exists() and [x.split("-")[0] for x in left] == ["art.old", "art.tmp"]
    assert run("compile", "--preset", "tiny", "--arch", "gfx1151", "--widths", "1", "--max-ctx", "64", "-o", out,
               env=env).exit_code == 0
    assert sorted(x.name for x in tmp_path.iterdir()) == ["art"]
    assert load_manifest(out)["buckets"]["widths"] == [1]
