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
"$BIN/specdraft-serve" --help >/dev/null
"$BIN/python" -c "import specdraft.pipeline, specdraft.decode.bench; print('specdraft', specdraft.__version__, specdraft.__file__)"
"$BIN/python" -c "from specdraft.decode import native_linear as n; assert n.SOURCE.is_file(), n.SOURCE"  # the native kernel's source ships
for name in train decode; do
  if "$BIN/python" -c "import $name" 2>/dev/null; then echo "install check: '$name' is importable as a top-level name" >&2; exit 1; fi
done
"$BIN/specdraft-distill" experiment=smoke hydra.run.dir="$WORK/smoke"
"$BIN/specdraft-bench" bench.num_prompts=1 decode.max_new_tokens=16 target.dtype=float32 hydra.run.dir="$WORK/bench"
# The server from the wheel: up on a free port, one chat request through the openai client, stopped with SIGINT.
PORT=$("$BIN/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$BIN/specdraft-serve" server.port="$PORT" target.dtype=float32 hydra.run.dir="$WORK/serve" > "$WORK/serve.log" 2>&1 &
SERVER=$!
"$BIN/python" - "$PORT" <<'PY' || { kill $SERVER; cat "$WORK/serve.log" >&2; exit 1; }
import sys, time, httpx, openai
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        if httpx.get(f"{base}/health", timeout=1).status_code == 200:
            break
    except httpx.HTTPError:
        time.sleep(0.5)
reply = openai.OpenAI(base_url=f"{base}/v1", api_key="unused").chat.completions.create(
    model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
assert reply.usage.completion_tokens >= 1, reply
print(f"install check: specdraft-serve answered {reply.choices[0].message.content!r}")
PY
kill -INT $SERVER
wait $SERVER
"$BIN/python" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
smoke, bench = (json.loads((work / d / "results.json").read_text()) for d in ("smoke", "bench"))
assert smoke["lossless"] is True and (work / "smoke" / "export" / "config.json").is_file(), smoke
assert bench["lossless"] is True and bench["num_prompts"] == 1, bench
print(f"install check: passed (distill smoke tau {smoke['tau']:.2f}, bench tau {bench['tau']:.2f})")
PY
