"""Another autoscaler on a service: an HPA or a KEDA ScaledObject whose scaleTargetRef names the InferenceService or
its Deployment is found (and nothing else is), the control loop then leaves replicas alone and says so in the
ReplicasManagedExternally condition, and a scaler on the Deployment keeps the count it set."""
from __future__ import annotations

from test_control_loop import LOCAL, apply_body, prometheus  # noqa: F401 - the fixture
from test_reconcile import MemoryKube

from metronome.operator import control_loop, reconcile
from metronome.operator.changes import describe_transitions
from metronome.operator.external_scalers import (
    KEDA_CRD,
    ScalerView,
    find_external_scalers,
    keda_installed,
    scalers_targeting,
)
from metronome.operator.spec import parse_service
from metronome.operator.status import Observed, compute_status, replicas_condition
from metronome.operator.tuning import autotune


def hpa(name: str, kind: str, target: str, api_version: str, namespace: str = "ml") -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"scaleTargetRef": {"apiVersion": api_version, "kind": kind, "name": target},
                     "minReplicas": 1, "maxReplicas": 3}}


def scaled_object(name: str, ref: dict) -> dict:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"scaleTargetRef": ref}}


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


def test_scaled_objects_are_listed_only_where_keda_is_installed(monkeypatch):
    kube = MemoryKube()
    service = parse_service(apply_body())
    kube.objects[("ScaledObject", "ml", "keda")] = scaled_object("keda", {"name": "chat"})
    assert find_external_scalers(kube, service).scalers == ()
    kube.crds.add(KEDA_CRD)
    assert find_external_scalers(kube, service).scalers == ()  # the CRD is asked about once a minute
    monkeypatch.setattr(keda_installed, "CRD_RECHECK_S", 0.0)
    assert find_external_scalers(kube, service).owner == "ScaledObject ml/keda"


def test_the_condition_says_who_sets_the_replicas():
    service = parse_service(apply_body(scaleReplicas=True))
    owned = ScalerView(scalers_targeting(service, [hpa("web", "InferenceService", "chat", "metronome.dev/v1alpha1")]))
    status, reason, message = replicas_condition(service, owned)
    assert (status, reason) == ("True", "HorizontalPodAutoscaler")
    assert "HorizontalPodAutoscaler ml/web sets the replicas of the InferenceService" in message
    assert replicas_condition(service, ScalerView())[:2] == ("False", "AutotuneScales")
    assert replicas_condition(parse_service(apply_body()), ScalerView())[:2] == ("False", "SpecReplicas")
    assert replicas_condition(service, ScalerView(error="cannot list: HTTP 403 Forbidden"))[:2] == (
        "Unknown", "ScalersUnknown")
    # Going back to the loop is news, not a problem.
    before = [{"type": "ReplicasManagedExternally", "status": "True", "reason": "HorizontalPodAutoscaler"}]
    after = [{"type": "ReplicasManagedExternally", "status": "False", "reason": "AutotuneScales", "message": "m"}]
    (event,) = describe_transitions(before, after)
    assert event.type == "Normal" and event.reason == "AutotuneScales"


def test_an_hpa_stops_the_loop_from_scaling_and_the_status_says_so(prometheus):  # noqa: F811
    kube, owner = MemoryKube(), apply_body(minChunkSize=1024, scaleReplicas=True)
    service = parse_service(owner)
    reconcile.sync_children(kube, service, owner)
    kube.objects[("HorizontalPodAutoscaler", "ml", "web")] = hpa("web", "InferenceService", "chat",
                                                                  "metronome.dev/v1alpha1")
    observed = reconcile.observe(kube, service)
    result = control_loop.tick(kube, service, owner, observed, autotune.TunerMemory(), LOCAL)
    assert result.replicas is None and kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    assert "AutotuneScaled" not in [reason for _, reason, _ in kube.events]
    conditions = {c["type"]: c for c in compute_status(service, result.observed, now="t")["conditions"]}
    assert conditions["ReplicasManagedExternally"]["status"] == "True"


def test_a_scaler_on_the_deployment_keeps_the_count_it_set():
    kube, owner = MemoryKube(), apply_body()
    service = parse_service(owner)
    reconcile.sync_children(kube, service, owner)
    kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] = 5  # the HPA scaled it
    reconcile.sync_children(kube, service, owner)
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2  # nobody else: spec.replicas wins
    kube.objects[("HorizontalPodAutoscaler", "ml", "web")] = hpa("web", "Deployment", "chat", "apps/v1")
    kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] = 5
    reconcile.sync_children(kube, service, owner)
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 5
    deployment = kube.objects[("Deployment", "ml", "chat")]
    deployment["status"] = {"replicas": 5, "readyReplicas": 5, "updatedReplicas": 5, "availableReplicas": 5,
                            "observedGeneration": 1}
    deployment["metadata"]["generation"] = 1
    status = compute_status(service, Observed(deployment, scalers=find_external_scalers(kube, service)), now="t")
    assert status["ready"] == "5/5"
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
