"""``ds4c bench`` on the CPU (the compiled-step column needs a GPU and is covered on the H200, see
docs/gpu-validation.md and docs/perf.md): the reference columns, the byte model behind the roofline, the
printed table, and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ds4c.bench import BenchError, family_table, format_report, plan_weight_bytes, run_bench, state_read_bytes
from ds4c.cli import main
from ds4c.config import preset
from ds4c.sources import open_model


def test_state_bytes_count_every_buffer_the_step_reads():
    cfg = preset("tiny")  # ratios (0, 0, 4, 16, 4, 16), window 16, head_dim 192, index_head_dim 128, top-k 8
    end, q = 100, 5
    ring = 6 * 16 * 192 * 2
    csa = 2 * (2 * 8 * 2 * 192 * 4 + 25 * 128 * 2 + 2 * 8 * 2 * 128 * 4 + min(25, 5 * 8) * 192 * 2)
    hca = 2 * (2 * 16 * 192 * 4 + 6 * 192 * 2)
    assert state_read_bytes(cfg, end, q) == ring + csa + hca
    # a short sequence reads only the ring rows that exist and no compressed rows
    assert state_read_bytes(cfg, 3, 1) < state_read_bytes(cfg, 100, 1)


def test_weight_bytes_count_only_the_routed_experts(tiny_path):
    mf = open_model(tiny_path)
    cfg = mf.config
    full, per_layer, per_kernel = plan_weight_bytes(mf, 1, 256, 256, None)  # default: q x n_active per layer
    one, _, _ = plan_weight_bytes(mf, 1, 256, 256, {i: 1 for i in range(cfg.n_layers)})
    none, _, _ = plan_weight_bytes(mf, 1, 256, 256, {i: 0 for i in range(cfg.n_layers)})
    assert sum(per_kernel.values()) == full and per_kernel["linear"] == cfg.vocab_size * cfg.hidden_size * 2
    per_expert = (one - none) // cfg.n_layers
    assert per_expert > 0 and full - none == per_expert * cfg.n_layers * cfg.n_active_experts
    assert 1 <= per_layer <= 12


def test_cpu_bench_times_the_reference_and_says_what_was_not_run(tiny_path):
    mf = open_model(tiny_path)
    rep = run_bench(mf, "cpu", (1, 3), (40,), ref_repeats=2, compile_modes=(), say=lambda m: None)
    assert [(r.width, r.context, r.pos) for r in rep.rows] == [(1, 40, 35), (3, 40, 35)]
    for r in rep.rows:
        assert r.eager_ms is not None and r.eager_ms > 0
        assert r.ours_ms is None and r.roofline_ms is None and r.compile_ms is None
        assert any("needs a CUDA device" in n for n in r.notes)
        assert r.weight_bytes > 0 and r.state_bytes > 0
    text = format_report(rep)
    assert "eager/ours" in text and "roof/ours" in text and "needs a CUDA device" in text
    assert "transformers port not run" in text
    d = rep.as_dict()
    assert json.loads(json.dumps(d))["rows"][1]["width"] == 3


@pytest.mark.parametrize("kw, msg", [({"widths": (0,)}, "widths must be in 1..5"),
                                     ({"widths": (6,)}, "widths must be in 1..5"),
                                     ({"contexts": (4,)}, "contexts must be in 8.."),
                                     ({"widths": (5, 1, 1)}, r"widths must be increasing without repeats, found \[5, 1, 1\]"),
                                     ({"contexts": (64, 16, 16)}, "contexts must be increasing without repeats"),
                                     ({"modes": ("nonsense",)}, r"modes must be among .*found \['nonsense'\]"),
                                     ({"modes": ("",)}, r"found \[''\]"),
                                     ({"artifact": "/does/not/exist"}, r"--artifact is used only by the compiled step"),
                                     ({"reference": False}, r"--no-reference leaves nothing to time with --device cpu")])
def test_bad_requests_name_what_was_expected(tiny_path, kw, msg):
    args = {"widths": (1,), "contexts": (40,), "modes": (), "artifact": None, "reference": True, **kw}
    with pytest.raises(BenchError, match=msg):
        run_bench(open_model(tiny_path), "cpu", args["widths"], args["contexts"], compile_modes=args["modes"],
                  artifact=args["artifact"], reference=args["reference"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a CUDA device")
def test_cli_bench_without_a_gpu_says_so(tiny_path, tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--ctx", "40"], catch_exceptions=False)
    assert r.exit_code == 2 and "no CUDA device" in r.output and "--device cpu" in r.output
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--widths", "1", "--ctx", "24",
                                  "--compile-modes", "none", "--ref-repeats", "1", "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["rows"][0]["eager_ms"] > 0
    assert "speed-ups" in r.stdout and "--no-generate changes nothing" not in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--widths", "1", "--ctx", "24",
                                  "--compile-modes", "none", "--ref-repeats", "1", "--no-generate"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and "note: --no-generate changes nothing with --device cpu" in r.output, r.output


@pytest.mark.parametrize("where, msg", [("missing/b.json", "cannot write a file there"), ("", "expected a file path"),
                                        ("/proc/b.json", "cannot write a file there")])
def test_cli_bench_checks_the_json_path_before_running(tiny_path, tmp_path, where, msg):
    path = where if where in ("", "/proc/b.json") else str(tmp_path / where)
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--json", path],
                           catch_exceptions=False)
    assert r.exit_code == 2 and msg in r.output and "\n" not in r.output.strip(), r.output
    assert "filling the sequence" not in r.output  # refused before the run


def test_cli_bench_writes_the_json_whole_and_leaves_no_temporary(tiny_path, tmp_path):
    out = tmp_path / "b.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--widths", "1", "--ctx", "40",
                                  "--compile-modes", "none", "--ref-repeats", "1", "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["rows"][0]["width"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]


def test_family_table_counts_a_kernel_of_several_launches_once():
    prof = [{"kernel": "l0.moe_experts", "family": "experts", "layer": 0, "entry": "up", "us": 30.0},
            {"kernel": "l0.moe_experts", "family": "experts", "layer": 0, "entry": "down", "us": 10.0},
            {"kernel": "linear", "family": "gemv", "layer": -1, "entry": "gemv", "us": 20.0}]
    fam = family_table(prof, {"l0.moe_experts": 4_000_000, "linear": 2_000_000})
    assert fam["experts"] == {"launches": 2, "us": 40.0, "bytes": 4_000_000, "GBps": 100.0}
    assert fam["gemv"]["GBps"] == 100.0


def test_llama_bench_tg_parses_and_records_failures(tmp_path):
    """``--llama-bench``: llama-bench's JSON parsed per depth; a crash, bad output or a missing binary is a
    one-line error per context, never an exception."""
    from ds4c.bench import llama_bench_tg, llama_step_ms

    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "d=$(echo \"$@\" | sed 's/.*-d \\([0-9]*\\).*/\\1/')\n"
                    "[ \"$d\" = 999 ] && { echo boom >&2; exit 3; }\n"
                    "echo '[{\"n_prompt\": 5, \"n_gen\": 0, \"n_depth\": '$d', \"avg_ts\": 1146.8},"
                    " {\"n_prompt\": 0, \"n_gen\": 128, \"n_depth\": '$d', \"avg_ts\": 478.6}]'\n")
    fake.chmod(0o755)
    out = llama_bench_tg(str(fake), "m.gguf", (4096, 999), say=lambda m: None)
    assert out["tg_tok_s"] == {4096: 478.6} and out["pp_tok_s"] == {4096: 1146.8}
    assert set(out["errors"]) == {999} and "boom" in out["errors"][999] and "\n" not in out["errors"][999]
    assert out["cmd"].endswith("-m MODEL -p 5 -n 128 -d CTX -r 3 -ngl 99 -o json")
    # the step-table columns: q=1 is llama's tg per token, q=5 its pp5 batch; other widths have none
    assert llama_step_ms(out, 1, 4096) == pytest.approx(1e3 / 478.6)
    assert llama_step_ms(out, 5, 4096) == pytest.approx(5e3 / 1146.8)
    assert llama_step_ms(out, 3, 4096) is None and llama_step_ms(out, 1, 999) is None
    for body, why in (('{"a": 1}', "expected llama-bench's JSON list"), ("[1, 2]", "expected llama-bench's JSON list"),
                      ('[{"n_prompt": 0, "n_gen": 128, "n_depth": 64, "avg_ts": -5}]', "expected a positive rate"),
                      ('[{"n_gen": 128, "avg_ts": "fast"}]', "expected a test record with n_gen 128 and n_depth 64, "
                                                             "found 1 record(s): [{'n_gen': 128"),
                      ("garbage", "expected llama-bench's JSON (-o json) on stdout, found 'garbage'")):
        odd = tmp_path / "odd-bench"
        odd.write_text(f"#!/bin/sh\necho '{body}'\n")
        odd.chmod(0o755)
        res = llama_bench_tg(str(odd), "m.gguf", (64,), say=lambda m: None)
        assert res["tg_tok_s"] == {} and why in res["errors"][64] and "\n" not in res["errors"][64], res
        assert "Error" not in res["errors"][64], res  # no Python exception names
    missing = llama_bench_tg(str(tmp_path / "nope"), "m.gguf", (64,), say=lambda m: None)
    assert missing["tg_tok_s"] == {} and "No such file" in missing["errors"][64]


def test_bench_cli_refuses_a_missing_llama_bench(tmp_path, tiny_path):
    from click.testing import CliRunner

    from ds4c.cli import main

    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--llama-bench", str(tmp_path / "x")])
    assert r.exit_code != 0 and "--llama-bench" in r.output and "no executable file" in r.output
    assert "Traceback" not in r.output
