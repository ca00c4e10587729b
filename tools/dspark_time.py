#!/usr/bin/env python3
"""The per-step cost of the compiled DSpark drafter (issue 13): one propose = a commit of the accepted rows + one
draft, each timed as back-to-back CUDA-graph replays (``CompiledDSpark.time_propose``), next to the target's verify
step at width B + 1 (``CompiledStep.time_replays``), with every draft launch timed on its own per kernel family.
Usage (the lead, on the H200):

    python tools/dspark_time.py --gguf synthetic:flash-l4 --drafter dspark:synthetic:flash-l4 [--pos 200] [--commit 1,3,5]

(no files: the target and the drafter are the synthetic sources, every weight generated in GPU memory,
docs/synthetic.md), or with files:

    ds4c make-model --preset flash-l4 -o /tmp/l4.gguf
    ds4c make-model --preset flash-l4 --drafter dspark -o /tmp/l4-dspark.gguf
    python tools/dspark_time.py --gguf /tmp/l4.gguf --drafter /tmp/l4-dspark.gguf [--pos 200] [--commit 1,3,5]

``--drafter`` takes a file or ``[dspark:]synthetic:PRESET[:FORMATS[:SEED]]``; with a synthetic ``--gguf`` and no
``--drafter`` the drafter is the synthetic one of the same preset and seed. Without ``--gguf`` it makes the
``--model`` preset's pair of files (seed 0) in a temporary folder (and the drafter file too when none is given). The rings
are filled by commits of random ``main_hidden`` rows (timing does not depend on their values); the draft's
prediction in docs/drafter.md is what this measures.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ds4c.buckets import BucketSpec  # noqa: E402
from ds4c.config import preset  # noqa: E402
from ds4c.drafters.dspark_sources import open_dspark  # noqa: E402
from ds4c.drafters.dspark_synth import make_dspark  # noqa: E402
from ds4c.sources import open_model  # noqa: E402
from ds4c.runtime.cache import KernelCache  # noqa: E402
from ds4c.runtime.dspark_exec import CompiledDSpark  # noqa: E402
from ds4c.runtime.step import CompiledStep  # noqa: E402
from ds4c.synth import make_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--gguf", default=None, help="target model file or synthetic:PRESET[:FORMATS[:SEED]]")
    ap.add_argument("--drafter", default=None,
                    help="DSpark drafter file or [dspark:]synthetic:PRESET[:FORMATS[:SEED]] (no file)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--pos", type=int, default=200, help="committed positions before the timed propose")
    ap.add_argument("--commit", default="1,3,5", help="commit sizes to time (accepted rows per step)")
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    gguf: Path | str = (a.gguf if a.gguf.startswith("synthetic:") else Path(a.gguf)) if a.gguf else \
        make_model(preset(a.model), tmp / f"{a.model}.gguf", seed=0)
    mf = open_model(gguf)
    dspec = a.drafter[len("dspark:"):] if a.drafter and a.drafter.startswith("dspark:") else a.drafter
    if dspec is None and getattr(mf, "generates_on_device", False):  # the synthetic target's synthetic drafter
        dspec = f"synthetic:{mf.preset}:official:{mf.seed}"
    dpath: Path | str = (dspec if dspec.startswith("synthetic:") else Path(dspec)) if dspec else \
        make_dspark(gguf, tmp / f"{a.model}-dspark.gguf", seed=0)
    f = open_dspark(dpath, mf.config, device="cuda")
    print(f"target {mf.path}, drafter {f.path}"
          f"{' (the drafter generated on the device, no file)' if getattr(f, 'generates_on_device', False) else ''}")
    B = f.block_size
    widths = tuple(sorted({1, min(5, B + 1)}))
    ex = CompiledStep(mf, BucketSpec.build(mf.config, widths, a.max_ctx), a.arch, KernelCache(tmp / "kcache"))
    ex.prepare_all(widths=widths, max_ctx=a.pos + 16, progress=True)
    cd = CompiledDSpark(f, ex)
    st = cd.prepare(progress=True)
    print(f"drafter prepared: {st['graphs']} graphs, compile {st['compile_s']:.1f} s, capture {st['capture_s']:.2f} s, "
          f"own weights {st['weight_bytes'] / 1e9:.3f} GB (embedding and head shared), launches {st['launches']}")
    g = torch.Generator().manual_seed(1)
    D = mf.config.hidden_size * len(f.taps)
    rows = (torch.randn(min(a.pos, cd.window), D, generator=g) * 0.5).to(torch.bfloat16).cuda()
    cd.ring_pos = a.pos - rows.shape[0]
    cd.commit(cd.ring_pos, rows)
    for n in (int(x) for x in a.commit.split(",")):
        t = cd.time_propose(300, commit_rows=n, repeats=a.repeats)
        print(f"propose with a commit of {n}: commit {t[f'commit{n}'] * 1e3:.1f} us + draft {t['draft'] * 1e3:.1f} us "
              f"= {t['propose_ms'] * 1e3:.1f} us")
    toks = torch.randint(0, mf.config.vocab_size, (a.pos + 8,), generator=g).tolist()
    p = 0
    while p < a.pos:
        q = min(max(widths), a.pos - p)
        ex.step(toks[p:p + (q if q in widths else 1)], p)
        p += q if q in widths else 1
    w = max(widths)
    print(f"target verify step q={w} at pos {p}: {ex.time_replays(toks[p:p + w], p) * 1e3:.1f} us (graph replay)")
    # every draft launch on its own
    sg = cd._graphs["draft"]
    cd._upload(cd.ring_pos, [300] + [f.noise_id] * (B - 1), rows=B)
    pairs = [(k, la) for k in sg.kernels for la in k.launches]
    evs = [[torch.cuda.Event(enable_timing=True) for _ in range(len(pairs) + 1)] for _ in range(20)]
    for r in range(20):
        evs[r][0].record()
        for i, b in enumerate(sg.launches):
            b.kernel(b.grid, b.block, b.args, smem=b.smem)
            evs[r][i + 1].record()
    torch.cuda.synchronize()
    fam: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for i, (k, _la) in enumerate(pairs):
        us = sorted(evs[r][i].elapsed_time(evs[r][i + 1]) * 1e3 for r in range(20))[10]
        fam[k.family][0] += us
        fam[k.family][1] += 1
    total = sum(v[0] for v in fam.values())
    print(f"draft: {len(pairs)} launches, sum of launches {total:.1f} us")
    for name, (us, n) in sorted(fam.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:12s} {n:4d} launches {us:9.1f} us ({100 * us / total:5.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
