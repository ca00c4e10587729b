"""ds4c: a compiler for DeepSeek-V4-Flash decode and speculative-verify steps.

Data flows one way: GGUF -> config + weights -> IR -> passes -> kernel plan -> render -> compile/cache ->
artifact -> runtime. This package holds the front half (config, GGUF model files, quant formats, synthetic
models, the PyTorch reference) and the CLI; ``ds4c.passes`` and ``ds4c.runtime`` hold the rest.
"""

__version__ = "0.2.0"

from ds4c.errors import ConfigError, Ds4cError, ModelFileError, QuantError, StepError  # noqa: E402

__all__ = ["__version__", "Ds4cError", "ConfigError", "ModelFileError", "QuantError", "StepError"]
