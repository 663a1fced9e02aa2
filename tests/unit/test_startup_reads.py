"""A new operator (a restart, a new leader) whose watches have listed the InferenceService but not yet its
Deployment, its pods, the HPAs or ScaledObjects of its namespace or KEDA's CRD: its first reconcile reads those from
the API (once per operator start) instead of planning from the gap, so it neither resets the replicas an HPA or a
ScaledObject set nor publishes a status (0 ready replicas, another Ready reason, Events) computed without them. What
it read and no watch delivered since is listed again, and forgotten when gone; in steady state nothing is read."""
from __future__ import annotations

import copy

import pytest
from kube_fakes import MemoryKube
from test_external_scalers import hpa, keda_crd, scaled_object
from test_reconcile import body

from metronome.operator import builders, kinds, reconcile, runtime
from metronome.operator.cache import ObjectCache
from metronome.operator.options import OperatorOptions

SERVICE = ("InferenceService", "ml", "chat")
DEPLOYMENT = ("Deployment", "ml", "chat")
SCALED_BY_HPA = 5  # spec.replicas is 2


def conditions(kube: MemoryKube) -> dict[str, dict]:
    return {c["type"]: c for c in kube.objects[SERVICE]["status"]["conditions"]}


def set_deployment(kube: MemoryKube, replicas: int, ready: int) -> None:
    """What the Deployment controller (and a scaler) made of the Deployment the operator wrote."""
    deployment = copy.deepcopy(kube.objects[DEPLOYMENT])
    deployment["spec"]["replicas"] = replicas
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                            "availableReplicas": ready, "updatedReplicas": replicas}
    kube.put(deployment)


def pod(name: str, ready: bool) -> dict:
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
              "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0, "started": True,
                                     "state": {"running": {}}}]}
    if not ready:
        status = {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}],
                  "containerStatuses": [{"name": "server", "ready": False, "restartCount": 0, "image": "bad:tag",
                                         "state": {"waiting": {"reason": "ImagePullBackOff",
                                                               "message": "pull access denied"}}}]}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "labels": builders.pod_labels("chat")},
            "status": status}


def previous_operator(kube: MemoryKube) -> None:
    """The operator that ran before: it wrote the children and the status of what runs."""
    old = runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)
    old.reconcile("ml", "chat")
    old.reconcile("ml", "chat")


def new_operator(kube: MemoryKube, listed: tuple[str, ...] = ()) -> runtime.Runtime:
    """A new operator whose cache holds the InferenceService and of the rest only the kinds in `listed` (the watches
    that have listed so far)."""
    kube.cache = ObjectCache()
    for key, obj in kube.objects.items():
        if key[0] in ("InferenceService", *listed):
            kube.cache.put(key[0], copy.deepcopy(obj))
    kube.events, kube.requests = [], []
    return runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)


def scaler_on_the_deployment(kube: MemoryKube, kind: str) -> None:
    if kind == "HorizontalPodAutoscaler":
        kube.put(hpa("web", "Deployment", "chat", "apps/v1"))
    else:
        kube.put({**keda_crd(), "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition"})
        kube.put(scaled_object("keda", {"name": "chat"}))


NOT_THE_SCALERS = ("ConfigMap", "Deployment", "Pod", "CustomResourceDefinition")
NOT_THE_DEPLOYMENT = ("ConfigMap", "Pod", "HorizontalPodAutoscaler", "ScaledObject", "CustomResourceDefinition")
NOT_KEDAS_CRD = ("ConfigMap", "Deployment", "Pod", "HorizontalPodAutoscaler", "ScaledObject")


@pytest.mark.parametrize("scaler, listed", [
    ("HorizontalPodAutoscaler", NOT_THE_SCALERS), ("ScaledObject", NOT_THE_SCALERS),
    ("HorizontalPodAutoscaler", NOT_THE_DEPLOYMENT), ("ScaledObject", NOT_THE_DEPLOYMENT),
    ("ScaledObject", NOT_KEDAS_CRD),
    ("HorizontalPodAutoscaler", ()), ("ScaledObject", ()),  # nothing but the service
], ids=["hpa-no-scalers", "keda-no-scalers", "hpa-no-deployment", "keda-no-deployment", "keda-no-crd",
        "hpa-nothing", "keda-nothing"])
def test_a_new_operator_keeps_the_replicas_a_scaler_set_whatever_its_cache_lacks(scaler, listed):
    kube = MemoryKube()
    kube.put(body())
    scaler_on_the_deployment(kube, scaler)
    previous_operator(kube)
    set_deployment(kube, replicas=SCALED_BY_HPA, ready=SCALED_BY_HPA)
    previous_operator(kube)
    assert conditions(kube)["ReplicasManagedExternally"]["reason"] == scaler
    status_before = copy.deepcopy(kube.objects[SERVICE]["status"])

    new_operator(kube, listed).reconcile("ml", "chat")

    assert kube.objects[DEPLOYMENT]["spec"]["replicas"] == SCALED_BY_HPA
    assert ("apply", "Deployment") not in kube.requests and kube.events == []
    assert kube.objects[SERVICE]["status"] == status_before


def test_a_new_operator_publishes_no_status_computed_without_the_pods():
    kube = MemoryKube()
    kube.put(body())
    previous_operator(kube)
    set_deployment(kube, replicas=2, ready=1)
    kube.put(pod("chat-a", ready=True))
    kube.put(pod("chat-b", ready=False))
    previous_operator(kube)
    ready = conditions(kube)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ImagePullFailed")
    status_before = copy.deepcopy(kube.objects[SERVICE]["status"])

    new_operator(kube, listed=("ConfigMap", "Deployment")).reconcile("ml", "chat")

    assert kube.objects[SERVICE]["status"] == status_before and kube.events == []
    assert ("list", "Pod") in kube.requests


def test_a_new_operator_reports_the_ready_replicas_of_a_refused_generation_it_has_not_listed():
    # The children of generation 2 are refused: nothing is written, and status reports the pods still running.
    kube = MemoryKube()
    kube.put(body())
    previous_operator(kube)
    set_deployment(kube, replicas=2, ready=2)
    kube.put({**kube.objects[SERVICE], "spec": {**kube.objects[SERVICE]["spec"], "replicas": 3},
              "metadata": {**kube.objects[SERVICE]["metadata"], "generation": 2}})
    kube.refuse["Deployment"] = (403, 'deployments.apps "chat" is forbidden: exceeded quota', [])
    previous_operator(kube)
    assert kube.objects[SERVICE]["status"]["readyReplicas"] == 2
    status_before = copy.deepcopy(kube.objects[SERVICE]["status"])

    new_operator(kube, listed=("ConfigMap",)).reconcile("ml", "chat")

    # (A new operator announces the refusal once more: it tries the change again after a restart.)
    assert kube.objects[SERVICE]["status"] == status_before
    assert [reason for _, reason, _ in kube.events] == ["SpecRejected"]


def test_reads_happen_once_per_start_and_a_read_the_watch_never_confirms_is_listed_again(monkeypatch):
    monkeypatch.setattr(reconcile, "CONFIRM_S", 0.0)
    kube = MemoryKube()
    kube.put(body())
    kube.put(hpa("web", "Deployment", "chat", "apps/v1"))
    previous_operator(kube)
    kube.put(pod("chat-a", ready=True))
    kube.put(pod("chat-gone", ready=True))
    rt = new_operator(kube, listed=("ConfigMap", "Deployment"))
    later = []
    monkeypatch.setattr(rt.queue, "add_after", lambda key, delay: later.append(key))
    rt.reconcile("ml", "chat")
    assert sorted(r for r in kube.requests if r[0] == "list") == [
        ("list", "HorizontalPodAutoscaler"), ("list", "Pod")]
    assert later == [("ml", "chat")]  # to look again once the watches should have delivered what was read
    # The pod watch delivers one pod; the other was deleted before that watch listed: no event will say so.
    rt.observe(kinds.POD, None, kube.objects[("Pod", "ml", "chat-a")])
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, None, kube.objects[("HorizontalPodAutoscaler", "ml", "web")])
    del kube.objects[("Pod", "ml", "chat-gone")]
    kube.requests, later[:] = [], []
    rt.reconcile("ml", "chat")
    assert [p["metadata"]["name"] for p in kube.cache.owned("Pod", "ml", "chat")] == ["chat-a"]
    assert [r for r in kube.requests if r[0] in ("list", "get")] == [("list", "Pod")] and later == []
    kube.requests = []
    rt.reconcile("ml", "chat")  # steady state: everything delivered by the watches, nothing read
    assert kube.requests == []


def test_a_read_of_a_version_a_watch_already_delivered_needs_no_confirmation():
    now = [0.0]
    cache = ObjectCache(clock=lambda: now[0])
    listed = {"metadata": {"name": "a", "namespace": "ml", "resourceVersion": "7"}}
    cache.put("Pod", listed)
    assert not cache.put_read("Pod", copy.deepcopy(listed))
    now[0] = 10.0
    assert not cache.unconfirmed("Pod", "ml", "a", for_s=0.0)
    newer = {"metadata": {"name": "a", "namespace": "ml", "resourceVersion": "8"}}
    assert cache.put_read("Pod", newer) and cache.unconfirmed("Pod", "ml", "a", for_s=0.0)
    now[0] = 20.0
    assert cache.put_read("Pod", copy.deepcopy(newer))  # read again while unconfirmed: its clock starts again
    assert not cache.unconfirmed("Pod", "ml", "a", for_s=5.0)
