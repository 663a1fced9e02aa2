# Versions of the Go-built tools; sourced by build-tools.sh and read by cluster.py (plain KEY=value lines only).
# Each is served by the Go module proxy and builds with Go 1.26.
K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0
GO_LANG_VERSION=1.26.0
VERSITYGW_VERSION=v1.8.0
# The Gateway API Inference Extension's endpoint picker (build-picker.sh): the newest release with the full cmd/epp.
PICKER_VERSION=v1.5.0
