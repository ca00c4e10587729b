"""Writes on a full disk (issue 28.3): each says "no space left on device", names the path that could not be
written, and leaves nothing behind. The disk is a real one: a small tmpfs mounted for the command
(``tests/small_fs.py``); the compiler is a stand-in for nvcc that does what nvcc does when the disk fills (exits 0,
its cubin truncated), so no CUDA toolkit is needed.
"""

from __future__ import annotations

import errno
import shutil

import pytest

from ds4c.write_errors import FULL_MARGIN, device_full, write_error_text
from small_fs import ds4c_argv, run_on_small_fs, write_fake_nvcc

COMPILE = ("compile", "--preset", "tiny", "--arch", "sm_90", "--widths", "1", "--max-ctx", "16", "--jobs", "1")


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("ds4c: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def test_make_model_on_a_full_disk(tmp_path):
    mnt = tmp_path / "small"
    r, left = run_on_small_fs(mnt, 1024, ds4c_argv("make-model", "--preset", "tiny", "-o", str(mnt / "m.gguf")),
                              env={"DS4C_HOME": str(tmp_path / "home")})
    assert r.returncode == 2, r.stderr
    line = _error_line(r.stderr)
    assert line.startswith(f"ds4c: error: no space left on device: cannot write {mnt / 'm.gguf'}"), line
    assert "requested and" not in line and "nothing was written" in line, line
    assert left == []  # the temporary file is gone


def test_compile_output_on_a_full_disk_names_the_artifact(tmp_path):
    mnt = tmp_path / "small"
    nvcc = write_fake_nvcc(tmp_path / "nvcc", pad_kib=8)
    out = mnt / "art"
    r, left = run_on_small_fs(mnt, 1024, ds4c_argv(*COMPILE, "-o", str(out), nvcc=nvcc),
                              env={"DS4C_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2, r.stderr
    line = _error_line(r.stderr)
    # the artifact being written, not the cache's kernel source a copy read (the OSError's filename)
    assert line.startswith(f"ds4c: error: no space left on device: cannot write the artifact {out} ("), line
    assert str(tmp_path / "cache") not in line and line.endswith("; nothing was written"), line
    assert left == []  # the temporary artifact folder is gone


def test_kernel_cache_on_a_full_disk_does_not_blame_the_compiler(tmp_path):
    mnt = tmp_path / "small"
    nvcc = write_fake_nvcc(tmp_path / "nvcc", pad_kib=1024)  # each cubin > the disk: truncated, exit 0
    cache = mnt / "cache"
    r, left = run_on_small_fs(mnt, 512, ds4c_argv(*COMPILE, "-o", str(tmp_path / "art"), nvcc=nvcc),
                              env={"DS4C_CACHE": str(cache)})
    assert r.returncode == 2, r.stderr
    line = _error_line(r.stderr)
    assert line.startswith(f"ds4c: error: no space left on device: cannot write the kernel cache entry {cache}/"), line
    assert "kernel.cubin" in line and "compiler exited 0" not in line and "$DS4C_CACHE" in line, line
    assert not (tmp_path / "art").exists()
    # nothing published: no entry folder under the target folder (only the lock folder and no temporaries)
    assert left and not [p for p in left if ".tmp-" in p or p.endswith("kernel.cubin")], left


def test_write_error_text():
    full = OSError(errno.ENOSPC, "No space left on device", "/cache/k/kernel.cu", None, "/out/art.tmp/src/k.cu")
    assert write_error_text(full) == "no space left on device: cannot write /out/art.tmp/src/k.cu"
    assert write_error_text(full, "the artifact /out/art") == \
        "no space left on device: cannot write the artifact /out/art (/out/art.tmp/src/k.cu)"
    assert write_error_text(OSError(errno.EACCES, "Permission denied", "/x/y"), "/x/y") == \
        "cannot write /x/y: Permission denied"
    free = shutil.disk_usage("/").free
    assert device_full("/") == (free < FULL_MARGIN)
