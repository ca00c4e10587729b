#!/usr/bin/env bash
# Batched prefill on the device (issue 12), in stages (comma list, default all):
#   tests    pytest -m gpu tests/test_prefill_exec.py (chunk graphs against token-wise decoding on tiny)
#   kernels  tools/gpu_kernel_check.py --only gemm,moe_gemm (actq warp layout, dense / fused-combine moe_gemm)
#   bench    ds4c bench synthetic:flash-l4 --prefill 4096 (chunks vs verify steps, logits agreement, roofline)
#   llama    ds4c bench FILE --prefill 4096,32768 --llama-bench (llama.cpp's pp on the same file, same run)
# llama.cpp (.peers/build_llama.sh, ~5 min) and the flash-l4 GGUF (make-model) are started in the background
# first (setsid: they outlive a call while the machine stays warm), so that a later call's llama stage finds them.
# The llama stage needs ../shared/peers/{build_llama.sh,llama.cpp-src.tar.xz} copied into .peers/ (git-ignored;
# name it in the device call's carry).
# usage: tools/gpu_prefill_run.sh OUTDIR [STAGES]
set -uo pipefail
OUT=${1:?usage: gpu_prefill_run.sh OUTDIR [STAGES]}
STAGES=",${2:-tests,kernels,bench,llama},"
mkdir -p "$OUT"
export DS4C_CACHE=${DS4C_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
LB=/tmp/llama-build/build/bin/llama-bench
M=${MODEL:-/tmp/fl4.gguf}
if [[ $STAGES == *,llama,* ]]; then
  if [ ! -x $LB ] && [ ! -f /tmp/llama-build.started ]; then
    touch /tmp/llama-build.started
    JOBS=${LLAMA_JOBS:-8} setsid nohup bash .peers/build_llama.sh "$PWD/.peers/llama.cpp-src.tar.xz" /tmp/llama-build \
        > /tmp/llama-build.log 2>&1 < /dev/null &
  fi
  if [ ! -f "$M" ] && [ ! -f /tmp/make-model.started ]; then
    touch /tmp/make-model.started
    setsid nohup ds4c make-model --preset flash-l4 --formats official -o "$M" > /tmp/make-model.log 2>&1 < /dev/null &
  fi
fi
t() { echo "== $1: $(( $(date +%s) - T0 )) s"; }
T0=$(date +%s)
if [[ $STAGES == *,tests,* ]]; then
  timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu -rs tests/test_prefill_exec.py > "$OUT/prefill-tests.log" 2>&1
  echo "tests rc $?"; grep -E "passed|failed|Error|assert" "$OUT/prefill-tests.log" | tail -15; t tests
fi
if [[ $STAGES == *,kernels,* ]]; then
  timeout ${KERNELS_S:-240} python3 tools/gpu_kernel_check.py --only gemm,moe_gemm --json "$OUT/kcheck.json" \
      > "$OUT/kcheck.log" 2>&1
  echo "kernels rc $?"; grep -E "^(gemm|moe_gemm) |RESULT|Error" "$OUT/kcheck.log" | tail -40; t kernels
fi
if [[ $STAGES == *,bench,* ]]; then
  timeout ${BENCH_S:-300} ds4c bench synthetic:flash-l4 --device cuda --prefill ${LENGTHS:-4096} \
      --json "$OUT/prefill-bench.json" > "$OUT/prefill-bench.log" 2>&1
  echo "bench rc $?"; tail -8 "$OUT/prefill-bench.log"; t bench
fi
if [[ $STAGES == *,llama,* ]]; then
  for i in $(seq 1 ${WAIT_S:-400}); do [ -x $LB ] && [ -f "$M" ] && break; sleep 1; done
  [ -x $LB ] || { echo "llama-bench not built yet:"; tail -3 /tmp/llama-build.log; }
  [ -f "$M" ] || { echo "model file not made yet:"; tail -3 /tmp/make-model.log; }
  if [ -x $LB ] && [ -f "$M" ]; then
    timeout ${LLAMA_S:-500} ds4c bench "$M" --device cuda --prefill ${LLAMA_LENGTHS:-4096,32768} --llama-bench $LB \
        --json "$OUT/prefill-llama.json" > "$OUT/prefill-llama.log" 2>&1
    echo "llama rc $?"; tail -8 "$OUT/prefill-llama.log"
  fi
  t llama
fi
