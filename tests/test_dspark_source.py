"""The synthetic DSpark drafter source (ds4c/drafters/dspark_source.py, docs/synthetic.md): ``synthetic:PRESET...``
where a drafter path goes, on the tiny preset.

* Every tensor equals the make_dspark file's, byte for byte and dequantized (experts one by one too), for the
  official and bf16 formats and non-default options; the config, metadata, taps, block size, noise, rank and types
  are the reader's; any generation piece size gives the same bytes.
* The reference DSpark drafter on the source drafts exactly what it drafts on the file (rings, base logits, Markov
  logits, tokens, confidence), and greedy speculative decoding through ``make_drafter("dspark:synthetic:tiny")``
  gives the file drafter's tokens and acceptance.
* Bad spellings, a K-quant formats and a mismatched target are one-line errors; ``ds4c generate tiny.gguf --draft
  dspark:synthetic:tiny`` runs on the CPU reference through the CLI and gives the plain greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from ds4c.config import preset
from ds4c.drafters.dspark import DSparkDrafter
from ds4c.drafters.dspark_file import DSparkFile
from ds4c.drafters.dspark_sources import open_dspark
from ds4c.drafters.dspark_model import DSparkModel
from ds4c.drafters.dspark_source import SyntheticDSpark, open_synthetic_dspark
from ds4c.drafters.dspark_synth import make_dspark
from ds4c.errors import ModelFileError, StepError
from ds4c.generate import generate
from ds4c.reference import Reference
from ds4c.drafters.factory import make_drafter

TINY = preset("tiny")
PROMPT = [5, 17, 301, 42, 7, 99] + list(range(30, 50))  # 26 tokens: past tiny's 16-row window
OPTS = dict(taps=(1, 4), block_size=4, markov_rank=32, noise_id=5, conf_bias=True)


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """make_dspark files of the tiny preset: (formats, seed, options) -> path."""
    d = tmp_path_factory.mktemp("dspark-src")
    return {("official", 0, False): make_dspark(TINY, d / "off.gguf"),
            ("bf16", 2, False): make_dspark(TINY, d / "bf16.gguf", seed=2, formats="bf16"),
            ("official", 3, True): make_dspark(TINY, d / "opts.gguf", seed=3, **OPTS)}


@pytest.mark.parametrize("formats, seed, opts", [("official", 0, False), ("bf16", 2, False), ("official", 3, True)])
def test_every_tensor_equals_the_make_dspark_file(files, formats, seed, opts):
    f = open_dspark(files[(formats, seed, opts)], TINY)
    s = SyntheticDSpark("tiny", formats, seed, **(OPTS if opts else {}))
    assert s.config == f.config and s.specs == f.specs and s.tensor_names == f.tensor_names
    for a in ("block_size", "taps", "noise_id", "markov_rank", "has_confidence", "has_conf_bias"):
        assert getattr(s, a) == getattr(f, a), a
    assert s.metadata == f.metadata
    assert s.weight_bytes() == sum(f.stored(n).numel() for n in f.tensor_names)
    for n in f.tensor_names:
        assert s.ggml_type(n) == f.ggml_type(n), n
        assert torch.equal(s.stored(n), f.stored(n)), n
        assert torch.equal(s.tensor(n), f.tensor(n)), n
        assert s.tensor(n, torch.bfloat16).dtype == torch.bfloat16
    for e in (0, 3, TINY.n_experts - 1):
        assert torch.equal(s.expert("blk.1.ffn_down_exps.weight", e), f.expert("blk.1.ffn_down_exps.weight", e))
    assert s.generates_on_device is True and f.generates_on_device is False


def test_opts_and_seeds_change_the_drafter_and_the_identity_says_so(files):
    a, b = SyntheticDSpark("tiny"), SyntheticDSpark("tiny", seed=1)
    assert not torch.equal(a.stored("fc.weight"), b.stored("fc.weight"))
    assert a.identity == "synthetic:tiny:official:0" and a.path == a.identity
    o = SyntheticDSpark("tiny", seed=3, **OPTS)
    assert o.identity == ("synthetic:tiny:official:3[taps=[1, 4], block_size=4, markov_rank=32, noise_id=5, "
                          "conf_bias=True]")
    assert open_dspark("synthetic:tiny:official:0").identity == a.identity
    assert open_synthetic_dspark("dspark:synthetic:tiny:bf16:2").identity == "synthetic:tiny:bf16:2"
    assert open_dspark("dspark:synthetic:tiny:bf16:2", TINY).identity == "synthetic:tiny:bf16:2"  # as --draft spells it
    from ds4c.cli.shell import tap_layers

    assert tap_layers(TINY, None, "dspark:synthetic:tiny") == tap_layers(TINY, None, "synthetic:tiny") == (3, 4, 5)


def test_any_piece_size_gives_the_same_bytes(files, monkeypatch):
    import ds4c.synth as synth

    s = SyntheticDSpark("tiny")
    names = ("markov_w1.weight", "markov_w2.weight", "fc.weight", "blk.2.ffn_gate_exps.weight")
    whole = {n: s.stored(n) for n in names}
    monkeypatch.setattr(synth, "_PIECE_WORDS", {"cpu": 100})  # pieces of a few rows
    for n in names:
        assert torch.equal(s.stored(n), whole[n]), n


def test_the_source_implements_the_drafter_file_interface():
    """Nothing of DSparkFile that reads the GGUF reader falls through to SyntheticDSpark."""
    generic = {"check_target", "generates_on_device"}  # from config / taps / path only (the source sets its own flag)
    public = {n for n in vars(DSparkFile) if not n.startswith("__") and n not in ("_validate", "_int_key", "_get")}
    missing = [n for n in public - generic if n not in vars(SyntheticDSpark)]
    assert not missing, missing
    assert SyntheticDSpark.generates_on_device is True
    s = SyntheticDSpark("tiny")
    with pytest.raises(ModelFileError, match="no tensor named 'nope'") as ei:
        s.tensor("nope")
    _one_line(ei)
    with pytest.raises(ModelFileError, match="expert index 99 out of range 0..15") as ei:
        s.expert("blk.0.ffn_up_exps.weight", 99)
    _one_line(ei)
    with pytest.raises(ModelFileError, match="'fc.weight' is not an expert tensor"):
        s.expert("fc.weight", 0)


# ------------------------------------------------------------------------------------------------ the reference
def test_reference_drafts_on_the_source_equal_the_file(files, tiny_weights):
    f = open_dspark(files[("official", 3, True)])
    s = SyntheticDSpark("tiny", seed=3, **OPTS)
    ref = Reference(tiny_weights, max_ctx=64, taps=f.taps)
    ref.verify(PROMPT[:5], 0)
    ref.verify(PROMPT[5:10], 5)
    mh = ref.main_hidden(0, 10)
    mf_, ms = DSparkModel(f, tiny_weights), DSparkModel(s, tiny_weights)
    for m in (mf_, ms):
        m.extend(0, mh)
    for st in range(3):
        assert torch.equal(ms.ring(st), mf_.ring(st)), st
    for t0 in (300, 7):
        df, ds = mf_.draft(t0), ms.draft(t0)
        assert ds.tokens == df.tokens and len(ds.tokens) == 4
        assert torch.equal(ds.logits, df.logits) and torch.equal(ds.confidence, df.confidence)
        assert torch.equal(ms.block(t0)[0], mf_.block(t0)[0])


def test_greedy_speculative_through_make_drafter_equals_the_file(files, tiny_weights):
    d_file = make_drafter(str(files[("official", 0, False)]), 512, config=TINY)
    d_syn = make_drafter("dspark:synthetic:tiny", 512, config=TINY)
    assert isinstance(d_syn, DSparkDrafter) and isinstance(d_syn.file, SyntheticDSpark)
    assert d_syn.name == "dspark:synthetic:tiny:official:0"
    a = generate(Reference(tiny_weights, max_ctx=128), PROMPT, 16, draft=d_file, spec_width=4)
    b = generate(Reference(tiny_weights, max_ctx=128), PROMPT, 16, draft=d_syn, spec_width=4)
    assert a.tokens == b.tokens == generate(Reference(tiny_weights, max_ctx=128), PROMPT, 16).tokens
    assert b.speculative["drafter"] == "dspark:synthetic:tiny:official:0"
    for k in ("steps", "acceptance_by_depth", "tokens"):
        assert a.speculative[k] == b.speculative[k], k


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("spec, msg", [
    ("dspark:synthetic:", "expected synthetic:PRESET"),
    ("dspark:synthetic:huge", "unknown preset 'huge'"),
    ("dspark:synthetic:tiny:q9", "unknown formats 'q9'"),
    ("dspark:synthetic:tiny:official:x", "seed 'x' is not an integer"),
    ("dspark:synthetic:tiny:official:1:2", "expected synthetic:PRESET"),
    ("dspark:synthetic:tiny:q2_k", "a drafter has no routed experts, so q2_k would be the official drafter"),
    ("dspark:synthetic:tiny:q4_k_all", "a synthetic DSpark drafter is written in official, bf16 or f32 formats only"),
])
def test_bad_spellings_are_one_line(spec, msg):
    with pytest.raises(ModelFileError, match=msg) as ei:
        make_drafter(spec, 512, config=TINY)
    text = _one_line(ei)
    assert "synthetic DSpark drafter is synthetic:PRESET[:FORMATS[:SEED]]" in text


def test_a_mismatched_target_is_one_line():
    with pytest.raises(ModelFileError, match=r"synthetic:flash-l4:official:0: the drafter does not fit the target "
                                             r"'tiny': expected vocabulary size = 512 \(the target's\), found 129280"
                       ) as ei:
        make_drafter("dspark:synthetic:flash-l4", 512, config=TINY)
    _one_line(ei)
    with pytest.raises(ModelFileError, match="the drafter's vocabulary has 129280 tokens, the target's 512") as ei:
        make_drafter("dspark:synthetic:flash-l4", 512)
    _one_line(ei)
    with pytest.raises(ModelFileError, match="expected window = 32") as ei:
        open_dspark("synthetic:tiny", TINY.replace(window=32))
    _one_line(ei)
    with pytest.raises(ModelFileError, match=r"DSpark taps: expected distinct layer ids in 0..5, found \[6\]") as ei:
        SyntheticDSpark("tiny", taps=(6,))
    _one_line(ei)
    with pytest.raises(StepError, match="dspark:synthetic:PRESET"):  # a synthetic spec needs the dspark: kind
        make_drafter("synthetic:tiny", 512)


# ------------------------------------------------------------------------------------------------ the CLI
def test_cli_generate_with_the_synthetic_drafter(tiny_path, tmp_path):
    from click.testing import CliRunner

    from ds4c.cli import main

    def run(*args):
        return CliRunner().invoke(main, [str(a) for a in args], env={"DS4C_HOME": str(tmp_path)})

    base = ["generate", tiny_path, "--prompt-ids", "5,17,301,42", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    plain = json.loads(run(*base).output.strip().splitlines()[-1])
    r = run(*base, "--draft", "dspark:synthetic:tiny", "--spec-width", "4")
    assert r.exit_code == 0, r.output
    spec = json.loads(r.output.strip().splitlines()[-1])
    assert spec["tokens"] == plain["tokens"] and spec["speculative"]["drafter"] == "dspark:synthetic:tiny:official:0"
    r = run("generate", "synthetic:tiny", "--prompt-ids", "5,17,301,42", "--max-new-tokens", "12", "--ignore-eos",
            "--json", "--draft", "dspark:synthetic:tiny", "--spec-width", "3")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["tokens"] == plain["tokens"]  # no file at all
    bad = run(*base, "--draft", "dspark:synthetic:tiny:q3_k")
    assert bad.exit_code == 2 and "a drafter has no routed experts" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
    info = run("info", "dspark:synthetic:tiny:official:3")
    assert info.exit_code == 0 and "DSpark drafter (arch dflash" in info.output, info.output
    assert "file: synthetic:tiny:official:3" in info.output and "block size 5" in info.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CPU == CUDA bytes)")
def test_cuda_bytes_equal_cpu_bytes():
    s = SyntheticDSpark("tiny", seed=3, **OPTS)
    for n in s.specs:
        g = s.stored(n, "cuda")
        assert g.device.type == "cuda" and torch.equal(g.cpu(), s.stored(n, "cpu")), n
    assert s.tensor("fc.weight", device="cuda").device.type == "cuda"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled drafter)")
def test_compiled_drafter_on_the_source_equals_it_on_the_file_and_generates_on_the_device(tiny_path, files,
                                                                                         tmp_path):
    """CompiledDSpark on ``synthetic:tiny:official:3[...]`` and on the make_dspark file: the same weights bit for bit
    (every one the graphs bind), the same rings and drafts bit for bit (same kernels, same bytes); every tensor the
    source is asked for is made on the GPU (no host generation, nothing uploaded)."""
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.dspark_exec import CompiledDSpark
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    f = open_dspark(files[("official", 3, True)], mf.config)
    s = SyntheticDSpark("tiny", seed=3, **OPTS)
    asked: list[str] = []
    for meth in ("stored", "tensor", "expert"):
        orig = getattr(s, meth)

        def spy(*a, _orig=orig, **k):
            out = _orig(*a, **k)
            asked.append(out.device.type)
            return out

        setattr(s, meth, spy)
    ex = CompiledStep(mf, BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128)), device_arch(),
                      KernelCache(tmp_path / "kcache"), taps=f.taps)
    ex.prepare_all(progress=False)
    cf, cs = CompiledDSpark(f, ex), CompiledDSpark(s, ex)
    cf.prepare(progress=False)
    cs.prepare(progress=False)
    assert asked and set(asked) == {"cuda"}, asked
    assert set(cf._weights) == set(cs._weights)
    for key, w in cf._weights.items():
        assert torch.equal(cs._weights[key], w), key
    g = torch.Generator().manual_seed(1)
    mh = (torch.randn(19, len(f.taps) * mf.config.hidden_size, generator=g) * 0.5).to(torch.bfloat16).cuda()
    for cd in (cf, cs):
        cd.reset()
        cd.commit(0, mh)
    for st in range(3):
        assert torch.equal(cs.ring(st), cf.ring(st)), st
    for t0 in (300, 7):
        a, b = cf.draft(t0), cs.draft(t0)
        assert a.tokens == b.tokens and torch.equal(a.logits, b.logits) and torch.equal(a.confidence, b.confidence)
