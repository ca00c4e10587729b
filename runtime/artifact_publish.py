"""Atomic publication of an artifact folder (:func:`publish`), and the repair of what a killed build left.

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
import os
import shutil
from pathlib import Path

from ds4c.runtime.artifact_manifest import MANIFEST, ArtifactError
from ds4c.tempfiles import TMP_TAG, OwnedTemp, remove_stale

_OLD_TAG = ".old-"


def _is_artifact_dir(p: Path) -> bool:
    return p.is_dir() and (p / MANIFEST).is_file()


def check_replaceable(out: Path) -> None:
    """Check that ``out`` may be replaced: absent, an empty folder, or a ds4c artifact (never some other folder)."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ArtifactError(f"{out} exists and is not a folder: choose another output folder (-o)")
    if not _is_artifact_dir(out) and any(out.iterdir()):
        raise ArtifactError(f"{out} exists and is not a ds4c artifact (no {MANIFEST}); refusing to replace it: "
                            f"remove it or choose another output folder (-o)")


def clean_leftovers(out: Path) -> None:
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

    remove_stale(out.parent, out.name, (_OLD_TAG, TMP_TAG), keep=rescue)


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


def publish(tmp: Path, out: Path) -> None:
    """Put ``tmp`` in place as ``out``. When ``out`` exists, the two are swapped in one atomic step, so ``out``
    is at every moment the old or the new complete artifact, and the old one (now at ``tmp``) is deleted with
    it. Where the system cannot swap atomically: ``out`` is renamed aside into ``<out>.old-<owner>/a``, ``tmp``
    renamed in, and the old one deleted; a kill between those two renames is repaired by the next build
    (:func:`clean_leftovers`)."""
    for _ in range(10):
        old: OwnedTemp | None = None
        if out.exists() or out.is_symlink():
            check_replaceable(out)
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
