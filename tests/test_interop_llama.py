"""Interop with llama.cpp (docs/interop.md), run when ``DS4C_DS4RUN`` names llama.cpp's ``ds4run`` binary
(``../shared/peers/build_llama.sh``, ``CPU_ONLY=1`` on a machine without a GPU): a ds4c-made ``tiny-128`` model
(compress ratios 0, 4, 128; F32 weights) loads in llama.cpp unchanged and its greedy tokens equal ds4c's (quant
emulation off, fp32 dataflow) for at least 64 tokens past the first ratio-128 flush, with the prompt token by
token and batched; the teacher-forced logits agree to fp32 roundoff."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DS4RUN = os.environ.get("DS4C_DS4RUN")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.interop,
              pytest.mark.skipif(not DS4RUN, reason="set DS4C_DS4RUN to llama.cpp's ds4run to run the interop test")]


def test_ds4c_model_runs_in_llama_cpp_with_the_same_greedy_tokens(tmp_path):
    out = tmp_path / "interop.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "interop_llama.py"), "--ds4run", DS4RUN,
                        "--workdir", str(tmp_path), "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["agree"] and rec["last_position"] >= rec["flush_position"] + 64
    for run in rec["llama.cpp"].values():
        assert run["first_diff"] is None or len(rec["prompt"]) + run["first_diff"] - 1 - rec["flush_position"] >= 64
    f = rec["teacher_forced_logits_rel_l2"]
    # F32 weights: neither engine rounds anything but fp32 sums, so the logits agree to fp32 roundoff (measured
    # 4e-7), four orders below the bf16 dataflow's own rounding floor (5e-3)
    assert rec["formats"] == "f32"
    assert f["llama_vs_ds4c_fp32"]["max"] < 1e-5 < 1e-3 < f["ds4c_bf16_vs_fp32"]["median"]
    assert f["llama_vs_ds4c_fp32"]["argmax_agree"] == 1.0
