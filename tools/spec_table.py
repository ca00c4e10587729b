#!/usr/bin/env python3
"""Speculative decoding on the compiled step, end to end (issue: speculative decoding, part 6): tokens/s of
``generate`` with the oracle drafter at several ALPHA for fixed verify widths 2..5 and the adaptive width,
beside autoregressive decoding (the host-free device-sampling loop), from one run on one GPU; and the cost of
rolling a rejected verify back (the undo family's kernel) against the verify step itself.

    python tools/spec_table.py MODEL.gguf [--prompt 512] [--new 256] [--alphas 0.5,0.7,0.8,0.9] [--seps 0,2,4]
        [--json out.json]

Each speculative run drafts the target's own greedy continuation (the AR run's tokens), each draft token
replaced by a wrong one with probability 1 - ALPHA; greedy acceptance, so its tokens must equal the AR run's
(the first divergence, if any, is reported: the compiled verify rows and decode steps round differently).
``--seps`` adds, per SEP, a column ``auto:SEP``: the adaptive width with the oracle's emulated confidence head of
that separation (``oracle:ALPHA:SEP``), i.e. the confidence-adaptive policy of ``ds4c.width_policy``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rollback_costs(step, prompt: list[int], repeats: int = 30) -> dict[int, dict[str, float]]:
    """Per verify width: the verify graph's replay time and the rollback's time (CUDA events around
    ``rollback(0)`` alone: the upload of the accepted count and the kernel; every row rejected, the most it
    restores), medians in ms, at the position after ``prompt``."""
    import torch

    out = {}
    pos = len(prompt)
    for w in (2, 3, 4, 5):
        toks = [1 + i for i in range(w)]
        step.reset()
        for s in range(0, pos, 5):
            step.step(prompt[s:s + 5], s)
        verify_ms = step.time_replays(toks, pos, repeats)
        rb = []
        for _ in range(repeats):
            step.verify(toks, pos)
            assert step.sequence.undo[0] == "kernel", step.sequence.undo[0]
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step.rollback(0)  # back at pos: the next repeat verifies the same rows
            b.record()
            torch.cuda.synchronize()
            rb.append(a.elapsed_time(b))
        step.reset()
        out[w] = {"verify_ms": verify_ms, "rollback_ms": statistics.median(rb),
                  "ratio": statistics.median(rb) / verify_ms}
    return out


class _Without:
    """The compiled step without some of its speculative paths (the A/B columns of ``--host-accept-ab``): without
    ``greedy_pipeline`` the loop runs ``verify_greedy`` step by step (``5 sync``); without both it verifies,
    brings the rows' argmax to the host, accepts there and calls ``rollback`` (``5 host``)."""

    def __init__(self, step, *hidden):
        self._step, self._hidden = step, hidden

    def __getattr__(self, name):
        if name in self._hidden:
            raise AttributeError(name)
        return getattr(self._step, name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--alphas", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--widths", default="2,3,4,5,auto")
    ap.add_argument("--seps", default="", help="emulated confidence separations for auto:SEP columns, e.g. 0,2,4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-accept-ab", action="store_true",
                    help="also run q=5 at each ALPHA unpipelined (verify_greedy step by step) and with the acceptance "
                         "and rollback on the host (the loop before verify_greedy), for an A/B in one run")
    a = ap.parse_args()

    from ds4c.engine import open_engine
    from ds4c.generate import generate
    from ds4c.sources import open_model
    from ds4c.drafters.oracle import OracleDrafter

    mf = open_model(a.model)
    V = mf.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(a.prompt)]
    step = open_engine(mf, device="cuda", max_ctx=a.prompt + a.new + 8, progress=False)
    generate(step, prompt[:8], 8)  # warm
    ar = generate(step, prompt, a.new)
    rows = [{"mode": "AR", "alpha": None, "width": 1, "tok_s": ar.decode_tokens_per_s, "tokens_per_step": 1.0,
             "same_as_ar": True, "first_diff": None}]
    print(f"AR: {ar.decode_tokens_per_s:.1f} tokens/s ({a.new} new tokens after a {a.prompt}-token prompt)",
          flush=True)
    widths = [w if w == "auto" else int(w) for w in a.widths.split(",")]
    widths += [f"auto:{float(x):g}" for x in a.seps.split(",") if x.strip()]
    runs = [(w, step) for w in widths] + ([("5 sync", _Without(step, "greedy_pipeline")),
                                           ("5 host", _Without(step, "greedy_pipeline", "verify_greedy"))]
                                          if a.host_accept_ab else [])
    for alpha in [float(x) for x in a.alphas.split(",")]:
        for w, stepper in runs:
            sep = float(w.split(":")[1]) if isinstance(w, str) and w.startswith("auto:") else None
            d = OracleDrafter(alpha, V, seed=1, continuation=ar.tokens, sep=sep)
            sw = 5 if str(w).startswith("5 ") else "auto" if sep is not None else w
            faulthandler.dump_traceback_later(120, exit=True)  # a hung run: its stacks, then the exit
            res = generate(stepper, prompt, a.new, draft=d, spec_width=sw)
            faulthandler.cancel_dump_traceback_later()
            diff = next((i for i, (x, y) in enumerate(zip(res.tokens, ar.tokens)) if x != y), None)
            sp = res.speculative
            row = {"mode": "spec", "alpha": alpha, "width": w, "tok_s": res.decode_tokens_per_s,
                   "tokens_per_step": sp["tokens_per_step"], "acceptance": sp["acceptance_by_depth"],
                   "widths": sp["widths"], "same_as_ar": diff is None, "first_diff": diff,
                   "speedup": res.decode_tokens_per_s / ar.decode_tokens_per_s, "policy": sp.get("policy"),
                   "discarded_drafts": sp.get("discarded_drafts"), "calibration": sp.get("calibration")}
            rows.append(row)
            row["host_ms_per_step"] = sp["ms_per_verify_step"]
            row["verify_ms_by_width"] = sp.get("verify_ms_by_width")
            host = ", ".join(f"{k} {v:.3f}" for k, v in sp["ms_per_verify_step"].items())
            print(f"alpha {alpha:.1f} width {w!s:>6s}: {row['tok_s']:7.1f} tokens/s ({row['speedup']:.2f}x AR), "
                  f"{row['tokens_per_step']:.2f} tokens/step, widths {sp['widths']}, same as AR: {diff is None}"
                  f"{'' if diff is None else f' (first difference at {diff})'}; ms per step: {host}"
                  + (f"; measured verify ms {sp['verify_ms_by_width']}" if str(w).startswith("auto") else ""),
                  flush=True)
    costs = rollback_costs(step, prompt)
    for w, c in costs.items():
        print(f"rollback q={w}: verify {c['verify_ms']:.3f} ms, rollback {c['rollback_ms'] * 1e3:.1f} us "
              f"({100 * c['ratio']:.1f}% of the verify)", flush=True)
    # the table
    cols = [w for w, _ in runs]
    print("\n| ALPHA | " + " | ".join(f"q={w}" if isinstance(w, int) else str(w) for w in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for alpha in [float(x) for x in a.alphas.split(",")]:
        cells = []
        for w in cols:
            r = next(r for r in rows if r["alpha"] == alpha and r["width"] == w)
            cells.append(f"{r['tok_s']:.0f} ({r['speedup']:.2f}x)")
        print(f"| {alpha:.1f} | " + " | ".join(cells) + " |")
    print(f"AR (host-free device sampling): {ar.decode_tokens_per_s:.0f} tokens/s")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "rollback": costs, "prompt": a.prompt, "new": a.new}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
