"""``ds4c bench --prefill`` (ds4c/prefill_bench.py, issue 12): the prompt's FLOPs against an independent count from
the IR, the llama-bench pp parsing, and the command on the CPU (the verify column through the reference; the chunk
graphs and the card's GEMM rate need a GPU and are reported as not run)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ds4c.cli import main
from ds4c.config import preset
from ds4c.prefill_bench import llama_pp, prefill_flops


@pytest.mark.parametrize("name", ["tiny", "flash-l4"])
def test_weight_flops_per_token_equal_the_irs_products(name):
    """Per token: 2 x every 2-D weight an op of the q = 1 step multiplies (linear, grouped_linear, hc_mix; the
    embedding and the position / hash tables are lookups, the head runs once) + the k routed experts' three
    matrices, counted from the IR graph, equal prefill_flops' weights (built from the tensor list)."""
    from ds4c.ir import build_step

    cfg = preset(name)
    g = build_step(cfg, 1, 256)
    params = {op.outputs[0]: op.attrs["weight"] for op in g.ops if op.kind == "param"}
    skip = ("token_embd.weight", "_ape.weight", "tid2eid.weight", "output.weight")
    ir = sum(2 * v.type.shape[0] * v.type.shape[1] for op in g.ops for v in op.inputs
             if v in params and len(v.type.shape) == 2 and not params[v].endswith(skip))
    ir += 2 * 3 * cfg.hidden_size * cfg.moe_inter * cfg.n_active_experts * cfg.n_layers
    f = prefill_flops(cfg, 7)
    assert f["weights"] == pytest.approx(7 * ir, rel=1e-12)
    assert f["head"] == 2 * cfg.vocab_size * cfg.hidden_size
    if name == "flash-l4":
        assert f["weights"] / 7 == pytest.approx(2.3647e9, rel=1e-4)  # docs/perf.md's 293 M weights a layer


def test_attention_and_indexer_flops_by_a_plain_loop():
    cfg = preset("tiny")
    n = 37
    att = idx = 0
    for layer in range(cfg.n_layers):
        r = cfg.ratio(layer)
        for p in range(n):
            entries = min(p + 1, cfg.window)
            if r == 4:
                entries += min(cfg.index_topk, (p + 1) // 4)
                idx += 2 * cfg.index_n_heads * cfg.index_head_dim * ((p + 1) // 4)
            elif r:
                entries += (p + 1) // r
            att += 4 * cfg.n_heads * cfg.head_dim * entries
    f = prefill_flops(cfg, n)
    assert f["attention"] == att and f["indexer"] == idx and idx > 0
    assert f["total"] == f["weights"] + f["head"] + f["attention"] + f["indexer"]


def test_llama_pp_parses_and_records_failures(tmp_path):
    ok = tmp_path / "llama-bench"
    ok.write_text("#!/bin/sh\necho '[{\"n_prompt\": 4096, \"n_gen\": 0, \"avg_ts\": 11157.0}]'\n")
    ok.chmod(0o755)
    out = llama_pp(str(ok), "m.gguf", (4096, 512), say=lambda m: None)
    assert out["pp_tok_s"] == {4096: 11157.0}
    assert "n_prompt 512" in out["errors"][512] and "\n" not in out["errors"][512]
    bad = tmp_path / "bad-bench"
    bad.write_text("#!/bin/sh\necho nonsense\n")
    bad.chmod(0o755)
    out = llama_pp(str(bad), "m.gguf", (64,), say=lambda m: None)
    assert out["pp_tok_s"] == {} and "found 'nonsense'" in out["errors"][64]


def test_bench_prefill_on_the_cpu(tiny_path, tmp_path):
    """The verify column runs on the reference; the chunk columns say why they did not run; --json has the rows."""
    js = tmp_path / "p.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--prefill", "9,23", "--json", str(js)])
    assert r.exit_code == 0, r.output
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in ("9", "23")]
    assert len(rows) == 2 and all(row[1] == "-" and float(row[3]) > 0 for row in rows), r.stdout
    rec = json.loads(js.read_text())
    assert [x["length"] for x in rec["rows"]] == [9, 23] and rec["chunks"] == []
    assert all(x["verify_tok_s"] > 0 and x["chunks_s"] is None and "need the compiled engine" in x["notes"][0]
               for x in rec["rows"])


@pytest.mark.parametrize("args, found", [
    (["--device", "cpu", "--prefill", "0"], "expected distinct prompt lengths >= 1"),
    (["--device", "cpu", "--prefill", "20,20"], "expected distinct prompt lengths >= 1"),
    (["--device", "cpu", "--prefill", "20", "--prefill-chunks", "8"], "expected distinct ints in 16..4096"),
    (["--device", "cpu", "--prefill-chunks", "256"], "--prefill-chunks: applies only with --prefill LENGTHS"),
    (["--device", "cpu", "--no-prefill-baseline"], "--no-prefill-baseline: applies only with --prefill"),
    (["--device", "cpu", "--prefill", "20", "--no-prefill-baseline"], "leaves nothing to measure"),
    (["--prefill", "x"], "--prefill"),
    (["--prefill", "64", "--artifact", "A"], "drop --devices / --layer-split / --artifact"),
    (["--device", "cuda", "--prefill", "64", "--prefill-chunks", "8"], "expected distinct ints in 16..4096"),
])
def test_bench_prefill_refusals(tiny_path, args, found):
    r = CliRunner().invoke(main, ["bench", str(tiny_path), *args])
    assert r.exit_code != 0 and found in r.output, r.output
    assert "Traceback" not in r.output
