#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the slow real-target tests included.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest "$@"
