#!/usr/bin/env bash
# Make sure a Docker engine answers and docker-compose and debootstrap are installed, for
# `make test-compose` on a fresh Debian machine: install Debian's docker.io, docker-compose and
# debootstrap when missing (as root), and start dockerd when nothing answers on its socket.
set -euo pipefail

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root" >&2
        exit 1
    fi
    echo "installing ${missing[*]} from Debian ..."
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
    echo "starting dockerd (log: /tmp/dockerd.log) ..."
    nohup dockerd >/tmp/dockerd.log 2>&1 &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { tail -20 /tmp/dockerd.log >&2; exit 1; }
fi
echo "docker engine: $(docker info -f '{{.ServerVersion}}, {{.Driver}}')"
