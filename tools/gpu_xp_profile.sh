#!/usr/bin/env bash
# Where the experts kernel's time goes (issue 14, and the q = 5 verify behind issue 13's 1.5x), one call:
# the experts / GEMV / tap kernel checks (per phase up / down, timed from HBM), then Nsight Compute on the
# official MXFP4 + Q8_0 experts at q = 1 and q = 5 (both phases: throughput, occupancy, warp stall reasons),
# then the compiled DSpark drafter's per-step cost on flash-l4 (tools/dspark_time.py, no files).
# usage: tools/gpu_xp_profile.sh OUTDIR
set -uo pipefail
OUT=${1:?usage: gpu_xp_profile.sh OUTDIR}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
timeout ${CHECK_TIMEOUT:-200} python3 tools/gpu_kernel_check.py --only ${FAMS:-experts,gemv,tap} --json "$OUT/kc.json" \
    > "$OUT/kernel-check.log" 2>&1
echo "kernel check rc $?"; grep -E "RESULT|Error|error|^(experts|gemv|tap) +NO" "$OUT/kernel-check.log" | head -12
grep -E "^  official (mma|simt)  q=[15] " "$OUT/kernel-check.log" | grep -v routed | cut -c1-140
grep -E "iq4_xs" "$OUT/kernel-check.log" | cut -c1-150 | head -8
# Nsight Compute: the first two launches of each case are its correctness launches (up, down)
if command -v ncu >/dev/null; then
  # one ncu run per width (the first two launches of a case are its correctness launches: up, down), with the
  # warp stall reasons per issued instruction (what the latency-bound phases wait on)
  for q in 1 5; do
    DS4C_XP_CASES="official mma  q=$q\$" timeout ${NCU_TIMEOUT:-150} ncu --clock-control none \
        -k regex:"xp_q${q}_d4096_f2048_k6_e256_mxfp4_q8_0_mma" --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python3 tools/gpu_checks/experts.py >> "$OUT/ncu-experts.log" 2>&1
    echo "ncu q=$q rc $?"
  done
  grep -E "xp_q|issue_stalled" "$OUT/ncu-experts.log" | awk '$NF+0 > 0.3 || /xp_q/' | cut -c1-120 | head -60
  grep -E "xp_q|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|L2 Hit|Block Limit" \
      "$OUT/ncu-experts.log" | cut -c1-120 | head -80
else
  echo "no ncu"
fi
timeout ${DSPARK_TIMEOUT:-200} python3 tools/dspark_time.py --gguf synthetic:flash-l4 --drafter dspark:synthetic:flash-l4 \
    > "$OUT/dspark-time.log" 2>&1
echo "dspark_time rc $?"; tail -25 "$OUT/dspark-time.log"
