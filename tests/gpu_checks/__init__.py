"""GPU correctness and timing checks per kernel family (tests/gpu_checks/<family>.py), run on a CUDA machine:
by ``pytest -m gpu tests/test_gpu_kernels.py`` (one test per family: every case within tolerance), or as a timing
table by ``python tests/gpu_checks [--only FAMILIES] [--json FILE]`` (``__main__.py``), or one family by
``python tests/gpu_checks/<family>.py``. The tests import them as ``gpu_checks.<family>``."""

#: every family with a GPU check, in the order the table lists them
FAMILIES = ("gemv", "gemm", "moe_gemm", "attention", "hc", "compressor", "indexer", "router", "experts", "rowchain",
            "tap")
