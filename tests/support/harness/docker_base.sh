#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim (and debian:bookworm-slim) (no image registry is reachable here): a Debian
# bookworm root file system from Debian's packages (debootstrap), imported, with this machine's
# CA bundle so that pip inside image builds reaches the package index. Cached: does nothing when
# the image exists. Needs root, a Docker engine and debootstrap (shared/DOCKER.md).
set -euo pipefail
# one at a time on this machine (the test suite runs in two processes): the second finds the images built
exec 9>"${TMPDIR:-/tmp}/psring-docker-base.lock"
flock 9
tag="${1:-python:3.11-slim}"
slim="debian:bookworm-slim"  # the etcd profile's base (deploy/etcd.Dockerfile): the same root file system
if docker image inspect "$tag" >/dev/null 2>&1; then
  docker image inspect "$slim" >/dev/null 2>&1 || docker tag local/debian-python:bookworm "$slim"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mirror=$(grep -hm1 '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}')
mirror="${mirror:-http://deb.debian.org/debian}"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$work/rootfs" "$mirror" >/dev/null
tar -C "$work/rootfs" -c . | docker import - local/debian-python:bookworm >/dev/null
mkdir -p "$work/base"
cp /etc/ssl/certs/ca-certificates.crt "$work/base/"
cat > "$work/base/Dockerfile" <<'DOCKERFILE'
FROM local/debian-python:bookworm
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && ln -sf /usr/bin/python3 /usr/local/bin/python
DOCKERFILE
docker build -q -t "$tag" "$work/base" >/dev/null
docker image inspect "$slim" >/dev/null 2>&1 || docker tag local/debian-python:bookworm "$slim"
