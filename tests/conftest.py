"""Shared pytest fixtures: synthetic tiny model files written once per test session.

``tiny_path``: the ``tiny`` preset, seed 0, official formats (MXFP4 experts, Q8_0 FP8 weights, BF16/F32).
``tiny_bf16_path``: the same model (seed 0) stored with ``--formats bf16``.

Tests must not modify these files; copy them (``shutil.copy``) to change anything.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

# A run with torch's CPU path forced (ATEN_CPU_CAPABILITY, as .ci/run does) gets its own inductor cache: torch
# 2.13 keys its cached kernels without that setting, and a kernel built under "default" crashed (SIGSEGV) a
# later run on the native path that loaded it from the shared /tmp/torchinductor_$USER.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / (
        f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY'].lower()}"))

import pytest  # noqa: E402
import torch  # noqa: E402

from ds4c.config import preset
from ds4c.sources import open_model
from ds4c.reference import ReferenceWeights
from ds4c.synth import make_model


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The test models' ops are far too small for intra-op threads; on a busy 2-core machine two threads make
    every step ~10x slower. Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-scoped path to a tiny official-format synthetic model (seed 0)."""
    return make_model(preset("tiny"), tmp_path_factory.mktemp("models") / "tiny-seed0.gguf", seed=0)


@pytest.fixture(scope="session")
def tiny_bf16_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-scoped path to the same tiny model (seed 0) stored as ``--formats bf16``."""
    return make_model(preset("tiny"), tmp_path_factory.mktemp("models-bf16") / "tiny-seed0-bf16.gguf", seed=0,
                      formats="bf16")


@pytest.fixture(scope="session")
def tiny_weights(tiny_path: Path) -> ReferenceWeights:
    """The reference's weights of ``tiny_path`` on the CPU (shared; tests must not modify them)."""
    return ReferenceWeights.load(open_model(tiny_path))
