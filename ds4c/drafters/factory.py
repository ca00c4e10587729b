"""The drafter a ``--draft`` value (or ``Model.generate(draft="...")``) names: :func:`make_drafter`."""

from __future__ import annotations

from typing import Any

from ds4c.drafters.dspark import DSparkDrafter
from ds4c.drafters.mtp import MTPDrafter
from ds4c.drafters.oracle import OracleDrafter
from ds4c.engine_protocol import Drafter
from ds4c.errors import ModelFileError, StepError


def make_drafter(spec: str, vocab_size: int, seed: int = 0, config: Any = None, target_file: Any = None) -> Drafter:
    """The drafter a ``--draft`` value names: ``oracle:ALPHA`` (``oracle:ALPHA:SEP``: with an emulated confidence
    head of separation SEP, :class:`OracleDrafter`); ``dspark:PATH`` / ``PATH.gguf`` (a DSpark drafter
    file, :class:`ds4c.drafters.dspark.DSparkDrafter`, checked against ``config``, the target's
    :class:`~ds4c.config.Ds4Config`, when given, else at its ``prepare``); ``dspark:synthetic:PRESET[:FORMATS[:SEED]]``
    (the same drafter with no file, :class:`ds4c.drafters.dspark_source.SyntheticDSpark`, checked likewise); ``mtp`` (the MTP block of the target file
    ``target_file`` itself) or ``mtp:PATH`` (a separate file holding one, llama.cpp's ``convert --mtp`` export or
    ``ds4c make-model --drafter mtp``; checked against ``config`` and the target file's embedding and head):
    :class:`ds4c.drafters.mtp.MTPDrafter`, spec 7.5.

    Raises:
        StepError: an unknown drafter, a bad ALPHA or SEP, ``mtp`` without ``target_file`` (one line, naming what
            was expected).
        ModelFileError: a DSpark or MTP file that is missing, invalid, or does not fit the target (its vocabulary not
            ``vocab_size``); ``mtp`` with a target that holds no MTP block.
    """
    text = str(spec)
    kind, _, arg = text.partition(":")
    if kind == "oracle":
        fields = arg.split(":")
        if len(fields) > 2:
            raise StepError(f"--draft oracle:ALPHA[:SEP]: expected at most two numbers after 'oracle:', found {arg!r}")
        bad_alpha = f"--draft {text!r}: expected oracle:ALPHA[:SEP] with ALPHA a number in [0, 1], found " \
            f"{'no ALPHA' if not fields[0] else repr(fields[0])}"
        try:
            alpha = float(fields[0])
        except ValueError:
            raise StepError(bad_alpha) from None
        if not 0.0 <= alpha <= 1.0:  # (nan fails too) named as typed, not as parsed
            raise StepError(bad_alpha)
        sep = None
        if len(fields) == 2:
            bad_sep = f"--draft {text!r}: expected oracle:ALPHA:SEP with SEP a finite number >= 0, found {fields[1]!r}"
            try:
                sep = float(fields[1])
            except ValueError:
                raise StepError(bad_sep) from None
            if not 0.0 <= sep < float("inf"):
                raise StepError(bad_sep)
        return OracleDrafter(alpha, vocab_size, seed, sep=sep)
    if kind == "mtp":
        if arg:
            return MTPDrafter(arg, seed=seed, target=config, target_file=target_file)
        if text != "mtp":
            raise StepError(f"--draft {text!r}: expected mtp (the target's own MTP block) or mtp:PATH, found "
                            f"{'an empty path' if text == 'mtp:' else repr(text)}")
        if target_file is None:
            raise StepError("--draft mtp uses the target file's own MTP block: expected the target's model file "
                            "(make_drafter(..., target_file=...)), found none")
        return MTPDrafter.of_target(target_file, seed=seed)
    if kind == "dspark" and not arg:
        raise StepError(f"--draft {text!r}: expected dspark:PATH (a DSpark drafter file) or "
                        f"dspark:synthetic:PRESET, found an empty path")
    path = arg if kind == "dspark" else text if text.endswith(".gguf") else None
    if path is not None:
        d = DSparkDrafter(path, seed=seed, target=config)
        if d.file.config.vocab_size != vocab_size:
            raise ModelFileError(f"{path}: the drafter's vocabulary has {d.file.config.vocab_size} tokens, the "
                                 f"target's {vocab_size}")
        return d
    raise StepError(f"unknown drafter {spec!r}: expected oracle:ALPHA[:SEP], dspark:PATH or PATH.gguf (a DSpark drafter "
                    f"file), dspark:synthetic:PRESET[:FORMATS[:SEED]] (the synthetic DSpark drafter, no file), mtp (the target's own MTP block) or mtp:PATH (an MTP file)")
