"""The compiled lanes step against each sequence run alone on the one-sequence compiled step, shared by the GPU test
(tests/test_lanes_gpu.py) and tools/lanes_gpu.py. Not a test module."""

from __future__ import annotations

from typing import Any

import torch


def lanes_vs_alone(ex: Any, lanes: Any, prompts: list[list[int]], feeds: list[list[int]]) -> dict[str, Any]:
    """Teacher-forced: lane j starts from ``prompts[j]`` (fed token by token on ``ex``, then installed into slot j)
    and decodes ``feeds[j]``; alone, the same sequence on ``ex``. The lanes' logits buffer is poisoned (NaN) before
    every step, so a lane row the step does not write shows. Returns per-row relative L2 errors (fp32 [steps * L]),
    the fraction of bit-equal rows and the argmax agreement."""
    n, steps = len(prompts), len(feeds[0])
    alone = []
    for p, f in zip(prompts, feeds):
        ex.reset()
        for t in p:
            ex.step([t], ex.pos)
        rows = []
        for t in f:
            rows.append(ex.step([t], ex.pos)[0].float().cpu().clone())
        alone.append(rows)
    for j, p in enumerate(prompts):
        ex.reset()
        for t in p:
            ex.step([t], ex.pos)
        lanes.install(j)
    errs, exact, agree = [], 0, 0
    for s in range(steps):
        if lanes.graphs.logits is not None:
            lanes.graphs.logits.fill_(float("nan"))  # a lane row the step does not write shows
        got = lanes.decode([feeds[j][s] for j in range(n)]).float().cpu()
        for j in range(n):
            want = alone[j][s]
            errs.append(float((got[j] - want).norm() / want.norm().clamp_min(1e-30)))
            exact += int(torch.equal(got[j], want))
            agree += int(int(got[j].argmax()) == int(want.argmax()))
    return {"errors": torch.tensor(errs), "exact": exact / (n * steps), "argmax": agree / (n * steps)}
