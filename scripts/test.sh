#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, the slow real-target tests included, on every core
# (pytest-xdist: most tests run one thread each; tests on the real target take a core each beside the others).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`, or `-n 0` for one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n auto "$@"
