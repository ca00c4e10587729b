"""``ds4c export-mlir`` and :func:`ds4c.export.export_mlir`: the step imported with torch-mlir, written atomically,
and (linalg) lowered to LLVM and run on the CPU with MLIR's ExecutionEngine equal to the IR interpreter at fp32
roundoff, at widths 1..5 and a prefill chunk, with the weights read back from the written side file; the one-line
errors for bad input and for a missing torch-mlir.

The tests that need torch-mlir skip with the reason when the ``ds4c[mlir]`` extra is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ds4c.cli import main
from ds4c.cli.export_mlir import MLIR_AFTER, MLIR_DIALECTS, MLIR_WEIGHTS
from ds4c.config import preset
from ds4c.errors import ConfigError, ExportError
from ds4c.export import AFTER_PASSES, export_mlir
from ds4c.export import mlir as M
from ds4c.export import step as S
from ds4c.export.fx import WEIGHT_MODES

import export_check as X
from export_check import fp32_weights, tokens  # noqa: F401  (fixtures)

TINY = preset("tiny")
needs_mlir = pytest.mark.skipif(M.available() is not None,
                                reason=f"the ds4c[mlir] extra is not installed ({M.available()} missing): "
                                       f"pip install 'ds4c[mlir]'")


def _cli(*args: str):
    return CliRunner().invoke(main, ["export-mlir", *args])


def _one_line_error(res, pattern: str) -> None:
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4c: error: "), res.output
    assert re.search(pattern, lines[0]), lines[0]


def test_cli_choices_are_the_apis():
    assert MLIR_DIALECTS == M.DIALECTS and MLIR_WEIGHTS == WEIGHT_MODES and MLIR_AFTER == AFTER_PASSES


def test_missing_torch_mlir_is_a_one_line_error(tiny_path, tmp_path):
    """Without the extra (torch_mlir made unimportable) the command says what to install; nothing is written."""
    code = ("import sys; sys.modules['torch_mlir'] = None; from ds4c.cli import main; "
            f"sys.argv = ['ds4c', 'export-mlir', {str(tiny_path)!r}, '--ctx', '64', '-o', {str(tmp_path / 's.mlir')!r}]; "
            "main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("ds4c:")]
    assert err == ["ds4c: error: MLIR export needs the ds4c[mlir] extra (torch-mlir, ml_dtypes): torch_mlir is not "
                   "installed; pip install 'ds4c[mlir]'"], r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, pattern", [
    (["--width", "2", "--prefill", "8"], r"give --width .* or --prefill .*, not both"),
    (["--layers", "2-4"], r"expected a layer range A:B .*found '2-4'"),
    (["--layers", "4:9"], r"layer"),
    (["--ctx", "100000000"], r"max_ctx must be in 1\.\.65536"),
    (["--prefill", "300", "--ctx", "256"], r"a prefill chunk must have 1\.\.256 rows"),
    (["--dialect", "spirv"], r"'spirv' is not one of"),
])
def test_bad_options_are_one_line_errors(tiny_path, tmp_path, args, pattern):
    _one_line_error(_cli(str(tiny_path), *args, "-o", str(tmp_path / "s.mlir")), pattern)
    assert list(tmp_path.iterdir()) == []


def test_bad_outputs_are_refused_before_any_work(tiny_path, tmp_path, monkeypatch):
    _one_line_error(_cli(str(tiny_path), "-o", str(tmp_path / "w.safetensors")),
                    r"ends in \.safetensors, the suffix of the weights file")
    _one_line_error(_cli(str(tiny_path), "-o", str(tmp_path / "missing" / "s.mlir")), r"cannot write .*s\.mlir")
    (tmp_path / "d.safetensors").mkdir()
    _one_line_error(_cli(str(tiny_path), "-o", str(tmp_path / "d.mlir")), r"cannot write .*d\.safetensors")
    # inline weights over the limit: refused before a weight is read (tiny reads ~52 MB)
    monkeypatch.setattr(S, "INLINE_MAX_BYTES", 1 << 20)
    with pytest.raises(ExportError, match=r"weights inline: the step reads 50 MiB of weights, inline holds at most 1 "
                                          r"MiB; use weights external"):
        export_mlir(tiny_path, tmp_path / "s.mlir", ctx=64, weights="inline")
    with pytest.raises(ConfigError):
        export_mlir(tiny_path, tmp_path / "s.mlir", ctx=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]


@needs_mlir
def test_cli_writes_a_named_parseable_module_with_inline_weights(tiny_path, tmp_path):
    """The torch dialect of a two-layer shard with its weights inline: one file (no side file), arguments and results
    named, the step described, every op located at its IR op, parsed back by torch-mlir-opt."""
    out = tmp_path / "shard.mlir"
    out.write_text("an older export")  # replaced whole
    res = _cli(str(tiny_path), "--width", "3", "--ctx", "64", "--layers", "0:2", "--dialect", "torch",
               "--weights", "inline", "-o", str(out))
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == (f"wrote {out} (tiny, width 3, ctx 64, layers 0:2, torch, "
                                                   f"4 arguments, 3 results)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.mlir"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o600)
    text = out.read_text()
    head = text[:text.index("{-#")] if "{-#" in text else text
    for name in ("tokens", "pos", "l0.ring", "l1.ring", "hc_out"):
        assert f'{{ds4c.name = "{name}"}}' in head, name
    assert 'ds4c.step = {' in head and 'config = "tiny"' in head and 'layers = "0:2"' in head
    assert 'weights = "inline"' in head and "dense_resource<" in head and "dialect_resources" in text
    assert 'loc("ds4c:sparse_attention (layer 1)"' in head and "torch.aten.mm" in head
    opt = Path(sys.executable).parent / "torch-mlir-opt"
    if opt.exists():  # the wheel's command-line tool reads the file back
        r = subprocess.run([str(opt), str(out), "-o", os.devnull], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]


@needs_mlir
def test_a_conversion_torch_mlir_refuses_is_one_line_naming_the_ir_op(tiny_path, tmp_path):
    """TOSA has no sort: the routed experts' ascending order cannot convert; the error names the aten op and the IR
    op, and nothing is written."""
    res = _cli(str(tiny_path), "--ctx", "64", "--layers", "0:1", "--dialect", "tosa", "--weights", "none",
               "-o", str(tmp_path / "s.mlir"))
    _one_line_error(res, r"torch-mlir cannot convert the step to tosa: torch\.aten\.sort from IR op "
                         r"routed_experts \(layer 0\)$")
    assert list(tmp_path.iterdir()) == []


@needs_mlir
@pytest.mark.slow
@pytest.mark.parametrize("case", X.cases(["q1", "q2", "q3", "q4", "q5", "prefill8"], ["q1", "q5", "prefill8"]))
def test_cpu_step_equals_the_interpreter(fp32_weights, tiny_path, tmp_path, tokens, case):
    """tiny's step exported to linalg with external weights, lowered to LLVM and run with the ExecutionEngine,
    its weights read from the written side file: logits and every state output within
    :func:`export_check.fp32_reorder_bound` of the interpreter over 40 positions from a reset state (ring wraps,
    compressor flushes of ratios 4 and 16, the indexer top-k over more candidates than it keeps, hash and scored
    routers; the prefill chunk of 8 rows holds 5..8 tokens). fp32 dataflow without fake quantization, so only
    the order of fp32 operations differs.

    Each case exports a third of the step, together all of it: width 1 the layers 0:2 (the embedding, the
    uncompressed layers, the hash router), width 5 the layers 2:4 (ratio 4 with the hash router, ratio 16 with the
    scored router; ``hc_in`` fresh random data), the chunk the layers 4:6 (both ratios with the scored router, the
    head and its logits): a third of the export and JIT time of the whole step (~50 s of a core each) in the CI
    suite. ``DS4C_EXPORT_ALL_WIDTHS=1`` runs every width whole; the CLI test below reads a module back."""
    st = pytest.importorskip("safetensors.torch", reason="the safetensors reader (requirements-cpu.txt)")
    prefill = 8 if case.startswith("prefill") else None
    layers = None if X.ALL_WIDTHS else {"q1": (0, 2), "prefill8": (4, 6)}.get(case, (2, 4))
    e = export_mlir(tiny_path, tmp_path / "step.mlir", width=1 if prefill else int(case[1:]), prefill=prefill,
                    ctx=X.MAX_CTX, layers=layers, dialect="linalg", weights="external", dataflow="fp32",
                    quant_emulation=False)
    assert e.weights_path == tmp_path / "step.safetensors"
    stored = st.load_file(str(e.weights_path))
    wv = [stored[w.name] for w in e.weights]
    step = M.compile_cpu(e.module, e.program)
    n = e.description["n_step_inputs"]
    names = [i.name for i in e.inputs[:n]]
    graph = S.step_graph(fp32_weights.config, e.description["width"] if not prefill else 1, prefill, X.MAX_CTX,
                         layers=layers)
    assert names == list(graph.inputs) and [o.name for o in e.outputs] == list(graph.outputs)
    rows = (lambda p: 5 + (p // 8) % 4) if prefill else None  # noqa: E731
    worst = X.step_alongside(graph, fp32_weights, lambda *a: step(*a, *wv), names, tokens,
                             tol=X.fp32_reorder_bound(fp32_weights.config), rows=rows)
    assert set(worst) == set(graph.outputs) and max(worst.values()) > 0  # computed by the JIT, not copied
