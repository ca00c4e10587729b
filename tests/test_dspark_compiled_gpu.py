"""The compiled DSpark drafter (runtime/dspark_exec.py) on a CUDA GPU, against the reference drafter on the same GPU
(tiny preset; skipped without a GPU). The lead runs:

    pytest -q -m gpu tests/test_dspark_compiled_gpu.py

and, for the per-step cost on flash-l4, ``python tools/dspark_time.py`` (its docstring).

Until the compiled step records the drafter's taps itself (``CompiledStep(..., taps=...)``, its ``tap_ring``), the
loop test gives it the taps of a reference run of the same committed tokens (:class:`TappedStep`); with a step that
has ``tap_ring`` the drafter reads it directly.
"""

from __future__ import annotations

import inspect

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled drafter)")]

PROMPT = [5, 17, 301, 42, 7, 99, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 19 > tiny's 16-row window


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def setup(tiny_path, tmp_path_factory):
    from ds4c.buckets import BucketSpec
    from ds4c.drafters.dspark_sources import open_dspark
    from ds4c.drafters.dspark_model import DSparkModel
    from ds4c.drafters.dspark_synth import make_dspark
    from ds4c.sources import open_model
    from ds4c.reference import Reference, ReferenceWeights
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.dspark_exec import CompiledDSpark
    from ds4c.runtime.step import CompiledStep, device_arch

    mf = open_model(tiny_path)
    path = make_dspark(tiny_path, tmp_path_factory.mktemp("dsparkgpu") / "tiny-dspark4.gguf", seed=3, block_size=4,
                       conf_bias=True)
    f = open_dspark(path)
    buckets = BucketSpec.build(mf.config, (1, 2, 3, 4, 5), 128, contexts=(32, 64, 128))
    kw = {"taps": f.taps} if "taps" in inspect.signature(CompiledStep).parameters else {}
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(tmp_path_factory.mktemp("kcache")), **kw)
    ex.prepare_all(progress=False)
    cd = CompiledDSpark(f, ex)
    stats = cd.prepare(progress=False)
    w = ReferenceWeights.load(mf, "cuda")
    ref = Reference(w, max_ctx=128, taps=f.taps)
    for i in range(0, len(PROMPT), 5):
        ref.verify(PROMPT[i:i + 5], i)
    return {"path": path, "file": f, "ex": ex, "cd": cd, "stats": stats, "weights": w,
            "model": DSparkModel(f, w), "mh": ref.main_hidden(0, len(PROMPT))}


def test_compiled_drafter_matches_the_reference_drafter(setup):
    cd, m, mh = setup["cd"], setup["model"], setup["mh"]
    assert setup["stats"]["graphs"] == 7 and cd.captures == 7  # commits of 1..5 rows, the draft, the sampling draft
    # the embedding and the head are the target's tensors, not copies
    assert cd._weight("output.weight", "raw").data_ptr() == setup["ex"].shared_weight("output.weight", "raw").data_ptr()
    cd.reset()
    m.reset()
    for start, stop in ((0, 6), (6, 19)):  # the second call keeps only the last 16 rows (7.4)
        assert cd.commit(start, mh[start:stop]) == m.extend(start, mh[start:stop])
        for s in range(3):
            e = rel(cd.ring(s), m.ring(s))
            print(f"ring {s} after commit {start}..{stop - 1}: relative error {e:.2e}")
            assert e < 2e-2, (start, s, e)  # bf16 rows after P3: FP8 act quant + fp32 sums in another order
    print("ring rows bit-equal:", [float((cd.ring(s) == m.ring(s)).all(-1).float().mean()) for s in range(3)])
    margins = []
    for t0 in (300, 7, 0, 511):
        before = [cd.ring(s).clone() for s in range(3)]
        d, r = cd.draft(t0), m.draft(t0)
        base, _hx = m.block(t0)
        assert all(torch.equal(cd.ring(s), before[s]) for s in range(3))  # a draft writes no state
        print(f"t0 {t0}: base relative error {rel(d.base, base):.2e}, confidence "
              f"{rel(d.confidence, r.confidence):.2e}")
        assert rel(d.base, base) < 5e-2, rel(d.base, base)  # three stages of bf16 / FP8-emulating kernels
        assert rel(d.confidence, r.confidence) < 5e-2
        for i, (a, b) in enumerate(zip(d.tokens, r.tokens)):  # equal up to the first near-tie
            li = r.logits[i].float().cpu()
            if a != b:
                margin = float(li[b] - li[a])
                margins.append((t0, i, margin))
                assert margin < 3e-2 * float(li.abs().max()) + 1e-3, (t0, i, margin)
                break
            assert rel(d.logits[i], li) < 5e-2
    print("greedy draft mismatches (anchor, depth, reference margin):", margins)


def test_device_sampled_drafts_are_seeded_and_drawn_from_q(setup):
    """draft_sampled: the chain drawn on the device; q rows are distributions, each draft has q > 0, the same seed
    gives the same drafts, another seed other drafts (at temperature 2 over 512 tokens), the chain's logits follow
    the drawn ids (logits_i = base_i + w2 . w1[out_i], checked on the host)."""
    cd, mh = setup["cd"], setup["mh"]
    cd.reset()
    cd.commit(0, mh[:6])
    runs = []
    for seed in (5, 5, 6):
        cd.configure_sampling(2.0, 0, 1.0, seed)
        d = cd.draft_sampled(300)
        q = d.q.float().cpu()
        assert torch.allclose(q.sum(-1), torch.ones(4), atol=1e-4)
        assert all(float(q[i, t]) > 0 for i, t in enumerate(d.tokens))
        runs.append((d.tokens, q.clone(), d.base.float().cpu(), d.logits.float().cpu()))
    assert runs[0][0] == runs[1][0] and runs[0][0] != runs[2][0]
    w1, w2 = cd._weight("markov_w1.weight", "bf16").float().cpu(), cd._weight("markov_w2.weight", "bf16").float().cpu()
    toks, _q, base, logits = runs[0]
    for i, prev in enumerate([300] + toks[:-1]):
        assert rel(logits[i], base[i] + w2 @ w1[prev]) < 1e-5, i
    g = cd.draft(300)  # greedy after sampling: the greedy graph, unaffected
    assert g.q is None and len(g.tokens) == 4


def test_a_rejected_verify_changes_no_drafter_state(setup):
    """Commit, draft, a target verify step whose drafts are all rejected, its rollback: the drafter's rings and
    position are those of the committed positions (a draft writes nothing; the compiled drafter commits only at the
    next proposal, what was accepted: the loop test checks the rings after a whole generation)."""
    cd, ex, mh = setup["cd"], setup["ex"], setup["mh"]
    cd.reset()
    cd.commit(0, mh[:6])
    rings = [cd.ring(s).clone() for s in range(3)]
    d = cd.draft(300)
    ex.reset()
    ex.verify(PROMPT[:5], 0)
    ex.rollback(5)
    ex.verify([PROMPT[5]] + [(t + 1) % 512 for t in d.tokens], 5)
    ex.rollback(1)
    assert all(torch.equal(cd.ring(s), rings[s]) for s in range(3)) and cd.ring_pos == 6


class TappedStep:
    """The compiled step with the drafter's taps (spec 5.2(q)) from a reference run of the same committed tokens:
    what the loop test needs until ``CompiledStep`` records taps itself. Tracks the committed tokens through
    ``verify`` / ``decode`` / ``rollback``; ``main_hidden(start, stop)`` runs the reference up to ``stop``."""

    def __init__(self, ex, ref):
        self._ex, self._ref, self._toks, self._last = ex, ref, [], (0, 0)
        self.taps = tuple(ref.taps)

    def __getattr__(self, name):
        if name == "decode_tokens":  # the loop's plain steps go through decode (so the tokens are seen)
            raise AttributeError(name)
        return getattr(self._ex, name)

    def reset(self):
        self._ex.reset()
        self._ref.reset()
        self._toks = []

    def verify(self, tokens, pos):
        del self._toks[pos:]
        self._toks += list(tokens)
        self._last = (pos, len(tokens))
        return self._ex.verify(tokens, pos)

    def decode(self, token, pos):
        del self._toks[pos:]
        self._toks.append(int(token))
        self._last = (pos, 1)
        return self._ex.decode(token, pos)

    def rollback(self, accepted):
        pos, _q = self._last
        del self._toks[pos + accepted:]
        return self._ex.rollback(accepted)

    def main_hidden(self, start, stop):
        r = self._ref
        while r.state.pos < stop:
            p = r.state.pos
            r.verify(self._toks[p:min(stop, p + 5)], p)
        return r.main_hidden(start, stop).to(self._ex.dev)


def test_greedy_speculative_with_the_compiled_drafter_follows_autoregressive(setup):
    """Greedy speculative decoding on the compiled target with the compiled drafter equals the compiled target's
    own autoregressive output up to a near-tie of the target (its verify rows and decode steps round differently)."""
    from ds4c.drafters.dspark import DSparkDrafter
    from ds4c.generate import generate
    from ds4c.reference import Reference

    ex = setup["ex"]
    prompt = PROMPT[:6]
    ar = generate(TappedStep(ex, Reference(setup["weights"], max_ctx=128)), prompt, 60).tokens
    d = DSparkDrafter(setup["path"])
    stepper = ex if getattr(ex, "tap_ring", None) is not None else TappedStep(
        ex, Reference(setup["weights"], max_ctx=128, taps=setup["file"].taps))
    spec = generate(stepper, prompt, 60, draft=d, spec_width=5)
    assert d.compiled is not None and len(spec.tokens) == 60 and spec.speculative["steps"] > 0
    assert d.compiled.captures == 7  # nothing captured during the generation
    first = next((i for i, (a, b) in enumerate(zip(ar, spec.tokens)) if a != b), None)
    print("first difference from AR:", first, "acceptance by depth:", spec.speculative["acceptance_by_depth"])
    assert first is None or first >= 10, first
    assert len(d.confidence) == 4 and all(0 < c < 1 for c in d.confidence)
    # one ring row per committed position, rejected rows never: the rings equal the reference drafter's rings of
    # the committed positions' taps (bf16 tolerance)
    from ds4c.drafters.dspark_model import DSparkModel

    n = d.compiled.ring_pos
    assert len(prompt) < n < len(prompt) + 60  # the last verify's accepted rows would be committed at the next call
    fresh = DSparkModel(setup["file"], setup["weights"])
    # the compiled step's tap ring holds the last window of positions only: the rings' rows are those positions'
    w = ex.cfg.window  # (rejected verify rows, up to 4 past the position, overwrote slots of older positions)
    lo = max(0, ex.pos + 4 - w)
    fresh.ring_pos = lo  # the rows before lo are overwritten in both rings
    fresh.extend(lo, stepper.main_hidden(lo, n))
    slots = [t % w for t in range(lo, n)]
    for s in range(3):
        assert rel(d.compiled.ring(s)[slots], fresh.ring(s)[slots]) < 2e-2, s


def test_sampling_with_the_compiled_drafter_is_seeded_and_drafts_from_q(setup):
    from ds4c.drafters.dspark import DSparkDrafter
    from ds4c.generate import generate
    from ds4c.reference import Reference

    ex, f = setup["ex"], setup["file"]
    d = DSparkDrafter(setup["path"])

    def run(seed):
        st = ex if getattr(ex, "tap_ring", None) is not None else TappedStep(
            ex, Reference(setup["weights"], max_ctx=128, taps=f.taps))
        return generate(st, PROMPT[:6], 12, temperature=0.8, top_k=40, top_p=0.95, seed=seed, draft=d,
                        spec_width=4).tokens

    a, b = run(1), run(1)
    assert a == b and len(a) == 12
    q = d.last_draft.q
    assert q is not None and q.device.type == "cpu" and q.shape == (4, 512)
    assert all(float(q[i, t]) > 0 for i, t in enumerate(d.last_draft.tokens))


def test_one_propose_timed(setup):
    """One propose (a commit of 1 row and a draft) as CUDA-graph replays; prints the milliseconds (tools/dspark_time.py
    runs the same on a large preset)."""
    cd, mh = setup["cd"], setup["mh"]
    cd.reset()
    cd.commit(0, mh[:6])
    t = cd.time_propose(300, commit_rows=1, repeats=20)
    print("tiny propose ms:", t)
    assert t["propose_ms"] > 0 and cd.ring_pos == 6
