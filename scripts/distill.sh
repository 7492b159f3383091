#!/usr/bin/env bash
# Set up (idempotent) and run the main job: distill a DSpark drafter from the embedded target, export it,
# validate it. Arguments are Hydra overrides, e.g. `bash scripts/distill.sh drafter=dflash`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python train/distill.py "$@"
