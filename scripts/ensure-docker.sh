#!/usr/bin/env bash
# The container test's engine (`make test-slow` calls it; tests/test_containers.py):
# - Debian's docker.io (dockerd), debootstrap, and python3-pip (the wheelhouse);
# - the Compose v2 CLI plugin, the binary inside Debian trixie's docker-compose package
#   (bookworm's docker-compose is Compose v1, which cannot read compose.cpu.yaml's
#   `!reset`), checked against its SHA-256;
# - a running engine: dockerd is started here when none answers;
# - the base images compose.yaml and the Dockerfile name (python:3.11-slim,
#   redis:7.2-alpine). Where no image registry is reachable they are built here from
#   Debian packages (debootstrap) and labelled org.gpulane.base=debootstrap; images
#   already present (pulled from a registry, or built by an earlier run) are kept.
# Idempotent: installs and builds only what is missing, as root or through sudo.
set -euo pipefail

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
MIRROR="${GPULANE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
COMPOSE_DEB="pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb"
COMPOSE_SHA256="47681197cb2b1ab88206b42a1a92fc75f50d9530a6322d03494a473eed0408ea"
PLUGINS=/usr/local/lib/docker/cli-plugins
WORK="${GPULANE_BASE_IMAGES_DIR:-/var/tmp/gpulane-base-images}"

install_packages() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  command -v curl >/dev/null 2>&1 || missing+=(curl)
  # The image's wheels are built by the host's Debian Python (tests/support/containers.py).
  /usr/bin/python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

install_compose() {
  docker compose version >/dev/null 2>&1 && return 0
  echo "installing the Compose v2 plugin from Debian trixie's docker-compose" >&2
  local tmp; tmp="$(mktemp -d)"
  curl -fsS -o "$tmp/compose.deb" "$MIRROR/$COMPOSE_DEB"
  echo "$COMPOSE_SHA256  $tmp/compose.deb" | sha256sum -c --quiet -
  dpkg-deb -x "$tmp/compose.deb" "$tmp/root"
  $SUDO install -D -m 0755 "$tmp/root/usr/libexec/docker/cli-plugins/docker-compose" \
    "$PLUGINS/docker-compose"
  rm -rf "$tmp"
  docker compose version >/dev/null
}

start_engine() {
  docker info >/dev/null 2>&1 && return 0
  echo "starting dockerd (log: /var/log/gpulane-dockerd.log)" >&2
  $SUDO sh -c 'nohup setsid dockerd >/var/log/gpulane-dockerd.log 2>&1 &'
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  echo "dockerd did not answer within 60 s; its log:" >&2
  tail -20 /var/log/gpulane-dockerd.log >&2 || true
  return 1
}

# base_image NAME PACKAGES SETUP [docker import --change ...]
# A minimal Debian bookworm root with PACKAGES, SETUP run inside it (chroot), imported
# as NAME. bookworm's python3 is 3.11, as python:3.11-slim's; its redis-server is 7.0.
base_image() {
  local name="$1" packages="$2" setup="$3"; shift 3
  docker image inspect "$name" >/dev/null 2>&1 && return 0
  echo "building base image $name from Debian packages (debootstrap)" >&2
  local root="$WORK/${name//[:\/]/_}"
  $SUDO rm -rf "$root"
  $SUDO mkdir -p "$WORK"
  $SUDO debootstrap --variant=minbase --include="$packages" bookworm "$root" "$MIRROR" \
    >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; return 1; }
  $SUDO chroot "$root" /bin/sh -euc "$setup; apt-get clean; rm -rf /var/lib/apt/lists/*"
  local changes=(--change "LABEL org.gpulane.base=debootstrap")
  for change in "$@"; do changes+=(--change "$change"); done
  $SUDO tar -C "$root" -c . | docker import "${changes[@]}" - "$name" >/dev/null
  $SUDO rm -rf "$root"
}

install_packages
install_compose
start_engine
# The official image's pip installs as root into the system; Debian's marks its Python
# externally managed, which this image, like the official one, is not.
base_image python:3.11-slim python3,python3-pip \
  'ln -sf /usr/bin/python3 /usr/local/bin/python; ln -sf /usr/bin/pip3 /usr/local/bin/pip;
   rm -f /usr/lib/python3*/EXTERNALLY-MANAGED' \
  'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  'CMD ["python3"]' &
python_job=$!
base_image redis:7.2-alpine redis-server 'mkdir -p /data' \
  'WORKDIR /data' 'EXPOSE 6379' 'CMD ["redis-server"]' &
redis_job=$!
wait "$python_job"
wait "$redis_job"
