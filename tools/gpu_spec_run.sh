#!/usr/bin/env bash
# Speculative decoding on the H200 (issue: speculative decoding), one call: the GPU tests of the compiled step's
# device-side acceptance, the pipelined loop and the DSpark taps, then the tokens/s-vs-ALPHA table on
# synthetic:flash-l4 with the A/B columns (tools/spec_table.py --host-accept-ab).
# usage: tools/gpu_spec_run.sh OUTDIR [MODEL]
set -uo pipefail
OUT=${1:?usage: gpu_spec_run.sh OUTDIR [MODEL]}
M=${2:-synthetic:flash-l4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rfE tests/test_compiled_step.py \
    tests/test_generation_loop.py ${EXTRA_TESTS:-} -k "${TEST_K:-verify_greedy or rollback or speculative or teacher or pipelined}" \
    > "$OUT/pytest-spec.log" 2>&1
echo "pytest rc $?"; grep -E "passed|failed|FAILED|Error" "$OUT/pytest-spec.log" | tail -12
timeout ${SPEC_TIMEOUT:-330} python3 tools/spec_table.py "$M" --prompt 512 --new 256 --alphas 0.5,0.7,0.8,0.9 \
    --host-accept-ab --json "$OUT/spec-table.json" > "$OUT/spec-table.log" 2>&1
echo "spec_table rc $?"; tail -16 "$OUT/spec-table.log"
