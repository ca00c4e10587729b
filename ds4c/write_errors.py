"""What ds4c says when a write fails: one line naming the path that could not be written, and "no space left on
device" when the device is full.

A full device shows in three ways: an ``OSError`` with ``errno`` ENOSPC or EDQUOT (Python's own writes); a copy
(``shutil.copyfile``) whose ENOSPC carries the source in ``filename`` and the destination, the path that could not
be written, in ``filename2``; and a program that loses its output without an error of its own (nvcc exits 0 with a
truncated or missing cubin when the disk fills): :func:`device_full` tells the last case by the free space left.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

NO_SPACE = "no space left on device"
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
FULL_MARGIN = 1 << 20
"""Free bytes below which :func:`device_full` calls a device full: a writer that filled it left less than a block;
1 MiB leaves room for the file systems' own rounding."""


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """Bytes this process may still write on the device holding ``path`` (its nearest existing parent): the free
    blocks, the reserved ones included for root; None when the file system does not say."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def device_full(path: str | os.PathLike[str]) -> bool:
    """Whether the device holding ``path`` has less than :data:`FULL_MARGIN` bytes left (False when unknown)."""
    free = free_bytes(path)
    return free is not None and free < FULL_MARGIN


def no_space_error(path: str | os.PathLike[str]) -> OSError:
    """The ``OSError`` (ENOSPC) of a write of ``path`` that a full device cut short without reporting it."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def unwritten_path(e: OSError) -> str | None:
    """The path ``e`` could not write: a copy's destination (``filename2``), else ``filename``."""
    return getattr(e, "filename2", None) or getattr(e, "filename", None)


def write_error_text(e: OSError, what: str | os.PathLike[str] | None = None) -> str:
    """One line for the failed write ``e`` of ``what`` (a path or words; default the error's own path):
    ``no space left on device: cannot write WHAT`` (naming the file too when it is not ``what``) when the device is
    full (ENOSPC, EDQUOT), else ``cannot write WHAT: <strerror>``."""
    path = unwritten_path(e)
    target = str(what) if what is not None else (str(path) if path else "the output")
    also = f" ({path})" if path and what is not None and str(path) != str(what) else ""
    if e.errno in FULL_ERRNOS:
        reason = NO_SPACE if e.errno == errno.ENOSPC else "disk quota exceeded"
        return f"{reason}: cannot write {target}{also}"
    return f"cannot write {target}{also}: {e.strerror or e}"
