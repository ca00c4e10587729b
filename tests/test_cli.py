"""Tests of the ``ds4c`` command line (ds4c.cli) through click's CliRunner: make-model, info, generate, the
built-in default model under $DS4C_HOME, and bad inputs (exit status 2 with one ``ds4c: error:`` line or a
click usage error)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from ds4c import __version__
from ds4c.cli import main
from ds4c.config import preset
from ds4c.sources import open_model

TINY = preset("tiny")
VOCAB = TINY.vocab_size  # 512


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "ds4c-home"


def run(home: Path, *args: str) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(home)}, catch_exceptions=False)


def run_json(home: Path, *args: str) -> dict:
    r = run(home, *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def assert_error_line(r: Result, *parts: str) -> str:
    """Exit 2, nothing on stdout, exactly one non-empty stderr line ``ds4c: error: ...`` holding ``parts``."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ds4c: error: "), lines[0]
    assert "Traceback" not in r.output
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


def assert_usage_error(r: Result, *parts: str) -> None:
    """A malformed option: one ``ds4c: error:`` line naming it and pointing at the command's --help."""
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ds4c: error: ") and "--help)" in lines[0], r.stderr
    assert "Traceback" not in r.output
    for p in parts:
        assert p in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------------ make-model

def test_make_model_writes_the_synthetic_file(tmp_path, home, tiny_path):
    out = tmp_path / "sub" / "m.gguf"
    r = run(home, "make-model", "--preset", "tiny", "-o", out)
    assert r.exit_code == 0, r.output
    assert out.is_file()
    assert f"wrote {out}" in r.stdout and "preset tiny, seed 0, formats official" in r.stdout
    assert out.read_bytes() == tiny_path.read_bytes()  # same preset + seed: the same bytes as the API writes
    assert not (home / "models").exists()  # no default model was needed


def test_make_model_seed_and_formats(tmp_path, home):
    out = tmp_path / "b.gguf"
    r = run(home, "make-model", "--preset", "tiny", "--seed", "3", "--formats", "bf16", "-o", out)
    assert r.exit_code == 0, r.output
    mf = open_model(out)
    assert mf.metadata["ds4c.synthetic_seed"] == 3 and mf.metadata["ds4c.formats"] == "bf16"
    assert set(mf.weight_bytes_by_type()) == {"BF16", "F32", "I32"}
    assert mf.config == TINY


def test_make_model_kquant_mix(tmp_path, home):
    """``--formats q4_k_all``: every FP8 and FP4 weight in Q4_K (a llama-quantize K-quant mix's shape; Q8_0 where a
    row is not a multiple of 256 values); the CLI's format list is ds4c.tensors.FORMATS."""
    from ds4c.cli.make_model import FORMAT_NAMES
    from ds4c.tensors import FORMATS

    assert FORMAT_NAMES == list(FORMATS)
    out = tmp_path / "k.gguf"
    r = run(home, "make-model", "--preset", "tiny", "--formats", "q4_k_all", "-o", out)
    assert r.exit_code == 0, r.output
    mf = open_model(out)
    assert mf.metadata["ds4c.formats"] == "q4_k_all"
    assert mf.ggml_type("blk.0.attn_q_a.weight").name == "Q4_K" and mf.ggml_type("blk.0.ffn_up_exps.weight").name == "Q4_K"


def test_make_model_bad_options(tmp_path, home):
    assert_usage_error(run(home, "make-model", "--preset", "huge", "-o", tmp_path / "x.gguf"), "huge")
    assert_usage_error(run(home, "make-model", "--formats", "fp8", "-o", tmp_path / "x.gguf"), "fp8")
    assert_usage_error(run(home, "make-model", "--preset", "tiny"), "-o")
    assert_usage_error(run(home, "make-model", "-o", tmp_path), "directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "f.gguf").write_bytes(b"x")  # the -o mistakes name their cause
    for o, msg in (("", "-o: expected a file path to write, found ''"),
                   (tmp_path / "f.gguf" / "x.gguf", "f.gguf is a file, not a folder")):
        r = run(home, "make-model", "--preset", "tiny", "-o", o)
        assert r.exit_code == 2 and msg in r.output and "Traceback" not in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.gguf"]


# ------------------------------------------------------------------------------------------------ info

EXPECTED_LAYERS = [(0, "SWA", 0, "hash"), (1, "SWA", 0, "hash"), (2, "CSA", 4, "hash"), (3, "HCA", 16, "scored"),
                   (4, "CSA", 4, "scored"), (5, "HCA", 16, "scored")]


def test_info_text(home, tiny_path):
    r = run(home, "info", tiny_path)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert f"file: {tiny_path}" in out
    assert f"config (tiny, hash {TINY.hash()[:12]})" in out
    assert re.search(r"^\s+hidden_size\s+256$", out, re.M)
    assert re.search(r"^\s+n_experts\s+16$", out, re.M)
    assert re.search(r"^\s+norm_eps\s+1e-06$", out, re.M)
    layers = [(int(m[1]), m[2], int(m[3]), m[4])
              for m in re.finditer(r"^\s+(\d+)\s+(SWA|CSA|HCA)\s+ratio (\d+)\s+router (hash|scored)\s*$", out, re.M)]
    assert layers == EXPECTED_LAYERS
    by_type = open_model(tiny_path).weight_bytes_by_type()
    assert set(by_type) == {"MXFP4", "Q8_0", "BF16", "F32", "I32"}
    for name, (n, b) in by_type.items():
        assert re.search(rf"^\s+{name}\s+{n}\s+tensors\s+{b:,d} bytes", out, re.M), name
    assert re.search(r"^\s+MXFP4\s+18\s+tensors", out, re.M)
    total = sum(b for _, b in by_type.values())
    assert re.search(rf"^\s+total\s+178\s+tensors\s+{total:,d} bytes", out, re.M)
    # table sorted by bytes, largest first
    order = re.findall(r"^\s+(MXFP4|Q8_0|BF16|F32|I32)\s+\d+\s+tensors", out, re.M)
    assert order == sorted(by_type, key=lambda k: -by_type[k][1])


def test_info_json(home, tiny_path):
    rec = run_json(home, "info", tiny_path)
    assert rec["file"] == str(tiny_path)
    assert rec["config"] == TINY.model_dict()
    assert rec["config_hash"] == TINY.hash()
    assert [(li["layer"], li["kind"].upper(), li["compress_ratio"], li["router"]) for li in rec["layers"]] == \
        EXPECTED_LAYERS
    assert rec["tensors"]["MXFP4"]["count"] == 18
    assert rec["tensors"]["Q8_0"]["count"] == 50
    assert sum(t["count"] for t in rec["tensors"].values()) == 178
    assert rec["tensors"]["MXFP4"]["bytes"] == 18 * 16 * 128 * 256 // 32 * 17


# ------------------------------------------------------------------------------------------------ generate

def _check_record(rec: dict, model: Path, prompt: list[int], n: int) -> list[int]:
    assert rec["model"] == str(model)
    assert rec["prompt"] == prompt
    toks = rec["tokens"]
    assert len(toks) == n
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in toks), toks
    assert rec["device"] == "cpu"
    for k in ("load_s", "prefill_s", "decode_s"):
        assert isinstance(rec[k], float) and rec[k] >= 0, k
    assert rec["load_s"] > 0 and rec["prefill_s"] > 0
    assert len(rec["step_ms"]) == n - 1 and all(s > 0 for s in rec["step_ms"])
    return toks


def test_generate_greedy_json_is_deterministic(home, tiny_path):
    a = run_json(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    toks = _check_record(a, tiny_path, [1, 2, 3], 5)
    assert a["temperature"] == 0.0 and a["seed"] == 0
    b = run_json(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert b["tokens"] == toks
    # greedy ignores the sampling seed
    c = run_json(home, "generate", tiny_path, "--prompt-ids", "1, 2, 3", "--max-new-tokens", "5", "--seed", "9")
    assert c["tokens"] == toks
    assert not (home / "models").exists()  # an explicit file never creates the default model


def test_generate_matches_the_python_api(home, tiny_path):
    from ds4c.generate import generate
    from ds4c.reference import Reference, ReferenceWeights

    rec = run_json(home, "generate", tiny_path, "--prompt-ids", "5,6,7,8,9,10,11", "--max-new-tokens", "6")
    ref = Reference(ReferenceWeights.load(open_model(tiny_path), "cpu"), max_ctx=13)
    assert rec["tokens"] == generate(ref, [5, 6, 7, 8, 9, 10, 11], 6).tokens


def test_generate_sampling_is_seeded(home, tiny_path):
    args = ("generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "16", "--temperature", "0.9")
    s1 = run_json(home, *args, "--seed", "1")
    toks = _check_record(s1, tiny_path, [1, 2, 3], 16)
    assert s1["temperature"] == 0.9 and s1["seed"] == 1
    assert run_json(home, *args, "--seed", "1")["tokens"] == toks
    assert run_json(home, *args, "--seed", "2")["tokens"] != toks  # 16 draws: equal only by a fluke


def test_generate_text_output(home, tiny_path):
    r = run(home, "generate", tiny_path, "--prompt-ids", "4,5", "--max-new-tokens", "3")
    assert r.exit_code == 0, r.output
    assert "prompt: [4, 5]" in r.stdout
    m = re.search(r"^tokens: \[(\d+), (\d+), (\d+)\]$", r.stdout, re.M)
    assert m and all(0 <= int(t) < VOCAB for t in m.groups())
    assert re.search(r"prefill 2 tokens in [\d.]+ s, decode [\d.]+ tokens/s", r.stderr)  # timings: stderr
    assert "prefill 2 tokens" not in r.stdout


def test_generate_zero_new_tokens(home, tiny_path):
    rec = run_json(home, "generate", tiny_path, "--prompt-ids", "7", "--max-new-tokens", "0")
    assert rec["prompt"] == [7] and rec["tokens"] == [] and rec["step_ms"] == []


def test_generate_without_file_uses_default_model(home, tiny_path):
    r = run(home, "generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json")
    assert r.exit_code == 0, r.output
    default = home / "models" / f"tiny-seed0-v{__version__}.gguf"
    assert default.is_file()
    assert "creating the built-in default model" in r.stderr and str(default) in r.stderr
    assert default.read_bytes() == tiny_path.read_bytes()  # tiny preset, seed 0
    rec = json.loads(r.stdout)
    toks = _check_record(rec, default, [1, 2, 3], 5)
    # the same model: the same greedy tokens as with the explicit file
    assert run_json(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "5")["tokens"] == toks
    # second use: no re-creation; info with no file reads the same model
    r2 = run(home, "info", "--json")
    assert r2.exit_code == 0, r2.output
    assert "creating" not in r2.stderr
    assert json.loads(r2.stdout)["file"] == str(default)
    assert sorted(p.name for p in default.parent.iterdir() if ".tmp-" in p.name) == []


def test_no_quant_emulation_flag_runs(home, tiny_path):
    from ds4c.generate import generate
    from ds4c.reference import Reference, ReferenceWeights

    rec = run_json(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                   "--no-quant-emulation")
    _check_record(rec, tiny_path, [1, 2, 3], 4)
    w = ReferenceWeights.load(open_model(tiny_path), "cpu")
    w.config = w.config.replace(quant_emulation=False)
    assert rec["tokens"] == generate(Reference(w, max_ctx=7), [1, 2, 3], 4).tokens


# ------------------------------------------------------------------------------------------------ bad inputs

def test_missing_file(home, tmp_path):
    missing = tmp_path / "nope.gguf"
    assert_error_line(run(home, "generate", missing, "--max-new-tokens", "1"), str(missing), "no such model file")
    assert_error_line(run(home, "info", missing), "no such model file")
    assert not (home / "models").exists()


def test_not_a_gguf_file(home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file\n" * 10)
    assert_error_line(run(home, "generate", bad, "--max-new-tokens", "1"), str(bad), "not a GGUF file")
    line = assert_error_line(run(home, "info", bad), "not a GGUF file (it starts with b'this'")
    assert "truncated" not in line  # a whole file of another kind is not a truncated GGUF


def test_truncated_file(home, tmp_path, tiny_path):
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(tiny_path.read_bytes()[:-4096])
    assert_error_line(run(home, "info", bad), "truncated")


@pytest.mark.parametrize("ids,msg", [("1,x", "found '1,x'"), ("a", "found 'a'"), ("1.5", "found '1.5'"),
                                     (",", "found ','"), ("1 2 3", "found '1 2 3'"), ("1,,2", "found '1,,2'"),
                                     ("1_0", "found '1_0'")])
def test_bad_prompt_ids(home, tiny_path, ids, msg):
    assert_usage_error(run(home, "generate", tiny_path, "--prompt-ids", ids), "Invalid value", "token id", msg)


@pytest.mark.parametrize("ids,bad", [("1,512", "512"), ("-1", "-1"), ("3,100000,4", "100000")])
def test_token_id_out_of_vocab(home, tiny_path, ids, bad):
    line = assert_error_line(run(home, "generate", tiny_path, "--prompt-ids", ids, "--max-new-tokens", "1"),
                             "0..511")
    assert bad in line


def test_bad_numeric_options(home, tiny_path):
    assert_usage_error(run(home, "generate", tiny_path, "--max-new-tokens", "-1"), "--max-new-tokens")
    assert_usage_error(run(home, "generate", tiny_path, "--temperature", "-0.5"), "--temperature")
    assert_usage_error(run(home, "generate", tiny_path, "--device", "tpu"), "tpu")


def test_context_past_max_position(home, tiny_path):
    assert_error_line(run(home, "generate", tiny_path, "--prompt-ids", "1", "--max-new-tokens", "70000"),
                      "--max-new-tokens 70000", "context length 65536")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda is valid here")
def test_device_cuda_without_cuda(home, tiny_path):
    assert_error_line(run(home, "generate", tiny_path, "--device", "cuda", "--max-new-tokens", "1"),
                      "--device cuda", "no CUDA device")


def test_version():
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and __version__ in r.stdout and "ds4c" in r.stdout


def test_artifact_with_the_reference_engine_is_an_error(home, tiny_path):
    assert_error_line(run(home, "generate", tiny_path, "--max-new-tokens", "1", "--artifact", "/does/not/exist"),
                      "--artifact is used only by the compiled engine")


def test_inspect_ir_bad_layers(home, tiny_path):
    assert_usage_error(run(home, "inspect-ir", tiny_path, "--layers", "a", "--after", "fuse_hc"), "--layers")
    assert_usage_error(run(home, "inspect-ir", tiny_path, "--layers", "99", "--after", "fuse_hc"), "--layers")


def test_generate_max_ctx_bounds_and_errors(home, tiny_path):
    r = run_json(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--max-ctx", "64",
                 "--json")
    assert len(r["tokens"]) == 4
    r = run(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--max-ctx", "6")
    assert r.exit_code != 0 and "--max-ctx 6 is below the 3 prompt ids + --max-new-tokens 4 = 7" in r.output
    r = run(home, "generate", tiny_path, "--prompt-ids", "1,2,3", "--max-ctx", "70000")
    assert r.exit_code != 0 and "exceeds the model's context length 65536" in r.output


def test_unwritable_home_names_the_variable(tmp_path):
    """$DS4C_HOME where no folder can be made (under a regular file: fails for root too) is one line naming the
    variable and its value."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    home = blocker / "home"
    r = run(home, "generate", "--max-new-tokens", "1")
    assert_error_line(r, "$DS4C_HOME", str(home), "set DS4C_HOME to a writable folder")
