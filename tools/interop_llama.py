#!/usr/bin/env python3
"""Run one ds4c-made GGUF in ds4c and in llama.cpp and compare greedy tokens and logits (docs/interop.md).

Writes the model with ``ds4c make-model`` (default preset ``tiny-128``: ratios 0, 4 and 128, the ones llama.cpp
accepts), tokenizes the prompt with the file's tokenizer, then:

1. ds4c greedy decoding on the CPU reference with quant emulation off and the fp32 dataflow (activations
   not rounded to bf16 between operations, as llama.cpp keeps them; prefill as verify steps of width 5, then
   q = 1 decodes), keeping the fp32 logits of every step;
2. llama.cpp's ``ds4run`` (built by ``../shared/peers/build_llama.sh``) greedy from the same ids, token by token
   (``--batch 1``) and with the prompt in one batch;
3. ``ds4run --force`` with ds4c's tokens (teacher forcing) and ``--logits``: per-step logits of llama.cpp on the
   same positions, compared by relative L2 error and argmax agreement with ds4c's in both dataflows, and the
   spec's bf16 dataflow against the fp32 one (the rounding noise floor between two valid implementations).

Prints a short table and writes a JSON record (``--out``). Exit 0 when the greedy tokens agree for at least
``--need-past`` tokens past the first ratio-128 flush (position 128) in both llama.cpp runs, 1 otherwise.

usage: tools/interop_llama.py --ds4run /tmp/llama-build/build/bin/ds4run [--preset tiny-128] [--seed 0]
       [--prompt TEXT] [--n-new 200] [--workdir /tmp/ds4c-interop] [--out interop.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ds4c.config import preset
from ds4c.engine import open_engine
from ds4c.errors import Ds4cError
from ds4c.sources import open_model
from ds4c.reference import MAX_WIDTH
from ds4c.synth import make_model
from ds4c.tokenizer import Tokenizer

DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog. DeepSeek-V4 compresses its KV cache: every fourth "
                  "position for CSA layers, every 128th for HCA layers.")


def ds4c_greedy(path: Path, prompt: list[int], n_new: int, max_ctx: int, dataflow: str,
                force: list[int] | None = None) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens (or the ``force``d ones) and the fp32 logits ``[n_new, V]`` of each step (step 0 = after
    the prompt), on the CPU reference with quant emulation off and the given dataflow."""
    mf = open_model(path)
    ref = open_engine(mf, "cpu", "reference", max_ctx=max_ctx, quant_emulation=False, dataflow=dataflow)
    t0 = time.perf_counter()
    ref.reset()
    for s in range(0, len(prompt), MAX_WIDTH):
        logits = ref.verify(prompt[s:s + MAX_WIDTH], s)[-1]
    toks, rows = [], []
    for i in range(n_new):
        rows.append(logits.float().cpu().numpy().reshape(-1))
        toks.append(int(torch.argmax(logits)) if force is None else force[i])
        if i + 1 < n_new:
            logits = ref.decode(toks[-1], len(prompt) + i).reshape(-1)
    return toks, np.stack(rows), time.perf_counter() - t0


def ds4run(exe: str, path: Path, prompt: list[int], n_new: int, ctx: int, batch: int, threads: int,
           force: list[int] | None = None, logits: Path | None = None) -> tuple[dict, float, list[str]]:
    cmd = [exe, str(path), "--prompt", ",".join(map(str, prompt)), "--n-new", str(n_new), "--ctx", str(ctx),
           "--batch", str(batch), "--threads", str(threads), "--type-k", "f32", "--quiet"]
    if force is not None:
        cmd += ["--force", ",".join(map(str, force))]
    if logits is not None:
        cmd += ["--logits", str(logits)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"interop: ds4run failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1]
    return json.loads(line), dt, cmd


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ds4run", required=True)
    ap.add_argument("--preset", default="tiny-128")
    ap.add_argument("--model", default=None, help="run this GGUF instead of writing one with make-model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default="f32", choices=["official", "bf16", "f32"],
                    help="make-model --formats (f32: no activation quantization in llama.cpp's products)")
    ap.add_argument("--index-topk", type=int, default=None,
                    help="override the preset's indexer top-k (>= the compressed blocks: the indexer selects all)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--n-new", type=int, default=200)
    ap.add_argument("--need-past", type=int, default=64, help="tokens that must agree past position 128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/ds4c-interop")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not (os.path.isfile(a.ds4run) and os.access(a.ds4run, os.X_OK)):
        sys.exit(f"interop: --ds4run {a.ds4run}: expected llama.cpp's ds4run executable "
                 f"(../shared/peers/build_llama.sh builds it), found {'a directory' if os.path.isdir(a.ds4run) else 'no executable file'}")

    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if a.model:
        path = Path(a.model)
        try:
            cfg = open_model(path).config
        except Ds4cError as e:
            sys.exit(f"interop: {e}")
    else:
        cfg = preset(a.preset)
        if a.index_topk is not None:
            cfg = cfg.replace(index_topk=a.index_topk)
        path = work / f"{a.preset}-s{a.seed}-{a.formats}{'' if a.index_topk is None else f'-k{a.index_topk}'}.gguf"
        make_model(cfg, path, seed=a.seed, formats=a.formats)
    tok = Tokenizer.from_metadata(open_model(path).metadata)
    prompt = tok.encode(a.prompt)
    n_pos = len(prompt) + a.n_new
    flush = max(cfg.compress_ratios[: cfg.n_layers])
    if n_pos - 1 < flush + a.need_past:
        sys.exit(f"interop: prompt ({len(prompt)}) + n-new ({a.n_new}) reaches position {n_pos - 1}, expected at "
                 f"least {flush + a.need_past} ({a.need_past} past the first ratio-{flush} flush)")
    ctx = 1 << (n_pos + 8).bit_length()

    ours, our_logits, t_ours = ds4c_greedy(path, prompt, a.n_new, ctx, "fp32")
    runs = {}
    for label, batch in (("token by token", 1), ("prompt batched", len(prompt))):
        rec, dt, cmd = ds4run(a.ds4run, path, prompt, a.n_new, ctx, batch, a.threads)
        d = first_diff(ours, rec["tokens"])
        runs[label] = {"tokens": rec["tokens"], "first_diff": d, "s": dt, "cmd": " ".join(cmd)}
    lg = work / "llama-forced.f32"
    _rec, _dt, fcmd = ds4run(a.ds4run, path, prompt, a.n_new, ctx, 1, a.threads, force=ours, logits=lg)
    theirs = np.fromfile(lg, dtype=np.float32).reshape(-1, our_logits.shape[1])[: a.n_new]
    _bt, bf16_logits, t_bf16 = ds4c_greedy(path, prompt, a.n_new, ctx, "bf16", force=ours)

    def rel(x: np.ndarray, y: np.ndarray) -> dict:
        r = np.linalg.norm(x - y, axis=1) / np.linalg.norm(y, axis=1)
        return {"median": float(np.median(r)), "p90": float(np.quantile(r, 0.9)), "max": float(r.max()),
                "argmax_agree": float(np.mean(x.argmax(1) == y.argmax(1)))}

    # generated token i sits at position len(prompt) + i; count those agreeing past the first flush
    def past_flush(d: int | None) -> int:
        upto = a.n_new if d is None else d
        return max(0, len(prompt) + upto - 1 - flush)

    ok = all(past_flush(r["first_diff"]) >= a.need_past for r in runs.values())
    forced = {"cmd": " ".join(fcmd), "llama_vs_ds4c_fp32": rel(theirs, our_logits),
              "llama_vs_ds4c_bf16": rel(theirs, bf16_logits), "ds4c_bf16_vs_fp32": rel(bf16_logits, our_logits)}
    record = {"model": str(path), "preset": None if a.model else a.preset, "seed": None if a.model else a.seed,
              "formats": None if a.model else a.formats, "index_topk": cfg.index_topk, "config_hash": cfg.hash(),
              "prompt_text": a.prompt, "prompt": prompt, "n_new": a.n_new, "last_position": n_pos - 1,
              "flush_position": flush, "ds4c": {"tokens": ours, "dataflow": "fp32", "s": t_ours},
              "llama.cpp": runs, "teacher_forced_logits_rel_l2": forced, "agree": ok}
    if a.out:
        Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    made = "" if a.model else f" (made: preset {a.preset}, seed {a.seed}, formats {a.formats})"
    print(f"model {path}{made}; prompt {len(prompt)} tokens, "
          f"{a.n_new} new, positions 0..{n_pos - 1}, first ratio-{flush} flush at position {flush}")
    print(f"{'greedy run':<36}{'first differing token':>22}{'agree past flush':>18}{'time s':>8}")
    print(f"{'ds4c reference, no emulation, fp32':<36}{'-':>22}{'-':>18}{t_ours:>8.2f}")
    for label, r in runs.items():
        d = r["first_diff"]
        print(f"{'llama.cpp CPU, ' + label:<36}{'none' if d is None else str(d):>22}{past_flush(d):>18}{r['s']:>8.2f}")
    print(f"{'teacher-forced logits, rel L2':<36}{'median':>10}{'p90':>10}{'max':>10}{'argmax agree':>14}")
    for k, label in (("llama_vs_ds4c_fp32", "llama.cpp vs ds4c fp32 dataflow"),
                     ("llama_vs_ds4c_bf16", "llama.cpp vs ds4c bf16 dataflow"),
                     ("ds4c_bf16_vs_fp32", "ds4c bf16 vs fp32 (noise floor)")):
        f = forced[k]
        print(f"{label:<36}{f['median']:>10.2e}{f['p90']:>10.2e}{f['max']:>10.2e}{f['argmax_agree']:>14.3f}")
    print("(llama.cpp is within fp32 roundoff of ds4c's fp32 dataflow when the first row is ~1e-7, so its distance "
          "to the bf16 dataflow is then the noise floor itself)")
    print("AGREE" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
