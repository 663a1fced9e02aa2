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
BUILD_NAME=build-s3-server
# shellcheck source=hack/go-build-env.sh
source "$HERE/go-build-env.sh"

DEST="$BIN_ROOT/versitygw-$VERSITYGW_VERSION/versitygw"
MOD="$MOD_ROOT/versitygw-$VERSITYGW_VERSION"

case "${1:-}" in
    --print) echo "$DEST"; exit 0 ;;
    "") ;;
    *) echo "usage: $0 [--print]" >&2; exit 2 ;;
esac
[[ -x "$DEST" ]] && { log "present: $DEST"; exit 0; }
require_go
take_build_lock  # a concurrent run finishes the build; this one then finds the binary
[[ -x "$DEST" ]] && { log "present: $DEST"; exit 0; }

start=$SECONDS
log "versitygw $VERSITYGW_VERSION: building with $(go version | cut -d' ' -f3) (a few minutes cold)"
new_module "$MOD" metronome.local/s3-server
(cd "$MOD" && go get "github.com/versity/versitygw@$VERSITYGW_VERSION")
(cd "$MOD" && go build -trimpath -ldflags "-s -w -X main.Version=$VERSITYGW_VERSION" -o out/versitygw \
    github.com/versity/versitygw/cmd/versitygw)
install_bin "$MOD/out/versitygw" "$DEST"
log "built $DEST in $((SECONDS - start)) s"
