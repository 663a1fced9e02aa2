#!/usr/bin/env bash
# Builds the S3-compatible object server the tests run on 127.0.0.1: Versity's versitygw (Apache-2.0; a real S3
# gateway with SigV4 auth over a POSIX directory), from its Go module, like build-tools.sh builds the control
# plane. MinIO's server would do the same job but is AGPL, so it is not used here.
# The binary lands in $METRONOME_CACHE/bin/versitygw-<version>/versitygw and is rebuilt only when missing.
#
#   hack/build-s3-server.sh          build it if missing
#   hack/build-s3-server.sh --print  print its path, build nothing
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=hack/tool-versions.sh
source "$HERE/tool-versions.sh"

CACHE="${METRONOME_CACHE:-$HOME/.cache/metronome}"
DEST="$CACHE/bin/versitygw-$VERSITYGW_VERSION/versitygw"
MOD="$CACHE/gomod/versitygw-$VERSITYGW_VERSION"

export GOFLAGS="-mod=mod -buildvcs=false"
export CGO_ENABLED=0
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

log() { printf '[build-s3-server %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

case "${1:-}" in
    --print) echo "$DEST"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print]" >&2; exit 2 ;;
esac
[[ -x "$DEST" ]] && { log "present: $DEST"; exit 0; }
command -v go >/dev/null || { echo "build-s3-server: 'go' is not on PATH" >&2; exit 1; }

mkdir -p "$CACHE"
exec 9>"$CACHE/.build-s3-server.lock"
flock 9  # a concurrent run finishes the build; this one then finds the binary
[[ -x "$DEST" ]] && { log "present: $DEST"; exit 0; }

start=$SECONDS
log "versitygw $VERSITYGW_VERSION: building with $(go version | cut -d' ' -f3) (a few minutes cold)"
rm -rf "$MOD" && mkdir -p "$MOD"
printf 'module metronome.local/s3-server\n\ngo %s\n' "$GO_LANG_VERSION" >"$MOD/go.mod"
(cd "$MOD" && go get "github.com/versity/versitygw@$VERSITYGW_VERSION")
(cd "$MOD" && go build -trimpath -ldflags "-s -w -X main.Version=$VERSITYGW_VERSION" -o out/versitygw \
    github.com/versity/versitygw/cmd/versitygw)
mkdir -p "$(dirname "$DEST")"
mv -f "$MOD/out/versitygw" "$DEST.tmp.$$" && mv -f "$DEST.tmp.$$" "$DEST"
log "built $DEST in $((SECONDS - start)) s"
