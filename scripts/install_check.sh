#!/usr/bin/env bash
# What a pip user gets: build the wheel, install it into a fresh venv (CPU torch first, then the wheel within
# constraints.txt), and run the console scripts from a folder outside the checkout. CI runs it after the tests.
#   bash scripts/install_check.sh [WORK_DIR]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
PY=${PYTHON:-python3}
rm -rf "$WORK/venv" "$WORK/dist" "$WORK/smoke" "$WORK/bench"
"$PY" -m venv "$WORK/venv"
PIP="$WORK/venv/bin/python -m pip"
$PIP install -q --progress-bar off --upgrade pip
$PIP install -q --progress-bar off "torch==2.13.0"
$PIP wheel -q --no-deps "$REPO" -w "$WORK/dist"
$PIP install -q --progress-bar off -c "$REPO/constraints.txt" "$WORK"/dist/specdraft-*.whl
cd "$WORK"  # outside the checkout: only the installed package can be imported
BIN="$WORK/venv/bin"
"$BIN/specdraft-distill" --help >/dev/null
"$BIN/specdraft-bench" --help >/dev/null
"$BIN/python" -c "import specdraft.pipeline, specdraft.decode.bench; print('specdraft', specdraft.__version__, specdraft.__file__)"
for name in train decode; do
  if "$BIN/python" -c "import $name" 2>/dev/null; then echo "install check: '$name' is importable as a top-level name" >&2; exit 1; fi
done
"$BIN/specdraft-distill" experiment=smoke hydra.run.dir="$WORK/smoke"
"$BIN/specdraft-bench" bench.num_prompts=1 decode.max_new_tokens=16 target.dtype=float32 hydra.run.dir="$WORK/bench"
"$BIN/python" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
smoke, bench = (json.loads((work / d / "results.json").read_text()) for d in ("smoke", "bench"))
assert smoke["lossless"] is True and (work / "smoke" / "export" / "config.json").is_file(), smoke
assert bench["lossless"] is True and bench["num_prompts"] == 1, bench
print(f"install check: passed (distill smoke tau {smoke['tau']:.2f}, bench tau {bench['tau']:.2f})")
PY
