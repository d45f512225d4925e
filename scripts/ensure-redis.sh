#!/usr/bin/env bash
# Make sure redis-server is on PATH (make run and make test need it).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
echo "redis-server not found; installing it" >&2
if command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  # The Debian package starts a system redis on :6379; gpulane does not need it.
  ($SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1) || true
elif command -v brew >/dev/null 2>&1; then
  brew install redis
elif command -v dnf >/dev/null 2>&1; then
  sudo dnf install -y redis
else
  echo "cannot install redis-server here: install it, or set GPULANE_REDIS_URL" >&2
  exit 1
fi
command -v redis-server >/dev/null
