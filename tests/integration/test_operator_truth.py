"""What the resource says when things go wrong, on the real control plane under the chart's RBAC: a failing model
download or image pull named in Ready, pods refused by a quota or by admission, children the Deployment API
refuses (nothing half-created; an update that is not applied leaves observedGeneration behind and says why),
every child put back after a deletion or an edit, monitoring CRDs installed later picked up without a restart,
and Events only for real changes.

One operator serves the module; each test has its own services. Pods annotated HELD_BY_TEST are left alone by
kwok: the test writes their status as the kubelet would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.hub_server import FakeHub
from metronome_testing.kube_objects import (
    HELD_BY_TEST,
    condition,
    events_for,
    get_json,
    open_crd,
    release_held_pods,
    set_pod_status,
)
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

SERVER_IMAGE = "localhost/metronome-server:latest"
ISVC = "inferenceservices.metronome.dev"
METRONOME = str(Path(sys.executable).parent / "metronome")


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work,
                              extra_args=("--server-image", SERVER_IMAGE, "--slo-alerts"))
    process.start()
    yield process
    process.stop()
    logs = process.all_logs()
    assert 'forbidden: User "system:serviceaccount' not in logs, logs[-4000:]
    assert "Traceback" not in logs, logs[max(logs.find("Traceback") - 2000, 0):][:6000]


@pytest.fixture
def ns(cluster, operator):
    name = cluster.namespace("truth")
    yield name
    release_held_pods(cluster, name)
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def manifest(name: str, **spec) -> dict:
    return {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"source": "random:tiny"}, "replicas": 1,
                     "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"}, **spec}}


def create(cluster, ns: str, obj: dict) -> None:
    cluster.apply(yaml.safe_dump(obj), namespace=ns)


def isvc(cluster, ns: str, name: str) -> dict:
    return get_json(cluster, ISVC, name, "-n", ns) or {}


def merge_patch(cluster, ns: str, name: str, patch: dict, kind: str = ISVC) -> None:
    cluster.kubectl("patch", kind, name, "-n", ns, "--type=merge", "-p", json.dumps(patch))


def ready_reason(cluster, ns: str, name: str, reason: str) -> dict | None:
    cond = condition(isvc(cluster, ns, name), "Ready")
    return cond if cond and cond["reason"] == reason else None


def settled(cluster, ns: str, name: str) -> dict | None:
    obj = isvc(cluster, ns, name)
    status = obj.get("status") or {}
    ready = condition(obj, "Ready")
    current = status.get("observedGeneration") == obj["metadata"]["generation"]
    return obj if current and ready and ready["status"] == "True" else None


def warnings(cluster, ns: str, name: str, reason: str) -> list[dict]:
    return [e for e in events_for(cluster, ns, name) if e["type"] == "Warning" and e["reason"] == reason]


def pods_of(cluster, ns: str, name: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"metronome.dev/inferenceservice={name}")["items"]


def scheduled_pod(cluster, ns: str, name: str) -> dict:
    return wait_for(lambda: next((p for p in pods_of(cluster, ns, name) if p["spec"].get("nodeName")), None),
                    f"a scheduled pod of {name}")


# --- pods that do not start ----------------------------------------------------------------------------------


def fetch_model_failure(tmp_path: Path) -> str:
    """What a real `metronome fetch-model` prints when the Hub refuses a gated repo: the last lines of its log, which
    the kubelet makes the termination message (terminationMessagePolicy FallbackToLogsOnError)."""
    with FakeHub() as hub:
        hub.add_repo("acme/gated-model", {"config.json": b"{}"}, gated=True)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, "HF_ENDPOINT": hub.url}
        result = subprocess.run([METRONOME, "fetch-model", "hf://acme/gated-model", "--cache-dir", str(tmp_path)],
                                capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0, result.stdout
    return result.stderr.strip()[-2048:]


def test_a_failing_model_download_and_an_image_pull_error_are_named_in_ready(cluster, ns, tmp_path):
    create(cluster, ns, manifest("fetch", model={"source": "hf://acme/gated-model"},
                                 podTemplate={"metadata": {"annotations": HELD_BY_TEST}}))
    pod = scheduled_pod(cluster, ns, "fetch")
    (init,) = pod["spec"]["initContainers"]
    assert init["name"] == "fetch-model" and init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    message = fetch_model_failure(tmp_path)
    pending = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Initialized", "status": "False", "reason": "ContainersNotInitialized",
         "message": "containers with incomplete status: [fetch-model]"},
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
        "containerStatuses": [{"name": "server", "image": SERVER_IMAGE, "imageID": "", "ready": False,
                               "restartCount": 0, "started": False,
                               "state": {"waiting": {"reason": "PodInitializing"}}}]}
    crash_loop = {"name": "fetch-model", "image": SERVER_IMAGE, "imageID": "", "ready": False, "restartCount": 3,
                  "started": False,
                  "state": {"waiting": {"reason": "CrashLoopBackOff",
                                        "message": "back-off 40s restarting failed container=fetch-model"}},
                  "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                                               "startedAt": "2026-12-01T10:00:00Z",
                                               "finishedAt": "2026-12-01T10:00:02Z"}}}
    set_pod_status(cluster, ns, pod["metadata"]["name"], {**pending, "initContainerStatuses": [crash_loop]})

    ready = wait_for(lambda: ready_reason(cluster, ns, "fetch", "ModelDownloadFailed"),
                     "Ready=False ModelDownloadFailed")
    assert ready["status"] == "False" and "fetch-model" in ready["message"] and "exit code 1" in ready["message"]
    assert "gated" in ready["message"], ready  # the download's own words
    wait_for(lambda: warnings(cluster, ns, "fetch", "ModelDownloadFailed"), "a Warning Event ModelDownloadFailed")
    progressing = condition(isvc(cluster, ns, "fetch"), "Progressing")
    assert "Ready says why" not in progressing["message"]

    pull = {"name": "fetch-model", "image": SERVER_IMAGE, "imageID": "", "ready": False, "restartCount": 0,
            "started": False, "state": {"waiting": {"reason": "ImagePullBackOff",
                                                    "message": f'Back-off pulling image "{SERVER_IMAGE}"'}}}
    set_pod_status(cluster, ns, pod["metadata"]["name"], {**pending, "initContainerStatuses": [pull]})
    ready = wait_for(lambda: ready_reason(cluster, ns, "fetch", "ImagePullFailed"), "Ready=False ImagePullFailed")
    assert SERVER_IMAGE in ready["message"] and "fetch-model" in ready["message"]
    wait_for(lambda: warnings(cluster, ns, "fetch", "ImagePullFailed"), "a Warning Event ImagePullFailed")


def test_pods_refused_by_a_quota_or_by_admission_are_named_in_ready(cluster, ns):
    cluster.apply(yaml.safe_dump({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-gpus"},
                                  "spec": {"hard": {"requests.nvidia.com/gpu": "0"}}}), namespace=ns)
    restricted = cluster.namespace("truth-restricted")
    cluster.kubectl("label", "namespace", restricted, "pod-security.kubernetes.io/enforce=restricted")
    create(cluster, ns, manifest("quota"))
    # A sidecar without a security context: the restricted Pod Security level refuses the pods.
    sidecar = {"name": "probe", "image": "busybox", "command": ["sleep", "infinity"]}
    create(cluster, restricted, manifest("psa", podTemplate={"spec": {"containers": [sidecar]}}))
    try:
        for namespace, name, words in ((ns, "quota", "exceeded quota"), (restricted, "psa", "PodSecurity")):
            ready = wait_for(lambda n=namespace, s=name: ready_reason(cluster, n, s, "ReplicaFailure"),
                             f"Ready=False ReplicaFailure for {name}", timeout=90)
            assert ready["status"] == "False" and words in ready["message"], ready
            wait_for(lambda n=namespace, s=name: warnings(cluster, n, s, "ReplicaFailure"),
                     f"a Warning Event ReplicaFailure for {name}")
    finally:
        cluster.kubectl("delete", "namespace", restricted, "--wait=false", check=False)


# --- children the API server refuses -------------------------------------------------------------------------


def test_a_spec_the_deployment_api_refuses_is_reported_and_creates_nothing(cluster, ns):
    # Valid for the CRD; Kubernetes refuses '=' in an environment variable's name.
    server = {"name": "server", "env": [{"name": "MODE=FAST", "value": "1"}]}
    create(cluster, ns, manifest("refused", podTemplate={"spec": {"containers": [server]}}))
    ready = wait_for(lambda: ready_reason(cluster, ns, "refused", "SpecRejected"), "Ready=False SpecRejected")
    assert ready["status"] == "False" and "spec.podTemplate.spec.containers" in ready["message"], ready
    assert "MODE=FAST" in ready["message"], ready
    wait_for(lambda: warnings(cluster, ns, "refused", "SpecRejected"), "a Warning Event SpecRejected")
    obj = isvc(cluster, ns, "refused")
    assert obj["status"].get("observedGeneration") != obj["metadata"]["generation"]
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        name = "refused-config" if kind == "configmap" else "refused"
        assert get_json(cluster, kind, name, "-n", ns) is None, f"{kind} written for a refused spec"


def test_a_refused_update_is_not_applied_and_says_so_until_it_is_fixed(cluster, ns):
    create(cluster, ns, manifest("update", replicas=2))
    before = wait_for(lambda: settled(cluster, ns, "update"), "Ready with observedGeneration current", timeout=90)
    template = get_json(cluster, "deployment", "update", "-n", ns)["spec"]["template"]
    # A sidecar port name that is not an IANA service name (upper case, underscore): valid for the CRD.
    sidecar = {"name": "exporter", "image": "busybox", "ports": [{"name": "Web_Port", "containerPort": 9100}]}
    merge_patch(cluster, ns, "update", {"spec": {"podTemplate": {"spec": {"containers": [sidecar]}}}})

    ready = wait_for(lambda: ready_reason(cluster, ns, "update", "SpecRejected"), "Ready=False SpecRejected")
    assert "Web_Port" in ready["message"] and "spec.podTemplate.spec.containers" in ready["message"], ready
    obj = isvc(cluster, ns, "update")
    assert obj["status"]["observedGeneration"] == before["metadata"]["generation"]  # not applied
    assert ready["observedGeneration"] == obj["metadata"]["generation"]  # ... and that is what Ready says
    assert condition(obj, "Progressing")["reason"] != "Stable"
    assert get_json(cluster, "deployment", "update", "-n", ns)["spec"]["template"] == template

    merge_patch(cluster, ns, "update", {"spec": {"podTemplate": None, "replicas": 3}})
    wait_for(lambda: settled(cluster, ns, "update"), "Ready again with the fixed spec applied", timeout=90)
    assert get_json(cluster, "deployment", "update", "-n", ns)["spec"]["replicas"] == 3


# --- children ------------------------------------------------------------------------------------------------


def test_deleted_and_edited_children_are_put_back(cluster, ns):
    create(cluster, ns, manifest("kept", replicas=2))
    wait_for(lambda: settled(cluster, ns, "kept"), "Ready", timeout=90)
    service = get_json(cluster, "service", "kept", "-n", ns)
    cluster.kubectl("delete", "service", "kept", "-n", ns)
    cluster.kubectl("delete", "poddisruptionbudget", "kept", "-n", ns)
    wait_for(lambda: get_json(cluster, "service", "kept", "-n", ns), "the Service to come back", timeout=30)
    wait_for(lambda: get_json(cluster, "poddisruptionbudget", "kept", "-n", ns), "the PDB to come back", timeout=30)
    assert get_json(cluster, "service", "kept", "-n", ns)["spec"]["ports"] == service["spec"]["ports"]

    merge_patch(cluster, ns, "kept", {"spec": {"replicas": 5}}, kind="deployment")
    cluster.kubectl("patch", "service", "kept", "-n", ns, "--type=json",
                    "-p", json.dumps([{"op": "replace", "path": "/spec/ports/0/targetPort", "value": 9000}]))
    wait_for(lambda: get_json(cluster, "deployment", "kept", "-n", ns)["spec"]["replicas"] == 2,
             "the Deployment's replicas put back", timeout=30)
    wait_for(lambda: get_json(cluster, "service", "kept", "-n", ns)["spec"]["ports"] == service["spec"]["ports"],
             "the Service's target port put back", timeout=30)
    wait_for(lambda: settled(cluster, ns, "kept"), "Ready", timeout=90)


MONITORING_CRDS = (("monitoring.coreos.com", "PodMonitor", "podmonitors"),
                   ("monitoring.coreos.com", "PrometheusRule", "prometheusrules"))


def test_monitoring_crds_installed_later_are_picked_up_without_a_restart(cluster, ns, operator):
    create(cluster, ns, manifest("watched", slo={"tbtP99Ms": 40}))
    wait_for(lambda: settled(cluster, ns, "watched"), "Ready", timeout=90)
    starts = operator.starts
    try:
        for group, kind, plural in MONITORING_CRDS:
            cluster.apply(open_crd(group, kind, plural))
        monitor = wait_for(lambda: get_json(cluster, "podmonitors.monitoring.coreos.com", "watched", "-n", ns),
                           "the PodMonitor of a service that existed before its CRD", timeout=60)
        assert monitor["metadata"]["ownerReferences"][0]["name"] == "watched"
        rule = wait_for(lambda: get_json(cluster, "prometheusrules.monitoring.coreos.com", "watched", "-n", ns),
                        "the service's SLO PrometheusRule", timeout=60)
        assert "40" in json.dumps(rule["spec"])
        cluster.kubectl("delete", "podmonitors.monitoring.coreos.com", "watched", "-n", ns)
        wait_for(lambda: get_json(cluster, "podmonitors.monitoring.coreos.com", "watched", "-n", ns),
                 "the deleted PodMonitor to come back", timeout=30)
    finally:
        for group, _, plural in MONITORING_CRDS:
            cluster.kubectl("delete", "crd", f"{plural}.{group}", "--ignore-not-found", check=False)
    # The CRDs' removal ends the open watches; a reconnect may find the kinds gone (404) before kopf's observer
    # has seen the deletion. The operator goes on serving: a service created afterwards becomes Ready.
    create(cluster, ns, manifest("after-removal"))
    wait_for(lambda: settled(cluster, ns, "after-removal"), "Ready after the CRDs' removal", timeout=90)
    assert operator.starts == starts and operator.process.poll() is None


# --- Events --------------------------------------------------------------------------------------------------


def test_events_only_for_real_changes_and_no_warnings_for_planned_ones(cluster, ns):
    create(cluster, ns, manifest("quiet", replicas=2))
    wait_for(lambda: settled(cluster, ns, "quiet"), "Ready", timeout=90)
    created = [e["reason"] for e in events_for(cluster, ns, "quiet") for _ in range(e.get("count") or 1)]
    assert created.count("AllReplicasReady") == 1, created
    merge_patch(cluster, ns, "quiet", {"metadata": {"labels": {"team": "a"}}})  # no spec change
    merge_patch(cluster, ns, "quiet", {"spec": {"replicas": 4}})  # a planned scale-up
    wait_for(lambda: settled(cluster, ns, "quiet") and isvc(cluster, ns, "quiet")["status"]["ready"] == "4/4",
             "4/4 ready after the scale-up", timeout=90)
    merge_patch(cluster, ns, "quiet", {"spec": {"resources": {"cpu": "2"}}})  # a planned rollout
    wait_for(lambda: (obj := settled(cluster, ns, "quiet"))
             and condition(obj, "Progressing")["reason"] == "Stable", "the rollout to finish", timeout=120)

    events = events_for(cluster, ns, "quiet")
    reasons = [e["reason"] for e in events for _ in range(e.get("count") or 1)]
    assert [e for e in events if e["type"] == "Warning"] == [], [(e["reason"], e["message"]) for e in events]
    assert reasons.count("Created") == 3, reasons  # Deployment, Service, PodDisruptionBudget: once each
    assert reasons.count("ConfigCreated") == 1 and reasons.count("Scaled") == 1, reasons
    assert reasons.count("RollingUpdate") == 1 and "Updated" not in reasons, reasons
    annotations = isvc(cluster, ns, "quiet")["metadata"].get("annotations") or {}
    assert not [key for key in annotations if key.startswith("metronome.dev/")], annotations  # no kopf progress
