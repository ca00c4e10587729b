"""Every kernel family on a CUDA GPU against its CPU reference (skipped without a GPU): one test per family runs
that family's check (tests/gpu_checks/<family>.py: its kernels rendered and compiled for this card, launched on
fresh random inputs with NaN-poisoned outputs, compared by relative error with each case's own bound, and timed)
and requires every case to pass. ``-s`` prints each family's table; ``python tests/gpu_checks`` prints the same
checks as one timing table with a JSON of every row (docs/gpu-validation.md)."""

from __future__ import annotations

import importlib

import pytest
import torch

from gpu_checks import FAMILIES


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (kernel family checks)")
@pytest.mark.parametrize("family", FAMILIES)
def test_every_case_of_the_family_matches_its_reference(family: str) -> None:
    from ds4c.runtime.step import device_arch

    check = importlib.import_module(f"gpu_checks.{family}")
    rows = check.run(arch=device_arch())
    check.print_table(rows)
    bad = [r.get("spec", r) for r in rows if not r.get("ok")]
    assert rows and not bad, f"{len(bad)}/{len(rows)} {family} cases failed: {bad}"
    if family == "compressor":  # its bound over the whole run, beside each case's own
        assert check.run_mismatch_ok(rows)


def test_every_family_has_a_check_with_the_common_shape() -> None:
    """On the CPU: each family's check imports without a GPU and has the ``run`` and ``print_table`` that the
    test above and ``python tests/gpu_checks`` call."""
    for family in FAMILIES:
        check = importlib.import_module(f"gpu_checks.{family}")
        assert callable(check.run) and callable(check.print_table), family
