#!/usr/bin/env bash
# Builds a Prometheus with Kubernetes service discovery from Go modules, for tests/e2e/test_kubernetes_sd.py.
# Debian's prometheus package (hack/install-prometheus.sh, which every other test uses) is built without
# kubernetes_sd_configs (Debian does not package the client-go it needs), and no release download is reachable
# here. Only the Kubernetes discoverer is compiled in (build tags remove_all_sd,enable_kubernetes_sd), which keeps
# the cloud SDKs out of the build. The binary lands in $METRONOME_CACHE/bin/prometheus-sd-<version>/prometheus and
# is rebuilt only when missing; the module work dir lives in $METRONOME_CACHE/gomod/.
#
#   hack/build-prometheus-sd.sh          build it if missing, then print its path
#   hack/build-prometheus-sd.sh --print  print the path, build nothing
set -euo pipefail

PROMETHEUS_SD_VERSION=v0.316.0  # the Go module version of Prometheus 3.16.0 (github.com/prometheus/prometheus)

BUILD_NAME=build-prometheus-sd
BUILD_LOG_FD=2  # stdout is the binary's path
# shellcheck source=hack/go-build-env.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/go-build-env.sh"

DEST="$BIN_ROOT/prometheus-sd-$PROMETHEUS_SD_VERSION/prometheus"
WORK="$MOD_ROOT/prometheus-sd-$PROMETHEUS_SD_VERSION"

if [[ "${1:-}" == "--print" ]]; then echo "$DEST"; exit 0; fi
[[ -z "${1:-}" ]] || { echo "usage: $0 [--print]" >&2; exit 2; }
if [[ -x "$DEST" ]]; then echo "$DEST"; exit 0; fi
require_go
take_build_lock  # a concurrent build finishes first; then the binary is there
if [[ -x "$DEST" ]]; then echo "$DEST"; exit 0; fi

log "prometheus $PROMETHEUS_SD_VERSION with kubernetes_sd only: building (cold: minutes on 2 cores)"
new_module "$WORK" metronome.local/prometheus-sd
start=$SECONDS
(cd "$WORK" && go get "github.com/prometheus/prometheus@$PROMETHEUS_SD_VERSION" >&2)
(cd "$WORK" && go build -trimpath -tags remove_all_sd,enable_kubernetes_sd -ldflags "-s -w" \
    -o out/prometheus github.com/prometheus/prometheus/cmd/prometheus >&2)
install_bin "$WORK/out/prometheus" "$DEST"
log "built $DEST in $((SECONDS - start)) s"
echo "$DEST"
