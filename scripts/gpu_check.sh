#!/usr/bin/env bash
# The accelerator check, one prepared script for a lent GPU machine (about 10 minutes): set-up, a short
# distillation on the GPU (bf16 autocast, target in bf16 for the speed pass), then the decode benchmark
# on MT-bench; prints training tokens/s, tau and speedup vs plain decoding.
#   bash scripts/gpu_check.sh [STEPS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-300}
OUT=${2:-outputs/gpu_check}
bash scripts/setup.sh
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'; print('GPU', torch.cuda.get_device_name(0))"
# Regeneration and training on the GPU; the data/train budgets keep the whole run near 7 minutes.
$PY train/distill.py hydra.run.dir="$OUT" trainer.steps="$STEPS" trainer.bf16=true trainer.compile=${COMPILE:-false} trainer.batch_size=16 \
    data.num_samples=2000 data.num_regenerate=512 data.regen_batch_size=128 budget.data_s=150 budget.train_s=240 \
    validate.num_prompts=8 validate.max_new_tokens=128 tracking=disabled
$PY decode/bench.py proposer=drafter proposer.path="$OUT/export" data=mtbench bench.num_prompts=10 \
    decode.max_new_tokens=128 target.dtype=bfloat16 out_dir="$OUT/bench_mtbench"
$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
distill = json.load(open(f"{out}/results.json"))
bench = json.load(open(f"{out}/bench_mtbench/results.json"))
print(f"train tokens/s {distill['train_tokens_per_s']:.0f}  steps {distill['train_steps']}  stage seconds {distill['stage_seconds']}")
print(f"held-out: tau {distill['tau']:.3f}  speedup {distill['speedup_vs_plain']:.2f}x  lossless {distill['lossless']}")
print(f"MT-bench: tau {bench['tau']:.3f}  speedup {bench['speedup_vs_plain']:.2f}x  lossless {bench['lossless']}")
PY
