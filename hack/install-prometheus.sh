#!/usr/bin/env bash
# Installs Debian's prometheus (used by `hack/cluster.py up --with-prometheus` and the e2e tests) unless a
# `prometheus` command already exists. Idempotent. Needs root (or sudo) for apt-get.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 || [[ -x /usr/bin/prometheus ]]; then
    echo "prometheus present: $( (command -v prometheus || echo /usr/bin/prometheus) | head -1)"
    exit 0
fi

SUDO=""
if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-prometheus: need root or sudo for apt-get" >&2; exit 1; }
    SUDO="sudo"
fi

# The package's maintainer scripts would start a system-wide prometheus on 0.0.0.0:9090; we only want the
# binary (hack/cluster.py runs it on 127.0.0.1), so deny service starts during the install (exit 101).
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [[ ! -e $POLICY ]]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee $POLICY >/dev/null
    $SUDO chmod +x $POLICY
    ADDED_POLICY=1
fi
cleanup() { if [[ $ADDED_POLICY == 1 ]]; then $SUDO rm -f $POLICY; fi; }
trap cleanup EXIT

echo "installing prometheus from Debian (apt-get update first)"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus
command -v prometheus >/dev/null 2>&1 || [[ -x /usr/bin/prometheus ]] || {
    echo "install-prometheus: apt-get finished but no prometheus binary was found" >&2; exit 1; }
/usr/bin/prometheus --version 2>&1 | head -1
