"""Prometheus discovering the servers as a stock install does: `kubernetes_sd_configs` (role pod) against the
local API server, as a ServiceAccount that may only read pods, instead of the stand-in's file_sd list.

Discovery is real; traffic stays on loopback: each target's address is relabelled from the annotation the
stand-in writes on the pods it plays (`metronome.dev/standin-address`, 127.0.0.x:port), and a `keep` rule drops
every target without it, so no scrape is ever sent to a pod's 10.x address. The operator's query path then reads
the series by the labels the server sets itself (`model`) and the ones discovery attaches (`namespace`, `pod`):
no relabelling of the project's own is involved.

This Prometheus is the module's own (another loopback port and data folder), so the session's file_sd
Prometheus keeps serving the other tests. Debian's package is built without Kubernetes service discovery, so
this one is built from Go modules with only that discoverer (hack/build-prometheus-sd.sh, cached; the first
build takes minutes, hence this module's longer timeout).
"""
from __future__ import annotations

import ipaddress
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import yaml
from e2e_helpers import (
    SCRAPE_INTERVAL_S,
    get_json,
    operator_view,
    own_prometheus,
    pod_generations,
    prom_query,
    service_namespace,
)

from metronome_testing.chart import service_account_kubeconfig
from metronome_testing.polling import wait_for
from metronome_testing.standin.standin import ADDRESS_ANNOTATION

pytestmark = pytest.mark.timeout(2400)  # a cold build of the Kubernetes-SD Prometheus included

NAME = "sd-tiny"
ANNOTATION_LABEL = "__meta_kubernetes_pod_annotation_" + "".join(c if c.isalnum() else "_" for c in ADDRESS_ANNOTATION)
READER_RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: prometheus-sd, namespace: NS}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: e2e-prometheus-sd}
rules: [{apiGroups: [""], resources: [pods], verbs: [get, list, watch]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: e2e-prometheus-sd}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: e2e-prometheus-sd}
subjects: [{kind: ServiceAccount, name: prometheus-sd, namespace: NS}]
"""


def scrape_config(kubeconfig: str) -> str:
    """One pod job, as a cluster's Prometheus would have it, plus the loopback address from the annotation."""
    return yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s"},
        "scrape_configs": [{
            "job_name": "kubernetes-pods",
            "kubernetes_sd_configs": [{"role": "pod", "kubeconfig_file": kubeconfig}],
            "relabel_configs": [
                # The only way to a target: the stand-in's loopback address. Everything else is dropped unscraped.
                {"source_labels": [ANNOTATION_LABEL], "regex": "127\\.[0-9.]+:[0-9]+", "action": "keep"},
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "regex": "true",
                 "action": "keep"},
                {"source_labels": [ANNOTATION_LABEL], "target_label": "__address__"},
                {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_path"], "regex": "(.+)",
                 "target_label": "__metrics_path__"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }],
    })


def manifest() -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {"model": {"source": "random:tiny"}, "replicas": 2,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"},
                 "server": {"chunkSize": 128, "queuePolicy": "fcfs", "maxNumSeqs": 8}},
    })


def build_prometheus_sd() -> Path:
    """The Kubernetes-SD Prometheus, built when missing (its progress goes to the terminal's stderr)."""
    script = Path(__file__).resolve().parents[2] / "hack" / "build-prometheus-sd.sh"
    result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, check=False)
    assert result.returncode == 0, f"{script} failed (exit {result.returncode}); its output is above"
    return Path(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ns(cluster, operator):
    with service_namespace(cluster, "e2e-sd", manifest()) as namespace:
        yield namespace


@pytest.fixture(scope="module")
def sd_prometheus(cluster, ns, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus-sd")
    cluster.apply(READER_RBAC.replace("NS", ns))
    kubeconfig = service_account_kubeconfig(cluster, ns, "prometheus-sd", work / "kubeconfig", duration="3h")
    try:
        with own_prometheus("prometheus-sd", build_prometheus_sd(), work, scrape_config(str(kubeconfig))) as url:
            yield url
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", "e2e-prometheus-sd", check=False)


def generations(prometheus: str, ns: str) -> dict[str, int]:
    return pod_generations(prometheus, f'namespace="{ns}",model="{NAME}"')


def test_discovered_pods_are_scraped_on_loopback_only_and_queried_by_the_servers_labels(cluster, standin, ns,
                                                                                          sd_prometheus):
    servers = standin.wait_for_servers(2, namespace=ns, timeout_s=240)
    pods = {s.pod for s in servers}
    series = wait_for(lambda: set(generations(sd_prometheus, ns)) == pods and generations(sd_prometheus, ns),
                      f"metronome_config_generation of pods {sorted(pods)} through kubernetes_sd", timeout=90)

    targets = get_json(f"{sd_prometheus}/api/v1/targets")["data"]
    active = targets["activeTargets"]
    assert {t["labels"]["pod"] for t in active if t["labels"]["namespace"] == ns} == pods
    for target in active:  # every scrape, of any namespace, goes to a stand-in server on 127.0.0.0/8
        host = urllib.parse.urlsplit(target["scrapeUrl"]).hostname
        assert ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8"), target["scrapeUrl"]
    # Pods without the annotation (the chart's operator pod under kwok, ...) were discovered at their pod IPs
    # and dropped before any scrape.
    dropped = [t["discoveredLabels"]["__address__"] for t in targets["droppedTargets"]]
    assert any(not address.startswith("127.") for address in dropped), dropped

    # The operator's query path over this Prometheus: the same generations, matched by `model` and `namespace`.
    assert operator_view(sd_prometheus, ns, NAME).pod_generations == series
    assert "service" not in prom_query(sd_prometheus, f'metronome_config_generation{{namespace="{ns}"}}')[0]["metric"]
