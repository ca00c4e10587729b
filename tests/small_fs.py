"""A real full disk for tests: run a command with a small tmpfs mounted on a folder, in a private mount namespace
(``unshare -m``, which needs root or user namespaces; the tests that use it skip, saying why, where the machine
cannot). The mount lives only as long as the command; what is left on it is listed into a file outside.

Also a stand-in for nvcc that behaves as nvcc does on a full disk (exit status 0, its output truncated or
missing): :func:`write_fake_nvcc`. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# mount, run, list what is left, exit with the command's status (97: the mount failed)
_INNER = 'mount -t tmpfs -o size="$1"k tmpfs "$2" || exit 97; d="$2"; out="$3"; shift 3; "$@"; rc=$?; ' \
         '(cd "$d" && find . -mindepth 1) > "$out"; exit $rc'


@functools.lru_cache(maxsize=None)
def _cannot_mount() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"ds4c-small-fs-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", str(probe)],
                           capture_output=True, text=True, timeout=30)
    finally:
        probe.rmdir()
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a private mount namespace: {r.stderr.strip()}"


def skip_without_small_fs() -> None:
    """``pytest.skip`` the calling test where a small tmpfs cannot be mounted."""
    why = _cannot_mount()
    if why:
        pytest.skip(why)


def run_on_small_fs(mount_point: Path, kib: int, argv: list[str], env: dict[str, str] | None = None,
                    timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``argv`` with a tmpfs of ``kib`` KiB mounted on ``mount_point`` (created); returns the finished process
    (text stdout / stderr) and the paths left on the tmpfs when it ended (``./a``, ``./a/b``...)."""
    skip_without_small_fs()
    mount_point.mkdir(parents=True, exist_ok=True)
    listing = mount_point.parent / f"{mount_point.name}.left.txt"
    r = subprocess.run(["unshare", "-m", "sh", "-c", _INNER, "sh", str(kib), str(mount_point), str(listing), *argv],
                       capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert r.returncode != 97, f"the tmpfs mount failed: {r.stderr}"
    return r, listing.read_text().split()


def ds4c_argv(*args: str, nvcc: Path | None = None) -> list[str]:
    """``python -m ds4c.cli ARGS``; with ``nvcc``, every CUDA target compiles with that executable (a toolchain
    named nvcc, version ``fake``) instead of the one ``find_toolchain`` finds."""
    if nvcc is None:
        return [sys.executable, "-m", "ds4c.cli", *args]
    code = ("import sys, ds4c.runtime.cache as c, ds4c.runtime.toolchain as t\n"
            f"c.find_toolchain = lambda target, prefer=None: t.Toolchain('nvcc', 'fake', {str(nvcc)!r})\n"
            "from ds4c.cli import main\nmain(args=sys.argv[1:], prog_name='ds4c')\n")
    return [sys.executable, "-c", code, *args]


def write_fake_nvcc(path: Path, pad_kib: int = 64) -> Path:
    """An executable at ``path`` that takes nvcc's command line (``... -o OUT SRC``) and writes OUT as nvcc does on
    a full disk: a CUDA ELF header, the source and ``pad_kib`` KiB, ignoring write errors, then exits 0 (nvcc 13
    does exactly that when the disk fills: a truncated cubin, status 0)."""
    path.write_text("""#!/bin/sh
out=""; src=""
while [ $# -gt 0 ]; do
  case "$1" in -o) out="$2"; shift 2 ;; *) src="$1"; shift ;; esac
done
{ printf '\\177ELF\\002\\001\\001\\000\\000\\000\\000\\000\\000\\000\\000\\000\\002\\000\\276\\000'
  cat "$src"; head -c %d /dev/zero; } > "$out" 2>/dev/null
exit 0
""" % (pad_kib * 1024))
    path.chmod(0o755)
    return path
