#!/usr/bin/env bash
# Builds the Gateway API Inference Extension's endpoint picker (`epp`, the ext_proc server a gateway asks which
# pod of an InferencePool gets a request) from its Go module, for tests/integration/test_endpoint_picker.py.
# v1.5.0 is the newest release of sigs.k8s.io/gateway-api-inference-extension that still ships the full picker
# (cmd/epp: pool discovery, metrics scraping, filters and scorers); v1.6.0 only has the lightweight `lwepp`, and
# the picker's new home (github.com/llm-d/llm-d-router) is not served by the module proxy here.
# The binary lands in $METRONOME_CACHE/bin/epp-<version>/epp with the release's InferencePool CRD beside it, and is
# rebuilt only when missing; the module work dir lives in $METRONOME_CACHE/gomod/.
#
#   hack/build-picker.sh          build it if missing, then print its path
#   hack/build-picker.sh --print  print the path, build nothing
#   hack/build-picker.sh --crd    print the path of the same release's InferencePool CRD (inference.networking.k8s.io
#                                 v1): the copy a build keeps beside the binary, else the one in the Go module
#                                 cache, downloading the module if needed
set -euo pipefail

BUILD_NAME=build-picker
BUILD_LOG_FD=2  # stdout is the binary's path
# shellcheck source=hack/go-build-env.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/go-build-env.sh"

DEST="$BIN_ROOT/epp-$PICKER_VERSION/epp"
WORK="$MOD_ROOT/epp-$PICKER_VERSION"
MODULE=sigs.k8s.io/gateway-api-inference-extension

CRD="$(dirname "$DEST")/inferencepools-crd.yaml"  # kept beside the binary: `make tools` drops Go's caches

release_crd() {  # the InferencePool CRD in the release's module, downloaded into the module cache if need be
    local dir
    dir="$(go mod download -json "$MODULE@$PICKER_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')"
    echo "$dir/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"
}

if [[ "${1:-}" == "--print" ]]; then echo "$DEST"; exit 0; fi
if [[ "${1:-}" == "--crd" ]]; then
    if [[ -f "$CRD" ]]; then echo "$CRD"; exit 0; fi
    require_go
    release_crd
    exit 0
fi
[[ -z "${1:-}" ]] || { echo "usage: $0 [--print|--crd]" >&2; exit 2; }
if [[ -x "$DEST" && -f "$CRD" ]]; then echo "$DEST"; exit 0; fi
require_go
take_build_lock  # a concurrent build finishes first; then the binary is there

if [[ ! -x "$DEST" ]]; then
    log "endpoint picker $MODULE $PICKER_VERSION: building (cold: minutes on 2 cores)"
    new_module "$WORK" metronome.local/endpoint-picker
    start=$SECONDS
    (cd "$WORK" && go get "$MODULE@$PICKER_VERSION" >&2)
    (cd "$WORK" && go build -trimpath -ldflags "-s -w -X $MODULE/version.BuildRef=$PICKER_VERSION" \
        -o out/epp "$MODULE/cmd/epp" >&2)
    install_bin "$WORK/out/epp" "$DEST"
    log "built $DEST in $((SECONDS - start)) s"
fi
if [[ ! -f "$CRD" ]]; then
    cp "$(release_crd)" "$CRD.tmp.$$"
    mv -f "$CRD.tmp.$$" "$CRD"
fi
echo "$DEST"
