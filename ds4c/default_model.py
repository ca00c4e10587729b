"""The built-in default model: the ``tiny`` preset with seed 0, written once per ds4c version under
``$DS4C_HOME/models/`` (:func:`ds4c.settings.home`), what ``ds4c.Model()``, ``ds4c info`` and ``ds4c generate``
open when no file is named.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from filelock import FileLock

from ds4c import settings
from ds4c.version import __version__
from ds4c.config import preset
from ds4c.errors import Ds4cError
from ds4c.synth import make_model

DEFAULT_PRESET, DEFAULT_SEED = "tiny", 0


def default_model_path() -> Path:
    """Where the built-in default model lives (``$DS4C_HOME/models/`` or ``~/.cache/ds4c/models/``), created on
    first use (saying so on stderr).

    Creation is atomic (written to a temporary file, then renamed) and guarded by a file lock, so concurrent
    first uses end with one complete file.

    Raises:
        Ds4cError: the folder cannot be created or written (naming it and ``DS4C_HOME``).
    """
    home = settings.home()
    path = home / "models" / f"{DEFAULT_PRESET}-seed{DEFAULT_SEED}-v{__version__}.gguf"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):
                raise PermissionError(13, "Permission denied")
        except OSError as e:
            where = "$DS4C_HOME" if settings.raw("DS4C_HOME") else "the default cache folder (~/.cache/ds4c)"
            raise Ds4cError(f"cannot write the built-in default model under {where} = {home}: "
                            f"{e.strerror or e}; set DS4C_HOME to a writable folder") from None
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                print(f"creating the built-in default model ({DEFAULT_PRESET}, seed {DEFAULT_SEED}) at {path}",
                      file=sys.stderr, flush=True)
                make_model(preset(DEFAULT_PRESET), path, seed=DEFAULT_SEED)
    return path


def model_path(file: str | os.PathLike[str] | None) -> Path | str:
    """The model a FILE argument names: a path, a ``synthetic:...`` spec (kept as text, docs/synthetic.md), or
    (None or empty) the built-in default model (:func:`default_model_path`)."""
    if file and str(file).startswith("synthetic:"):
        return str(file)
    return Path(file) if file else default_model_path()
