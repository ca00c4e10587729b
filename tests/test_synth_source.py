"""The synthetic generator (ds4c.synth: counter-based hash, stored-form generators), the synthetic weight source
(ds4c.synth_source: ``synthetic:PRESET[:FORMATS[:SEED]]``, byte-identical to make-model files) and the memory
plan of the compiled step (runtime/memory_plan.py: printed before loading, refusal naming the shortfall)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from ds4c import synth as S
from ds4c.cli import main
from ds4c.config import preset
from ds4c.errors import ModelFileError
from ds4c.gguf_file import ModelFile
from ds4c.sources import open_model
from ds4c.quant import GGMLType as G
from ds4c.quant import dequantize
from ds4c.shard_plan import ShardPlan, ShardPlanError
from ds4c.synth_source import SyntheticModel, parse_spec
from ds4c.tensors import FORMATS

TINY = preset("tiny")


# ------------------------------------------------------------------------------------------------ the hash

def test_hash_words_equal_the_scalar_oracle_at_any_start():
    key = S.tensor_key(7, "blk.3.attn_q_a.weight")
    for start, n in ((0, 1), (5, 37), (2**40 - 3, 9), (2**62, 4)):
        got = S.hash_words(key, start, n).tolist()
        want = [S._s64(S.word(key, start + i)) for i in range(n)]
        assert got == want, (start, n)
    # bytes at an unaligned offset are the same stream's bytes
    whole = S.random_bytes(key, 0, 64)
    assert torch.equal(S.random_bytes(key, 13, 29), whole[13:42])


def test_streams_differ_by_seed_name_and_substream():
    a, b = S.tensor_key(0, "x"), S.tensor_key(1, "x")
    assert len({a, b, S.tensor_key(0, "y"), S.sub_key(a, 0), S.sub_key(a, 1)}) == 5
    assert not torch.equal(S.hash_words(a, 0, 8), S.hash_words(b, 0, 8))


def test_normal_and_uniform_statistics():
    x = S.normal01(S.tensor_key(0, "n"), 0, 1 << 18)
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    assert float(x.abs().max()) <= math.sqrt(12) + 1e-6  # Irwin-Hall of 4: bounded at sqrt(12)
    u = S.uniform01(S.tensor_key(0, "u"), 0, 1 << 16)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


@pytest.mark.parametrize("t", list(S.STORED_GENERATORS))
def test_stored_generators_hit_the_target_std_and_any_row_range_is_the_same_rows(t):
    k, rows, std = 512, 96, 0.03
    key = S.tensor_key(3, "w")
    raw = S.STORED_GENERATORS[t](key, 0, rows, k, std, "cpu")
    vals = dequantize(raw, t, (rows, k))
    assert abs(float(vals.pow(2).mean().sqrt()) / std - 1) < 0.15, float(vals.std())
    assert abs(float(vals.mean())) < 0.05 * std
    part = S.STORED_GENERATORS[t](key, 17, 40, k, std, "cpu")
    assert torch.equal(part, raw[17:40])


def test_pieces_do_not_change_the_bytes(monkeypatch):
    from ds4c.tensors import tensor_specs

    spec = next(s for s in tensor_specs(TINY) if s.name == "blk.1.ffn_up_exps.weight")
    big = torch.cat([p.reshape(-1) for p in S.stored_pieces(TINY, spec, G.MXFP4, 0)])
    monkeypatch.setitem(S._PIECE_WORDS, "cpu", 100)
    small = list(S.stored_pieces(TINY, spec, G.MXFP4, 0))
    assert len(small) > 10 and torch.equal(torch.cat([p.reshape(-1) for p in small]), big)


# ------------------------------------------------------------------------------------------------ the source

@pytest.fixture(scope="module")
def tiny_f32_path(tmp_path_factory):
    return S.make_model(TINY, tmp_path_factory.mktemp("f32") / "tiny-f32.gguf", seed=0, formats="f32")


@pytest.mark.parametrize("formats", ["official", "bf16", "f32", "q2_k", "q6_k", "iq4_xs"])
def test_every_tensor_equals_the_make_model_file(formats, tiny_path, tiny_bf16_path, tiny_f32_path, tmp_path):
    path = {"official": tiny_path, "bf16": tiny_bf16_path, "f32": tiny_f32_path}.get(formats)
    if path is None:  # a K-quant: routed gate/up in that type, the rest official (tiny's w2: Q8_0)
        path = S.make_model(TINY, tmp_path / f"tiny-{formats}.gguf", seed=0, formats=formats)
    mf = open_model(path)
    sm = open_model(f"synthetic:tiny:{formats}")
    assert isinstance(sm, SyntheticModel) and sm.identity == f"synthetic:tiny:{formats}:0"
    assert sm.config == mf.config and sm.metadata == mf.metadata
    assert sm.weight_bytes_by_type() == mf.weight_bytes_by_type() and sm.file_type == mf.file_type
    assert sm.n_tensors == mf.n_tensors and sm.specs.keys() == mf.specs.keys()
    for name in mf.specs:
        assert sm.ggml_type(name) == mf.ggml_type(name), name
        assert torch.equal(sm.stored(name), mf.stored(name)), name
        r, f = sm.raw(name), np.asarray(mf.raw(name))
        assert r.dtype == f.dtype and r.shape == f.shape and np.array_equal(r.view(np.uint8), f.view(np.uint8)), name
    for name in ("blk.0.ffn_gate_tid2eid.weight", "output_norm.weight", "blk.2.attn_q_b.weight"):
        assert torch.equal(sm.tensor(name), mf.tensor(name)), name
    e = sm.expert("blk.4.ffn_down_exps.weight", 5)
    assert torch.equal(e, mf.expert("blk.4.ffn_down_exps.weight", 5))


def test_the_source_implements_the_model_file_interface():
    """Nothing of ModelFile that reads the GGUF reader falls through to SyntheticModel (it has none)."""
    generic = {"file_type", "_expert_shape"}  # computed from metadata / specs only
    public = {n for n in vars(ModelFile) if not n.startswith("__") and n not in ("_validate", "_get",
                                                                                 "_trunk_metadata")}
    missing = [n for n in public - generic if n not in vars(SyntheticModel)]
    assert not missing, missing
    sm = SyntheticModel("tiny")
    for attr in ("mtp_specs", "nextn_blocks", "mtp_only", "legacy_names", "extra_tensors", "path", "specs"):
        getattr(sm, attr)
    with pytest.raises(ModelFileError, match="no tensor named 'nope'"):
        sm.tensor("nope")
    with pytest.raises(ModelFileError, match="expert index 99"):
        sm.expert("blk.0.ffn_up_exps.weight", 99)


@pytest.mark.parametrize("spec, msg", [
    ("synthetic:", "expected synthetic:PRESET"), ("synthetic:huge", "unknown preset 'huge'"),
    ("synthetic:tiny:q9", "unknown formats 'q9'"), ("synthetic:tiny:bf16:-1", "seed '-1'"),
    ("synthetic:tiny:bf16:1:2", "expected synthetic:PRESET"), ("synthetic:tiny::1", "unknown formats ''")])
def test_bad_specs_are_one_line_listing_the_choices(spec, msg):
    with pytest.raises(ModelFileError, match=msg) as e:
        parse_spec(spec)
    text = str(e.value)
    assert "\n" not in text and "flash-l4" in text and "official" in text
    r = CliRunner().invoke(main, ["info", spec])
    assert r.exit_code != 0 and msg.split("'")[0] in r.output and len(r.output.strip().splitlines()) == 1


def test_generate_on_the_reference_equals_the_file(tiny_path, monkeypatch, tmp_path):
    monkeypatch.setenv("DS4C_HOME", str(tmp_path))
    args = ["--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--ignore-eos", "--json"]
    a = CliRunner().invoke(main, ["generate", "synthetic:tiny", *args])
    b = CliRunner().invoke(main, ["generate", str(tiny_path), *args])
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    import json

    ja, jb = (json.loads(x.stdout.strip().splitlines()[-1]) for x in (a, b))
    assert ja["tokens"] == jb["tokens"] and len(ja["tokens"]) == 6 and ja["model"] == "synthetic:tiny:official:0"


def test_info_of_a_synthetic_model():
    r = CliRunner().invoke(main, ["info", "synthetic:tiny:bf16:2"])
    assert r.exit_code == 0, r.output
    assert "file: synthetic:tiny:bf16:2" in r.output and "MOSTLY_BF16" in r.output and "tokenizer: gpt2" in r.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU == CUDA bytes)")
@pytest.mark.parametrize("formats", sorted(FORMATS))
def test_cuda_bytes_equal_cpu_bytes(formats):
    sm = SyntheticModel("tiny", formats)
    for name in sm.specs:
        assert torch.equal(sm.stored(name, "cuda").cpu(), sm.stored(name, "cpu")), name


# ------------------------------------------------------------------------------------------------ memory plan

def _plan(spec: str, free: list[int] | None, plan=None):
    from ds4c.buckets import BucketSpec
    from ds4c.runtime.memory_plan import memory_plan

    mf = open_model(spec)
    return memory_plan(mf, BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 512), plan, free)


def test_memory_plan_adds_up_and_agrees_with_the_layer_split_model():
    from ds4c.buckets import BucketSpec
    from ds4c.runtime.memory_plan import memory_model

    mf = open_model("synthetic:tiny")
    b = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 512)
    whole = _plan("synthetic:tiny", None)
    mm = memory_model(mf, b)
    assert whole.shards[0].need == mm.need(0, mf.config.n_layers)
    assert sum(whole.weights.values()) >= sum(mf.weight_bytes_by_type()[k][1] for k in ("MXFP4", "Q8_0"))
    assert list(whole.state_by_bucket) == list(b.contexts) and whole.fits  # free memory unknown: no verdict
    split = _plan("synthetic:tiny", [1 << 30] * 2, ShardPlan(("cuda:0", "cuda:1"), (2, 4)))
    assert [s.need for s in split.shards] == [mm.need(0, 2), mm.need(2, 6)]
    assert split.fits and "shard 1 cuda:1 layers [2,6)" in split.describe()


def test_memory_plan_refuses_in_one_line_naming_the_shortfall():
    p = _plan("synthetic:tiny", [300 << 20])
    text = p.describe()
    for part in ("routed experts", "state by bucket", "arena", "graphs/modules/slack", "free 300.0 MiB", "short"):
        assert part in text, part
    with pytest.raises(ShardPlanError) as e:
        p.check()
    msg = str(e.value)
    assert "\n" not in msg and "needs" in msg and "has 300.0 MiB free" in msg and "short" in msg
    assert "try" not in msg  # no device count helps: one shard's fixed overhead alone exceeds 285 MiB usable
    _plan("synthetic:tiny", [1 << 30]).check()
    with pytest.raises(ShardPlanError) as e:  # flash-l4 official (~16 GB) on 10 GiB: at least 2 such devices
        _plan("synthetic:flash-l4", [10 << 30]).check()
    assert "a layer split over at least 2 such devices (--devices cuda:0,cuda:1,...)" in str(e.value)
    with pytest.raises(ShardPlanError) as e:  # two shards on one device share its free memory
        _plan("synthetic:tiny", [800 << 20] * 2, ShardPlan(("cuda:0", "cuda:0"), (2, 4))).check()
    assert "shard 1 (layers [2,6)) on cuda:0" in str(e.value)


def test_compiled_engine_refuses_before_loading_anything(monkeypatch, capsys):
    """open_engine on a (faked) CUDA device with too little free memory: the plan goes to stderr and the
    refusal comes before any CompiledStep exists (nothing is loaded)."""
    import ds4c.runtime.step as ex
    import ds4c.runtime.sharded as sh
    from ds4c.engine import open_engine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ex, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(sh, "free_memory", lambda devices: [200 << 20] * len(devices))

    def no_step(*a, **k):
        raise AssertionError("a CompiledStep was built before the memory check")

    monkeypatch.setattr(ex, "CompiledStep", no_step)
    with pytest.raises(ShardPlanError, match=r"short .*MiB"):
        open_engine(open_model("synthetic:tiny"), device="cuda", max_ctx=512)
    assert "memory plan for synthetic:tiny:official:0" in capsys.readouterr().err


def test_info_plan_without_a_gpu():
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--max-ctx", "512"])
    assert r.exit_code == 0 and "free unknown" in r.output, r.output
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--max-ctx", "512", "--free-gib", "0.25"])
    assert r.exit_code != 0 and "short" in r.output and r.output.strip().splitlines()[-1].startswith("ds4c: error")
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--max-ctx", "512", "--free-gib", "1",
                                  "--devices", "cuda:0,cuda:1", "--json"])
    import json

    rec = json.loads(r.stdout)["memory_plan"]
    assert r.exit_code == 0 and [s["device"] for s in rec["shards"]] == ["cuda:0", "cuda:1"] and rec["fits"] is True
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--max-ctx", "512", "--json"])
    rec = json.loads(r.stdout)["memory_plan"]  # free memory unknown (no GPU, no --free-gib): no verdict
    assert r.exit_code == 0 and rec["fits"] is None and rec["shards"][0]["free"] is None


def test_info_plan_options_are_checked(tmp_path):
    """--free-gib must be a finite positive size; the --plan options without --plan are a usage error (not
    silently ignored); a --max-ctx between buckets plans the bucket that holds it."""
    from click.testing import CliRunner

    from ds4c.cli import main

    env = {"DS4C_HOME": str(tmp_path)}
    for bad in ("nan", "inf", "1e400"):
        r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--free-gib", bad], env=env)
        assert r.exit_code == 2 and "expected a finite size in GiB" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--free-gib", "3", "--max-ctx", "64"], env=env)
    assert r.exit_code == 2 and "--max-ctx, --free-gib: these apply only with --plan" in r.output
    r = CliRunner().invoke(main, ["info", "synthetic:tiny", "--plan", "--max-ctx", "100", "--free-gib", "10"], env=env)
    assert r.exit_code == 0 and "buckets 112..112" in r.output, r.output
