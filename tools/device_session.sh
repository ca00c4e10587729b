#!/usr/bin/env bash
# One GPU device session in stages: what past sessions ran (docs/gpu-validation.md, docs/perf.md), as one script.
# Each stage writes its logs and JSON records to OUTDIR and prints a short summary; a stage's failure is reported
# and the next stage still runs (the exit status is the number of stages that failed). Several stages can share
# one call of the device tool: keep the sum of their timeouts under its limit.
#
# usage: tools/device_session.sh STAGE[,STAGE...] [OUTDIR]        (OUTDIR: default $OUT, else ./out)
#
#   tests     pytest -m gpu over TESTS (default tests/: every GPU test, the kernel families included), TEST_K
#             narrows it (-k); ~5-10 min for all of tests/ on an H100 / H200
#   kernels   python tests/gpu_checks --only $FAMS (default every family): the per-family timing table + JSON
#   soak      python tests/gpu_soak.py $SOAK_ARGS (default: tiny from an artifact, a 470 s lockstep budget,
#             resumable through OUTDIR/soak.pt, phase 1 skipped when resuming)
#   compile   ds4c compile $MODEL --max-ctx (the largest of $CTXS) -o $ART: the artifact bench serves from
#   bench     ds4c bench $MODEL q = $WIDTHS at each of $CTXS from $ART (compile first), no reference; once per
#             word of BENCH_ENVS (e.g. "DS4C_PDL=1 DS4C_PDL=0 DS4C_PDL=1": an A/B with the run-to-run spread);
#             GENERATE=1 adds the end-to-end rows
#   generate  $FILE (flash-l4 official, made once) through ds4c generate --device cuda: a 4000-token prompt and
#             512 new tokens, cold then warm kernel cache (start-up, prefill and decode tokens/s, step spread)
#   split     ds4c bench $FILE --layer-split 2,2 (the boundary's cost), then generate unsplit / 2,2 / 1,3: the
#             same greedy tokens and the tokens/s of each
#   spec      tools/spec_table.py $MODEL: tokens/s against ALPHA, fixed widths and auto, host-accept A/B
#   prefill   ds4c bench $MODEL --prefill $LENGTHS $PREFILL_ARGS (chunk graphs vs verify steps, TTFT, the compute
#             roofline), once per word of PREFILL_ENVS (as LANE_ENVS; e.g. "DS4C_PREFILL_ATTN_MMA=0 -": an A/B)
#   chunkprof tools/gpu_step_profile.py --prefill $CHUNK (2048) at pos $CHUNK_POS (2048; the graph is built for
#             CHUNK_CTX, default 4096, raised to hold the chunk): every launch of one chunk timed alone, by family,
#             once per word of PREFILL_ENVS
#   llama     ds4c bench $FILE --prefill $LLAMA_LENGTHS --llama-bench: llama.cpp's pp on the same file and GPU;
#             needs .peers/{build_llama.sh,llama.cpp-src.tar.xz} (from ../shared/peers, git-ignored: name .peers
#             in the device call's carry); the build (~5 min) and $FILE start in the background at once
#             (setsid), so a later call on the same warm machine finds them
#   lanes     tools/lanes_gpu.py --model $MODEL --lanes $LANES (default 1,8,16), once per word of LANE_ENVS
#             (default "- DS4C_LANE_BATCH=0 DS4C_LANE_BATCH=0,DS4C_LANE_STREAMS=1": the defaults (merged launches),
#             in order, a stream per lane; "-" = no setting, commas join settings); the runs with a setting also
#             check 8 lanes' rows against each alone
#   lanebench ds4c bench $MODEL --device cuda --lanes $LANES $LANEBENCH_ARGS (end to end through the batch engine),
#             once per word of LANE_ENVS
#   profile   Nsight Compute on the official MXFP4 experts at q = 1 and 5 (throughput, occupancy, warp stall
#             reasons), then the compiled DSpark drafter's per-step cost (tools/dspark_time.py)
#   ncu       Nsight Compute (throughput, occupancy, stall reasons) on tests/gpu_checks kernels, per word of NCU_SETS
#             (default "prefill kquant"), after a probe that ncu reads this machine's counters (else skipped, as is
#             profile's ncu part): prefill = the grouped experts' up and down (cases NCU_MG, default
#             =flash_c2048,=flash_c2048_bn128, exact names (tests/gpu_checks/moe_gemm.py picked): the
#             64-wide case then its 128-wide twin, both profiled), the chunk attention on tensor cores (CSA), the
#             GEMM launches matching NCU_GEMM (default wq_a and expert_w1 at 4096 rows); kquant = the decode GEMV wq_b in Q3_K and Q8_0 at q = 1 and the Q3_K
#             experts at q = 1 (issue 32: instruction- or latency-bound?)
#
# Settings (environment): MODEL (default synthetic:flash-l4), FILE (/tmp/fl4.gguf), ARCH (sm_90), ART
# (/tmp/ds4c-session-art), CTXS (4096), WIDTHS (1,5), DS4C_CACHE (/tmp/ds4c-kcache: one kernel cache for the
# session), and the per-stage ones named above. Examples:
#   tools/device_session.sh tests,kernels "$OUT"
#   FAMS=experts,gemv tools/device_session.sh kernels,compile,bench "$OUT"
#   MODEL=synthetic:flash:q3_k CTXS=4096,32768 tools/device_session.sh compile,bench "$OUT"
#   BENCH_ENVS="DS4C_PDL=1 DS4C_PDL=0 DS4C_PDL=1" tools/device_session.sh compile,bench "$OUT"
set -uo pipefail
STAGES=${1:?usage: tools/device_session.sh STAGE[,STAGE...] [OUTDIR] (stages: see the head of this script)}
OUTDIR=${2:-${OUT:-out}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache}
MODEL=${MODEL:-synthetic:flash-l4}
FILE=${FILE:-/tmp/fl4.gguf}
ARCH=${ARCH:-sm_90}
ART=${ART:-/tmp/ds4c-session-art}
CTXS=${CTXS:-4096}
WIDTHS=${WIDTHS:-1,5}
LB=/tmp/llama-build/build/bin/llama-bench
FAILED=0
T0=$(date +%s)

say() { echo "== $1 ($(( $(date +%s) - T0 )) s): $2"; }
check() { local rc=$1; say "$2" "rc $rc"; [ "$rc" = 0 ] || FAILED=$((FAILED + 1)); }
make_file() {  # the flash-l4 official file, once per machine
  [ -f "$FILE" ] || /usr/bin/time -f "make-model %e s" ds4c make-model --preset flash-l4 --formats official \
      -o "$FILE" 2>&1 | tail -2
}
ids() {  # N random token ids, the same every session
  python3 -c "import random, sys; random.seed(0)
print(','.join(str(random.randrange(129280)) for _ in range(int(sys.argv[1]))))" "$1"
}
generate_summary() {  # one line from a ds4c generate --json record
  python3 - "$1" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
st = r["step_ms"]
med = statistics.median(st)
print(f"prefill {len(r['prompt'])} tokens {r['prefill_s']:.2f} s ({r['prefill_tokens_per_s']:.0f} tok/s); decode "
      f"{len(r['tokens'])} tokens {r['decode_tokens_per_s']:.1f} tok/s; step median {med:.3f} ms, max {max(st):.3f} "
      f"ms (x{max(st) / med:.2f}); steps > 2x median: {sum(s > 2 * med for s in st)}")
PY
}

stage_tests() {
  timeout "${TESTS_S:-570}" python3 -m pytest -q -m gpu -p no:cacheprovider -rfEs ${TESTS:-tests} \
      ${TEST_K:+-k "$TEST_K"} > "$OUTDIR/pytest-gpu.log" 2>&1
  check $? tests; grep -E "passed|failed|FAILED|ERROR" "$OUTDIR/pytest-gpu.log" | tail -15
}

stage_kernels() {
  timeout "${KERNELS_S:-400}" python3 tests/gpu_checks --arch "$ARCH" ${FAMS:+--only "$FAMS"} \
      --json "$OUTDIR/kernels.json" > "$OUTDIR/kernels.log" 2>&1
  check $? kernels; grep -E "checks in|RESULT|Error|^[a-z_]+ +NO " "$OUTDIR/kernels.log" | head -30
}

stage_soak() {
  local resume=()
  [ -f "$OUTDIR/soak.pt" ] && resume=(--requests 0 --cli-runs 0)
  timeout "${SOAK_S:-560}" python3 tests/gpu_soak.py ${SOAK_ARGS:---model tiny --artifact --time-budget 470} \
      --checkpoint "$OUTDIR/soak.pt" "${resume[@]}" > "$OUTDIR/soak.log" 2>&1
  check $? soak; tail -12 "$OUTDIR/soak.log"
}

tag_of() { local t=${1:-default}; t=${t//=/-}; echo "${t//,/_}"; }  # a file name tag for a setting (the device tool returns no '=')
lane_envs() { echo "${LANE_ENVS:-- DS4C_LANE_BATCH=0 DS4C_LANE_BATCH=0,DS4C_LANE_STREAMS=1}"; }

each_env() {  # each_env "WORDS" FN: FN SETTING TAG once per word ("-" = no setting, commas join settings)
  local e
  for e in $1; do
    [ "$e" = - ] && e=
    "$2" "$e" "$(tag_of "$e")"
  done
}

lanes_one() {
  local check_n=8
  [ -z "$1" ] && check_n=0
  say lanes "${1:-in order}"
  env ${1//,/ } timeout "${LANES_S:-150}" python3 tools/lanes_gpu.py --model "$MODEL" --lanes "${LANES:-1,8,16}" \
      --check "$check_n" --beside 0 --steps 48 --json "$OUTDIR/lanes-$2.json" > "$OUTDIR/lanes-$2.log" 2>&1
  check $? "lanes ${1:-in order}"; tail -8 "$OUTDIR/lanes-$2.log"
}
stage_lanes() { each_env "$(lane_envs)" lanes_one; }

lanebench_one() {
  env ${1//,/ } timeout "${LANEBENCH_S:-280}" ds4c bench "$MODEL" --device cuda --lanes "${LANES:-1,8,16}" \
      ${LANEBENCH_ARGS:-} --json "$OUTDIR/lanebench-$2.json" > "$OUTDIR/lanebench-$2.log" 2>&1
  check $? "lanebench ${1:-in order}"; tail -9 "$OUTDIR/lanebench-$2.log"
}
stage_lanebench() { each_env "$(lane_envs)" lanebench_one; }

stage_compile() {
  local max_ctx
  max_ctx=$(tr ',' '\n' <<< "$CTXS" | sort -n | tail -1)
  /usr/bin/time -f "compile %e s" ds4c compile "$MODEL" --arch "$ARCH" --max-ctx "$max_ctx" -o "$ART" \
      > "$OUTDIR/compile.log" 2>&1
  check $? compile; tail -3 "$OUTDIR/compile.log"
}

stage_bench() {
  local envs=(${BENCH_ENVS:-""}) i=0 c e tag
  [ ${#envs[@]} = 0 ] && envs=("")
  for c in ${CTXS//,/ }; do
    for e in "${envs[@]}"; do
      i=$((i + 1)); tag="bench-$i-c$c${e:+-${e//[^A-Za-z0-9]/_}}"
      env $e timeout "${BENCH_S:-300}" ds4c bench "$MODEL" --widths "$WIDTHS" --ctx "$c" --artifact "$ART" \
          --no-reference $([ "${GENERATE:-0}" = 1 ] && echo --generate || echo --no-generate) \
          --compile-modes none --no-transformers --repeats "${REPEATS:-50}" --json "$OUTDIR/$tag.json" \
          > "$OUTDIR/$tag.log" 2> "$OUTDIR/$tag.err"
      check $? "bench ctx $c ${e:-}"; grep -E "^q=|artifact loaded|rror" "$OUTDIR/$tag.err" | cut -c1-200
      cat "$OUTDIR/$tag.log"
    done
  done
}

stage_generate() {
  make_file
  local run prompt cache=/tmp/ds4c-kcache-generate-$$  # its own cache: the first run starts cold
  prompt=$(ids 4000)
  for run in cold warm; do
    DS4C_CACHE=$cache /usr/bin/time -f "$run generate wall %e s" ds4c generate "$FILE" --device cuda \
        --prompt-ids "$prompt" --max-new-tokens 512 --ignore-eos --json \
        > "$OUTDIR/generate-$run.json" 2> "$OUTDIR/generate-$run.err"
    check $? "generate $run"; grep -E "ready:|wall|kernels" "$OUTDIR/generate-$run.err" | tail -3
    generate_summary "$OUTDIR/generate-$run.json"
  done
}

stage_split() {
  make_file
  ds4c bench "$FILE" --device cuda --widths "$WIDTHS" --ctx 4096 --compile-modes none --no-transformers \
      --ref-repeats 1 --repeats 50 --layer-split 2,2 --json "$OUTDIR/bench-split.json" > "$OUTDIR/bench-split.log" 2>&1
  check $? "split bench"; grep -A4 "^layer split" "$OUTDIR/bench-split.log"
  local prompt split opt
  prompt=$(ids 1000)
  for split in none 2-2 1-3; do
    opt=(); [ "$split" = none ] || opt=(--layer-split "${split/-/,}")
    ds4c generate "$FILE" --device cuda --prompt-ids "$prompt" --max-new-tokens 256 --ignore-eos --json "${opt[@]}" \
        > "$OUTDIR/generate-split-$split.json" 2> "$OUTDIR/generate-split-$split.err"
    check $? "split generate $split"; generate_summary "$OUTDIR/generate-split-$split.json"
  done
  python3 - "$OUTDIR" <<'PY'
import json, sys
recs = {s: json.load(open(f"{sys.argv[1]}/generate-split-{s}.json"))["tokens"] for s in ("none", "2-2", "1-3")}
print("split tokens equal the unsplit tokens:", {s: t == recs["none"] for s, t in recs.items()})
PY
}

stage_spec() {
  timeout "${SPEC_S:-330}" python3 tools/spec_table.py "$MODEL" --prompt 512 --new 256 --alphas 0.5,0.7,0.8,0.9 \
      --host-accept-ab --json "$OUTDIR/spec-table.json" > "$OUTDIR/spec-table.log" 2>&1
  check $? spec; tail -16 "$OUTDIR/spec-table.log"
}

prefill_one() {
  env ${1//,/ } timeout "${PREFILL_S:-300}" ds4c bench "$MODEL" --device cuda --prefill "${LENGTHS:-4096}" \
      ${PREFILL_ARGS:-} --json "$OUTDIR/prefill-bench-$2.json" > "$OUTDIR/prefill-bench-$2.log" 2>&1
  check $? "prefill ${1:-defaults}"; tail -8 "$OUTDIR/prefill-bench-$2.log"
}
stage_prefill() { each_env "${PREFILL_ENVS:--}" prefill_one; }  # PREFILL_ENVS: settings per run, as LANE_ENVS

chunkprof_one() {  # every launch of one chunk (CHUNK rows at CHUNK_POS) timed alone
  local pos=${CHUNK_POS:-2048} ctx=${CHUNK_CTX:-4096}
  [ $((pos + ${CHUNK:-2048})) -le "$ctx" ] || ctx=$((pos + ${CHUNK:-2048}))
  env ${1//,/ } timeout "${CHUNKPROF_S:-300}" python3 tools/gpu_step_profile.py --model flash-l4 --gguf "$MODEL" \
      --widths 5 --pos "$pos" --max-ctx "$ctx" --prefill "${CHUNK:-2048}" > "$OUTDIR/chunkprof-$2.log" 2>&1
  check $? "chunk profile ${1:-defaults}"; grep -iE "family|attention|moe_gemm|gemm|compressor|sum|total" \
      "$OUTDIR/chunkprof-$2.log" | tail -14
}
stage_chunkprof() { each_env "${PREFILL_ENVS:--}" chunkprof_one; }

start_llama_build() {  # llama.cpp and the model file in the background: they outlive a call on a warm machine
  if [ ! -x $LB ] && [ ! -f /tmp/llama-build.started ]; then
    touch /tmp/llama-build.started
    JOBS=${LLAMA_JOBS:-8} setsid nohup bash .peers/build_llama.sh "$PWD/.peers/llama.cpp-src.tar.xz" \
        /tmp/llama-build > /tmp/llama-build.log 2>&1 < /dev/null &
  fi
  if [ ! -f "$FILE" ] && [ ! -f /tmp/make-model.started ]; then
    touch /tmp/make-model.started
    setsid nohup ds4c make-model --preset flash-l4 --formats official -o "$FILE" > /tmp/make-model.log 2>&1 \
        < /dev/null &
  fi
}

stage_llama() {
  local i
  for i in $(seq 1 "${WAIT_S:-400}"); do [ -x $LB ] && [ -f "$FILE" ] && break; sleep 1; done
  [ -x $LB ] || { echo "llama-bench not built yet:"; tail -3 /tmp/llama-build.log; }
  [ -f "$FILE" ] || { echo "model file not made yet:"; tail -3 /tmp/make-model.log; }
  if [ -x $LB ] && [ -f "$FILE" ]; then
    timeout "${LLAMA_S:-500}" ds4c bench "$FILE" --device cuda --prefill "${LLAMA_LENGTHS:-4096,32768}" \
        --llama-bench $LB --json "$OUTDIR/prefill-llama.json" > "$OUTDIR/prefill-llama.log" 2>&1
    check $? llama; tail -8 "$OUTDIR/prefill-llama.log"
  else
    check 1 llama
  fi
}

ncu_run() {  # ncu_run LOG KERNEL_REGEX LAUNCHES CMD...: Nsight Compute's throughput, occupancy and stall reasons
  timeout "${NCU_S:-150}" ncu --clock-control none -k regex:"$2" --launch-count "$3" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section SchedulerStats --section LaunchStats \
      --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' "${@:4}" >> "$1" 2>&1
}
ncu_summary() {  # per kernel of an ncu log: its name, then the headline rows and the stall reasons above 0.3
  grep -E "^  [A-Za-z_0-9]+.*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Achieved \
Occupancy|Registers Per|Issued Ipc|issue_stalled" "$1" | awk '!/issue_stalled/ || $NF+0 > 0.3' | cut -c1-120 | head -${2:-80}
}

stage_profile() {
  local q
  if has_counters; then
    for q in 1 5; do  # the first two launches of a case are its correctness launches (up, down)
      DS4C_XP_CASES="official mma  q=$q\$" ncu_run "$OUTDIR/ncu-experts.log" "xp_q${q}_d4096_f2048_k6_e256_mxfp4_q8_0_mma" 2 \
          python3 tests/gpu_checks/experts.py --arch "$ARCH"
      check $? "ncu q=$q"
    done
    ncu_summary "$OUTDIR/ncu-experts.log" 60
  fi
  timeout "${DSPARK_S:-200}" python3 tools/dspark_time.py --gguf "$MODEL" --drafter "dspark:$MODEL" --arch "$ARCH" \
      > "$OUTDIR/dspark-time.log" 2>&1
  check $? dspark_time; tail -25 "$OUTDIR/dspark-time.log"
}

ncu_prefill() {  # the prefill chunk's big kernels: grouped experts (up, down), chunk attention (MMA, CSA), GEMMs
  DS4C_MG_CASES=${NCU_MG:-=flash_c2048,=flash_c2048_bn128} ncu_run "$1" "mg_.*_(up|down)" 4 \
      python3 tests/gpu_checks --arch "$ARCH" --only moe_gemm
  check $? "ncu moe_gemm"
  ncu_run "$1" "ca_prefill.*csa.*" 1 python3 tests/gpu_checks --arch "$ARCH" --only attention
  check $? "ncu chunk attention"
  ncu_run "$1" "${NCU_GEMM:-gemm_(wq_a|expert_w1)_c4096$}" 2 python3 tests/gpu_checks --arch "$ARCH" --only gemm
  check $? "ncu gemm"
}
ncu_kquant() {  # the decode step's K-quant kernels (issue 32): GEMV wq_b in Q3_K against Q8_0, Q3_K experts at q = 1
  ncu_run "$1" "gemv_wq_b(_q3_k)?_q1$" 2 python3 tests/gpu_checks --arch "$ARCH" --only gemv
  check $? "ncu gemv"
  DS4C_XP_CASES="official mma  q=1 routed q3_k" ncu_run "$1" "xp_q1_.*q3_k.*mma" 2 \
      python3 tests/gpu_checks/experts.py --arch "$ARCH"
  check $? "ncu experts q3_k"
}
has_counters() {  # whether Nsight Compute reads this machine's hardware counters: a probe on one small kernel (device
  # KINDS.md: it does on Firecracker machines, not on gVisor ones; on 2026-12-07 an H100 segfaulted in ncu with "No
  # kernels were profiled" and the runtime was not printed, so probe rather than guess from the kernel name)
  command -v ncu > /dev/null || { echo "no ncu on this machine"; return 1; }
  local probe
  probe=$(timeout "${NCU_PROBE_S:-90}" ncu --clock-control none --launch-count 1 --metrics sm__cycles_elapsed.avg \
      python3 -c "import torch; x = torch.ones(1024, device='cuda'); print(float((x + 1).sum()))" 2>&1)
  if [ $? -ne 0 ] || ! grep -q "sm__cycles_elapsed.avg" <<< "$probe"; then
    echo "ncu reads no hardware counters here (kernel $(uname -r)); its probe said:"; tail -3 <<< "$probe"
    return 1
  fi
  echo "ncu reads the counters (kernel $(uname -r))"
}
stage_ncu() {  # once per word of NCU_SETS (default "prefill kquant"); skipped (not failed) without counters
  has_counters || { say ncu "skipped"; return; }
  local set
  for set in ${NCU_SETS:-prefill kquant}; do
    "ncu_$set" "$OUTDIR/ncu-$set.log"
    ncu_summary "$OUTDIR/ncu-$set.log" 100
  done
}

[[ ",$STAGES," == *,llama,* ]] && start_llama_build
for stage in ${STAGES//,/ }; do
  case "$stage" in
    tests|kernels|soak|compile|bench|generate|split|spec|prefill|chunkprof|llama|lanes|lanebench|profile|ncu) "stage_$stage" ;;
    *) echo "unknown stage '$stage' (stages: tests kernels soak compile bench generate split spec prefill llama"\
" chunkprof lanes lanebench profile ncu)"; FAILED=$((FAILED + 1)) ;;
  esac
done
say done "$FAILED stage(s) failed"
exit "$FAILED"
