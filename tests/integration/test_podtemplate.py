"""spec.podTemplate, spec.strategy, spec.disruption and spec.shutdown on the real control plane: the CRD refuses
bad overlays naming the field; the operator (under the chart's RBAC) builds the Deployment with the overlay merged
and keeps a PodDisruptionBudget; a Deployment's ReplicaFailure (a quota) reaches the Ready condition.

The operator tests share one InferenceService (examples/inferenceservice-podtemplate.yaml) and run in order.
"""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from metronome_testing.chart import chart_release, ensure_crd, service_account_kubeconfig
from metronome_testing.checkout import ROOT
from metronome_testing.kube_objects import condition, events_for, get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

EXAMPLE = ROOT / "examples" / "inferenceservice-podtemplate.yaml"
VALID = yaml.safe_load(EXAMPLE.read_text())
NAME = VALID["metadata"]["name"]
LABEL = f"metronome.dev/inferenceservice={NAME}"


def _with(path: str, value) -> dict:
    """VALID with `path` (dots; [n] picks a list item) set to `value`."""
    obj = copy.deepcopy(VALID)
    node = obj
    keys = path.split(".")
    for key in keys[:-1]:
        name, _, index = key.partition("[")
        node = node.setdefault(name, {})
        if index:
            node = node[int(index.rstrip("]"))]
    node[keys[-1]] = value
    return obj


def _containers(*containers: dict) -> dict:
    return _with("spec.podTemplate.spec.containers", list(containers))


INVALID = [
    # (id, object, text the API server's message must contain)
    ("unknown-pod-field", _with("spec.podTemplate.spec.hostNetwork", True), "spec.podTemplate.spec.hostNetwork"),
    ("volume-named-like-ours", _with("spec.podTemplate.spec.volumes", [{"name": "model", "emptyDir": {}}]),
     "spec.podTemplate.spec.volumes[].name may not be one of the operator's own volumes"),
    ("volume-without-source", _with("spec.podTemplate.spec.volumes", [{"name": "scratch"}]),
     "spec.podTemplate.spec.volumes[] needs exactly one source"),
    ("hostpath-volume", _with("spec.podTemplate.spec.volumes", [{"name": "h", "hostPath": {"path": "/"}}]),
     "spec.podTemplate.spec.volumes[0].hostPath"),
    ("server-image", _containers({"name": "server", "image": "evil:1"}),
     "spec.podTemplate.spec.containers[name=server] may set only env, envFrom and volumeMounts"),
    ("sidecar-without-image", _containers({"name": "proxy"}),
     "spec.podTemplate.spec.containers[].image is required for a sidecar"),
    ("mount-of-unknown-volume", _containers({"name": "server", "volumeMounts": [{"name": "nope", "mountPath": "/x"}]}),
     "spec.podTemplate.spec.containers[].volumeMounts[].name must name a volume"),
    ("mount-over-ours", _containers({"name": "server", "volumeMounts": [{"name": "tmp", "mountPath": "/models"}]}),
     "spec.podTemplate.spec.containers[name=server].volumeMounts[].mountPath may not"),
    ("env-value-and-valuefrom", _containers({"name": "server", "env": [
        {"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}),
     "spec.podTemplate.spec.containers[].env[] sets value or valueFrom, not both"),
    ("reserved-label", _with("spec.podTemplate.metadata.labels", {"app.kubernetes.io/instance": "x"}),
     "spec.podTemplate.metadata.labels may not set the operator's own labels"),
    ("bad-spread-policy", _with("spec.podTemplate.spec.topologySpreadConstraints[0].whenUnsatisfiable", "Maybe"),
     "spec.podTemplate.spec.topologySpreadConstraints[0].whenUnsatisfiable"),
    ("bad-affinity-operator", _with("spec.podTemplate.spec.affinity", {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Near"}]}]}}}),
     "spec.podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
     ".nodeSelectorTerms[0].matchExpressions[0].operator"),
    ("bad-service-account", _with("spec.podTemplate.spec.serviceAccountName", "Not_A_Name"),
     "spec.podTemplate.spec.serviceAccountName"),
    ("strategy-both-zero", _with("spec.strategy", {"maxSurge": 0, "maxUnavailable": "0%"}),
     "spec.strategy.maxSurge and spec.strategy.maxUnavailable may not both be 0"),
    ("strategy-bad-percent", _with("spec.strategy", {"maxUnavailable": "150%"}), "spec.strategy.maxUnavailable"),
    ("disruption-both", _with("spec.disruption", {"maxUnavailable": 1, "minAvailable": 1}),
     "spec.disruption sets maxUnavailable or minAvailable, not both"),
    ("extra-arg-owned-flag", _with("spec.engine.extraArgs", ["--port=9000"]),
     "spec.engine.extraArgs may not repeat a flag the operator sets"),
    ("negative-prestop", _with("spec.shutdown.preStopSleepSeconds", -1), "spec.shutdown.preStopSleepSeconds"),
]


@pytest.fixture(scope="module")
def crd_ns(cluster):
    ensure_crd(cluster)
    return cluster.namespace("podtemplate-crd")


def _dry_run(cluster, ns: str, obj: dict):
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-o", "json", "-f", "-",
                           input=json.dumps(obj), check=False)


def test_the_example_is_accepted(cluster, crd_ns):
    result = _dry_run(cluster, crd_ns, VALID)
    assert result.returncode == 0, result.stderr
    stored = json.loads(result.stdout)["spec"]
    assert stored["podTemplate"] == VALID["spec"]["podTemplate"]  # nothing pruned
    assert stored["strategy"] == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize(("obj", "expected"), [(o, e) for _, o, e in INVALID], ids=[i for i, _, _ in INVALID])
def test_bad_overlays_are_rejected_naming_the_field(cluster, crd_ns, obj, expected):
    result = _dry_run(cluster, crd_ns, obj)
    assert result.returncode != 0, f"accepted: {json.dumps(obj['spec'])}"
    assert expected in result.stderr, result.stderr


# --- the operator ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    release = chart_release(cluster)
    work = tmp_path_factory.mktemp("podtemplate-operator")
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account, work / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=work)
    process.start()
    yield process
    process.stop()
    assert "Forbidden" not in process.all_logs(), "the operator hit an RBAC denial:\n" + process.all_logs()[-4000:]


@pytest.fixture(scope="module")
def ns(cluster):
    namespace = cluster.namespace("podtemplate")
    # The objects the overlay names must exist, or the API server refuses the pods.
    cluster.kubectl("create", "serviceaccount", "model-reader", "-n", namespace)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "inference-high"},
        "value": 1000, "description": "test",
    }))
    return namespace


def _service(cluster, ns, name: str = NAME):
    return get_json(cluster, "inferenceservices.metronome.dev", name, "-n", ns)


def _deployment(cluster, ns):
    return get_json(cluster, "deployment", NAME, "-n", ns)


def _patch(cluster, ns, spec: dict) -> None:
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": spec}))


def test_the_deployment_carries_the_overlay(cluster, operator, ns):
    body = _with("spec.podTemplate.spec.serviceAccountName", "model-reader")
    body["spec"]["podTemplate"]["spec"]["priorityClassName"] = "inference-high"
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(body))
    deployment = wait_for(lambda: _deployment(cluster, ns), "the Deployment")

    spec = deployment["spec"]
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    template = spec["template"]
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert template["metadata"]["labels"]["metronome.dev/inferenceservice"] == NAME
    assert template["metadata"]["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "true"
    pod = template["spec"]
    assert pod["serviceAccountName"] == "model-reader" and pod["priorityClassName"] == "inference-high"
    assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 100
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["labelSelector"]["matchLabels"]["metronome.dev/inferenceservice"] == NAME
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hf-token"]["secret"]["secretName"] == "hf-token"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    (server,) = pod["containers"]
    env = {e["name"]: e for e in server["env"]}
    assert env["HF_TOKEN_PATH"]["value"] == "/var/run/secrets/hf/token" and "HOME" in env
    assert server["envFrom"] == [{"secretRef": {"name": "server-env", "optional": True}}]
    assert {"name": "hf-token", "mountPath": "/var/run/secrets/hf", "readOnly": True} in server["volumeMounts"]
    assert server["args"][-2:] == ["--log-level", "warning"]
    assert server["args"][server["args"].index("--drain-seconds") + 1] == "60"
    assert server["lifecycle"]["preStop"] == {"sleep": {"seconds": 20}}
    assert pod["terminationGracePeriodSeconds"] == 20 + 60 + 15

    # The pods exist (the API server admitted them: service account and priority class resolve) and run.
    wait_for(lambda: (condition(_service(cluster, ns), "Ready") or {}).get("status") == "True",
             "Ready with the overlay's pods running", timeout=120)
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", LABEL)["items"]
    assert pods and all(p["spec"]["priority"] == 1000 for p in pods)


def test_a_disruption_budget_is_kept_and_removed_on_request(cluster, operator, ns):
    pdb = wait_for(lambda: get_json(cluster, "pdb", NAME, "-n", ns), "the PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"]["matchLabels"]["metronome.dev/inferenceservice"] == NAME
    (owner,) = pdb["metadata"]["ownerReferences"]
    assert owner["kind"] == "InferenceService" and owner["controller"] is True
    # The budget is computed against the ready pods (the disruption controller sees them).
    wait_for(lambda: (get_json(cluster, "pdb", NAME, "-n", ns).get("status") or {}).get("currentHealthy") == 2,
             "the PDB to count 2 healthy pods")

    _patch(cluster, ns, {"disruption": {"maxUnavailable": None, "minAvailable": "50%"}})
    wait_for(lambda: get_json(cluster, "pdb", NAME, "-n", ns)["spec"].get("minAvailable") == "50%",
             "the PDB to switch to minAvailable 50%")
    assert "maxUnavailable" not in get_json(cluster, "pdb", NAME, "-n", ns)["spec"]

    _patch(cluster, ns, {"disruption": {"enabled": False}})
    wait_for(lambda: get_json(cluster, "pdb", NAME, "-n", ns) is None, "the PDB to be deleted")


def test_replica_failure_reaches_the_ready_condition(cluster, operator, ns):
    # No pod may be created in the namespace: the ReplicaSet controller's FailedCreate surfaces on the Deployment.
    cluster.kubectl("create", "quota", "no-pods", "-n", ns, "--hard=pods=2")
    _patch(cluster, ns, {"replicas": 3})

    def failing():
        ready = condition(_service(cluster, ns), "Ready") or {}
        return ready.get("reason") == "ReplicaFailure" and ready

    ready = wait_for(failing, "Ready=False with reason ReplicaFailure", timeout=120)
    assert ready["status"] == "False"
    assert "exceeded quota" in ready["message"] and "no-pods" in ready["message"], ready["message"]

    cluster.kubectl("delete", "quota", "no-pods", "-n", ns)
    wait_for(lambda: (condition(_service(cluster, ns), "Ready") or {}).get("status") == "True",
             "Ready again once the quota is gone", timeout=180)


def test_what_only_the_operator_can_check_is_refused_in_an_event(cluster, operator, ns):
    """The schema does not check annotation keys; the operator does, and says which field in Ready and in an
    InvalidSpec Event."""
    bad = _with("metadata.name", "bad-annotations")
    bad["spec"]["podTemplate"]["metadata"]["annotations"] = {"not a key!": "x"}
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(bad))

    def refusal():
        events = events_for(cluster, ns, "bad-annotations")
        return next((e for e in events if e["reason"] == "InvalidSpec"), None)

    event = wait_for(refusal, "an InvalidSpec Event for bad-annotations")
    assert event["type"] == "Warning"
    assert event["message"].startswith("spec.podTemplate.metadata.annotations: 'not a key!' is not a valid key")
    ready = condition(_service(cluster, ns, "bad-annotations"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and "not a key!" in ready["message"]
    assert get_json(cluster, "deployment", "bad-annotations", "-n", ns) is None
