"""What a model name opens: :func:`open_model` gives a GGUF file's :class:`~ds4c.gguf_file.ModelFile`, or for
``synthetic:PRESET[:FORMATS[:SEED]]`` the :class:`~ds4c.synth_source.SyntheticModel` that stands where the reader
stands (same interface, tensors generated on demand). Both sources sit below this module: neither knows the other.
"""

from __future__ import annotations

import os

from ds4c.gguf_file import ModelFile
from ds4c.synth_source import open_synthetic


def open_model(path: str | os.PathLike[str], allow_mtp_only: bool = False) -> ModelFile:
    """Open and validate a DeepSeek-V4-Flash GGUF (see :class:`~ds4c.gguf_file.ModelFile`); an MTP-only file (the converter's
    ``--mtp`` export) raises :class:`~ds4c.errors.ModelFileError` unless ``allow_mtp_only``.

    ``synthetic:PRESET[:FORMATS[:SEED]]`` opens no file: the :class:`ds4c.synth_source.SyntheticModel` of that
    make-model (preset, formats, seed), whose tensors are generated on demand (a bad spec: one line listing the
    presets and formats)."""
    if str(path).startswith("synthetic:"):
        return open_synthetic(str(path))
    return ModelFile(path, allow_mtp_only=allow_mtp_only)
