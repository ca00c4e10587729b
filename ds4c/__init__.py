"""ds4c: a compiler for DeepSeek-V4-Flash decode and speculative-verify steps.

Data flows one way: GGUF -> config + weights -> IR -> passes -> kernel plan -> render -> compile/cache ->
artifact -> runtime. This package holds the front half (config, GGUF model files, quant formats, synthetic
models, the PyTorch reference) and the CLI; ``ds4c.passes`` and ``ds4c.runtime`` hold the rest.

Docstrings cite the model as ``spec N`` (``spec 2.3``, ``spec P9``, ``spec 5.2(q)``): section N of docs/model.md.
docs/README.md maps every other document.
"""

from ds4c.version import __version__  # noqa: E402
from ds4c.errors import ConfigError, Ds4cError, ModelFileError, QuantError, StepError  # noqa: E402

__all__ = ["__version__", "Model", "Completion", "Ds4cError", "ConfigError", "ModelFileError", "QuantError",
           "StepError"]


def __getattr__(name: str):
    """``ds4c.Model`` / ``ds4c.Completion`` (:mod:`ds4c.api`), imported on first use so ``import ds4c`` stays
    light (torch and the tokenizer load only when a model is opened)."""
    if name in ("Model", "Completion", "CompletionStream", "Timings"):
        from ds4c import api

        return getattr(api, name)
    raise AttributeError(f"module 'ds4c' has no attribute {name!r}")
