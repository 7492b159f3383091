#!/usr/bin/env bash
# The measurements behind docs/results/*-fast-backend.md, in one run (about 80 minutes on 2 CPU cores):
#   bash scripts/fast_backend_bench.sh EXPORT OUT
# EXPORT: a distill export (DIR/export of `bash scripts/distill.sh`), calibrated here first when it has no
# calibration.json. Everything is float32 at T=0 unless the name says T1; 128 new tokens per prompt.
# OUT/roofline           scripts/roofline.py
# OUT/ngram-single       prompt lookup + cost vs plain, HF generate and HF prompt lookup, 30 MT-bench coding/extraction/math prompts
# OUT/ngram-sweep-T{0,1} prompt lookup: fixed 2/4/8 and cost, same prompts
# OUT/{drafter,hybrid}-sweep-T{0,1}   the export alone and in the hybrid: fixed 1/2/3 and cost, 20 held-out ShareGPT prompts
# OUT/hybrid-single      hybrid + cost vs plain and HF generate on the same 20 held-out prompts (exactness)
# OUT/ngram-heldout-sweep-T0   prompt lookup alone on those 20 held-out prompts (the hybrid's other part)
# OUT/peers              scripts/peers.py on the 30 MT-bench prompts (llama.cpp rows where it is built)
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT=$1
OUT=$2
PY=.venv/bin/python
mkdir -p "$OUT"
CATS="data.categories=[coding,extraction,math]"
COMMON=(target.dtype=float32 decode.max_new_tokens=128 "bench.concurrency=[1]")
if [ ! -f "$EXPORT/calibration.json" ]; then
  $PY decode/bench.py bench.mode=calibrate proposer=drafter proposer.path="$EXPORT" target.dtype=float32 \
    data=sharegpt_heldout bench.first_prompt=40 bench.num_prompts=16 decode.max_new_tokens=64 hydra.run.dir="$OUT/calibrate"
fi
# Each step is skipped when its results exist (rerun the script to resume); the headline cells run first.
run() { local dir=$1; shift; [ -f "$OUT/$dir/results.json" ] || "$@" hydra.run.dir="$OUT/$dir"; }
[ -f "$OUT/roofline/roofline.json" ] || $PY scripts/roofline.py --out "$OUT/roofline"
run ngram-single $PY decode/bench.py proposer=ngram scheduler=cost decode.num_draft=8 "$CATS" bench.num_prompts=null "${COMMON[@]}"
sweep() {  # sweep NAME T PROPOSER [overrides...]
  local name=$1 t=$2 p=$3; shift 3
  run "$name" $PY decode/bench.py bench.mode=sweep proposer=$p decode.temperature=$t "bench.sweep_thresholds=[]" "${COMMON[@]}" "$@"
}
DRAFTED=(proposer.path="$EXPORT" decode.num_draft=7 data=sharegpt_heldout bench.num_prompts=20 "bench.sweep_lengths=[1,2,3]")
sweep drafter-sweep-T0 0 drafter "${DRAFTED[@]}"
run hybrid-single $PY decode/bench.py proposer=hybrid proposer.path="$EXPORT" scheduler=cost decode.num_draft=7 \
  data=sharegpt_heldout bench.num_prompts=20 "${COMMON[@]}"
for T in 0 1; do
  sweep ngram-sweep-T$T $T ngram decode.num_draft=8 "$CATS" bench.num_prompts=null "bench.sweep_lengths=[2,4,8]"
  sweep drafter-sweep-T$T $T drafter "${DRAFTED[@]}"
  sweep hybrid-sweep-T$T $T hybrid "${DRAFTED[@]}"
done
# the hybrid's lookup part alone on the hybrid's prompts ("hybrid >= both of its parts")
sweep ngram-heldout-sweep-T0 0 ngram decode.num_draft=7 data=sharegpt_heldout bench.num_prompts=20 "bench.sweep_lengths=[1,2,3,7]"
[ -f "$OUT/peers/peers.json" ] || $PY scripts/peers.py --drafter "$EXPORT" --categories coding extraction math --num-prompts 30 --out "$OUT/peers"
$PY scripts/fast_backend_table.py "$OUT"
