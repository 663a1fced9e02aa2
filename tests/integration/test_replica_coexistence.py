"""Another autoscaler on a running service, on the real control plane (its controller-manager runs the HPA
controller) with the operator under the chart's RBAC and canned Prometheus readings that make the loop want more
replicas:

- an HPA (autoscaling/v2) added on the InferenceService: the operator stops changing replicas and says so
  (ReplicasManagedExternally=True, the SLOMet message); the HPA drives the service through its scale subresource
  (raising its minReplicas scales spec.replicas and the Deployment follows); once the HPA is gone the loop scales
  again;
- an HPA on the Deployment itself: the Deployment keeps the count the HPA set, through a spec change that rewrites
  it, and READY counts against that count;
- KEDA installed while the operator runs (its ScaledObject CRD, reduced to an open schema): a ScaledObject on a
  service is seen through the watch kopf starts once the CRD is served, and the CRD's removal hands the replicas
  back.

No metrics server runs here, so an HPA only enforces its bounds: what these tests need of it.
"""
from __future__ import annotations

import json

import pytest
import yaml

from metronome_testing.canned_prometheus import CannedPrometheus
from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import EXAMPLE
from metronome_testing.kube_objects import condition, events_for, get_json, open_crd
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

LOOPED, PLAIN, KEDA = "looped", "plain", "keda"
WINDOW_S = 10


@pytest.fixture(scope="module")
def ns(cluster):
    return cluster.namespace("replicas")


@pytest.fixture(scope="module")
def canned(ns):
    fake = CannedPrometheus(ns, (LOOPED,), WINDOW_S)
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory, canned):
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work,
                              extra_args=("--allow-prometheus-url", canned.url,
                                          "--server-image", "localhost/metronome-server:latest"))
    process.start()
    yield process
    process.stop()
    assert "Forbidden" not in process.all_logs(), "the operator hit an RBAC denial:\n" + process.all_logs()[-4000:]


def isvc(cluster, ns, name) -> dict:
    return get_json(cluster, "inferenceservices.metronome.dev", name, "-n", ns) or {}


def replicas_of(cluster, ns, name) -> tuple[int, int]:
    """(spec.replicas of the InferenceService, of its Deployment)."""
    deployment = get_json(cluster, "deployment", name, "-n", ns) or {}
    return isvc(cluster, ns, name).get("spec", {}).get("replicas"), deployment.get("spec", {}).get("replicas")


def hpa(name: str, kind: str, api_version: str, target: str, low: int, high: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": name},
        "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                 "minReplicas": low, "maxReplicas": high,
                 "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                                                               "target": {"type": "Utilization",
                                                                          "averageUtilization": 80}}}]}})


def manifest(name: str, replicas: int, **spec) -> str:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"]["name"] = name
    body["spec"].update({"replicas": replicas, "minReplicas": 1, "maxReplicas": 4, **spec})
    return yaml.safe_dump(body)


def replicas_condition(cluster, ns, name) -> dict | None:
    return condition(isvc(cluster, ns, name), "ReplicasManagedExternally")


def test_an_hpa_on_the_service_takes_the_replicas_over_from_the_loop(cluster, operator, ns, canned):
    canned.failing = False
    canned.state.update(tbt_p99_s=0.090, generations={"p0": 1})
    cluster.apply(manifest(LOOPED, 1, server={"chunkSize": 64, "queuePolicy": "fcfs"}, slo={"tbtP99Ms": 30},
                           autotune={"mode": "apply", "policy": "multiplicative", "intervalSeconds": 5,
                                     "cooldownSeconds": 0, "minChunkSize": 64, "policySwitching": False,
                                     "scaleReplicas": True},
                           metrics={"prometheusUrl": canned.url, "windowSeconds": WINDOW_S}), namespace=ns)

    # 1. The loop scales: the chunk is at its floor and the SLO is broken.
    wait_for(lambda: replicas_of(cluster, ns, LOOPED) == (2, 2), "the loop to scale 1 -> 2", timeout=90)
    assert any(e["reason"] == "AutotuneScaled" and "replicas 1 -> 2" in e["message"]
               for e in events_for(cluster, ns, LOOPED))
    assert replicas_condition(cluster, ns, LOOPED)["reason"] == "AutotuneScales"

    # 2. An HPA on the InferenceService: the operator reports it and leaves the replicas alone, although its own
    # rule (both pods now report, the SLO is still broken) would add one.
    cluster.apply(hpa("looped-hpa", "InferenceService", "metronome.dev/v1alpha1", LOOPED, 1, 4), namespace=ns)
    managed = wait_for(lambda: (c := replicas_condition(cluster, ns, LOOPED)) and c["status"] == "True" and c,
                       "ReplicasManagedExternally=True", timeout=60)
    assert managed["reason"] == "HorizontalPodAutoscaler"
    assert f"HorizontalPodAutoscaler {ns}/looped-hpa sets the replicas of the InferenceService" in managed["message"]
    canned.state.update(generations={"p0": 1, "p1": 1})

    def reported():
        slo = condition(isvc(cluster, ns, LOOPED), "SLOMet") or {}
        return "replicas are managed by HorizontalPodAutoscaler" in slo.get("message", "") and slo

    wait_for(reported, "a reading that the loop could not act on", timeout=60)
    assert replicas_of(cluster, ns, LOOPED) == (2, 2)
    assert isvc(cluster, ns, LOOPED)["status"]["lastDecision"]["to"]["replicas"] == 2

    # 3. The HPA drives the service through the scale subresource: a minimum of 3 scales it to 3.
    cluster.kubectl("patch", "hpa", "looped-hpa", "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"minReplicas": 3}}))
    wait_for(lambda: replicas_of(cluster, ns, LOOPED) == (3, 3), "the HPA to scale the service to 3", timeout=90)

    # 4. The HPA goes: the loop takes the replicas back and adds one (the SLO is still broken).
    canned.state.update(generations={"p0": 1, "p1": 1, "p2": 1})
    cluster.kubectl("delete", "hpa", "looped-hpa", "-n", ns)
    wait_for(lambda: (replicas_condition(cluster, ns, LOOPED) or {}).get("reason") == "AutotuneScales",
             "ReplicasManagedExternally=False once the HPA is gone", timeout=60)
    wait_for(lambda: replicas_of(cluster, ns, LOOPED) == (4, 4), "the loop to scale 3 -> 4", timeout=90)
    cluster.kubectl("delete", "inferenceservices.metronome.dev", LOOPED, "-n", ns, "--wait=false")


def test_an_hpa_on_the_deployment_keeps_the_count_it_set(cluster, operator, ns):
    cluster.apply(manifest(PLAIN, 1), namespace=ns)
    wait_for(lambda: replicas_of(cluster, ns, PLAIN) == (1, 1), "the service's Deployment", timeout=60)
    cluster.apply(hpa("plain-hpa", "Deployment", "apps/v1", PLAIN, 2, 3), namespace=ns)
    wait_for(lambda: replicas_of(cluster, ns, PLAIN) == (1, 2), "the HPA to scale the Deployment to 2", timeout=90)
    managed = wait_for(lambda: (c := replicas_condition(cluster, ns, PLAIN)) and c["status"] == "True" and c,
                       "ReplicasManagedExternally=True", timeout=60)
    assert "sets the replicas of the Deployment" in managed["message"]
    wait_for(lambda: isvc(cluster, ns, PLAIN).get("status", {}).get("ready") == "2/2", "READY 2/2", timeout=90)

    # A spec change rewrites the Deployment: it keeps the HPA's count, not spec.replicas.
    cluster.kubectl("patch", "inferenceservices.metronome.dev", PLAIN, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"metrics": {"windowSeconds": 30}}}))
    wait_for(lambda: isvc(cluster, ns, PLAIN)["status"].get("observedGeneration")
             == isvc(cluster, ns, PLAIN)["metadata"]["generation"], "the spec change to be reconciled", timeout=60)
    assert replicas_of(cluster, ns, PLAIN) == (1, 2)
    assert condition(isvc(cluster, ns, PLAIN), "Ready")["status"] == "True"
    cluster.kubectl("delete", "inferenceservices.metronome.dev", PLAIN, "-n", ns, "--wait=false")


def test_keda_installed_later_is_followed(cluster, operator, ns):
    cluster.apply(manifest(KEDA, 1), namespace=ns)
    wait_for(lambda: (replicas_condition(cluster, ns, KEDA) or {}).get("reason") == "SpecReplicas",
             "ReplicasManagedExternally=False", timeout=60)
    cluster.apply(open_crd("keda.sh", "ScaledObject", "scaledobjects", version="v1alpha1"))
    try:
        cluster.kubectl("wait", "--for=condition=Established", "crd/scaledobjects.keda.sh", "--timeout=60s")
        cluster.apply(yaml.safe_dump({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
                                      "metadata": {"name": "keda-scaler"},
                                      "spec": {"scaleTargetRef": {"name": KEDA}, "minReplicaCount": 1,
                                               "maxReplicaCount": 3}}), namespace=ns)
        managed = wait_for(lambda: (c := replicas_condition(cluster, ns, KEDA)) and c["status"] == "True" and c,
                           "ReplicasManagedExternally=True from the ScaledObject", timeout=60)
        assert managed["reason"] == "ScaledObject"
        assert f"ScaledObject {ns}/keda-scaler sets the replicas of the Deployment" in managed["message"]
    finally:
        cluster.kubectl("delete", "crd", "scaledobjects.keda.sh", "--ignore-not-found", check=False)
    wait_for(lambda: (replicas_condition(cluster, ns, KEDA) or {}).get("reason") == "SpecReplicas",
             "the replicas back once KEDA is gone", timeout=60)
    cluster.kubectl("delete", "inferenceservices.metronome.dev", KEDA, "-n", ns, "--wait=false")
