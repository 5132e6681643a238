#!/usr/bin/env bash
# Make a Debian bookworm base image locally, for hosts that cannot pull from an image registry:
# debootstrap a minimal root file system from Debian's package mirror, then `docker import` it.
# It has what the Dockerfile's BASE needs: Python 3.11 (Debian's), venv and CA certificates.
#
#   docker/base-image.sh [TAG]        # default pdserve-base:bookworm; a no-op if TAG exists
#   PDSERVE_BASE_IMAGE=pdserve-base:bookworm docker-compose build
#
# Needs root and debootstrap (apt-get install debootstrap). Takes 2-4 minutes once; the image
# stays in the Docker host's store, so later builds start from it at once.
set -euo pipefail

tag="${1:-pdserve-base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag: already built"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install debootstrap" >&2; exit 1; }

rootfs="$(mktemp -d /tmp/pdserve-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
echo "base image $tag: debootstrap bookworm from $mirror (a few minutes) ..."
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"
# The image's apt must reach the same mirror the build used, and keep no downloaded lists.
echo "deb $mirror bookworm main" >"$rootfs/etc/apt/sources.list"
if [ "$mirror" = http://deb.debian.org/debian ]; then
    echo "deb http://deb.debian.org/debian-security bookworm-security main" >>"$rootfs/etc/apt/sources.list"
fi
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$tag" >/dev/null
echo "base image $tag: built ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))"
