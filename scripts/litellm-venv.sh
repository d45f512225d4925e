#!/usr/bin/env bash
# LiteLLM's proxy (its router) for `python -m bench generate`, in a virtual environment
# of its own (.venv-litellm): a peer the bench measures, never a project dependency.
# Idempotent: does nothing when it is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-litellm
VERSION="${LITELLM_VERSION:-1.108.7}"
if [ -x "$VENV/bin/litellm" ]; then
  exit 0
fi
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q "litellm[proxy]==$VERSION"
"$VENV/bin/litellm" --version >/dev/null
