"""The package version, in a leaf module: ``ds4c/__init__`` re-exports it, and modules that stamp it into what they
write (artifact manifests, the kernel cache's key, exported MLIR) import it from here without importing the package
front (whose lazy ``Model`` attribute reaches the API). pyproject.toml reads it from here too."""

__version__ = "0.2.0"
