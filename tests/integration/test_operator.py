"""The operator on the real control plane, under the chart's RBAC identity: example → children → Running pods →
columns and conditions; reload vs roll; scale; restart without duplicates; garbage collection on delete.

The tests of this module share one InferenceService and run in order (each builds on the previous state).
"""
from __future__ import annotations

import json
import re

import pytest
import yaml

from metronome_testing.canned_prometheus import CannedPrometheus
from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import EXAMPLE
from metronome_testing.kube_objects import condition, events_for, get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

NAME = "smollm2"  # examples/inferenceservice.yaml
LABEL = f"metronome.dev/inferenceservice={NAME}"
SERVER_IMAGE = "localhost/metronome-server:latest"  # --server-image: the example sets no spec.image


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory, canned_prometheus):
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    # The autotune tests name the canned Prometheus in spec.metrics.prometheusUrl: the allow-list must admit it.
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work,
                              extra_args=("--allow-prometheus-url", canned_prometheus.url,
                                          "--server-image", SERVER_IMAGE))
    process.start()
    yield process
    process.stop()
    assert "Forbidden" not in process.all_logs(), "the operator hit an RBAC denial:\n" + process.all_logs()[-4000:]


@pytest.fixture(scope="module")
def ns(cluster):
    return cluster.namespace("misvc")


def _isvc(cluster, ns):
    return get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)


def _deployment(cluster, ns):
    return get_json(cluster, "deployment", NAME, "-n", ns)


def _config(cluster, ns) -> dict:
    cm = get_json(cluster, "configmap", f"{NAME}-config", "-n", ns)
    return yaml.safe_load(cm["data"]["server.yaml"])


def _replicasets(cluster, ns) -> dict[str, str]:
    items = cluster.kubectl_json("get", "replicasets", "-n", ns, "-l", LABEL)["items"]
    return {rs["metadata"]["name"]: rs["metadata"]["labels"]["pod-template-hash"] for rs in items}


def _running_pods(cluster, ns) -> list[dict]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", LABEL)["items"]
    return [p for p in pods if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


def _columns(cluster, ns, *flags: str) -> dict[str, str]:
    """The printed table row, cut at the header's column offsets (empty cells print as nothing)."""
    header, row = cluster.kubectl("get", "inferenceservices.metronome.dev", NAME, "-n", ns,
                                  *flags).stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = list(zip(starts, starts[1:] + [None]))
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def _ready_and_settled(cluster, ns, replicas: int) -> bool:
    isvc = _isvc(cluster, ns)
    ready = condition(isvc, "Ready")
    status = isvc.get("status") or {}
    return (
        ready is not None
        and ready["status"] == "True"
        and status.get("ready") == f"{replicas}/{replicas}"
        and status.get("observedGeneration") == isvc["metadata"]["generation"]
        and len(_running_pods(cluster, ns)) == replicas
    )


def test_example_creates_children_running_pods_columns_and_conditions(cluster, operator, ns):
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
    wait_for(lambda: _ready_and_settled(cluster, ns, 2), "READY 2/2 with two Running pods", timeout=120)

    isvc = _isvc(cluster, ns)
    uid = isvc["metadata"]["uid"]
    for kind, name in [("deployment", NAME), ("service", NAME), ("configmap", f"{NAME}-config")]:
        child = get_json(cluster, kind, name, "-n", ns)
        assert child is not None, f"{kind} {name} missing"
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("InferenceService", uid, True)

    # Pods are on the kwok GPU nodes with one GPU each.
    for pod in _running_pods(cluster, ns):
        assert pod["spec"]["nodeName"].startswith("kwok-gpu-")
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["image"] == SERVER_IMAGE

    columns = _columns(cluster, ns)
    assert columns["READY"] == "2/2"
    # split: the step's budget is its larger lane (2048 short, 512 long), the number the servers enforce
    assert columns["CHUNK"] == "2048" and columns["POLICY"] == "split"
    assert _columns(cluster, ns, "-o", "wide")["SPLIT"] == "2048/512"
    assert list(columns) == ["NAME", "READY", "CHUNK", "POLICY", "TBT-P99", "SLO", "TOK/S", "EXPERIMENT", "AGE"]
    assert columns["TBT-P99"] == "" and columns["TOK/S"] == ""  # not measured yet
    assert columns["EXPERIMENT"] == ""  # none was ever run
    assert columns["SLO"] == "Unknown"  # no Prometheus in this test: nothing to judge by

    status = _isvc(cluster, ns)["status"]
    types = {c["type"]: c for c in status["conditions"]}
    assert set(types) == {"Ready", "Progressing", "MetricsAvailable", "SLOMet", "ConfigApplied",
                          "ReplicasManagedExternally"}
    assert (types["ReplicasManagedExternally"]["status"], types["ReplicasManagedExternally"]["reason"]) == (
        "False", "SpecReplicas")
    generation = _isvc(cluster, ns)["metadata"]["generation"]
    for cond in types.values():
        assert cond["observedGeneration"] == generation and cond["reason"] and cond["lastTransitionTime"]
    assert status["configGeneration"] == 1 and _config(cluster, ns)["generation"] == 1

    reasons = {e["reason"] for e in events_for(cluster, ns, NAME)}
    assert {"Created", "ConfigCreated", "AllReplicasReady"} <= reasons

    # The same name is KServe's kind too: the short name and the full name both reach ours.
    assert NAME in cluster.kubectl("get", "misvc", "-n", ns).stdout


def test_scheduler_change_patches_the_configmap_and_rolls_nothing(cluster, operator, ns):
    before_rs = _replicasets(cluster, ns)
    before_deployment = _deployment(cluster, ns)
    before_pods = sorted(p["metadata"]["name"] for p in _running_pods(cluster, ns))

    cluster.kubectl(
        "patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"server": {"chunkSize": 256, "queuePolicy": "sjf"}}}),
    )
    config = wait_for(
        lambda: (c := _config(cluster, ns))["scheduler"]["chunk_size"] == 256 and c, "server.yaml with chunk_size 256"
    )
    assert config["generation"] == 2 and config["scheduler"]["queue_policy"] == "sjf"
    wait_for(lambda: _columns(cluster, ns)["CHUNK"] == "256", "the CHUNK column to show 256")
    assert _columns(cluster, ns)["POLICY"] == "sjf"

    after_deployment = _deployment(cluster, ns)
    assert after_deployment["metadata"]["generation"] == before_deployment["metadata"]["generation"]
    assert after_deployment["spec"]["template"] == before_deployment["spec"]["template"]
    assert _replicasets(cluster, ns) == before_rs
    assert sorted(p["metadata"]["name"] for p in _running_pods(cluster, ns)) == before_pods
    messages = [e["message"] for e in events_for(cluster, ns, NAME) if e["reason"] == "ConfigUpdated"]
    assert any("chunkSize 512 -> 256" in m and "1 -> 2" in m for m in messages), messages


def test_model_change_rolls_the_deployment(cluster, operator, ns):
    before_rs = _replicasets(cluster, ns)
    cluster.kubectl(
        "patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"model": {"source": "random:tiny"}}}),
    )

    def rolled():
        deployment = _deployment(cluster, ns)
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        return "random:tiny" in args and set(_replicasets(cluster, ns).values()) - set(before_rs.values())

    wait_for(rolled, "a new ReplicaSet with --model random:tiny")
    wait_for(lambda: _ready_and_settled(cluster, ns, 2), "the rollout to finish with 2/2 ready", timeout=120)
    for pod in _running_pods(cluster, ns):
        assert "random:tiny" in pod["spec"]["containers"][0]["args"]
    assert _config(cluster, ns)["generation"] == 2  # a roll is not a config change
    assert "RollingUpdate" in {e["reason"] for e in events_for(cluster, ns, NAME)}


def test_scale_subresource_and_replica_bounds(cluster, operator, ns):
    cluster.kubectl("scale", "inferenceservices.metronome.dev", NAME, "-n", ns, "--replicas=3")
    wait_for(lambda: _ready_and_settled(cluster, ns, 3), "3/3 after kubectl scale", timeout=120)
    assert _deployment(cluster, ns)["spec"]["replicas"] == 3
    refused = cluster.kubectl("scale", "inferenceservices.metronome.dev", NAME, "-n", ns, "--replicas=9", check=False)
    assert refused.returncode != 0 and "spec.replicas" in refused.stderr


def test_restart_creates_no_duplicates_and_catches_up(cluster, operator, ns):
    def children():
        # generation moves only when someone changes an object's spec (status updates leave it alone).
        kinds = {}
        for kind in ("deployments", "services", "configmaps", "replicasets"):
            items = cluster.kubectl_json("get", kind, "-n", ns, "-l", LABEL)["items"]
            kinds[kind] = {i["metadata"]["name"]: i["metadata"].get("generation") for i in items}
        return kinds

    before = children()
    operator.stop()
    # A change made while the operator is down is applied when it comes back.
    cluster.kubectl(
        "patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
        "-p", json.dumps({"spec": {"server": {"chunkSize": 128}}}),
    )
    operator.start()
    wait_for(lambda: _config(cluster, ns)["scheduler"]["chunk_size"] == 128, "the missed change after restart")
    wait_for(lambda: (obj := _isvc(cluster, ns))["status"].get("observedGeneration") == obj["metadata"]["generation"],
             "the new operator to report the generation it applied")
    after = children()
    assert {k: sorted(v) for k, v in after.items()} == {k: sorted(v) for k, v in before.items()}
    # Nothing was re-created or rewritten: the same objects at the same spec generation.
    assert after["deployments"] == before["deployments"]
    assert _config(cluster, ns)["generation"] == 3


def test_a_deleted_child_comes_back_with_a_newer_generation(cluster, operator, ns):
    generation = _config(cluster, ns)["generation"]
    wait_for(lambda: _isvc(cluster, ns)["status"].get("configGeneration") == generation,
             "status.configGeneration to record the served generation")
    cluster.kubectl("delete", "configmap", f"{NAME}-config", "-n", ns)
    config = wait_for(lambda: get_json(cluster, "configmap", f"{NAME}-config", "-n", ns), "the ConfigMap to return")
    assert yaml.safe_load(config["data"]["server.yaml"])["generation"] > generation


def test_unschedulable_pods_are_explained_in_ready(cluster, operator, ns):
    # 16 GPUs per pod: valid for the CRD, but no kwok node has more than 8.
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = "too-big"
    manifest["spec"]["resources"]["gpus"] = 16
    manifest["spec"]["replicas"] = 1
    cluster.apply(yaml.safe_dump(manifest), namespace=ns)

    def explained():
        ready = condition(get_json(cluster, "inferenceservices.metronome.dev", "too-big", "-n", ns) or {}, "Ready")
        return ready if ready and ready["reason"] == "Unschedulable" else None

    ready = wait_for(explained, "Ready=False with the scheduler's reason")
    assert ready["status"] == "False" and "nvidia.com/gpu" in ready["message"], ready
    warnings = [e for e in events_for(cluster, ns, "too-big") if e["type"] == "Warning"]
    assert any(e["reason"] == "Unschedulable" for e in warnings), warnings
    cluster.kubectl("delete", "inferenceservices.metronome.dev", "too-big", "-n", ns)


PODMONITOR_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: podmonitors.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: PodMonitor, listKind: PodMonitorList, plural: podmonitors, singular: podmonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"""


def test_a_podmonitor_is_created_when_the_cluster_has_its_crd(cluster, operator, ns):
    # The real API group (prometheus-operator's CRD, reduced to an open schema), installed for this test only.
    cluster.apply(PODMONITOR_CRD)
    try:
        cluster.kubectl("wait", "--for=condition=Established", "crd/podmonitors.monitoring.coreos.com", "--timeout=60s")
        manifest = yaml.safe_load(EXAMPLE.read_text())
        manifest["metadata"]["name"] = "monitored"
        cluster.apply(yaml.safe_dump(manifest), namespace=ns)
        monitor = wait_for(lambda: get_json(cluster, "podmonitors.monitoring.coreos.com", "monitored", "-n", ns),
                           "the PodMonitor")
        assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
        assert monitor["metadata"]["ownerReferences"][0]["name"] == "monitored"
        cluster.kubectl("delete", "inferenceservices.metronome.dev", "monitored", "-n", ns, "--timeout=60s")
        wait_for(lambda: get_json(cluster, "podmonitors.monitoring.coreos.com", "monitored", "-n", ns) is None,
                 "the PodMonitor to be garbage-collected", timeout=120)
    finally:
        cluster.kubectl("delete", "crd", "podmonitors.monitoring.coreos.com", "--ignore-not-found", check=False)


def test_delete_removes_every_child(cluster, operator, ns):
    cluster.kubectl("delete", "inferenceservices.metronome.dev", NAME, "-n", ns, "--wait=true", "--timeout=60s")

    def remaining() -> list[str]:
        left = []
        for kind in ("deployments", "services", "configmaps", "replicasets", "pods"):
            items = cluster.kubectl_json("get", kind, "-n", ns, "-l", LABEL)["items"]
            left += [f"{kind}/{i['metadata']['name']}" for i in items]
        return left

    try:
        wait_for(lambda: not remaining(), "the garbage collector to remove every child", timeout=120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still there: {remaining()}") from None


# --- the closed loop against a fake Prometheus ----------------------------------------------------------------
# The operator's real path (PrometheusMetricsSource → controller → ConfigMap, status, Events) with canned
# readings (metronome_testing.canned_prometheus) that the service names in spec.metrics.prometheusUrl.

TUNED = "tuned"
SCALED = "scaled"
TUNED_WINDOW_S = 10


@pytest.fixture(scope="module")
def canned_prometheus(ns):
    fake = CannedPrometheus(ns, (TUNED, SCALED), TUNED_WINDOW_S)
    yield fake
    fake.close()


def _tuned(cluster, ns) -> dict:
    return get_json(cluster, "inferenceservices.metronome.dev", TUNED, "-n", ns) or {}


def _tuned_config(cluster, ns) -> dict:
    cm = get_json(cluster, "configmap", f"{TUNED}-config", "-n", ns)
    return yaml.safe_load(cm["data"]["server.yaml"])


def _tuned_events(cluster, ns) -> list[dict]:
    return events_for(cluster, ns, TUNED)


def test_autotune_reads_prometheus_advises_applies_and_reports(cluster, operator, ns, canned_prometheus):
    fake = canned_prometheus
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = TUNED
    manifest["spec"].update({
        "replicas": 2,
        "server": {"chunkSize": 1024, "queuePolicy": "fcfs"},
        "slo": {"tbtP99Ms": 30},
        "autotune": {"mode": "advise", "policy": "multiplicative", "intervalSeconds": 5, "cooldownSeconds": 600,
                     "minChunkSize": 64, "maxChunkSize": 4096, "policySwitching": False},
        "metrics": {"prometheusUrl": fake.url, "windowSeconds": TUNED_WINDOW_S},
    })
    cluster.apply(yaml.safe_dump(manifest), namespace=ns)

    # 1. Prometheus fails: MetricsAvailable=False with the reason, one Warning, nothing changed.
    def metrics_condition():
        cond = condition(_tuned(cluster, ns), "MetricsAvailable")
        return cond if cond and cond["status"] == "False" else None

    cond = wait_for(metrics_condition, "MetricsAvailable=False while Prometheus fails", timeout=60)
    assert cond["reason"] == "QueryFailed" and fake.url in cond["message"]
    wait_for(lambda: any(e["type"] == "Warning" and e["reason"] == "QueryFailed" for e in _tuned_events(cluster, ns)),
             "the Warning Event of the failing Prometheus")
    assert _tuned(cluster, ns)["status"]["slo"] == "Unknown" and _tuned_config(cluster, ns)["generation"] == 1

    # 2. Prometheus answers, advise mode: the proposal is recorded, announced, and not acted on.
    fake.failing = False

    def advised():
        status = _tuned(cluster, ns).get("status") or {}
        return status.get("lastDecision") if status.get("slo") == "Violated" and status.get("lastDecision") else None

    decision = wait_for(advised, "an advised decision with SLO=Violated", timeout=60)
    assert decision["applied"] is False and decision["policy"] == "multiplicative"
    assert decision["from"]["chunkSize"] == 1024 and decision["to"]["chunkSize"] == 922
    assert condition(_tuned(cluster, ns), "MetricsAvailable")["status"] == "True"
    assert any(e["reason"] == "Advice" and "chunk 1024→922" in e["message"] for e in _tuned_events(cluster, ns))
    status = _tuned(cluster, ns)["status"]
    assert status["tbtP99Ms"] == 60.0 and status["throughputTokensPerSecond"] == 900.0
    assert status["podsOnGeneration"] == 2 and condition(_tuned(cluster, ns), "ConfigApplied")["status"] == "True"
    assert _tuned_config(cluster, ns)["generation"] == 1  # advice changes no config

    # 3. apply: a new server.yaml generation with the smaller chunk; the pods are not on it yet.
    cluster.kubectl("patch", "inferenceservices.metronome.dev", TUNED, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"autotune": {"mode": "apply"}}}))
    config = wait_for(lambda: (c := _tuned_config(cluster, ns))["generation"] == 2 and c, "server.yaml generation 2")
    assert config["scheduler"]["chunk_size"] == 922 and config["scheduler"]["queue_policy"] == "fcfs"

    def applied():
        status = _tuned(cluster, ns).get("status") or {}
        record = status.get("lastDecision") or {}
        return status if record.get("applied") and status.get("configGeneration") == 2 else None

    status = wait_for(applied, "lastDecision applied and status on generation 2")
    assert status["chunkSize"] == 922 and status["lastDecision"]["to"]["chunkSize"] == 922
    messages = [e["message"] for e in _tuned_events(cluster, ns) if e["reason"] == "ConfigUpdated"]
    assert any("1 -> 2 (autotune:" in m and "chunkSize 1024 -> 922" in m for m in messages), messages
    assert condition(_tuned(cluster, ns), "ConfigApplied")["reason"] == "PodsOnOlderGeneration"

    # 4. The servers reload it and the TBT falls inside the SLO (inside the dead band: no further change).
    fake.state.update(tbt_p99_s=0.025, generations={"p0": 2, "p1": 2})

    def settled():
        status = _tuned(cluster, ns).get("status") or {}
        return status if status.get("slo") == "Met" and status.get("podsOnGeneration") == 2 else None

    status = wait_for(settled, "SLO=Met with both pods on generation 2", timeout=60)
    assert condition(_tuned(cluster, ns), "ConfigApplied")["status"] == "True"
    assert condition(_tuned(cluster, ns), "SLOMet")["status"] == "True"
    header, row = cluster.kubectl("get", "inferenceservices.metronome.dev", TUNED, "-n", ns).stdout.splitlines()[:2]
    cells = dict(zip(header.split(), row.split()))
    assert (cells["CHUNK"], cells["SLO"], cells["TBT-P99"]) == ("922", "Met", "25")
    assert _tuned_config(cluster, ns)["generation"] == 2
    cluster.kubectl("delete", "inferenceservices.metronome.dev", TUNED, "-n", ns, "--wait=false")


def test_autotune_at_the_chunk_floor_scales_replicas_then_reports_the_slo_unreachable(cluster, operator, ns,
                                                                                       canned_prometheus):
    fake = canned_prometheus
    fake.failing = False
    fake.state.update(tbt_p99_s=0.090, generations={"p0": 1, "p1": 1})
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = SCALED
    manifest["spec"].update({
        "replicas": 2, "minReplicas": 1, "maxReplicas": 3,
        "server": {"chunkSize": 64, "queuePolicy": "fcfs"},
        "slo": {"tbtP99Ms": 30},
        "autotune": {"mode": "apply", "policy": "multiplicative", "intervalSeconds": 5, "cooldownSeconds": 0,
                     "minChunkSize": 64, "maxChunkSize": 4096, "policySwitching": False, "scaleReplicas": True},
        "metrics": {"prometheusUrl": fake.url, "windowSeconds": TUNED_WINDOW_S},
    })
    cluster.apply(yaml.safe_dump(manifest), namespace=ns)

    def scaled():
        isvc = get_json(cluster, "inferenceservices.metronome.dev", SCALED, "-n", ns) or {}
        deployment = get_json(cluster, "deployment", SCALED, "-n", ns) or {}
        return isvc if isvc.get("spec", {}).get("replicas") == 3 and deployment["spec"]["replicas"] == 3 else None

    isvc = wait_for(scaled, "the autotuner to scale spec.replicas and the Deployment to 3", timeout=60)
    record = isvc["status"]["lastDecision"]
    assert record["applied"] is True and (record["from"]["replicas"], record["to"]["replicas"]) == (2, 3)
    assert record["to"]["chunkSize"] == 64 and record["policy"] == "scale"
    assert any(e["reason"] == "AutotuneScaled" and "replicas 2 -> 3" in e["message"]
               for e in events_for(cluster, ns, SCALED))

    # The loop judges nothing until the new replica reports: then, at the maximum, nothing is left to do, and
    # SLOMet says so, once, as a Warning.
    fake.state.update(generations={"p0": 1, "p1": 1, "p2": 1})
    def unreachable():
        cond = condition(get_json(cluster, "inferenceservices.metronome.dev", SCALED, "-n", ns) or {}, "SLOMet")
        return cond if cond and cond["reason"] == "ChunkAtFloor" else None

    cond = wait_for(unreachable, "SLOMet=False reason ChunkAtFloor", timeout=90)
    assert cond["status"] == "False" and "replicas already at the maximum 3" in cond["message"]
    warnings = [e for e in events_for(cluster, ns, SCALED) if e["type"] == "Warning" and e["reason"] == "ChunkAtFloor"]
    assert len(warnings) == 1 and warnings[0].get("count", 1) == 1
    assert get_json(cluster, "inferenceservices.metronome.dev", SCALED, "-n", ns)["spec"]["replicas"] == 3
    cluster.kubectl("delete", "inferenceservices.metronome.dev", SCALED, "-n", ns, "--wait=false")
