#!/usr/bin/env bash
# Build llama.cpp (the CPU peer of scripts/peers.py) from the source tree that the PyPI sdist of
# llama-cpp-python vendors, once, into the specdraft cache (SPECDRAFT_CACHE, default ~/.cache/specdraft).
# Prints the folder holding the binaries. About 15 minutes on 2 cores the first time; a no-op after.
# It compiles for this machine's CPU (GGML_NATIVE; the flags: decode/llama_cpp.py's cmake_flags), so each CPU
# and configuration gets its own build folder (its build_dir): a cache carried to another CPU builds again.
# Usage: bash scripts/build_llama_cpp.sh [VERSION]   (default 0.3.36)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-0.3.36}
CACHE=${SPECDRAFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdraft}
ROOT="$CACHE/llama.cpp-$VERSION"
TARGETS=(llama-bench llama-speculative-simple)
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BUILD=$("$PY" -c "from specdraft.decode.llama_cpp import build_dir; print(build_dir())")
mapfile -t FLAGS < <("$PY" -c "from specdraft.decode.llama_cpp import cmake_flags; print(*cmake_flags(), sep='\n')")
BIN="$BUILD/bin"
# The tree's convert_hf_to_gguf.py (bench.mode=check converts exports with it) imports sentencepiece
# before it falls back to tokenizer.json.
"$PY" -c "import sentencepiece" 2>/dev/null || "$PY" -m pip install -q --progress-bar off "sentencepiece==0.2.3" >&2
if [ -x "$BIN/llama-speculative-simple" ] && [ -x "$BIN/llama-bench" ]; then
  echo "$BIN"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -f "$ROOT/CMakeLists.txt" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
  tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
  mkdir -p "$CACHE"
  rm -rf "$ROOT.tmp" && mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT.tmp" && mv "$ROOT.tmp" "$ROOT"
fi
cmake -S "$ROOT" -B "$BUILD" "${FLAGS[@]}" >&2
cmake --build "$BUILD" -j"$(nproc)" --target "${TARGETS[@]}" >&2
echo "$BIN"
