#!/usr/bin/env bash
# Make sure the tools the tests drive are installed (make test and make test-slow call
# it): headless Chromium (dashboard, Swagger UI), Prometheus (promtool for /metrics and
# the alert rules, a real server for the Grafana panels), redis-sentinel (the failover
# test) and iproute2 (`ip netns` for the multi-host test).
# Idempotent: installs only what is missing, as root or through sudo.
set -euo pipefail

missing=()
[ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-sentinel >/dev/null 2>&1 || missing+=(redis-sentinel)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing test tools: ${missing[*]}" >&2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "cannot install ${missing[*]} here (no apt-get): install chromium and promtool" >&2
  exit 1
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  "${missing[@]}" >/dev/null
if [[ " ${missing[*]} " == *" prometheus "* ]]; then
  # The Debian package starts a Prometheus server on :9090; the tests only need promtool.
  ($SUDO systemctl disable --now prometheus >/dev/null 2>&1 \
    || $SUDO service prometheus stop >/dev/null 2>&1) || true
fi
if [[ " ${missing[*]} " == *" redis-sentinel "* ]]; then
  # Debian starts a system Sentinel; the tests start their own on free ports.
  ($SUDO systemctl disable --now redis-sentinel >/dev/null 2>&1 \
    || $SUDO service redis-sentinel stop >/dev/null 2>&1) || true
fi
command -v promtool >/dev/null && command -v redis-sentinel >/dev/null \
  && { [ -x /usr/bin/chromium ] || command -v chromium >/dev/null; }
