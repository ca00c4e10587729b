"""What a DSpark drafter name opens: :func:`open_dspark` gives a drafter file's
:class:`~ds4c.drafters.dspark_file.DSparkFile`, or for ``synthetic:PRESET[:FORMATS[:SEED]]`` the
:class:`~ds4c.drafters.dspark_source.SyntheticDSpark` that stands where the reader stands (same interface, tensors
generated on demand). Both sources sit below this module: neither knows the other.
"""

from __future__ import annotations

import os

import torch

from ds4c.config import Ds4Config
from ds4c.drafters.dspark_file import DSparkFile
from ds4c.drafters.dspark_source import open_synthetic_dspark
from ds4c.errors import ModelFileError


def open_dspark(path: str | os.PathLike[str], target: Ds4Config | None = None,
                device: torch.device | str = "cpu") -> DSparkFile:
    """Open and validate a DSpark drafter file (:class:`DSparkFile`); with ``target``, also check it serves that
    model (:meth:`DSparkFile.check_target`). Raises ModelFileError (one line).

    ``synthetic:PRESET[:FORMATS[:SEED]]`` opens no file: the :class:`ds4c.drafters.dspark_source.SyntheticDSpark`
    of the drafter ``make-model --preset PRESET --drafter dspark`` writes, its tensors generated on demand (by
    default on ``device``; ``dspark:synthetic:...``, as ``--draft`` spells it, too); a bad spec is one line naming the
    presets and formats (docs/synthetic.md)."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise ModelFileError(f"DSpark drafter: expected a file path (str or os.PathLike), found "
                             f"{type(path).__name__} {path!r:.60}")
    if str(path).startswith(("synthetic:", "dspark:synthetic:")):
        f: DSparkFile = open_synthetic_dspark(str(path), device)
    else:
        f = DSparkFile(path)
    if target is not None:
        f.check_target(target)
    return f
