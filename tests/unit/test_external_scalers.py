"""Another autoscaler on a service: an HPA or a KEDA ScaledObject whose scaleTargetRef names the InferenceService or
its Deployment is found (and nothing else is), from the watch cache and never by a request; its events queue the
service it targets (not its status updates); ScaledObjects count only while KEDA's CRD is served, also when the CRD
appears later; the control loop then leaves replicas alone and says so in the ReplicasManagedExternally condition,
and a scaler on the Deployment keeps the count it set, with no write when it moves."""
from __future__ import annotations

import copy

from kube_fakes import MemoryKube
from test_control_loop import LOCAL, apply_body, prometheus, sync  # noqa: F401 - the fixture

from metronome.operator import control_loop, kinds, reconcile, runtime
from metronome.operator.changes import describe_transitions
from metronome.operator.external_scalers import ScalerView, cached_scalers, scalers_targeting, targeted_services
from metronome.operator.options import OperatorOptions
from metronome.operator.spec import parse_service
from metronome.operator.status import Observed, compute_status, replicas_condition
from metronome.operator.tuning import autotune


def hpa(name: str, kind: str, target: str, api_version: str, namespace: str = "ml") -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 3}}


def scaled_object(name: str, ref: dict) -> dict:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}"}, "spec": {"scaleTargetRef": ref}}


def keda_crd() -> dict:
    return {"metadata": {"name": kinds.SCALED_OBJECT.crd, "resourceVersion": "1"},
            "status": {"conditions": [{"type": "Established", "status": "True"}]}}


def conditions_of(kube: MemoryKube) -> dict:
    status = kube.objects[("InferenceService", "ml", "chat")]["status"]
    return {c["type"]: c for c in status["conditions"]}


def test_only_scalers_that_target_the_service_or_its_deployment_count():
    service = parse_service(apply_body(scaleReplicas=True))
    hpas = [hpa("on-service", "InferenceService", "chat", "metronome.dev/v1alpha1"),
            hpa("on-deployment", "Deployment", "chat", "apps/v1"),
            hpa("other-service", "InferenceService", "chat", "serving.kserve.io/v1beta1"),  # KServe's, not ours
            hpa("other-name", "Deployment", "web", "apps/v1")]
    keda = [scaled_object("keda-default", {"name": "chat"}),  # KEDA reads a bare name as an apps/v1 Deployment
            scaled_object("keda-statefulset", {"name": "chat", "kind": "StatefulSet", "apiVersion": "apps/v1"})]
    found = scalers_targeting(service, hpas, keda)
    assert [(s.kind, s.name, s.target_kind) for s in found] == [
        ("HorizontalPodAutoscaler", "on-deployment", "Deployment"),
        ("HorizontalPodAutoscaler", "on-service", "InferenceService"),
        ("ScaledObject", "keda-default", "Deployment")]


def test_a_scaler_names_its_service_directly_or_through_a_deployment_the_operator_made():
    kube, owner = MemoryKube(), apply_body()
    sync(kube, parse_service(owner), owner)
    kube.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "ml"}})
    cache = kube.cache
    assert targeted_services("HorizontalPodAutoscaler", hpa("a", "InferenceService", "chat",
                                                            "metronome.dev/v1alpha1"), cache) == {("ml", "chat")}
    assert targeted_services("HorizontalPodAutoscaler", hpa("b", "Deployment", "chat", "apps/v1"), cache) == {
        ("ml", "chat")}
    assert targeted_services("ScaledObject", scaled_object("c", {"name": "chat"}), cache) == {("ml", "chat")}
    assert targeted_services("HorizontalPodAutoscaler", hpa("d", "Deployment", "web", "apps/v1"), cache) == set()
    assert targeted_services("HorizontalPodAutoscaler", hpa("e", "Deployment", "chat", "apps/v1", "other"),
                             cache) == set()


def test_scaler_events_queue_the_service_they_target_but_not_their_status_updates():
    kube, owner = MemoryKube(), apply_body()
    kube.put(owner)
    rt = runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)
    rt.reconcile("ml", "chat")

    def queued() -> list:
        keys = []
        while (key := rt.queue.get(0)) is not None:
            keys.append(key)
            rt.queue.done(key)
        return keys

    web = hpa("web", "Deployment", "chat", "apps/v1")
    web["metadata"]["resourceVersion"] = "100"
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, None, web)
    assert queued() == [("ml", "chat")]
    busy = copy.deepcopy(web)
    busy["metadata"]["resourceVersion"] = "101"
    busy["status"] = {"currentReplicas": 3, "desiredReplicas": 3}
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, "MODIFIED", busy)
    assert queued() == []  # a scaler's status moves nothing here
    elsewhere = copy.deepcopy(busy)
    elsewhere["metadata"]["resourceVersion"] = "102"
    elsewhere["spec"]["scaleTargetRef"]["name"] = "web"
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, "MODIFIED", elsewhere)
    assert queued() == [("ml", "chat")]  # it left the service: the service takes its replicas back
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, "DELETED", elsewhere)
    assert queued() == [] and kube.cache.in_namespace("HorizontalPodAutoscaler", "ml") == []


def test_a_reconcile_finds_the_scalers_in_the_cache_without_a_request():
    kube, owner = MemoryKube(), apply_body(scaleReplicas=True)
    kube.put(owner)
    rt = runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)
    rt.reconcile("ml", "chat")
    assert (conditions_of(kube)["ReplicasManagedExternally"]["status"],
            conditions_of(kube)["ReplicasManagedExternally"]["reason"]) == ("False", "AutotuneScales")
    rt.observe(kinds.HORIZONTAL_POD_AUTOSCALER, None, kube.put(hpa("web", "InferenceService", "chat",
                                                                   "metronome.dev/v1alpha1"), watched=False))
    kube.requests = []
    rt.reconcile("ml", "chat")
    assert conditions_of(kube)["ReplicasManagedExternally"]["reason"] == "HorizontalPodAutoscaler"
    assert [verb for verb, _ in kube.requests] == ["patch"]  # the status; nothing read


def test_scaled_objects_count_once_kedas_crd_is_served_also_when_it_appears_later():
    kube, owner = MemoryKube(), apply_body()
    kube.put(owner)
    rt = runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)
    rt.reconcile("ml", "chat")
    rt.observe(kinds.SCALED_OBJECT, None, scaled_object("keda", {"name": "chat"}))
    assert cached_scalers(kube.cache, parse_service(owner), keda_served=True).owner == "ScaledObject ml/keda"
    rt.reconcile("ml", "chat")
    assert conditions_of(kube)["ReplicasManagedExternally"]["status"] == "False"  # no CRD: not KEDA's
    while (key := rt.queue.get(0)) is not None:
        rt.queue.done(key)
    rt.observe(kinds.CRD, None, keda_crd())
    assert rt.queue.get(0) == ("ml", "chat")  # KEDA installed: every service looks again
    rt.reconcile("ml", "chat")
    assert conditions_of(kube)["ReplicasManagedExternally"]["reason"] == "ScaledObject"


def test_the_condition_says_who_sets_the_replicas():
    service = parse_service(apply_body(scaleReplicas=True))
    owned = ScalerView(scalers_targeting(service, [hpa("web", "InferenceService", "chat", "metronome.dev/v1alpha1")]))
    status, reason, message = replicas_condition(service, owned)
    assert (status, reason) == ("True", "HorizontalPodAutoscaler")
    assert "HorizontalPodAutoscaler ml/web sets the replicas of the InferenceService" in message
    assert replicas_condition(service, ScalerView())[:2] == ("False", "AutotuneScales")
    assert replicas_condition(parse_service(apply_body()), ScalerView())[:2] == ("False", "SpecReplicas")
    # Going back to the loop is news, not a problem.
    before = [{"type": "ReplicasManagedExternally", "status": "True", "reason": "HorizontalPodAutoscaler"}]
    after = [{"type": "ReplicasManagedExternally", "status": "False", "reason": "AutotuneScales", "message": "m"}]
    (event,) = describe_transitions(before, after)
    assert event.type == "Normal" and event.reason == "AutotuneScales"


def test_an_hpa_stops_the_loop_from_scaling_and_the_status_says_so(prometheus):  # noqa: F811
    kube, owner = MemoryKube(), apply_body(minChunkSize=1024, scaleReplicas=True)
    service = parse_service(owner)
    sync(kube, service, owner)
    kube.put(hpa("web", "InferenceService", "chat", "metronome.dev/v1alpha1"))
    scalers = cached_scalers(kube.cache, service, keda_served=False)
    observed = reconcile.observe(kube.cache, service, scalers=scalers)
    result = control_loop.tick(kube, service, owner, observed, autotune.TunerMemory(), LOCAL)
    assert result.replicas is None and kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    assert "AutotuneScaled" not in [reason for _, reason, _ in kube.events]
    conditions = {c["type"]: c for c in compute_status(service, result.observed, now="t")["conditions"]}
    assert conditions["ReplicasManagedExternally"]["status"] == "True"


def test_a_scaler_on_the_deployment_keeps_the_count_it_set_and_its_moves_are_not_written():
    kube, owner = MemoryKube(), apply_body()
    service = parse_service(owner)
    memory, refused = reconcile.ConfigMemory(), reconcile.SyncMemory()

    def sync_with_scalers() -> None:
        reconcile.sync_children(kube.children(), service, owner, memory, refused, 0.0,
                                cached_scalers(kube.cache, service, keda_served=False))

    def scale_deployment(replicas: int) -> dict:
        deployment = copy.deepcopy(kube.objects[("Deployment", "ml", "chat")])
        deployment["spec"]["replicas"] = replicas
        return kube.put(deployment)

    sync_with_scalers()
    scale_deployment(5)
    sync_with_scalers()
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2  # nobody else: spec.replicas wins
    kube.put(hpa("web", "Deployment", "chat", "apps/v1"))
    scale_deployment(5)  # the HPA scaled it
    kube.requests = []
    sync_with_scalers()
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 5 and kube.requests == []
    deployment = scale_deployment(4)
    deployment["status"] = {"replicas": 4, "readyReplicas": 4, "updatedReplicas": 4, "availableReplicas": 4,
                            "observedGeneration": 1}
    deployment["metadata"]["generation"] = 1
    kube.put(deployment)
    sync_with_scalers()
    assert kube.requests == []  # the scaler moved it again: still nothing to write
    scalers = cached_scalers(kube.cache, service, keda_served=False)
    status = compute_status(service, Observed(kube.cache.get("Deployment", "ml", "chat"), scalers=scalers), now="t")
    assert status["ready"] == "4/4"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
