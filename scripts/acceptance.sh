#!/usr/bin/env bash
# The speed and losslessness measurements of speculation on this machine, one after another (two benchmarks at
# once on a few cores measure nothing), on the default target in float32, 20 prompts x 128 tokens:
#   roofline      the verify curve against this machine's floor (scripts/roofline.py)
#   peers-*       HF generate, HF prompt lookup and our methods, interleaved per prompt (scripts/peers.py)
#   lookup-*      prompt lookup on MT-bench coding/extraction/math: fixed lengths and scheduler=cost (sweep),
#                 then one run against HF generate (its `lossless` field)
#   export-*      the trained drafter EXPORT on held-out ShareGPT, the same two kinds of run
#   *-T1          the same sweeps sampled at T=1 (one chain: trees are greedy only)
# The two greedy sweeps keep the fastest of two runs per prompt and setting (bench.repeats=2): the scheduler and the
# best fixed length differ by about a percent there, which one run's timing noise can move either way.
# Each run writes OUT/NAME/results.json (decode/bench.py) or OUT/NAME/peers.json; a run whose output exists is
# skipped, so an interrupted pass resumes. Usage: scripts/acceptance.sh EXPORT OUT [BENCH OVERRIDES...]
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT=$1; OUT=$2; shift 2
PY=.venv/bin/python
lookup=(proposer=ngram "data.categories=[coding,extraction,math]" bench.spread=true)
export_=(proposer=drafter "proposer.path=$EXPORT" data=sharegpt_heldout)
common=(target.dtype=float32 bench.num_prompts=20 decode.max_new_tokens=128 "$@")
sweep=(bench.mode=sweep "bench.sweep_thresholds=[]" "bench.concurrency=[1]" bench.baselines=false)

bench() {  # NAME OVERRIDES...: one decode/bench.py run into OUT/NAME
  local name=$1; shift
  [ -f "$OUT/$name/results.json" ] && return 0
  echo "== $name $(date -u +%H:%M:%S)"
  $PY decode/bench.py "$@" "${common[@]}" "hydra.run.dir=$OUT/$name"
}
peers() {  # NAME ARGS...: one scripts/peers.py run into OUT/NAME
  local name=$1; shift
  [ -f "$OUT/$name/peers.json" ] && return 0
  echo "== $name $(date -u +%H:%M:%S)"
  $PY scripts/peers.py --num-prompts 20 "$@" --out "$OUT/$name"
}

[ -f "$OUT/roofline/roofline.json" ] || $PY scripts/roofline.py --dtypes float32 --contexts 300 --repeats 9 \
  --out "$OUT/roofline"
peers peers-lookup --categories coding extraction math --spread --methods hf_generate hf_prompt_lookup ours_ngram
peers peers-heldout --data sharegpt_heldout --drafter "$EXPORT" --methods hf_generate ours_ngram ours_drafter ours_hybrid
bench lookup-sweep "${lookup[@]}" "${sweep[@]}" "bench.sweep_lengths=[2,4,8]" decode.num_draft=8 bench.repeats=2
bench lookup-single "${lookup[@]}" scheduler=cost decode.num_draft=8
bench export-sweep "${export_[@]}" "${sweep[@]}" "bench.sweep_lengths=[1,2,3]" bench.repeats=2
bench export-single "${export_[@]}" scheduler=cost decode.num_draft=3
bench lookup-sweep-T1 "${lookup[@]}" "${sweep[@]}" "bench.sweep_lengths=[2,4]" decode.num_draft=4 decode.temperature=1.0
bench export-sweep-T1 "${export_[@]}" "${sweep[@]}" "bench.sweep_lengths=[1,2]" decode.temperature=1.0
peers peers-heldout-T1 --data sharegpt_heldout --drafter "$EXPORT" --temperature 1.0 \
  --methods ours_ngram ours_drafter ours_hybrid
echo "== done $(date -u +%H:%M:%S)"
