#!/usr/bin/env bash
# The experts cp.async ring on the H200 (docs/perf.md "Optimisation 5"), one call:
#   1. the experts kernel check (every format and engine; the ring against the register path, same run);
#   2. pytest -m gpu tests (the whole GPU suite: the compiled steps run the new kernels);
#   3. ds4c bench synthetic:flash-l4 q = 1, 5 at 4096 (the command of Optimisations 2 and 3).
# usage: tools/gpu_xp_ring_run.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: gpu_xp_ring_run.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
M=${MODEL:-synthetic:flash-l4}
timeout 150 python3 tools/gpu_kernel_check.py --only experts --json "$OUT/experts.json" > "$OUT/experts.log" 2>&1
echo "experts rc $?"; grep -E "RESULT|rror|^experts +NO" "$OUT/experts.log" | head -8
grep -E "^  official (mma|simt)  q=[15] " "$OUT/experts.log" | cut -c1-150
grep -E "^  official mma  q=[15] routed" "$OUT/experts.log" | cut -c1-150
if [ -z "${SKIP_PYTEST:-}" ]; then
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests -p no:cacheprovider -rfE > "$OUT/pytest-gpu.log" 2>&1
  echo "pytest rc $?"; grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest-gpu.log" | tail -12
fi
A=/tmp/ds4c-ring-art
/usr/bin/time -f "compile %e s" ds4c compile "$M" --arch sm_90 --max-ctx 4096 -o $A > "$OUT/compile.log" 2>&1
echo "compile rc $?"; grep -E "seconds|compile " "$OUT/compile.log" | tail -2
timeout 90 ds4c bench "$M" --widths 1,5 --ctx 4096 --artifact $A --no-reference --no-generate \
    --compile-modes none --no-transformers --repeats 50 --json "$OUT/bench.json" > "$OUT/bench.log" 2> "$OUT/bench.err"
echo "bench rc $?"; grep -E "^q=|artifact loaded|rror" "$OUT/bench.err" | cut -c1-200; grep -E "^\| *[15] " "$OUT/bench.log" | head -4
grep -E "experts|gemv" "$OUT/bench.log" | head -6
