#!/usr/bin/env bash
# Programmatic dependent launch on and off (DS4C_PDL), the same artifact, one call (docs/perf.md):
#   1. the compiled step against the reference with PDL on (tiny: teacher-forced widths 5/1/3, rollback, bench);
#   2. ds4c compile synthetic:flash-l4 once, then ds4c bench q=1,5 at 4096 with DS4C_PDL=1 and DS4C_PDL=0.
# usage: tools/gpu_launch_ab.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: gpu_launch_ab.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
M=${MODEL:-synthetic:flash-l4}
timeout 120 python3 -m pytest -q tests/test_compiled_step.py -p no:cacheprovider -rfE \
    -k "teacher or rollback or bench or two_requests" > "$OUT/pytest.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -8
A=/tmp/ds4c-ab-art
/usr/bin/time -f "compile %e s" ds4c compile "$M" --arch sm_90 --max-ctx 4096 -o $A > "$OUT/compile.log" 2>&1
echo "compile rc $?"; grep -E "binaries|seconds|compile " "$OUT/compile.log"
i=0
for pdl in 1 0 1; do  # on, off, on again (DS4C_PDL=1 opts in): the run-to-run spread next to the difference
  i=$((i + 1))
  DS4C_PDL=$pdl timeout 60 ds4c bench "$M" --widths 1,5 --ctx 4096 --artifact $A --no-reference --no-generate \
      --compile-modes none --no-transformers --repeats 50 --json "$OUT/bench-$i-pdl$pdl.json" \
      > "$OUT/bench-$i-pdl$pdl.log" 2> "$OUT/bench-$i-pdl$pdl.err"
  echo "bench DS4C_PDL=$pdl rc $?"; grep -E "^q=|artifact loaded|Error" "$OUT/bench-$i-pdl$pdl.err" | cut -c1-200
done
