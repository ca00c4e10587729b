"""Decode lanes on the compiled step (issue 30) on a CUDA GPU: each lane's logits equal the same sequence run alone on
the one-sequence compiled step, teacher-forced, with lanes at different positions crossing window wraps, flushes
of both ratios and context buckets (skipped without a GPU; run on the device and recorded in
docs/gpu-validation.md)."""

from __future__ import annotations

import pytest
import torch
from lanes_compare import lanes_vs_alone

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled lanes step)")]


@pytest.fixture(scope="module")
def kcache(tmp_path_factory):
    """One kernel cache for the module's steps (each distinct kernel compiled once)."""
    return tmp_path_factory.mktemp("lanes-kc")


@pytest.mark.parametrize("streams,batch", [("0", "0"), ("1", "0"), ("0", "1")],
                         ids=["in-order", "lane-streams", "lane-batch"])
def test_lanes_equal_each_sequence_alone(tiny_path, kcache, monkeypatch, streams, batch):
    """Five lanes (prompts of 3..60 tokens; tiny: window 16, ratios 4 and 16, buckets 32..128), 40 decode steps:
    every row within the one-sequence step's noise floor of its alone run and the same argmax (measured: bit-equal,
    docs/gpu-validation.md); with the per-lane launches in order, on a stream per lane (DS4C_LANE_STREAMS) and
    merged into one launch per kernel over the lanes (DS4C_LANE_BATCH)."""
    monkeypatch.setenv("DS4C_LANE_STREAMS", streams)
    monkeypatch.setenv("DS4C_LANE_BATCH", batch)
    from ds4c.buckets import BucketSpec
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.step.lanes import LanesStep
    from ds4c.sources import open_model

    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1,), 128, contexts=(32, 64, 128))
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(kcache))
    lanes = LanesStep(ex, slots=5)
    assert lanes.graphs.lane_streams == (5 if streams == "1" else 0) and lanes.lane_batch == (batch == "1")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (3, 15, 31, 47, 60)]
    feeds = [torch.randint(0, 512, (40,), generator=g).tolist() for _ in prompts]
    r = lanes_vs_alone(ex, lanes, prompts, feeds)
    e = r["errors"]
    assert torch.isfinite(e).all() and e.median() < 1e-3 and e.max() < 2e-2, e
    assert r["argmax"] == 1.0, r


def test_batch_engine_on_the_compiled_step_equals_each_request_alone(tiny_path):
    """Continuous batching on the compiled step (ds4c.batch_slots): three slots, four requests (greedy, seeded
    sampling with top-k / top-p, one waiting for a slot), vacated slots poisoned: each request's tokens equal the
    same request alone on the same compiled step (``ds4c.generate``: chunked prefill, then the device loop), and a
    chat's next turn starts from the first turn's slot snapshot."""
    from ds4c.batching import BatchConfig, BatchEngine
    from ds4c.engine import open_engine
    from ds4c.generate import generate
    from ds4c.sources import open_model

    step = open_engine(open_model(tiny_path), device="cuda", engine="compiled", max_ctx=256, progress=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (21, 40, 7, 70)]
    kws = [dict(), dict(temperature=0.8, top_p=0.9, seed=2), dict(temperature=1.0, top_k=30, seed=3), dict()]
    want = [generate(step, p, 96, **kw).tokens for p, kw in zip(prompts, kws)]
    eng = BatchEngine(step, step.max_ctx, BatchConfig(max_lanes=3, poison=True))
    assert eng.backend.name == "compiled" and eng.backend.warm_s > 0
    reqs = [eng.submit(p, 96, **kw) for p, kw in zip(prompts, kws)]
    assert [r.run().tokens for r in reqs] == want
    # the next turn of the last to end (the snapshots kept are at most the slots: the first to end was dropped)
    turn2 = prompts[3] + want[3] + torch.randint(0, 512, (5,), generator=g).tolist()
    cold = generate(step, turn2, 8).tokens
    t2 = eng.submit(turn2, 8)
    assert t2.run().tokens[:1] == cold[:1] and t2.prefix_reused == len(prompts[3]) + 95
    st = eng.stats()
    assert st["running"] == 0 and st["prefix_hits"] == 1
    eng.close()


def test_model_lanes_on_cuda_runs_threads_together(tiny_path):
    """``Model(device="cuda", lanes=3)``: the compiled step's batch; four threads' generations give each the text a
    Model without lanes gives."""
    from concurrent.futures import ThreadPoolExecutor

    from ds4c import Model

    one = Model(tiny_path, device="cuda", max_ctx=256)
    prompts = ["The quick brown fox", "def main():", "Hello there", "Once upon a time, in"]
    want = [one.generate(p, 24, temperature=0.8, seed=k).text for k, p in enumerate(prompts)]
    del one
    m = Model(tiny_path, device="cuda", max_ctx=256, lanes=3)
    assert m.batch.backend.name == "compiled"
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda k: m.generate(prompts[k], 24, temperature=0.8, seed=k).text, range(4)))
    assert got == want
    m.close()


@pytest.mark.parametrize("batch", ["0", "1"], ids=["in-order", "lane-batch"])
def test_prompt_lane_beside_decode_lanes_equals_each_sequence_alone(tiny_path, kcache, monkeypatch, batch):
    """``LanesStep(prompt_rows=5)``: two decode lanes and a 45-token prompt fed 5 rows a step in the prompt lane of
    the same graphs, then moved to a decode slot and decoded beside them: the decode rows, the prompt's last-row
    logits per piece and its decode rows after the move each within the one-sequence step's noise floor of the
    same sequence alone (the prompt alone: verify steps of 5 rows), with the logits buffer poisoned every step."""
    from ds4c.buckets import BucketSpec
    from ds4c.runtime.cache import KernelCache
    from ds4c.runtime.step import CompiledStep, device_arch
    from ds4c.runtime.step.lanes import LanesStep
    from ds4c.sources import open_model

    monkeypatch.setenv("DS4C_LANE_BATCH", batch)
    mf = open_model(tiny_path)
    buckets = BucketSpec.build(mf.config, (1, 5), 128, contexts=(32, 64, 128))
    ex = CompiledStep(mf, buckets, device_arch(), KernelCache(kcache))
    lanes = LanesStep(ex, slots=3, prompt_rows=5)
    assert lanes.prompt_sizes == (1, 2) and lanes.prompt_slot == 3
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (6, 29)]
    feeds = [torch.randint(0, 512, (14,), generator=g).tolist() for _ in prompts]
    newp = torch.randint(0, 512, (45,), generator=g).tolist()
    after = torch.randint(0, 512, (5,), generator=g).tolist()

    def row(logits):
        return logits.float().cpu().clone()

    alone = []
    for p, f in zip(prompts, feeds):
        ex.reset()
        for t in p:
            ex.step([t], ex.pos)
        alone.append([row(ex.step([t], ex.pos)[0]) for t in f])
    ex.reset()
    alone_p = [row(ex.step(newp[s:s + 5], s)[-1]) for s in range(0, 45, 5)]
    alone_p += [row(ex.step([t], ex.pos)[0]) for t in after]
    for j, p in enumerate(prompts):
        ex.reset()
        for t in p:
            ex.step([t], ex.pos)
        lanes.install(j)
    ex.reset()
    lanes.install(lanes.prompt_slot)
    errs, agree, n_rows = [], 0, 0

    def check(got, want):
        nonlocal agree, n_rows
        errs.append(float((got - want).norm() / want.norm().clamp_min(1e-30)))
        agree += int(int(got.argmax()) == int(want.argmax()))
        n_rows += 1

    for s in range(9):
        lanes.graphs.logits.fill_(float("nan"))
        dec, last = lanes.decode_beside([feeds[0][s], feeds[1][s]], newp[5 * s:5 * s + 5])
        dec, last = row(dec), row(last[0])
        check(dec[0], alone[0][s])
        check(dec[1], alone[1][s])
        check(last, alone_p[s])
    lanes.move(lanes.prompt_slot, 2)
    assert lanes.pos[2] == 45
    for k in range(5):
        s = 9 + k
        lanes.graphs.logits.fill_(float("nan"))
        got = row(lanes.decode([feeds[0][s], feeds[1][s], after[k]]))
        check(got[0], alone[0][s])
        check(got[1], alone[1][s])
        check(got[2], alone_p[9 + k])
    e = torch.tensor(errs)
    assert torch.isfinite(e).all() and e.median() < 1e-3 and e.max() < 2e-2, e
    assert agree == n_rows
