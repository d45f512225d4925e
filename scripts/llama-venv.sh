#!/usr/bin/env bash
# llama.cpp's server for the tests (tests/test_backend.py) and the generation bench, in
# a virtual environment of its own (.venv-llama) so its dependencies never meet the
# project's. llama-cpp-python builds llama.cpp from source: about 9 minutes on 2 cores
# the first time; pip keeps the wheel in its cache, so later builds take seconds.
# Idempotent: does nothing when the server is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-llama
VERSION=0.3.36
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  exit 0
fi
echo "building llama.cpp's server (llama-cpp-python $VERSION) into $VENV; ~9 min the first time" >&2
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
  "$VENV/bin/pip" install -q "llama-cpp-python[server]==$VERSION"
"$VENV/bin/python" -c "import llama_cpp.server"
