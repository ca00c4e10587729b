"""ds4c/tempfiles.py's AtomicFile: the one way ds4c writes a file in place (model files, --json records, --dot)."""

from __future__ import annotations

import os

import pytest

from ds4c.tempfiles import AtomicFile, OwnedTemp, write_text_atomic


def test_an_atomic_file_is_published_whole_or_not_at_all(tmp_path):
    dest = tmp_path / "out.json"
    dest.write_text("old")
    with pytest.raises(RuntimeError):
        with AtomicFile.create(dest) as out:
            out.tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert dest.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    umask = os.umask(0o022)
    os.umask(umask)
    write_text_atomic(dest, "new \u00e9")
    assert dest.read_text(encoding="utf-8") == "new \u00e9"
    assert dest.stat().st_mode & 0o777 == 0o666 & ~umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_a_killed_writers_temporary_is_swept_by_the_next(tmp_path):
    """A temporary whose owner died (its lock dropped, its pid gone) is removed when the next writer of the same
    destination starts."""
    dest = tmp_path / "m.gguf"
    dead = OwnedTemp.create(tmp_path, dest.name)
    dead.release()  # as after kill -9: the lock is gone ...
    stale = dead.path.with_name(dead.path.name.replace(f"-{os.getpid()}-", "-999999999-"))
    dead.path.rename(stale)  # ... and so is the owner
    with AtomicFile.create(dest) as out:
        out.tmp.write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
