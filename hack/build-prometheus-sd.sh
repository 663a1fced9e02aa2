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

CACHE="${METRONOME_CACHE:-$HOME/.cache/metronome}"
DEST="$CACHE/bin/prometheus-sd-$PROMETHEUS_SD_VERSION/prometheus"
WORK="$CACHE/gomod/prometheus-sd-$PROMETHEUS_SD_VERSION"

export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

log() { printf '[build-prometheus-sd %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ "${1:-}" == "--print" ]]; then echo "$DEST"; exit 0; fi
[[ -z "${1:-}" ]] || { echo "usage: $0 [--print]" >&2; exit 2; }
if [[ -x "$DEST" ]]; then echo "$DEST"; exit 0; fi
command -v go >/dev/null || { echo "build-prometheus-sd: 'go' is not on PATH" >&2; exit 1; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.build-prometheus-sd.lock"
flock 9  # a concurrent build finishes first; then the binary is there
if [[ -x "$DEST" ]]; then echo "$DEST"; exit 0; fi

log "prometheus $PROMETHEUS_SD_VERSION with kubernetes_sd only: building (cold: minutes on 2 cores)"
rm -rf "$WORK"
mkdir -p "$WORK"
printf 'module metronome.local/prometheus-sd\n\ngo 1.26.0\n' >"$WORK/go.mod"
start=$SECONDS
(cd "$WORK" && go get "github.com/prometheus/prometheus@$PROMETHEUS_SD_VERSION" >&2)
(cd "$WORK" && go build -trimpath -tags remove_all_sd,enable_kubernetes_sd -ldflags "-s -w" \
    -o out/prometheus github.com/prometheus/prometheus/cmd/prometheus >&2)
mkdir -p "$(dirname "$DEST")"
mv -f "$WORK/out/prometheus" "$DEST.tmp.$$"
mv -f "$DEST.tmp.$$" "$DEST"
log "built $DEST in $((SECONDS - start)) s"
echo "$DEST"
