#!/usr/bin/env bash
# The generation loop as a user runs it on the device (issue: generation as users run it), flash-l4 official:
#   1. ds4c make-model flash-l4;
#   2. ds4c generate --device cuda, a 4000-token prompt, 512 new tokens, cold kernel cache (JSON + stderr kept);
#   3. the same warm (kernel cache filled): what a second start costs;
#   4. (BENCH=1) ds4c bench q=1,5 at 4096 with the end-to-end rows.
# usage: tools/gpu_generation_run.sh OUTDIR        (logs and JSON records land in OUTDIR)
set -euo pipefail
OUT=${1:?usage: gpu_generation_run.sh OUTDIR}
mkdir -p "$OUT"
M=${MODEL:-/tmp/fl4.gguf}
export DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache-$$}
[ -f "$M" ] || { /usr/bin/time -f "make-model %e s" ds4c make-model --preset flash-l4 --formats official -o "$M" 2>&1 | tail -2; }
IDS=$(python3 -c "import random; random.seed(0); print(','.join(str(random.randrange(129280)) for _ in range(4000)))")
for run in cold warm; do
  /usr/bin/time -f "$run generate wall %e s" ds4c generate "$M" --device cuda --prompt-ids "$IDS" --max-new-tokens 512 \
      --ignore-eos --json > "$OUT/generate-$run.json" 2> "$OUT/generate-$run.err" || { tail -5 "$OUT/generate-$run.err"; exit 1; }
  grep -E "ready:|wall|kernels" "$OUT/generate-$run.err" | tail -3
  python3 - "$OUT/generate-$run.json" <<'PY'
import json, statistics, sys
r = json.load(open(sys.argv[1]))
st = r["step_ms"]
med = statistics.median(st)
print(f"prefill {len(r['prompt'])} tokens {r['prefill_s']:.2f} s ({r['prefill_tokens_per_s']:.0f} tok/s); decode "
      f"{len(r['tokens'])} tokens {r['decode_tokens_per_s']:.1f} tok/s; step median {med:.3f} ms, max {max(st):.3f} ms "
      f"(x{max(st) / med:.2f}) at step {st.index(max(st))}; first {st[0]:.3f} ms; steps > 2x median: "
      f"{sum(s > 2 * med for s in st)}")
PY
done
if [ "${BENCH:-0}" = "1" ]; then
  ds4c bench "$M" --device cuda --widths 1,5 --ctx 4096 --compile-modes none --no-transformers --ref-repeats 1 \
      --repeats 50 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 || { tail -5 "$OUT/bench.log"; exit 1; }
  tail -14 "$OUT/bench.log"
fi
if [ "${PROFILE:-0}" = "1" ]; then  # where a warm start's seconds go (cProfile, cumulative, top 30)
  python3 -m cProfile -o "$OUT/start.prof" -m ds4c.cli generate "$M" --device cuda --prompt-ids 1,2,3 \
      --max-new-tokens 4 > /dev/null 2>&1
  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(30)" "$OUT/start.prof" \
      > "$OUT/start-profile.txt"
  grep -E "^ +[0-9]" "$OUT/start-profile.txt" | head -30 | cut -c1-160
fi
