"""The chart and the operator's identity: install charts/metronome, apply the CRD, and write a kubeconfig that
authenticates as the chart's ServiceAccount, so that the operator run as a local process gets exactly the chart's
RBAC (a missing permission fails the tests and the demo).

`kube` is anything with .kubectl(...), .kubectl_json(...), .helm(...) and .kubeconfig: the tests' `cluster`
fixture or the demo's localcluster KubeTools. Everything talks to the API server on 127.0.0.1 only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from metronome_testing.checkout import CHART, CRD_FILE, CRD_NAME
from metronome_testing.polling import wait_for

RELEASE = "metronome"  # the tests' release, installed once per cluster and session


@dataclass(frozen=True)
class ChartRelease:
    namespace: str
    release: str
    service_account: str
    install_output: str  # helm's output, NOTES.txt included


_RELEASES: dict[str, ChartRelease] = {}


def install_chart(kube, release: str, namespace: str, values: dict[str, str] | None = None) -> ChartRelease:
    """`helm upgrade --install` (idempotent) into `namespace` (created when missing); waits for the CRD."""
    sets = [arg for key, value in (values or {}).items() for arg in ("--set", f"{key}={value}")]
    result = kube.helm("upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace",
                       *sets, timeout=180)
    wait_for(lambda: crd_established(kube), "the chart's CRD to be established")
    # The chart's fullname: the release name when it contains the chart's name, else "<release>-metronome".
    service_account = release if "metronome" in release else f"{release}-metronome"
    return ChartRelease(namespace=namespace, release=release, service_account=service_account,
                        install_output=result.stdout)


def chart_release(cluster) -> ChartRelease:
    """The tests' release of charts/metronome, installed once per cluster and session in a namespace of its own."""
    key = cluster.api_url
    if key not in _RELEASES:
        _RELEASES[key] = install_chart(cluster, RELEASE, cluster.namespace("metronome-system"))
    return _RELEASES[key]


def ensure_crd(kube) -> None:
    """The CRD alone, applied from crds/ (tests that need no operator)."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_for(lambda: crd_established(kube), "the CRD to be established", timeout=60)


def crd_established(kube) -> bool:
    """Polled, not `kubectl wait`: that fails at once on a CRD the API server has not given a status yet."""
    crd = kube.kubectl_json("get", "crd", CRD_NAME)
    conditions = crd.get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def service_account_kubeconfig(kube, namespace: str, service_account: str, path: Path,
                               duration: str = "24h") -> Path:
    """A kubeconfig for the same API server that authenticates as the ServiceAccount (TokenRequest token)."""
    token = kube.kubectl("create", "token", service_account, "-n", namespace, f"--duration={duration}").stdout.strip()
    admin = yaml.safe_load(Path(kube.kubeconfig).read_text())
    context_name = admin.get("current-context") or admin["contexts"][0]["name"]
    context = next(c for c in admin["contexts"] if c["name"] == context_name)["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": service_account}}],
        "current-context": "operator",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path
