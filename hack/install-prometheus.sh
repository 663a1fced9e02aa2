#!/usr/bin/env bash
# Installs Debian's prometheus (used by `hack/cluster.py up --with-prometheus` and the e2e tests) unless a
# `prometheus` command already exists, and leaves the package's own service disabled and stopped: we only want
# the binary (hack/cluster.py runs it on 127.0.0.1), never a system-wide prometheus on 0.0.0.0:9090, now or
# after a reboot. Idempotent; needs root (or sudo) only when there is something to change.
set -euo pipefail

SUDO=""
need_root() {
    if [[ "$(id -u)" != 0 && -z $SUDO ]]; then
        command -v sudo >/dev/null 2>&1 || { echo "install-prometheus: need root or sudo for $1" >&2; exit 1; }
        SUDO="sudo"
    fi
}

UNIT=prometheus.service
# The boot-time links the package's postinst makes: systemd's (deb-systemd-helper enable) and SysV's (update-rc.d).
boot_links() {
    compgen -G "/etc/systemd/system/*.wants/$UNIT" || true
    compgen -G "/etc/rc[2-5].d/S*prometheus" || true
}
service_running() { [[ -d /run/systemd/system ]] && systemctl is-active --quiet $UNIT; }

leave_service_off() {
    if [[ -z "$(boot_links)" ]] && ! service_running; then
        return 0
    fi
    need_root "disabling the prometheus service"
    if [[ -d /run/systemd/system ]]; then  # a booted systemd: disable and stop in one go
        $SUDO systemctl disable --now $UNIT >/dev/null 2>&1 || true
    fi
    # Offline as well (containers, chroots): deb-systemd-helper also records the choice, so package upgrades
    # keep the unit disabled.
    if command -v deb-systemd-helper >/dev/null 2>&1; then
        $SUDO deb-systemd-helper disable $UNIT >/dev/null 2>&1 || true
    fi
    if [[ -e /etc/init.d/prometheus ]] && command -v update-rc.d >/dev/null 2>&1; then
        $SUDO update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
    local left
    left="$(boot_links | grep -v '/rc[2-5].d/K' || true)"
    if [[ -n $left ]] || service_running; then
        echo "install-prometheus: could not disable the package's service: ${left:-still running}" >&2
        exit 1
    fi
    echo "prometheus: the package's service is disabled and stopped"
}

if command -v prometheus >/dev/null 2>&1 || [[ -x /usr/bin/prometheus ]]; then
    echo "prometheus present: $( (command -v prometheus || echo /usr/bin/prometheus) | head -1)"
    leave_service_off
    exit 0
fi

need_root "apt-get"

# The package's maintainer scripts would start a system-wide prometheus on 0.0.0.0:9090: deny service starts
# during the install (exit 101), then undo the boot-time enabling that policy-rc.d does not prevent.
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
leave_service_off
