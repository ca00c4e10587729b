#!/usr/bin/env bash
# What the device owes since session 6 (docs/gpu-validation.md), in two calls that fit the 10-minute limit:
#   tools/gpu_kquant_run.sh checks OUTDIR   pytest -m gpu (K-quant compiled steps, synthetic bytes CPU == CUDA),
#                                           the experts and GEMV kernel checks (K-quant cases, timed);
#   tools/gpu_kquant_run.sh flash OUTDIR    the 43-layer flash with Q3_K experts on one H200 (issue 14 part 3):
#                                           ds4c bench --no-reference at 4K and 32K, generate end to end included.
set -uo pipefail
PHASE=${1:?usage: gpu_kquant_run.sh checks|flash OUTDIR}
OUT=${2:?usage: gpu_kquant_run.sh checks|flash OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
case "$PHASE" in
  checks)
    timeout 330 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE > "$OUT/pytest-gpu.log" 2>&1
    echo "pytest rc $?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest-gpu.log" | tail -15
    for fam in experts gemv; do
      timeout 150 python3 tools/gpu_kernel_check.py --only $fam --json "$OUT/$fam.json" > "$OUT/$fam.log" 2>&1
      echo "$fam rc $?"; grep -E "compiled|checks in|RESULT|Error|error" "$OUT/$fam.log" | head -8
      grep -E "^$fam " "$OUT/$fam.log" | grep -iE "NO |q[2-6]_k|iq4|mxfp4|q8_0" | cut -c1-150 | head -60
    done
    ;;
  flash)  # one artifact (cold kernel cache) for both runs; generate end to end at 4K only (32K: minutes of prefill)
    A=/tmp/ds4c-flash-q3k-art
    /usr/bin/time -f "compile %e s" ds4c compile synthetic:flash:q3_k --arch sm_90 --max-ctx 32768 -o $A \
        > "$OUT/compile.log" 2>&1; echo "compile rc $?"; tail -3 "$OUT/compile.log"
    for c in 4096 32768; do
      g=$([ $c = 4096 ] && echo --generate || echo --no-generate)
      timeout 400 ds4c bench synthetic:flash:q3_k --widths 1,5 --ctx $c --artifact $A --no-reference $g \
          --compile-modes none --no-transformers --repeats 30 --json "$OUT/bench-flash-q3k-$c.json" \
          > "$OUT/bench-flash-q3k-$c.log" 2> "$OUT/bench-flash-q3k-$c.err"
      echo "bench $c rc $?"; grep -vE "^ +|Traceback" "$OUT/bench-flash-q3k-$c.err" | tail -8; cat "$OUT/bench-flash-q3k-$c.log"
    done
    ;;
esac
