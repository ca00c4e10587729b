"""Temporary files and folders that say who owns them, and the sweep that removes those whose owner died.

Every writer of ds4c that publishes by rename (model files, kernel-cache entries, artifacts) first writes a
temporary beside its destination, named

    <prefix><tag><pid>-<host>-<random>        e.g. flash-l4.gguf.tmp-4242-buildbox-k2j9x1

and holds an exclusive ``flock`` on it (on the file, or on the folder's own descriptor) until it is published
or removed. A process killed with SIGKILL cannot clean up, but the kernel drops its lock, so the next writer
into the same place (the next ``make-model``, ``compile`` or kernel-cache open) can tell a live temporary from a
dead one:

* same host, owner pid alive: in use (kept even if its lock is free: the owner may be between creating and
  locking it, or the pid was reused);
* same host, owner pid gone: stale once its lock can be taken;
* another host (a shared folder): stale once its lock can be taken and it is older than :data:`FOREIGN_AGE_S`
  (``flock`` may not reach across hosts, so age is the second witness);
* a name without an owner (written by ds4c 0.x before owners were recorded): stale once its lock can be taken
  and it is older than :data:`LEGACY_AGE_S`.

A stale temporary is removed while the sweeper holds its lock, so two sweepers never race a writer.
We write this small module ourselves because no maintained library offers "owned temporaries swept after
SIGKILL" (``tempfile`` cleans up only in a live process; ``filelock`` locks but neither names nor sweeps).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

TMP_TAG = ".tmp-"
FOREIGN_AGE_S = 3600.0
LEGACY_AGE_S = 60.0
_OWNER = re.compile(r"(\d+)-([A-Za-z0-9]{1,32})-([A-Za-z0-9]+)$")


def host_id() -> str:
    """This machine's name with only ASCII letters and digits kept (at most 32), as written in owner tags."""
    h = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]
    return h or "host"


def owner_tag() -> str:
    """``<pid>-<host>`` of this process."""
    return f"{os.getpid()}-{host_id()}"


def _lock(fd: int, block: bool) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        return True
    except BlockingIOError:
        return False
    except OSError:  # a file system without flock: treat as unlocked (age and pid still decide)
        return True


@dataclass
class OwnedTemp:
    """A temporary file or folder ``path`` that this process owns (holds the lock on) until :meth:`release`.

    Use as a context manager, or call :meth:`release` (closing the lock) and :meth:`discard` (removing what
    is left at ``path``) yourself; renaming ``path`` to its destination before releasing is the publication.
    """

    path: Path
    is_dir: bool
    _fd: int | None = field(default=None, repr=False)

    @classmethod
    def create(cls, parent: str | os.PathLike, prefix: str, tag: str = TMP_TAG, is_dir: bool = False) -> "OwnedTemp":
        """Create ``<parent>/<prefix><tag><pid>-<host>-<random>`` (an empty file, mode 0600, or a folder, mode
        0700) and lock it.

        Raises:
            OSError: ``parent`` does not exist or is not writable.
        """
        parent = Path(parent)
        for _ in range(100):
            p = parent / f"{prefix}{tag}{owner_tag()}-{secrets.token_hex(4)}"
            try:
                if is_dir:
                    p.mkdir(mode=0o700)
                    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
                else:
                    fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            _lock(fd, block=True)
            return cls(p, is_dir, fd)
        raise FileExistsError(f"cannot create a temporary {prefix}{tag}... in {parent}")  # pragma: no cover

    def release(self) -> None:
        """Drop the lock (the temporary is now published, or about to be removed)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Remove whatever is still at ``path`` (nothing, after a publication) and drop the lock."""
        try:
            if self.is_dir:
                shutil.rmtree(self.path, ignore_errors=True)
            else:
                self.path.unlink(missing_ok=True)
        finally:
            self.release()

    def __enter__(self) -> "OwnedTemp":
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


@dataclass(frozen=True)
class Leftover:
    """A temporary found beside a destination: its path, owner pid and host (None for an unowned legacy name)
    and whether it is stale (its owner is gone)."""

    path: Path
    pid: int | None
    host: str | None
    stale: bool


def _is_stale(p: Path, pid: int | None, host: str | None, fd: int | None) -> bool:
    try:
        age = time.time() - p.lstat().st_mtime
    except OSError:
        return False
    lock_free = fd is None or _lock(fd, block=False)
    if not lock_free:
        return False
    if pid is None:
        return age > LEGACY_AGE_S
    if host != host_id():
        return age > FOREIGN_AGE_S
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _open_for_lock(p: Path) -> int | None:
    try:
        return os.open(p, os.O_RDONLY | (os.O_DIRECTORY if p.is_dir() and not p.is_symlink() else 0))
    except OSError:
        return None


def _parse(name: str, prefix: str | None, tags: tuple[str, ...]) -> tuple[bool, re.Match | None]:
    """``(is a temporary, owner match or None for a legacy name)`` of a file name."""
    for tag in tags:
        if prefix is not None:
            if name.startswith(prefix + tag):
                return True, _OWNER.fullmatch(name[len(prefix) + len(tag):])
            continue
        i = name.rfind(tag)
        if i >= 0:
            m = _OWNER.fullmatch(name[i + len(tag):])
            if m is not None or i == 0:  # owned, or a legacy name that starts with the tag
                return True, m
    return False, None


def find_leftovers(parent: str | os.PathLike, prefix: str | None, tags: tuple[str, ...] = (TMP_TAG,),
                   legacy: bool = True) -> Iterator[Leftover]:
    """The temporaries in ``parent``, stale or not (see module docstring): names ``<prefix><tag><owner>`` for
    each tag, or with ``prefix=None`` any name ending in ``<tag><owner>`` (and, as legacy, any name starting
    with the tag). With ``legacy``, names ``<prefix><tag>...`` without an owner count too (stale only when
    old)."""
    parent = Path(parent)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return
    for name in names:
        is_tmp, m = _parse(name, prefix, tags)
        if not is_tmp or (m is None and not legacy):
            continue
        pid, host = (int(m.group(1)), m.group(2)) if m else (None, None)
        p = parent / name
        fd = _open_for_lock(p)
        try:
            stale = _is_stale(p, pid, host, fd)
        finally:
            if fd is not None:
                os.close(fd)  # drops the lock _is_stale may have taken: the caller takes it again to remove
        yield Leftover(p, pid, host, stale)


def remove_stale(parent: str | os.PathLike, prefix: str | None, tags: tuple[str, ...] = (TMP_TAG,),
                 legacy: bool = True, keep: Callable[[Path], bool] | None = None) -> list[Path]:
    """Remove the stale temporaries (as :func:`find_leftovers` finds them) of ``parent`` (each under its lock) and return their
    paths. ``keep(path)`` (optional) is asked first for each stale one and may return True to leave it (the
    caller rescues something from it first). Errors while removing are ignored: a temporary that cannot be
    removed stays and is reported again next time."""
    removed = []
    for lo in find_leftovers(parent, prefix, tags, legacy):
        if not lo.stale or (keep is not None and keep(lo.path)):
            continue
        fd = _open_for_lock(lo.path)
        try:
            if fd is not None and not _lock(fd, block=False):
                continue  # someone took it meanwhile
            if lo.path.is_dir() and not lo.path.is_symlink():
                shutil.rmtree(lo.path, ignore_errors=True)
            else:
                try:
                    lo.path.unlink()
                except OSError:
                    pass
            if not lo.path.exists():
                removed.append(lo.path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def usual_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file under this process's umask (owned temporaries
    are 0600 until published)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


class AtomicFile:
    """A file written whole or not at all, the one way ds4c writes a file in place: the content goes into
    :attr:`tmp`, an owned temporary beside the destination (:class:`OwnedTemp`), which :meth:`publish` renames
    over it; :meth:`discard` (or any exception inside ``with``) removes it. After a ``kill -9`` the temporary is
    found stale by :func:`remove_stale`, which :meth:`create` runs for the destination first.

    ::

        with AtomicFile.create(path) as out:   # published on a normal exit, removed on an exception
            out.tmp.write_bytes(data)

    The writer flushes and fsyncs its own handle before publishing (:func:`write_text_atomic` does).
    """

    def __init__(self, path: Path, owned: OwnedTemp):
        self.path, self._owned = path, owned
        self.tmp: Path = owned.path
        """Where to write the content (mode ``0o666 & ~umask``, as ``open`` would create the destination)."""

    @classmethod
    def create(cls, path: str | os.PathLike) -> "AtomicFile":
        """Remove what killed writers of ``path`` left, then create and lock the temporary beside it.

        Raises:
            OSError: the folder does not exist or is not writable.
        """
        p = Path(path)
        remove_stale(p.parent, p.name)
        owned = OwnedTemp.create(p.parent, p.name)
        try:
            os.chmod(owned.path, usual_file_mode())  # OwnedTemp makes 0600 files: the usual umask-based mode instead
        except BaseException:
            owned.discard()
            raise
        return cls(p, owned)

    def publish(self) -> None:
        """Rename the temporary over the destination (atomic) and drop its lock.

        Raises:
            OSError: the rename fails (the temporary is then removed).
        """
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            self._owned.discard()
            raise
        self._owned.release()

    def discard(self) -> None:
        """Remove the temporary (nothing of it reaches the destination) and drop its lock."""
        self._owned.discard()

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.discard()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (:class:`AtomicFile`; flushed to disk first).

    Raises:
        OSError: the folder does not exist or is not writable, or the write fails.
    """
    with AtomicFile.create(path) as out, open(out.tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_stream_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write a file too large to hold in memory whole or not at all: the stale temporaries of ``path`` (left by
    writers killed with ``kill -9``) removed, ``write(f)`` called on a binary file open on an owned temporary
    beside ``path`` (:class:`AtomicFile`), flushed to disk, and the temporary renamed over ``path`` once ``write``
    returns (removed if it raises), with the :func:`usual_file_mode`.

    Raises:
        OSError: the folder does not exist or is not writable, or the write fails; whatever ``write`` raises.
    """
    with AtomicFile.create(path) as out, open(out.tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def check_writable(path: str | os.PathLike) -> None:
    """Check that a file can be written at ``path`` later, by creating (and removing) an owned temporary beside
    it now: a long run then fails before it starts, not after.

    Raises:
        OSError: the folder does not exist or is not writable, or ``path`` is a folder.
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{p} is a folder")
    with OwnedTemp.create(p.parent, p.name):
        pass
