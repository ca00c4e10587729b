#!/usr/bin/env bash
# The layer split on the device (issue: layer split), flash-l4 official, one kernel cache for all runs:
#   1. ds4c make-model flash-l4;
#   2. ds4c bench q=1,5 at 4096 with the virtual split --layer-split 2,2 (both shards on this GPU): the split
#      step's replay time against the unsplit step's (the cost of one boundary);
#   3. ds4c generate unsplit and with --layer-split 2,2 / 1,3: the same greedy tokens, tokens/s of each.
# usage: tools/gpu_split_run.sh OUTDIR
set -euo pipefail
OUT=${1:?usage: gpu_split_run.sh OUTDIR}
mkdir -p "$OUT"
M=${MODEL:-/tmp/fl4.gguf}
export DS4C_CACHE=${DS4C_CACHE:-/tmp/ds4c-kcache-split}
[ -f "$M" ] || { /usr/bin/time -f "make-model %e s" ds4c make-model --preset flash-l4 --formats official -o "$M" 2>&1 | tail -2; }
ds4c bench "$M" --device cuda --widths 1,5 --ctx 4096 --compile-modes none --no-transformers --ref-repeats 1 \
    --repeats 50 --layer-split 2,2 --json "$OUT/bench-split.json" > "$OUT/bench-split.log" 2>&1 \
    || { tail -5 "$OUT/bench-split.log"; exit 1; }
grep -A4 "^layer split" "$OUT/bench-split.log"
IDS=$(python3 -c "import random; random.seed(0); print(','.join(str(random.randrange(129280)) for _ in range(1000)))")
for split in none 2-2 1-3; do
  opt=(); [ "$split" = none ] || opt=(--layer-split "${split/-/,}")
  ds4c generate "$M" --device cuda --prompt-ids "$IDS" --max-new-tokens 256 --ignore-eos --json "${opt[@]}" \
      > "$OUT/generate-$split.json" 2> "$OUT/generate-$split.err" || { tail -5 "$OUT/generate-$split.err"; exit 1; }
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
recs = {s: json.load(open(f"{out}/generate-{s}.json")) for s in ("none", "2-2", "1-3")}
base = recs["none"]["tokens"]
for s, r in recs.items():
    st = r["step_ms"]
    print(f"split {s:5s}: {len(r['tokens'])} tokens, same as unsplit: {r['tokens'] == base}, first difference at "
          f"{next((i for i, (a, b) in enumerate(zip(r['tokens'], base)) if a != b), None)}; decode "
          f"{r['decode_tokens_per_s']:.1f} tok/s, step median {statistics.median(st):.3f} ms, prefill "
          f"{r['prefill_tokens_per_s']:.0f} tok/s")
PY
