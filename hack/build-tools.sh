#!/usr/bin/env bash
# Builds the local control plane's tools from Go modules (no release downloads are reachable here):
# kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, kwok and helm.
# Each lands in $METRONOME_CACHE/bin/<component>-<version>/<component> and is rebuilt only when missing.
# Go module work dirs live in $METRONOME_CACHE/gomod/, never in the repository.
#
#   hack/build-tools.sh            build whatever is missing
#   hack/build-tools.sh --print    print "<component> <path>" for each tool, build nothing
#   hack/build-tools.sh --check    exit 1 (naming them) when any tool is missing, build nothing
# Concurrent runs wait for each other (a lock in the cache dir). One failing part does not stop the others;
# the run then exits 1 naming the parts that failed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD_NAME=build-tools
# shellcheck source=hack/go-build-env.sh
source "$HERE/go-build-env.sh"

tool_path() {  # component version
    echo "$BIN_ROOT/$1-$2/$1"
}

all_tools() {  # "component version" lines
    local c
    for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do echo "$c $K8S_VERSION"; done
    echo "etcd $ETCD_VERSION"
    echo "kwok $KWOK_VERSION"
    echo "helm $HELM_VERSION"
}

missing_tools() {
    local c v
    while read -r c v; do
        [[ -x "$(tool_path "$c" "$v")" ]] || echo "$c"
    done < <(all_tools)
}

# Runs a long command, printing a heartbeat every 30 s so a cold build never looks hung.
with_heartbeat() {  # label cmd...
    local label="$1"; shift
    local start=$SECONDS
    "$@" &
    local pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        for _ in $(seq 30); do sleep 1; kill -0 "$pid" 2>/dev/null || break; done
        kill -0 "$pid" 2>/dev/null && log "$label: still building ($((SECONDS - start)) s)"
    done
    wait "$pid"
}

k8s_major_minor() {  # "1 36" for v1.36.3, as the version stamps want them
    echo "$K8S_VERSION" | sed -E 's/^v([0-9]+)\.([0-9]+)\..*/\1 \2/'
}

build_kubernetes() {
    local need=() c
    for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
        [[ -x "$(tool_path "$c" "$K8S_VERSION")" ]] || need+=("$c")
    done
    ((${#need[@]})) || return 0
    log "kubernetes $K8S_VERSION: building ${need[*]} (cold: tens of minutes on 2 cores)"
    local dir="$MOD_ROOT/kubernetes-$K8S_VERSION"
    new_module "$dir" metronome.local/k8s-tools
    log "kubernetes $K8S_VERSION: resolving the staging modules from the tag's own go.mod"
    local gomod
    gomod="$(cd "$dir" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')"
    python3 "$HERE/k8s_staging_replaces.py" "$gomod" "$K8S_VERSION" >>"$dir/go.mod"
    log "kubernetes $K8S_VERSION: $(grep -c '=>' "$dir/go.mod") staging modules replaced with published versions"
    local pkgs=() 
    for c in "${need[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$c"); done
    (cd "$dir" && with_heartbeat "kubernetes go get" go get "k8s.io/kubernetes@$K8S_VERSION")
    local major minor
    read -r major minor < <(k8s_major_minor)
    local build_date
    build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    local ld="-s -w"
    local p
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor"
        ld+=" -X $p.gitTreeState=clean -X $p.buildDate=$build_date"
    done
    mkdir -p "$dir/out"
    (cd "$dir" && with_heartbeat "kubernetes compile" go build -trimpath -ldflags "$ld" -o out/ "${pkgs[@]}")
    for c in "${need[@]}"; do install_bin "$dir/out/$c" "$(tool_path "$c" "$K8S_VERSION")"; log "built $(tool_path "$c" "$K8S_VERSION")"; done
}

build_etcd() {
    [[ -x "$(tool_path etcd "$ETCD_VERSION")" ]] && return 0
    log "etcd $ETCD_VERSION: building (its own module, so k8s's etcd client versions stay untouched)"
    local dir="$MOD_ROOT/etcd-$ETCD_VERSION"
    new_module "$dir" metronome.local/etcd-tool
    (cd "$dir" && with_heartbeat "etcd go get" go get "go.etcd.io/etcd/server/v3@$ETCD_VERSION")
    (cd "$dir" && with_heartbeat "etcd compile" go build -trimpath -ldflags "-s -w" -o out/etcd go.etcd.io/etcd/server/v3)
    install_bin "$dir/out/etcd" "$(tool_path etcd "$ETCD_VERSION")"
    log "built $(tool_path etcd "$ETCD_VERSION")"
}

build_kwok() {
    [[ -x "$(tool_path kwok "$KWOK_VERSION")" ]] && return 0
    log "kwok $KWOK_VERSION: building"
    local dir="$MOD_ROOT/kwok-$KWOK_VERSION"
    new_module "$dir" metronome.local/kwok-tool
    (cd "$dir" && with_heartbeat "kwok go get" go get "sigs.k8s.io/kwok@$KWOK_VERSION")
    (cd "$dir" && with_heartbeat "kwok compile" go build -trimpath -ldflags "-s -w" -o out/kwok sigs.k8s.io/kwok/cmd/kwok)
    install_bin "$dir/out/kwok" "$(tool_path kwok "$KWOK_VERSION")"
    log "built $(tool_path kwok "$KWOK_VERSION")"
}

build_helm() {
    [[ -x "$(tool_path helm "$HELM_VERSION")" ]] && return 0
    log "helm $HELM_VERSION: building (templates assume Kubernetes $K8S_VERSION)"
    local dir="$MOD_ROOT/helm-$HELM_VERSION"
    new_module "$dir" metronome.local/helm-tool
    (cd "$dir" && with_heartbeat "helm go get" go get "helm.sh/helm/v3@$HELM_VERSION")
    local major minor
    read -r major minor < <(k8s_major_minor)
    local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
    ld+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
    local p
    for p in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
        ld+=" -X $p.k8sVersionMajor=$major -X $p.k8sVersionMinor=$minor"
    done
    (cd "$dir" && with_heartbeat "helm compile" go build -trimpath -ldflags "$ld" -o out/helm helm.sh/helm/v3/cmd/helm)
    install_bin "$dir/out/helm" "$(tool_path helm "$HELM_VERSION")"
    log "built $(tool_path helm "$HELM_VERSION")"
}

main() {
    case "${1:-}" in
        --part)  # internal: one part in its own process, so `set -e` holds inside it
            "build_$2"
            return 0 ;;
        --print)
            while read -r c v; do echo "$c $(tool_path "$c" "$v")"; done < <(all_tools)
            return 0 ;;
        --check)
            local missing
            missing="$(missing_tools | xargs)"
            if [[ -n "$missing" ]]; then echo "missing tools in $BIN_ROOT: $missing" >&2; return 1; fi
            return 0 ;;
        "") ;;
        *) echo "usage: $0 [--print|--check]" >&2; return 2 ;;
    esac
    require_go
    local missing
    missing="$(missing_tools | xargs)"
    if [[ -z "$missing" ]]; then
        log "all tools present in $BIN_ROOT"
        return 0
    fi
    take_build_lock
    missing="$(missing_tools | xargs)"
    if [[ -z "$missing" ]]; then
        log "all tools present in $BIN_ROOT"
        return 0
    fi
    log "missing: $missing; building with $(go version | cut -d' ' -f3) into $BIN_ROOT"
    local start=$SECONDS part failed=()
    for part in kubernetes etcd kwok helm; do
        if ! bash "${BASH_SOURCE[0]}" --part "$part"; then
            log "FAILED: $part (see the output above)"
            failed+=("$part")
        fi
    done
    if ((${#failed[@]})); then
        log "failed parts: ${failed[*]}; still missing: $(missing_tools | xargs)"
        return 1
    fi
    log "done in $((SECONDS - start)) s"
}

main "$@"
