#!/usr/bin/env bash
# Build every image docker-compose.yml runs, on a host with no image registry access:
#   1. the base image from Debian's packages (docker/base-image.sh; once, then cached),
#   2. what the host lends the build into docker/host/: its CA bundle (pip's PIP_CERT or the
#      system's), for a TLS-intercepting proxy, and its torch wheel when pip has one locally,
#   3. `docker-compose build` of pdserve, Redis and Prometheus on that base, with host networking
#      so that apt and pip inside the build use the host's network path to the mirrors.
# On a host that can pull python:3.11-slim, plain `docker-compose build` does the same.
set -euo pipefail
cd "$(dirname "$0")/.."

export PDSERVE_BASE_IMAGE="${PDSERVE_BASE_IMAGE:-pdserve-base:bookworm}"
compose="${COMPOSE:-docker-compose}"

docker/base-image.sh "$PDSERVE_BASE_IMAGE"

ca_bundle="${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
if [ -f "$ca_bundle" ]; then
    cp "$ca_bundle" docker/host/ca-bundle.crt
fi

torch_version="$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)"
for dir in $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    for wheel in "$dir"/torch-"$torch_version"*-cp311-*.whl; do
        if [ -f "$wheel" ] && [ ! -f "docker/host/$(basename "$wheel")" ]; then
            echo "torch: using the host's wheel $wheel"
            cp "$wheel" docker/host/
        fi
    done
done

# router, prefill and decode share one image (PDSERVE_IMAGE): building it once is enough.
$compose build redis prometheus router
