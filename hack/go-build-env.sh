# Sourced by hack/build-*.sh: where Go-built tools are cached, how Go is run, and the steps every build shares.
# The caller sets BUILD_NAME (its log prefix and lock name) before sourcing, and BUILD_LOG_FD=2 when its stdout
# is reserved for a path. Layout: $CACHE/bin/<name>-<version>/<binary>, module work dirs in $CACHE/gomod/, Go's
# caches in $CACHE/go/.
# shellcheck shell=bash

# shellcheck source=hack/tool-versions.sh
source "$(dirname "${BASH_SOURCE[0]}")/tool-versions.sh"

CACHE="${METRONOME_CACHE:-$HOME/.cache/metronome}"
BIN_ROOT="$CACHE/bin"
MOD_ROOT="$CACHE/gomod"

# Modules resolved from the proxy into go.mod as needed, no VCS stamping (work dirs are not checkouts), static
# binaries, and the installed Go only (no toolchain download).
export GOFLAGS="-mod=mod -buildvcs=false -modcacherw"
# The builds' own module and build caches (a cold build of every tool fills 9.5 GB), apart from the user's so
# that `make tools` can drop them once the binaries are in place: the binaries are the cache that matters, and
# a CI run needs the disk for its image builds. Writable (-modcacherw), so a plain `rm -rf` removes them.
GO_CACHES="$CACHE/go"
export GOMODCACHE="$GO_CACHES/mod" GOCACHE="$GO_CACHES/build"
export CGO_ENABLED=0
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

log() { printf '[%s %s] %s\n' "$BUILD_NAME" "$(date +%H:%M:%S)" "$*" >&"${BUILD_LOG_FD:-1}"; }

require_go() {
    command -v go >/dev/null || { echo "$BUILD_NAME: 'go' is not on PATH" >&2; return 1; }
}

# Holds $CACHE/.$BUILD_NAME.lock (fd 9) for the rest of the script, waiting for a concurrent run first; the
# caller then checks again for what that run may have built.
take_build_lock() {
    mkdir -p "$CACHE"
    exec 9>"$CACHE/.$BUILD_NAME.lock"
    if ! flock -n 9; then
        log "another $BUILD_NAME.sh is running; waiting for it"
        flock 9
    fi
}

# A fresh module work dir that requires nothing yet; `go get` fills it in.
new_module() {  # dir module-name
    rm -rf "$1"
    mkdir -p "$1"
    printf 'module %s\n\ngo %s\n' "$2" "$GO_LANG_VERSION" >"$1/go.mod"
}

# Moves a freshly built binary into place atomically, so a half-written file is never mistaken for a build.
install_bin() {  # src dest
    mkdir -p "$(dirname "$2")"
    mv -f "$1" "$2.tmp.$$"
    mv -f "$2.tmp.$$" "$2"
}
