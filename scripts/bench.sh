#!/usr/bin/env bash
# Set up (idempotent) and run the decode benchmark on the embedded default target.
# Arguments are Hydra overrides, e.g. `bash scripts/bench.sh proposer=model proposer.num_layers=4`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python decode/bench.py "$@"
