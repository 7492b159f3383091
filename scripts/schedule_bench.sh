#!/usr/bin/env bash
# Issue-4 benchmarks for one dspark export: calibrate the confidence head on held-out prompts the
# benchmarks do not use (skipped if EXPORT/calibration.json exists), sweep fixed lengths, a threshold
# and the cost scheduler (MT-bench and held-out ShareGPT, T=0 and T=1), then the load sweep (T=0).
# Sweeps run every setting REPEATS times per prompt and keep its fastest run (bench.repeats).
# Usage: scripts/schedule_bench.sh EXPORT OUT [N_PROMPTS] [TOKENS] [DTYPE] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT=$1; OUT=$2; N=${3:-4}; TOKENS=${4:-48}; DTYPE=${5:-bfloat16}; REPEATS=${6:-3}
PY=.venv/bin/python
common=(proposer=drafter "proposer.path=$EXPORT" "target.dtype=$DTYPE" "decode.max_new_tokens=$TOKENS")
if [ ! -f "$EXPORT/calibration.json" ]; then
  $PY decode/bench.py "${common[@]}" bench.mode=calibrate data=sharegpt_heldout bench.first_prompt=40 \
    bench.num_prompts=12 decode.max_new_tokens=64 "hydra.run.dir=$OUT/calibrate"
fi
for data in mtbench sharegpt_heldout; do
  for t in 0.0 1.0; do
    $PY decode/bench.py "${common[@]}" bench.mode=sweep data=$data decode.temperature=$t bench.num_prompts=$N \
      bench.repeats=$REPEATS "bench.sweep_lengths=[1,2,3,5,7]" "bench.sweep_thresholds=[0.5]" "bench.concurrency=[1]" \
      "hydra.run.dir=$OUT/sweep-$data-T$t"  # one request: its profile needs only 1-row verify steps
  done
done
$PY decode/bench.py "${common[@]}" bench.mode=load data=mtbench decode.temperature=0.0 bench.num_prompts=16 \
  decode.num_draft=3 decode.max_new_tokens=32 scheduler=load bench.load_repeats=3 "hydra.run.dir=$OUT/load-mtbench-T0.0"
