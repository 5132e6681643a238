#!/usr/bin/env bash
# The programs the deployment tests run for real, installed from Debian's packages when missing:
#   kubectl   `kubectl kustomize DIR` renders k8s/ (tests/test_k8s.py); it ships kustomize v5
#   promtool  checks and unit-tests monitoring/prometheus (tests/test_monitoring.py); Debian's
#             `prometheus` package ships it
# Only as root (apt-get needs it); otherwise, or when a package cannot be installed, it says so
# and leaves it to the tests, which skip with that reason. Never fails the build on its own.
# Usage: bash .ci/ensure-tools.sh   (make test runs it first)
set -uo pipefail

# command -> the Debian package that provides it
declare -A PACKAGE_OF=([kubectl]=kubectl [promtool]=prometheus)

missing=()
for command in kubectl promtool; do
  command -v "$command" >/dev/null 2>&1 || missing+=("${PACKAGE_OF[$command]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-tools: missing ${missing[*]} (not root or no apt-get: install them yourself;" \
    "the tests that need them skip)" >&2
  exit 0
fi

echo "ensure-tools: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || echo "ensure-tools: apt-get update failed" >&2
for package in "${missing[@]}"; do
  # One at a time, so that a package no configured source has does not block the other.
  # --no-install-recommends: prometheus recommends the node exporter and its collectors.
  apt-get install -y -qq --no-install-recommends "$package" >/dev/null \
    || echo "ensure-tools: could not install $package; the tests that need it skip" >&2
done
exit 0
