#!/usr/bin/env python3
"""Run every kernel family's GPU check (tests/gpu_checks/<family>.py) on a CUDA machine and print one table.

Each check renders its kernels, compiles them with nvcc for the given arch, launches them through
ds4c.runtime.launch on fresh random inputs with NaN-poisoned outputs, compares with the family's CPU
reference by relative error, and times them with CUDA events. The pass/fail of the same checks is
``pytest -m gpu tests/test_gpu_kernels.py``; this is the timing table (and a JSON of every row). Usage:

    python tests/gpu_checks [--arch sm_90] [--only gemv,attention,hc] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as ``python tests/gpu_checks``: tests/, for gpu_checks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_checks import FAMILIES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", default=",".join(FAMILIES))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows, failed = [], []
    for fam in [f for f in a.only.split(",") if f]:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"gpu_checks.{fam}")
            res = mod.run(arch=a.arch)
        except Exception:  # report and go on with the other families
            traceback.print_exc()
            failed.append(fam)
            continue
        for r in res:
            r.setdefault("family", fam)
        rows += res
        print(f"[{fam}] {len(res)} checks in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    print(f"{'family':10s} {'ok':3s} {'rel_err':>9s} {'us':>9s} {'GB/s':>8s}  spec")
    for r in rows:
        print(f"{r['family']:10s} {'yes' if r.get('ok') else 'NO ':3s} {r.get('rel_err', float('nan')):9.2e} "
              f"{r.get('us', float('nan')):9.1f} {r.get('GBps', float('nan')):8.1f}  {r.get('spec', '')}")
    bad = [r for r in rows if not r.get("ok")]
    print(f"RESULT {'PASS' if not bad and not failed else 'FAIL'}: {len(rows) - len(bad)}/{len(rows)} ok"
          + (f"; families that crashed: {failed}" if failed else ""))
    return 0 if not bad and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
