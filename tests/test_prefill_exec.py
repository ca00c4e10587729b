"""Prompts through the compiled step's prefill chunk graphs (issue 12; ``CompiledStep(prefill_chunks=...)``,
``CompiledStep.prefill``, docs/prefill.md).

CPU: the chunk sizes' validation and the chunk policy (:func:`ds4c.buckets.prefill_chunk_for`), ``generate`` handing
the prompt to a stepper's ``prefill``, the CLI's one-line refusals. GPU (``-m gpu``; skipped without CUDA): on the
tiny model (window 16, CSA ratio 4, HCA ratio 16) prompts of 1 to 20x the window prefilled with chunks of 16 and 64
rows (full, padded, and a verify tail) against token-wise decoding: the next-token logits and every state buffer
against the reference's token-wise state within the compiled step's own noise floor (its token-wise decode against
the same reference, measured in the same test), then decoding on from the prefilled state.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from ds4c.buckets import MIN_PREFILL_CHUNK, check_prefill_chunks, prefill_chunk_for
from ds4c.cli import main
from ds4c.engine import check_prefill_request
from ds4c.errors import Ds4cError, StepError


@pytest.mark.parametrize("given, want", [((2048, 256), (256, 2048)), ("256,2048", (256, 2048)), ("", ()), ((), ()),
                                         ("none", ()), (" None ", ()),
                                         ("16", (16,)), ([4096], (4096,))])
def test_chunk_sizes_are_validated_and_sorted(given, want):
    assert check_prefill_chunks(given) == want


@pytest.mark.parametrize("given, found", [((8,), "found 8"), ((4097,), "found 4097"), ((True,), "found True"),
                                          ((64, 64), "a duplicate"), ("64,abc", "'64,abc'"), ("64,,128", "'64,,128'"),
                                          (64, "found int 64"), ((64.0,), "found 64.0"), ("\u00b2", "'\u00b2'"),
                                          ("\uff11\uff16", "found")])
def test_bad_chunk_sizes_are_one_line_errors(given, found):
    with pytest.raises(StepError, match="expected distinct ints in 16..4096") as ei:
        check_prefill_chunks(given)
    assert found in str(ei.value) and "\n" not in str(ei.value)


def test_the_chunk_policy():
    """Verify steps under MIN_PREFILL_CHUNK tokens; the smallest chunk above the tokens left when they fill at
    least half of it (padded); else the largest full chunk; else a padded one; only chunks whose rows (padding
    included) fit the context."""
    ch = (16, 64, 256)
    assert prefill_chunk_for(ch, 1000, 0, 4096) == 256
    assert prefill_chunk_for(ch, 256, 0, 4096) == 256
    assert prefill_chunk_for(ch, 255, 0, 4096) == 256  # padded: 1 masked row, not 64 + 64 + 64 + 16 + ...
    assert prefill_chunk_for(ch, 127, 0, 4096) == 64  # under half of 256: the largest full chunk
    assert prefill_chunk_for(ch, 63, 0, 4096) == 64
    assert prefill_chunk_for(ch, 17, 0, 4096) == 16  # 17 fills under half of 64
    assert prefill_chunk_for(ch, 15, 0, 4096) is None  # a tail under MIN_PREFILL_CHUNK: verify steps
    assert prefill_chunk_for((64, 256), 40, 0, 4096) == 64  # padded: 24 masked rows
    assert prefill_chunk_for((256, 2048), 20, 0, 4096) == 256  # nothing full: padded
    assert prefill_chunk_for((64, 256), 10, 0, 4096) is None
    assert prefill_chunk_for((256, 2048), 1952, 2048, 4096) == 2048  # one padded chunk, not 7 x 256 + a padded 256
    assert prefill_chunk_for((256, 2048), 1000, 0, 4096) == 256
    assert prefill_chunk_for(ch, 1000, 4096 - 100, 4096) == 64  # 256 rows would not fit the context
    assert prefill_chunk_for((64,), 40, 4096 - 50, 4096) is None  # the padded 64 would not fit either
    assert prefill_chunk_for((), 1000, 0, 4096) is None
    assert MIN_PREFILL_CHUNK == 16


def test_generate_hands_the_prompt_to_a_steppers_prefill(tiny_weights):
    """A stepper with prefill_chunks gets the whole prompt in one prefill call, and the tokens are what verify
    steps give (this stepper's prefill runs verify steps: only the hand-over is under test here)."""
    from ds4c.generate import generate
    from ds4c.reference import Reference

    class Chunked(Reference):
        prefill_chunks = (16,)

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.calls: list[tuple[int, int]] = []

        def prefill(self, tokens, pos):
            self.calls.append((len(tokens), pos))
            out = None
            for s in range(0, len(tokens), 5):
                out = self.verify(tokens[s:s + 5], pos + s)
            return out[-1:]

    prompt = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    want = generate(Reference(tiny_weights, max_ctx=64), prompt, 4).tokens
    ch = Chunked(tiny_weights, max_ctx=64)
    ch.last_prefill = {"chunks": [[16, 16], [16, 7]], "verify_tokens": 0}
    res = generate(ch, prompt, 4)
    assert res.tokens == want and ch.calls == [(23, 0)]
    assert res.as_dict()["prefill_plan"] == ch.last_prefill  # the stepper's account of how it ran
    plain = generate(Reference(tiny_weights, max_ctx=64), prompt, 4).as_dict()
    assert plain["prefill_plan"] == {"chunks": [], "verify_tokens": 23}


def test_the_timings_line_says_which_chunks_ran():
    from ds4c.cli.generate import timings_line as _timings_line
    from ds4c.generate import GenerationResult

    res = GenerationResult([1] * 4000, [5, 6], 0.2, 0.01, prefill_plan={"chunks": [[2048, 2048], [2048, 1952]],
                                                                         "verify_tokens": 0})
    assert "prefill 4000 tokens (chunks 2048+2048[1952]) in 0.200 s" in _timings_line(1.0, res, 4000)
    res.prefill_plan = {"chunks": [[256, 256]], "verify_tokens": 3}
    assert "(chunks 256, 3 as verify steps)" in _timings_line(1.0, res, 259)
    res.prefill_plan = {"chunks": [], "verify_tokens": 259}
    assert "prefill 259 tokens in" in _timings_line(1.0, res, 259)


@pytest.mark.parametrize("args, found", [
    (["--prefill", "8"], "found 8"),
    (["--prefill", "64,x"], "'64,x'"),
    (["--prefill", "\u00b2"], "'\u00b2'"),
    (["--prefill", "64"], "run on the compiled engine (--device cuda); found --device cpu"),
])
def test_cli_refuses_bad_prefill_options_in_one_line(tiny_path, args, found):
    r = CliRunner().invoke(main, ["generate", str(tiny_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "1", *args])
    assert r.exit_code != 0 and found in r.output, r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_prefill_default_leaves_the_choice_to_the_engine():
    """No chunks asked for: None (open_engine's default: an artifact's own chunk graphs, else the default ones);
    chunks with a drafter's taps or final HC recording build them here, but not from an artifact (one line, before
    the device is looked at)."""
    assert check_prefill_request(None, "cpu", "auto", "bf16", "some/artifact") is None
    assert check_prefill_request(None, "cpu") is None
    assert check_prefill_request(None, "cpu", artifact="some/artifact", record_hc=True) is None
    for need in (dict(record_hc=True), dict(taps=(3, 4, 5))):
        with pytest.raises(Ds4cError, match="with --draft and --artifact") as ei:
            check_prefill_request("64", "cuda", "compiled", "bf16", "some/artifact", **need)
        assert "\n" not in str(ei.value)


@pytest.mark.parametrize("max_ctx,want", [(4096, [(256, 2048), (256,), ()]), (2048, [(256, 2048), (256,), ()]),
                                          (1024, [(256,), ()]), (200, [()])])
def test_default_chunks_fit_the_context_and_fall_back(max_ctx, want):
    """Without an artifact the compiled engine tries the default chunk graphs that fit max_ctx, then fewer, then
    none: the first whose memory plan fits is used (open_engine)."""
    from ds4c.engine import default_prefill_tries

    assert default_prefill_tries(max_ctx) == want


def _open_faked_cuda(monkeypatch, model: str, arch: str, **kw):
    """open_engine on a faked CUDA device of ``arch`` (no GPU: the CompiledStep records its chunk sizes)."""
    import ds4c.runtime.sharded as sh
    import ds4c.runtime.step as st
    from ds4c.engine import open_engine
    from ds4c.sources import open_model

    built: list[tuple[int, ...]] = []

    class Recorded:
        def __init__(self, mf, buckets, arch, artifact=None, plan=None, taps=(), record_hc=False, prefill_chunks=()):
            built.append(tuple(prefill_chunks))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(st, "device_arch", lambda: arch)
    monkeypatch.setattr(st, "CompiledStep", Recorded)
    monkeypatch.setattr(sh, "free_memory", lambda devices: [64 << 30] * len(devices))
    open_engine(open_model(model), device="cuda", max_ctx=512, prepare=False, **kw)
    return built


def test_default_chunks_that_do_not_lower_fall_back_to_verify_steps(monkeypatch, capsys):
    """The default chunk graphs are kept only where they lower: routed experts in a K-quant the grouped GEMM reads
    (Q4_K) get the 256-row chunk graph on sm_90; on a target the grouped GEMM does not build (sm_80) the engine
    says why in one stderr line and prefills with verify steps instead of failing to open; an explicit ``--prefill``
    that does not lower is a one-line error."""
    from ds4c.runtime.lowered import LoweringError

    assert _open_faked_cuda(monkeypatch, "synthetic:tiny:q4_k", "sm_90") == [(256,)]
    capsys.readouterr()
    assert _open_faked_cuda(monkeypatch, "synthetic:tiny:q4_k", "sm_80") == [()]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("prefill chunks")]
    assert len(err) == 1 and "not built for sm_80" in err[0] and "verify steps" in err[0], err
    with pytest.raises(LoweringError) as ei:
        _open_faked_cuda(monkeypatch, "synthetic:tiny:q4_k", "sm_80", prefill_chunks=(256,))
    assert "\n" not in str(ei.value) and "moe_experts" in str(ei.value)


@pytest.mark.parametrize("value", ["none", "NONE", ""])
def test_cli_prefill_none_means_verify_steps(value):
    assert check_prefill_request(value, "cpu") == ()


def test_reference_engine_refuses_prefill_chunks(tiny_path):
    from ds4c.api import Model
    from ds4c.errors import Ds4cError

    with pytest.raises(Ds4cError, match=r"prefill chunk graphs run on the compiled engine \(--device cuda\); found "
                       r"--device cpu --engine auto \(the reference prefills with verify steps\)"):
        Model(tiny_path, prefill_chunks=(16,))


# ------------------------------------------------------------------------------------------------ GPU

LENGTHS = (1, 15, 16, 17, 40, 64, 100, 129, 320)  # 320 = 20x the tiny window; 16 / 64-row chunks; 40, 100: padded 64


@pytest.fixture(scope="module")
def gpu_env(tiny_path, tmp_path_factory):
    return _env(tiny_path, tmp_path_factory)


@pytest.fixture(scope="module")
def gpu_env_kquant(tmp_path_factory):
    """tiny with every FP8 / FP4 weight in Q4_K (a K-quant mix: the chunk GEMMs and grouped experts decode it)."""
    return _env("synthetic:tiny:q4_k_all", tmp_path_factory)


def _env(model, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(model)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 512, contexts=(64, 128, 256, 512))
    cache = KernelCache(tmp_path_factory.mktemp("kcache"))
    chunked = CompiledStep(mf, buckets, device_arch(), cache, prefill_chunks=(16, 64))
    chunked.prepare_all(progress=False)
    plain = CompiledStep(mf, buckets, device_arch(), cache)
    plain.prepare_all(progress=False)
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=512)
    return chunked, plain, ref, _token_wise_floor(plain, ref)


def _prompt(n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _token_wise_floor(plain, ref) -> dict[str, float]:
    """The noise floor of two valid implementations on tiny: for every buffer (and ``"logits"``) the largest
    error of the token-wise compiled step against the token-wise reference over the test's prompts. At some
    lengths the two agree bit for bit, at others one rounding flip (fp32 sums in another order, then a bf16 or
    FP8 rounding, or a near-tie in the indexer's top-k) grows through the random tiny layers to a few 1e-2 in
    the deepest buffers (measured on the H200: l5.ring 3.3e-2 at 33 tokens). The GEMM kernels of a chunk sum
    in yet another order, so the chunked state is held to the floor over all lengths, not to the one
    length's, which is 0 where the token-wise step happens to be exact."""
    floor: dict[str, float] = {}
    for n in LENGTHS:
        prompt = _prompt(n, plain.cfg.vocab_size)
        ref.reset()
        plain.reset()
        for i, t in enumerate(prompt):
            want = ref.decode(t, i)[-1]
            base = plain.step([t], i)[-1]
        errs = {"logits": _rel(base, want), **_state_errors(plain, ref)}
        for k, v in errs.items():
            floor[k] = max(floor.get(k, 0.0), v)
    return floor


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _state_errors(step, ref) -> dict[str, float]:
    from ds4c.ir.interpreter import state_to_inputs

    want = state_to_inputs(ref.state)
    out = {}
    for name, w in want.items():
        g = step.state[name]
        fin = torch.isfinite(w.float())  # compressor scores start at -inf
        out[name] = 0.0 if not fin.any() else _rel(g[fin], w[fin]) if bool((w[fin] != 0).any()) else \
            float((g[fin].float() - w[fin].float()).abs().max())
    return out


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")
def test_chunked_prefill_equals_token_wise_decoding(gpu_env, n):
    """A prompt of n tokens through the chunk graphs: its next-token logits and every state buffer are the
    reference's token-wise ones within 3x the noise floor (:func:`_token_wise_floor`: the token-wise compiled
    step's largest error against the same reference over the test's lengths; at least 1e-2 relative L2), the
    same argmax unless the reference's top two are within 1e-2, the sequence at position n; then 8 greedy decode
    steps from the prefilled state, both from the reference's next token, give the tokens the token-wise
    compiled step gives (up to a near-tie, reported with its margin)."""
    _check_chunked_prefill(gpu_env, n)


@pytest.mark.parametrize("n", (40, 129))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")
def test_chunked_prefill_of_a_kquant_mix(gpu_env_kquant, n):
    """The same check on tiny with its projections and experts in Q4_K (``q4_k_all``): the K-quant chunk GEMMs and
    grouped experts against the reference's token-wise decoding, within the token-wise compiled step's floor."""
    _check_chunked_prefill(gpu_env_kquant, n)


def _check_chunked_prefill(env, n):
    chunked, plain, ref, floor = env
    prompt = _prompt(n, chunked.cfg.vocab_size)
    ref.reset()
    for i, t in enumerate(prompt):
        want = ref.decode(t, i)[-1]
    plain.reset()
    for i, t in enumerate(prompt):
        plain.step([t], i)
    chunked.reset()
    got = chunked.prefill(prompt, 0)
    assert got.shape == (1, chunked.cfg.vocab_size) and chunked.pos == n
    plan = chunked.last_prefill  # every token once, in chunks of the prepared sizes (padded ones at least half full)
    assert sum(k for _, k in plan["chunks"]) + plan["verify_tokens"] == n
    assert all(c in chunked.prefill_chunks and 0 < k <= c and (k == c or 2 * k >= c or c == min(chunked.prefill_chunks))
               for c, k in plan["chunks"])
    e = _rel(got[0], want)
    assert e <= max(3 * floor["logits"], 1e-2), f"prefill logits rel err {e:.3g}, floor {floor['logits']:.3g}"
    top2 = torch.topk(want.float(), 2).values
    if float(top2[0] - top2[1]) > 1e-2:
        assert int(got[0].argmax()) == int(want.argmax())
    for name, err in _state_errors(chunked, ref).items():
        assert err <= max(3 * floor[name], 1e-2), f"{name}: {err:.3g} (floor {floor[name]:.3g})"
    a = c = int(want.argmax())  # both decode on from the same token
    toks_a, toks_b = [], []
    for k in range(8):
        la = chunked.step([a], n + k)[-1]
        lb = plain.step([c], n + k)[-1]
        a, c = int(la.argmax()), int(lb.argmax())
        toks_a.append(a)
        toks_b.append(c)
        if a != c:
            v = torch.topk(lb.float(), 2).values
            assert float(v[0] - v[1]) < 5e-2, f"decode after prefill diverges at {k}: {toks_a} vs {toks_b}"
            break


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")
def test_prefill_refusals_and_no_capture_after_start(gpu_env, tiny_path):
    """Every chunk graph is captured by prepare_all (none after); a prefill not at the next position, of nothing,
    or past max_ctx is a one-line StepError; chunks with taps / record_hc / a split are refused (from an artifact:
    test_prefill_from_an_artifact)."""
    from ds4c.sources import open_model
    from ds4c.runtime.step import CompiledStep, device_arch

    chunked = gpu_env[0]
    chunked.reset()
    before = chunked.captures
    chunked.prefill(list(range(1, 200)), 0)
    assert chunked.captures == before
    for call, what in ((lambda: chunked.prefill([1, 2], 0), "next position is 199"),
                       (lambda: chunked.prefill([], 199), "no tokens"),
                       (lambda: chunked.prefill([1] * 400, 199), "exceed max_ctx")):
        with pytest.raises(StepError, match=what) as ei:
            call()
        assert "\n" not in str(ei.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")
def test_chunked_prefill_records_the_final_hc(gpu_env, tiny_path):
    """With record_hc (the MTP drafter's input) the chunk graphs write the final HC ring as token-wise decoding
    leaves it: after a 100-token prompt (chunks 64, 16, 16, then 4 tokens as a verify step; past the 21-row ring) the newest window of
    rows equals the token-wise compiled step's within the noise floor (median below 3x the floor of the last
    layer's buffers, at least 2e-2; max < 0.25: the bound of the other free-running comparisons)."""
    from ds4c.sources import open_model
    from ds4c.runtime.step import CompiledStep, device_arch

    chunked, floor = gpu_env[0], gpu_env[3]
    mf = open_model(tiny_path)
    a = CompiledStep(mf, chunked.buckets, device_arch(), chunked.cache, record_hc=True, prefill_chunks=(16, 64))
    a.prepare_all(progress=False)
    b = CompiledStep(mf, chunked.buckets, device_arch(), chunked.cache, record_hc=True)
    b.prepare_all(progress=False)
    prompt = torch.randint(0, mf.config.vocab_size, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    a.reset()
    a.final_hc_ring.fill_(float("nan"))
    a.prefill(prompt, 0)
    b.reset()
    for i, t in enumerate(prompt):
        b.step([t], i)
    lo = 100 - mf.config.window
    got, want = a.final_hc(lo, 100).float(), b.final_hc(lo, 100).float()
    assert not torch.isnan(got).any()
    e = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
    last = mf.config.n_layers - 1
    bound = max(2e-2, 3 * max(v for k, v in floor.items() if k.startswith(f"l{last}.")))
    assert e.median() < bound and e.max() < 0.25, (bound, e)


def test_memory_plan_counts_the_widest_chunk_graph():
    """With prefill chunks the plan's arena holds the widest chunk graph's activations and its workspaces: on
    flash-l4 at C = 2048 at least the grouped experts' bf16 [C, k, D] outputs and the f16 [C, D] quantized x."""
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.runtime.memory_plan import plan_parts

    mf = open_model("synthetic:flash-l4")
    cfg = mf.config
    b = BucketSpec.build(cfg, (1, 2, 3, 4, 5), 4096)
    base = plan_parts(mf, b)
    big = plan_parts(mf, b, prefill_chunks=(256, 2048))
    floor = 2048 * cfg.n_active_experts * cfg.hidden_size * 2 + 2048 * cfg.hidden_size * 2
    assert big.arena >= base.arena + floor and big.weights.keys() == base.weights.keys()
    assert plan_parts(mf, b, prefill_chunks=(256,)).arena < big.arena


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")
def test_prefill_from_an_artifact(gpu_env, tiny_path, tmp_path):
    """An artifact compiled with the chunk graphs (build_artifact(prefill_chunks=(16, 64)), as `ds4c compile
    --prefill 16,64`) serves CompiledStep(prefill_chunks=...) with nothing compiled: its prefill equals the step
    that compiled its own chunk graphs (the same binaries); open_engine defaults to the artifact's chunks; chunks the
    artifact lacks are a one-line ArtifactError naming both."""
    from ds4c.engine import open_engine
    from ds4c.sources import open_model
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import ArtifactError
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.targets import target

    chunked = gpu_env[0]
    mf = open_model(tiny_path)
    types = {n: mf.ggml_type(n) for n in mf.specs}
    out = build_artifact(mf.config, [target(device_arch())], chunked.buckets, tmp_path / "art", chunked.cache,
                         progress=False, weight_types=types, prefill_chunks=(16, 64))
    step = CompiledStep(mf, chunked.buckets, device_arch(), artifact=str(out), prefill_chunks=(16, 64))
    step.prepare_all(progress=False)
    assert step.binary_batches == 0  # nothing compiled
    prompt = torch.randint(0, mf.config.vocab_size, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    chunked.reset()
    want = chunked.prefill(prompt, 0).clone()
    got = step.prefill(prompt, 0)
    assert torch.equal(got, want)
    with pytest.raises(ArtifactError, match="compiled with --prefill 16,64; asked for 16,32") as ei:
        CompiledStep(mf, chunked.buckets, device_arch(), artifact=str(out), prefill_chunks=(16, 32))
    assert "\n" not in str(ei.value)
    eng = open_engine(open_model(tiny_path), "cuda", artifact=out, max_ctx=None, prepare=False, progress=False)
    assert eng.prefill_chunks == (16, 64)
    eng = open_engine(open_model(tiny_path), "cuda", artifact=out, max_ctx=None, prepare=False, progress=False,
                      prefill_chunks=())
    assert eng.prefill_chunks == ()
