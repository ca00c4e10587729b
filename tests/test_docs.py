"""The documents a user reads (issue 28.9): the README says how to run the real DeepSeek-V4-Flash and points only at
what a clone of the repository holds; the design documents do not say that batched prefill is unlowered."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ds4c.config import preset
from ds4c.quant import nbytes
from ds4c.tensors import storage_types, tensor_specs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = sorted((ROOT / "docs").glob("*.md"))
# a path in the repository as the documents write it in backticks: a top folder of the repository, then a file
_REPO_PATH = re.compile(r"`((?:docs|tools|tests|ds4c|runtime|passes|templates)/[\w./-]+\.(?:md|py|sh|j2|json|log))`")


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert m, f"no section '## {title}'"
    return m.group(1)


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_named_repository_files_exist(path):
    text = path.read_text(encoding="utf-8")
    missing = sorted({p for p in _REPO_PATH.findall(text) if not (ROOT / p).exists()})
    assert not missing, f"{path.name} names files the repository does not have: {missing}"


def test_readme_points_at_nothing_outside_a_clone():
    assert "../" not in README, [ln for ln in README.splitlines() if "../" in ln]


def test_readme_says_how_to_run_the_real_model():
    sec = _section(README, "Running the real DeepSeek-V4-Flash")
    for need in ("convert_hf_to_gguf.py", "--mtp", "llama-quantize", "ds4c info dsv4-flash.gguf --plan",
                 "https://github.com/ggml-org/llama.cpp", "rope.scaling"):
        assert need in sec, need
    # the table's weights are the files' (the plan holds some in wider forms: at most 2 GiB more) and its fit
    # columns agree with them (plus ~1 GiB of state, graphs and slack, 5% headroom of the free memory)
    rows = re.findall(r"^\| (.+?) \| (\d+) GiB \| (yes|no[^|]*) \| (yes|no[^|]*) \|$", sec, re.M)
    formats = {"converter output": "official", "Q4_K": "q4_k", "Q3_K": "q3_k", "Q2_K": "q2_k"}
    assert len(rows) == len(formats), rows
    cfg = preset("flash")
    for what, gib, h200, h100 in rows:
        fmt = next(f for k, f in formats.items() if what.startswith(k))
        types = storage_types(cfg, fmt)
        file_gib = sum(nbytes(types[s.name], s.shape) for s in tensor_specs(cfg)) / 2**30
        assert file_gib <= int(gib) + 0.5 <= file_gib + 2.5, (what, gib, file_gib)
        for col, free in ((h200, 139), (h100, 78)):
            assert col.startswith("yes") == (int(gib) + 1 <= 0.95 * free), (what, col, free)


def test_prefill_is_not_described_as_unlowered():
    codegen = (ROOT / "docs" / "codegen.md").read_text(encoding="utf-8")
    ir = (ROOT / "docs" / "ir.md").read_text(encoding="utf-8")
    assert "not wired into the lowering" not in codegen
    assert "IR and interpreter only" not in ir and "lowering refuses a chunk graph" not in ir
    assert "`lower_graph` refuses a chunk graph" not in ir
    for text in (codegen, ir):
        assert "runtime/lower_prefill.py" in text
    assert (ROOT / "runtime" / "lower_prefill.py").is_file()
