"""ds4c error types.

Every error raised on bad input is a :class:`Ds4cError` (or a subclass) whose message says what was
expected and what was found, so a user can fix the input without reading ds4c's source.
"""

from __future__ import annotations


class Ds4cError(Exception):
    """Base class of every error ds4c raises on bad input or bad state."""


class ConfigError(Ds4cError):
    """A configuration is inconsistent (spec section 1) or a GGUF metadata key is missing or invalid."""


class ModelFileError(Ds4cError):
    """A GGUF model file is unreadable, truncated, of the wrong architecture, or has a missing,
    mis-shaped or wrongly typed tensor (docs/gguf-layout.md)."""


class QuantError(Ds4cError):
    """A tensor cannot be quantized or dequantized in the requested format (bad shape or type)."""


class StepError(Ds4cError):
    """A decode/verify step was asked for with bad inputs: a position past the maximum context, a width
    outside 1..5, a token id outside the vocabulary, or a state of another model."""


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C (a KeyboardInterrupt) during :meth:`ds4c.Model.generate`: still a KeyboardInterrupt, carrying what
    was generated until then in ``completion`` (a :class:`ds4c.api.Completion` with ``stop_reason``
    ``"interrupted"``)."""

    def __init__(self, completion: object):
        super().__init__("generation interrupted")
        self.completion = completion


class ExportError(Ds4cError):
    """A step graph cannot be exported (``ds4c.export``): an IR op with no lowering, a symbolic shape, a bad
    option, the optional MLIR dependencies missing, or a conversion torch-mlir refuses."""
