"""The compiled step records the final HC state (spec ds4-flash.md 7.5's ``X_main``) and the MTP drafter runs on it, on a
CUDA GPU: ``CompiledStep(..., record_hc=True)`` on the synthetic tiny model against the reference's ``final_hc``
(teacher-forced, the ring poisoned with NaN before the steps so that an unwritten row shows), through verify +
rollback and the host-free decode loop; the refusals of positions not committed and of a step built without it; a
virtual layer split (the last shard records) against the unsplit step bit for bit; an artifact compiled with it and
one without refusing; greedy ``generate(..., draft=MTPDrafter)`` on the compiled step equal to the step's own
autoregressive tokens (up to near-ties, reported with their margin), also through ``Model`` and ``ds4c generate
--draft mtp:FILE``. Skipped without a GPU; the lead runs them on the H200:

    pytest -q -m gpu tests/test_compiled_mtp.py

The CPU side (IR op, interpreter against the reference, the copy kernel on the CPU emulation, the drafter's file
target) is tests/test_record_hc.py.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled step)")]

PROMPT = [5, 17, 301, 42, 7, 99, 3, 250, 11, 64, 128, 9, 33, 77, 401, 2, 18, 260, 95, 44]  # 20: past the window


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(7575)
    return torch.randint(0, 512, (96,), generator=g).tolist()


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory):
    from ds4c.config import preset
    from ds4c.drafters.mtp_synth import make_mtp

    return make_mtp(preset("tiny"), tmp_path_factory.mktemp("mtp") / "tiny-mtp.gguf", seed=0)  # tiny_path's block


@pytest.fixture(scope="module")
def env(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    cache = KernelCache(tmp_path_factory.mktemp("kcache"))
    ex = CompiledStep(mf, buckets, device_arch(), cache, record_hc=True)
    ex.prepare_all(progress=False)
    ref = Reference(ReferenceWeights.load(mf, "cuda"), max_ctx=128)
    ref.record_final_hc(True)
    return mf, buckets, cache, ex, ref


def _rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error per (row, stream) (fp32) of [n, hc, D] tensors."""
    got, want = got.float(), want.float()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()


def _copy_state(ex, ref, p: int) -> None:
    """The reference's sequence state into the compiled step (teacher forcing) at position ``p``; the final HC ring
    is the step's own."""
    from ds4c.ir.interpreter import state_to_inputs

    for name, buf in state_to_inputs(ref.state).items():
        ex.state[name].copy_(buf)
    ex.pos = p


def _ring_rows(ex, p: int, q: int) -> torch.Tensor:
    return ex.final_hc_ring[torch.arange(p, p + q, device=ex.dev) % ex.final_hc_ring.shape[0]]


def test_teacher_forced_final_hc_matches_the_reference(env, tokens):
    """Steps of widths 5, 1, 3, 2, 4 from position 0 to 80 (the 21-row ring wraps three times, across the 32 / 64 /
    128 buckets), each from the reference's state: every written ring row (position t at row t % 21) is the
    reference's final_hc(t) within bf16 tolerance (the compiled step's noise floor: test_compiled_taps' bounds), no
    written row is NaN, rows of positions not reached yet keep the poison; final_hc is a copy of the ring rows."""
    _, _, _, ex, ref = env
    cfg = ex.cfg
    R = cfg.window + 5
    assert ex.records_final_hc and ex.final_hc_rows is ex.final_hc_ring
    ex.reset()
    ref.reset()
    ref.record_final_hc(True)
    ex.final_hc_ring.fill_(float("nan"))
    assert ex.final_hc_ring.shape == (R, cfg.hc_mult, cfg.hidden_size) and ex.final_hc_ring.dtype == torch.bfloat16
    errs, p, k, widths = [], 0, 0, (5, 1, 3, 2, 4)
    while p < 80:
        q = widths[k % len(widths)]
        k += 1
        _copy_state(ex, ref, p)
        ex.step(tokens[p:p + q], p)
        ref.verify(tokens[p:p + q], p)
        rows = _ring_rows(ex, p, q)
        assert not torch.isnan(rows.float()).any(), f"step at {p} (q={q}) left a ring row unwritten"
        if p + q < R:
            assert torch.isnan(ex.final_hc_ring[p + q:].float()).all(), "a row of a later position was written"
        errs.append(_rel(rows, ref.final_hc(p, p + q)).cpu())
        lo = max(0, p + q - cfg.window)
        got = ex.final_hc(lo, p + q)
        assert got.shape == (p + q - lo, cfg.hc_mult, cfg.hidden_size)
        assert torch.equal(got, _ring_rows(ex, lo, p + q - lo))
        p += q
    e = torch.cat(errs)
    assert e.median() < 1e-2 and torch.quantile(e, 0.9) < 3e-2 and e.max() < 0.25, e


def test_final_hc_through_verify_rollback_and_its_refusals(env, tokens):
    """A verify of 5 rows, a rollback keeping 2: the committed rows are the reference's, the rejected positions are
    refused (not committed), the next decode rewrites the first rejected position's row; ranges outside the newest
    window committed positions are refused in one line."""
    from ds4c.errors import StepError

    _, _, _, ex, ref = env
    ref.reset()
    ref.record_final_hc(True)
    for s in range(0, 30, 5):
        ref.verify(tokens[s:s + 5], s)
    ex.reset()
    _copy_state(ex, ref, 30)
    ex.final_hc_ring.fill_(float("nan"))
    ex.verify(tokens[30:35], 30)
    ex.rollback(2)
    ref.verify(tokens[30:35], 30)
    ref.rollback(2)
    assert ex.pos == 32
    assert _rel(ex.final_hc(30, 32), ref.final_hc(30, 32)).max() < 0.25
    for start, stop, what in ((30, 33, r"inside 16\.\.31"), (15, 20, r"inside 16\.\.31"), (31, 30, "31..29"),
                              (True, 31, "expected int positions")):
        with pytest.raises(StepError, match=what) as ei:
            ex.final_hc(start, stop)
        assert "\n" not in str(ei.value)
    ex.step([tokens[95]], 32)
    ref.decode(tokens[95], 32)
    assert _rel(ex.final_hc(32, 33), ref.final_hc(32, 33)).max() < 0.25


def test_decode_loop_graphs_record_the_final_hc(env, tokens):
    """decode_tokens (the captured decode-loop graphs) writes a ring row per token: from the reference's state at 37,
    12 greedy tokens. The same tokens fed step by step (the plain step graphs) from the same state give the same rows
    (the same kernels on the same inputs: a misplaced or stale row would differ by O(1)); the reference on the same
    tokens gives them within the drift of 12 free-running steps (the first H200 run: median 0.024, max 0.075; the
    teacher-forced bound above is 1e-2 because there every step starts from the reference's state)."""
    _, _, _, ex, ref = env
    ref.reset()
    ref.record_final_hc(True)
    for s in range(0, 37, 5):
        ref.verify(tokens[s:min(s + 5, 37)], s)
    ex.reset()
    _copy_state(ex, ref, 37)
    saved = {name: buf.clone() for name, buf in ex.state.items()}
    ex.final_hc_ring.fill_(float("nan"))
    captures = ex.captures
    out = list(ex.decode_tokens(tokens[37], 37, 12))
    assert ex.captures == captures and ex.pos == 49
    assert torch.isnan(_ring_rows(ex, 49, 4).float()).all()
    loop_rows = ex.final_hc(37, 49).clone()
    fed = [tokens[37]] + out[:-1]
    for name, buf in saved.items():
        ex.state[name].copy_(buf)
    ex.pos = 37
    ex.final_hc_ring.fill_(float("nan"))
    for i, t in enumerate(fed):
        ex.step([t], 37 + i)
    assert _rel(loop_rows, ex.final_hc(37, 49)).max() < 1e-3
    for i, t in enumerate(fed):
        ref.decode(t, 37 + i)
    e = _rel(loop_rows, ref.final_hc(37, 49))
    assert e.median() < 4e-2 and e.max() < 0.25, e


def test_a_step_without_record_hc_is_refused_in_one_line(env, mtp_path):
    from ds4c.drafters.mtp import MTPDrafter
    from ds4c.errors import StepError
    from ds4c.runtime.step import CompiledStep, device_arch

    mf, buckets, cache, _, _ = env
    plain = CompiledStep(mf, buckets, device_arch(), cache)
    assert not plain.records_final_hc and plain.final_hc_ring is None and plain.final_hc_rows is None
    for fn, what in ((lambda: plain.final_hc(0, 0), r"records no final HC state: build it with CompiledStep\(\.\.\., "
                                                    r"record_hc=True\)"),
                     (lambda: plain.record_final_hc(True), "record_hc=True"),
                     (lambda: MTPDrafter(mtp_path).prepare(plain, PROMPT, 4),
                      r"which this CompiledStep does not record: open the compiled step with record_hc=True")):
        with pytest.raises(StepError, match=what) as ei:
            fn()
        assert "\n" not in str(ei.value)


def _ar_with_logits(ex, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The compiled step's own greedy tokens (``generate`` without a drafter) and, for reporting a divergence, the
    fp32 logits of each new token from the same steps run by hand (the prompt as steps of 5 rows, then decodes)."""
    from ds4c.generate import generate

    toks = generate(ex, prompt, n).tokens
    ex.reset()
    for s in range(0, len(prompt), 5):
        chunk = prompt[s:s + 5]
        lg = ex.step(chunk, s)[len(chunk) - 1].float().cpu()
    lgs = [lg]
    for i, t in enumerate(toks[:-1]):
        lgs.append(ex.step([t], len(prompt) + i)[0].float().cpu())
    return toks, lgs


def _first_divergence(spec: list[int], ar: list[int], lgs: list[torch.Tensor]) -> str:
    i = next(i for i, (a, b) in enumerate(zip(spec, ar)) if a != b)
    top = torch.topk(lgs[i], 2)
    return (f"first divergence at new token {i}: speculative {spec[i]}, autoregressive {ar[i]} (AR logit margin "
            f"{float(top.values[0] - top.values[1]):.3g}; the speculative token's logit "
            f"{float(lgs[i][spec[i]]):.4f} vs {float(top.values[0]):.4f})")


def _steered(mtp_path, prompt: list[int], continuation: list[int], steer: float, seed: int):
    """The MTP drafter with each draft replaced by ``continuation``'s token with probability ``steer`` (so verify
    steps accept several tokens and the drafter commits several positions from ``final_hc``); logs the positions
    each proposal committed."""
    import random

    from ds4c.drafters.mtp import MTPDrafter

    class Steered(MTPDrafter):
        def __init__(self):
            super().__init__(mtp_path)
            self.rng, self.log = random.Random(seed), []

        def propose(self, context, k):
            drafts, q = super().propose(context, k)
            self.log.append(list(self.last_committed))
            at = len(context) - len(prompt)
            return [continuation[at + i] if at + i < len(continuation) and self.rng.random() < steer else t
                    for i, t in enumerate(drafts)], q

    return Steered()


@pytest.mark.parametrize("width,steer", [(2, 0.0), (3, 0.7), (5, 0.5), (5, 0.9)])
def test_greedy_generate_with_the_mtp_drafter_equals_the_steps_own_tokens(env, mtp_path, width, steer):
    """Greedy ``generate(ex, prompt, 24, draft=MTPDrafter)`` on the compiled step (verify_greedy: acceptance and
    rollback on the device; the drafter commits the accepted positions from final_hc) gives the compiled step's own
    autoregressive tokens. Steered drafts (the AR continuation with probability ``steer``) make verify steps accept
    several tokens, so the drafter reads several rows per step. A difference is allowed only at a near-tie of the AR
    logits (margin < 1e-2: the verify rows' and the decode's kernels differ in rounding), reported with its margin."""
    from ds4c.generate import generate

    _, _, _, ex, _ = env
    n = 24
    ar, lgs = _ar_with_logits(ex, PROMPT, n)
    d = _steered(mtp_path, PROMPT, ar, steer, seed=width)
    res = generate(ex, PROMPT, n, draft=d, spec_width=width)
    sp = res.speculative
    assert sp["drafter"] == "mtp:tiny-mtp.gguf" and sp["steps"] > 0 and 0 < d.model.ring_pos <= ex.pos
    assert d.model.device.type == "cuda"
    L = len(PROMPT)
    assert d.log[0] == list(range(L - ex.cfg.window + 1, L + 1))  # the drafter's prefill: the newest window
    if steer >= 0.7:
        assert max(len(c) for c in d.log[1:]) >= 3, d.log  # multi-token accepts happened
    if res.tokens != ar:
        msg = _first_divergence(res.tokens, ar, lgs)
        print(msg)
        i = next(i for i, (a, b) in enumerate(zip(res.tokens, ar)) if a != b)
        top = torch.topk(lgs[i], 2)
        assert float(top.values[0] - top.values[1]) < 1e-2, msg
    print(f"width {width} steer {steer}: {sp}")


def test_sampling_with_the_mtp_drafter_on_the_compiled_step(env, mtp_path):
    """Sampling (temperature 0.8, top-k 40): the loop's verify + rollback with the exact acceptance rule on the
    compiled step, the drafter's q from its block: reproducible for a seed, another seed another sequence; a greedy
    request after it gives the AR tokens again."""
    from ds4c.drafters.mtp import MTPDrafter
    from ds4c.generate import generate

    _, _, _, ex, _ = env
    d = MTPDrafter(mtp_path, seed=5)
    kw = dict(temperature=0.8, top_k=40, spec_width=4, draft=d)
    r1, r2, r3 = (generate(ex, PROMPT, 10, seed=s, **kw) for s in (1, 1, 2))
    assert r1.tokens == r2.tokens and r1.tokens != r3.tokens and r1.speculative["steps"] > 0
    ar, lgs = _ar_with_logits(ex, PROMPT, 6)
    greedy = generate(ex, PROMPT, 6, draft=d, spec_width=3)
    assert d.temperature == 0
    if greedy.tokens != ar:
        msg = _first_divergence(greedy.tokens, ar, lgs)
        i = next(i for i, (a, b) in enumerate(zip(greedy.tokens, ar)) if a != b)
        top = torch.topk(lgs[i], 2)
        assert float(top.values[0] - top.values[1]) < 1e-2, msg


def test_model_and_cli_run_the_mtp_drafter_compiled(tiny_path, mtp_path, tmp_path):
    """``Model(engine="compiled", record_hc=True).generate(draft="mtp:FILE")`` and ``ds4c generate --device cuda
    --draft mtp:FILE`` give the plain compiled greedy tokens (up to a reported near-tie); a Model opened without
    record_hc refuses the drafter in one line."""
    from click.testing import CliRunner

    from ds4c.api import Model
    from ds4c.cli import main
    from ds4c.errors import StepError

    m = Model(tiny_path, device="cuda", engine="compiled", max_ctx=64, record_hc=True)
    plain = m.generate(PROMPT, 12, ignore_eos=True).result.tokens
    spec = m.generate(PROMPT, 12, ignore_eos=True, draft=f"mtp:{mtp_path}", spec_width=3).result
    assert spec.speculative["drafter"] == "mtp:tiny-mtp.gguf"
    if spec.tokens != plain:
        print("Model: speculative", spec.tokens, "plain", plain)
        assert spec.tokens[:4] == plain[:4]
    off = Model(tiny_path, device="cuda", engine="compiled", max_ctx=64)
    with pytest.raises(StepError, match="open the compiled step with record_hc=True") as ei:
        off.generate(PROMPT, 4, draft=f"mtp:{mtp_path}")
    assert "\n" not in str(ei.value)
    base = ["generate", str(tiny_path), "--device", "cuda", "--prompt-ids", ",".join(map(str, PROMPT)),
            "--max-new-tokens", "12", "--ignore-eos", "--json"]
    env = {"DS4C_HOME": str(tmp_path)}
    r0 = CliRunner().invoke(main, base, env=env)
    r1 = CliRunner().invoke(main, [*base, "--draft", f"mtp:{mtp_path}", "--spec-width", "4"], env=env)
    assert r0.exit_code == 0 and r1.exit_code == 0, r0.output + r1.output
    a, b = (json.loads(r.output.strip().splitlines()[-1]) for r in (r0, r1))
    assert b["speculative"]["drafter"] == "mtp:tiny-mtp.gguf"
    if a["tokens"] != b["tokens"]:
        print("CLI: speculative", b["tokens"], "plain", a["tokens"])
        assert a["tokens"][:4] == b["tokens"][:4]


@pytest.mark.parametrize("split", [(4, 2), (5, 1)])
def test_virtual_split_final_hc_equals_the_unsplit_step(env, tokens, split):
    """A virtual split (every shard on this GPU): the last shard records; ShardedStep.final_hc equals the unsplit
    compiled step's bit for bit over verify and decode steps; a shard before the last refuses in one line."""
    from ds4c.errors import StepError
    from ds4c.runtime.step import device_arch
    from ds4c.runtime.sharded import ShardedStep
    from ds4c.shard_plan import ShardPlan

    mf, buckets, cache, ex, _ = env
    s = ShardedStep(mf, buckets, ShardPlan(("cuda:0",) * len(split), split), device_arch(), cache, record_hc=True)
    s.prepare_all(widths=(1, 5), max_ctx=64, progress=False)
    assert s.records_final_hc and s.shards[0].final_hc_ring is None and s.final_hc_ring is not None
    ex.reset()
    s.reset()
    s.final_hc_ring.fill_(float("nan"))
    p = 0
    for q in (5, 5, 1, 5, 1, 1, 5):
        ex.step(tokens[p:p + q], p)
        s.step(tokens[p:p + q], p)
        p += q
    lo = p - ex.cfg.window
    assert torch.equal(s.final_hc(lo, p), ex.final_hc(lo, p))
    with pytest.raises(StepError, match="does not run the last layer") as ei:
        s.shards[0].final_hc(lo, p)
    assert "\n" not in str(ei.value)


def test_artifact_with_record_hc_serves_and_one_without_refuses(env, tokens, tmp_path):
    """``build_artifact(record_hc=True)`` (``ds4c compile --draft mtp``) for this GPU's arch: a CompiledStep with
    record_hc runs from it and records the same rows as the cache-built step bit for bit; it refuses a step without,
    and a plain artifact refuses a step with it, in one line, before any GPU work."""
    from ds4c.runtime.artifact import build_artifact
    from ds4c.runtime.artifact_manifest import ArtifactError
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.targets import target

    mf, buckets, cache, ex, _ = env
    types = {n: mf.ggml_type(n) for n in mf.specs}
    arch = device_arch()
    art = build_artifact(mf.config, [target(arch)], buckets, tmp_path / "mtp", cache, progress=False,
                         weight_types=types, record_hc=True)
    a = CompiledStep(mf, buckets, arch, cache, artifact=str(art), record_hc=True)
    ex.reset()
    for p in range(0, 20, 5):
        a.step(tokens[p:p + 5], p)
        ex.step(tokens[p:p + 5], p)
    assert torch.equal(a.final_hc(4, 20), ex.final_hc(4, 20))
    with pytest.raises(ArtifactError, match="compiled with the final HC state recorded .*, asked to serve a step with "
                                            "no final HC state recorded; compile one without --draft mtp"):
        CompiledStep(mf, buckets, arch, cache, artifact=str(art))
    plain = build_artifact(mf.config, [target(arch)], buckets, tmp_path / "plain", cache, progress=False,
                           weight_types=types)
    with pytest.raises(ArtifactError, match="compiled with no final HC state recorded, .*compile one with --draft mtp"):
        CompiledStep(mf, buckets, arch, cache, artifact=str(plain), record_hc=True)
