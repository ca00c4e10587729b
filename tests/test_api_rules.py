"""The CLI is a thin shell: every rule ``ds4c`` enforces is the Python API's, so a Python caller meets the same
one-line error as the command line (the CLI prints it after ``ds4c: error: ``). One test per rule the CLI used to
decide alone: what a drafter needs of its target, prefill chunk graphs, sampling values and stop strings, the
memory plan of ``info --plan``, and the prefill benchmark's lengths, baseline and ``--llama-bench``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ds4c.api import Model
from ds4c.cli import main
from ds4c.config import preset
from ds4c.drafters.factory import make_drafter
from ds4c.drafters.mtp_synth import make_mtp
from ds4c.engine import check_prefill_request, plan_memory, resolve_needs
from ds4c.engine_protocol import drafter_needs
from ds4c.errors import Ds4cError
from ds4c.sources import open_model

DSPARK = "dspark:synthetic:tiny"


def cli_error(*args: str) -> str:
    """The one error line of ``ds4c ARGS`` without its ``ds4c: error: `` prefix."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("ds4c: error: "), r.output
    return lines[0].removeprefix("ds4c: error: ")


def api_error(call) -> str:
    with pytest.raises(Ds4cError) as ei:
        call()
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    return make_mtp(preset("tiny"), tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf", seed=0)


@pytest.fixture(scope="module")
def split_model(tiny_path):
    return Model(tiny_path, max_ctx=64, layer_split=[3, 3])


# ------------------------------------------------------------------------------------------- drafters
def test_a_dspark_drafter_needs_an_unsplit_target(tiny_path, split_model):
    api = api_error(lambda: split_model.generate([1, 2, 3], max_new_tokens=2, draft=DSPARK))
    assert api == f"--draft {DSPARK}: the DSpark drafter runs on an unsplit target (no --devices / --layer-split)"
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--layer-split", "3,3",
                     "--draft", DSPARK) == api


def test_the_mtp_drafter_needs_an_unsplit_reference(tiny_path, split_model, mtp_path):
    spec = f"mtp:{mtp_path}"
    api = api_error(lambda: split_model.generate([1, 2, 3], max_new_tokens=2, draft=spec))
    assert api.startswith(f"--draft {spec}: the MTP drafter reads the target's final HC state, which the reference "
                          f"engine records unsplit only")
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--layer-split", "3,3",
                     "--draft", spec) == api


def test_the_compiled_dspark_drafter_is_not_served_from_an_artifact(tiny_path):
    """The rule is decided from the drafter's declared needs before any device is touched
    (:func:`ds4c.engine.resolve_needs`). On the reference engine the drafter needs nothing at open time."""
    mf = open_model(tiny_path)
    drafter = make_drafter(DSPARK, mf.config.vocab_size, 0, config=mf.config, target_file=mf)
    needs = drafter_needs(drafter)
    assert resolve_needs(needs, "reference", False, "some/artifact") == ((), False)
    assert resolve_needs(needs, "compiled", False) == (tuple(drafter.file.taps), False)
    api = api_error(lambda: resolve_needs(needs, "compiled", False, "some/artifact", name=DSPARK))
    assert api.startswith(f"--draft {DSPARK}: the compiled DSpark drafter is not served from an artifact yet")


def test_the_mtp_drafter_asks_the_compiled_step_for_the_final_hc(tiny_path, mtp_path):
    mf = open_model(tiny_path)
    drafter = make_drafter(f"mtp:{mtp_path}", mf.config.vocab_size, 0, config=mf.config, target_file=mf)
    assert resolve_needs(drafter_needs(drafter), "reference", False) == ((), False)
    # the compiled step records it on a split too
    assert resolve_needs(drafter_needs(drafter), "compiled", True) == ((), True)
    oracle = make_drafter("oracle:0.5", mf.config.vocab_size, 0)
    assert resolve_needs(drafter_needs(oracle), "compiled", True, "A") == ((), False)


# ------------------------------------------------------------------------------------------- prefill chunks
def test_prefill_chunks_run_on_the_compiled_engine_only(tiny_path):
    api = api_error(lambda: Model(tiny_path, max_ctx=64, prefill_chunks="64"))
    assert api == ("--prefill 64: prefill chunk graphs run on the compiled engine (--device cuda); found --device cpu "
                   "--engine auto (the reference prefills with verify steps)")
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--prefill", "64") == api


def test_a_malformed_chunk_list_is_the_same_line(tiny_path):
    api = api_error(lambda: Model(tiny_path, max_ctx=64, prefill_chunks="64,x"))
    assert api.startswith("--prefill: prefill chunk sizes: expected distinct ints in 16..4096")
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2", "--prefill", "64,x") == api
    assert check_prefill_request(" none ") == () and check_prefill_request([]) == ()


# ------------------------------------------------------------------------------------------- sampling, stops, threads
@pytest.mark.parametrize("kw, args", [
    (dict(top_k=-1), ("--top-k", "-1")),
    (dict(top_p=0.0), ("--top-p", "0")),
    (dict(temperature=float("nan")), ("--temperature", "nan")),
    (dict(stop=[""]), ("--stop", "")),
])
def test_sampling_values_and_stop_strings(tiny_path, kw, args):
    m = Model(tiny_path, max_ctx=64)
    api = api_error(lambda: m.generate([1, 2], max_new_tokens=1, **kw))
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2", "--max-new-tokens", "1", *args) == api


def test_threads(tiny_path):
    api = api_error(lambda: Model(tiny_path, max_ctx=64, threads=0))
    assert api == "threads (--threads) must be an int >= 1, found 0"
    assert cli_error("generate", tiny_path, "--prompt-ids", "1,2", "--threads", "0") == api


# ------------------------------------------------------------------------------------------- info --plan
def test_the_memory_plan_rules(tiny_path, mtp_path):
    mf = open_model(tiny_path)
    limit = mf.config.max_position
    api = api_error(lambda: plan_memory(mf, max_ctx=limit + 1))
    assert api == f"--max-ctx {limit + 1}: the model's context length is {limit}"
    assert cli_error("info", tiny_path, "--plan", "--max-ctx", limit + 1) == api
    api = api_error(lambda: plan_memory(mf, devices="cpu,cpu"))
    assert api == "--devices cpu,cpu: the memory plan is the compiled step's (CUDA devices)"
    assert cli_error("info", tiny_path, "--plan", "--devices", "cpu,cpu") == api
    only = open_model(mtp_path, allow_mtp_only=True)
    api = api_error(lambda: plan_memory(only))
    assert api.endswith("an MTP-only file has no compiled step to plan")
    assert cli_error("info", mtp_path, "--plan") == api
    plan = plan_memory(mf, max_ctx=256, free_gib=1.0)
    assert plan.as_dict() and "\n" in plan.describe()


# ------------------------------------------------------------------------------------------- bench --prefill
def test_the_prefill_bench_rules(tiny_path, tmp_path):
    from ds4c.prefill_bench import run_prefill_bench

    mf = open_model(tiny_path)
    for lengths, args in (((20, 20), ("--prefill", "20,20")), ((0,), ("--prefill", "0"))):
        api = api_error(lambda: run_prefill_bench(mf, lengths, "cpu"))
        assert api.startswith("--prefill: expected distinct prompt lengths >= 1 (tokens), found")
        assert cli_error("bench", tiny_path, "--device", "cpu", *args) == api
    api = api_error(lambda: run_prefill_bench(mf, (20,), "cpu", baseline=False))
    assert api.startswith("--no-prefill-baseline on the cpu leaves nothing to measure")
    assert cli_error("bench", tiny_path, "--device", "cpu", "--prefill", "20", "--no-prefill-baseline") == api
    missing = tmp_path / "llama-bench"
    api = api_error(lambda: run_prefill_bench(mf, (20,), "cpu", llama_bench=str(missing)))
    assert api.startswith(f"--llama-bench {missing}: expected llama.cpp's llama-bench executable")
    assert cli_error("bench", tiny_path, "--device", "cpu", "--prefill", "20", "--llama-bench", missing) == api


def test_llama_bench_needs_a_gguf_file(tmp_path):
    from ds4c.bench import check_llama_bench

    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    api = api_error(lambda: check_llama_bench(open_model("synthetic:tiny"), str(exe)))
    assert api.startswith("--llama-bench reads a GGUF file; synthetic:tiny")
    assert cli_error("bench", "synthetic:tiny", "--device", "cpu", "--prefill", "20", "--llama-bench", exe) == api
