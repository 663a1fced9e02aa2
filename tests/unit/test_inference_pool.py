"""spec.routing and the InferencePool child: the pure builder, the spec's checks, the engine-type labels on the pod
template, and the sync against an in-memory API (create, leave a stranger's pool alone, delete when turned off).
tests/integration/test_endpoint_picker.py runs the real picker against the pool and real servers."""
from __future__ import annotations

import pytest
from kube_fakes import MemoryKube

from metronome.contract import metric_names as names
from metronome.operator import builders, inference_pool, reconcile
from metronome.operator.spec import SpecError, parse_service


def body(routing: dict | None = None, name: str = "chat") -> dict:
    spec = {"model": {"source": "default"}, "replicas": 2}
    if routing is not None:
        spec["routing"] = routing
    return {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ml", "uid": "u1", "generation": 1}, "spec": spec}


def enabled(**picker) -> dict:
    return {"inferencePool": {"enabled": True, **({"endpointPicker": picker} if picker else {})}}


def test_routing_is_off_unless_asked_for():
    assert not parse_service(body()).spec.routing.inference_pool.enabled
    assert not parse_service(body({})).spec.routing.inference_pool.enabled


def test_the_pool_selects_the_deployments_pods_on_the_server_port_and_names_the_picker():
    service = parse_service(body(enabled()))
    pool = inference_pool.inference_pool(service)
    deployment = builders.deployment(service)
    assert (pool["apiVersion"], pool["kind"]) == ("inference.networking.k8s.io/v1", "InferencePool")
    assert pool["metadata"]["name"] == "chat" and pool["metadata"]["namespace"] == "ml"
    assert pool["metadata"]["ownerReferences"] == [service.owner_reference]
    assert pool["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (port,) = deployment["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    # The picker's own chart names its Service <release>-epp and serves ext_proc on 9002; a gateway that cannot
    # reach it refuses the request rather than routing blind (the API's default).
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "chat-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailClose"}


def test_the_picker_reference_comes_from_the_spec():
    service = parse_service(body(enabled(name="shared-picker", port=9102, failureMode="FailOpen")))
    ref = inference_pool.inference_pool(service)["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("shared-picker", {"number": 9102}, "FailOpen")


@pytest.mark.parametrize("picker, field", [
    ({"name": "Bad_Name"}, "endpointPicker.name"),
    ({"name": "x" * 64}, "endpointPicker.name"),
    ({"port": 0}, "endpointPicker.port"),
    ({"port": 70000}, "endpointPicker.port"),
    ({"port": True}, "endpointPicker.port"),
    ({"failureMode": "Open"}, "endpointPicker.failureMode"),
])
def test_bad_picker_references_are_refused_naming_the_field(picker, field):
    with pytest.raises(SpecError, match=f"spec.routing.inferencePool.{field}"):
        parse_service(body(enabled(**picker)))


def test_a_non_object_routing_is_refused():
    with pytest.raises(SpecError, match="spec.routing.inferencePool: expected an object"):
        parse_service(body({"inferencePool": True}))


def test_server_pods_carry_the_engine_type_the_pickers_read_but_selectors_do_not():
    deployment = builders.deployment(parse_service(body()))
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for key in ("inference.networking.k8s.io/engine-type", "llm-d.ai/engine-type"):
        assert labels[key] == names.PICKER_ENGINE_TYPE == "vllm"
        assert key not in deployment["spec"]["selector"]["matchLabels"]  # immutable once the Deployment exists


def _sync(kube: MemoryKube, routing: dict | None, memory: reconcile.SyncMemory | None = None,
          generation: int = 1) -> None:
    owner = body(routing)
    owner["metadata"]["generation"] = generation
    reconcile.sync_children(kube.children(), parse_service(owner), owner, reconcile.ConfigMemory(),
                            memory or reconcile.SyncMemory(), 0.0)


def pool_events(kube: MemoryKube) -> list[tuple[str, str]]:
    return [(t, r) for t, r, m in kube.events if "InferencePool" in r or "InferencePool" in m]


def test_sync_writes_the_pool_once_and_removes_it_when_turned_off():
    kube = MemoryKube(crds=(inference_pool.CRD,))
    _sync(kube, enabled())
    assert ("InferencePool", "ml", "chat") in kube.objects
    assert pool_events(kube) == [("Normal", "Created")]
    _sync(kube, enabled())
    assert pool_events(kube) == [("Normal", "Created")]  # unchanged: nothing said
    _sync(kube, None, generation=2)
    assert ("InferencePool", "ml", "chat") not in kube.objects
    assert kube.events[-1][1] == "Deleted"


def test_sync_without_the_api_writes_nothing_and_warns_once_only_when_asked_for_a_pool():
    kube = MemoryKube()
    _sync(kube, None)
    assert pool_events(kube) == []
    memory = reconcile.SyncMemory()
    for _ in range(2):
        _sync(kube, enabled(), memory)
    assert not any(key[0] == "InferencePool" for key in kube.objects)
    assert pool_events(kube) == [("Warning", "InferencePoolUnavailable")]


def test_a_pool_of_the_same_name_made_by_someone_else_is_left_alone():
    kube = MemoryKube(crds=(inference_pool.CRD,))
    stranger = {"apiVersion": inference_pool.API_VERSION, "kind": "InferencePool",
                "metadata": {"name": "chat", "namespace": "ml", "labels": {"app.kubernetes.io/managed-by": "Helm"}},
                "spec": {"selector": {"matchLabels": {"app": "vllm"}}}}
    kube.put(stranger, watched=False)  # not the operator's label: its watch never shows it
    before = kube.objects[("InferencePool", "ml", "chat")]
    _sync(kube, enabled())
    assert kube.objects[("InferencePool", "ml", "chat")] == before
    assert pool_events(kube)[-1] == ("Warning", "InferencePoolConflict")
    _sync(kube, None, generation=2)  # turned off: still not ours to delete
    assert kube.objects[("InferencePool", "ml", "chat")] == before


def test_the_crds_routing_fields_are_the_parsers():
    """Each spec.routing default and check is written once in routing_spec.py: the CRD must say the same."""
    from pathlib import Path

    import yaml

    from metronome.operator import routing_spec

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    pool = spec["routing"]["properties"]["inferencePool"]["properties"]
    picker = pool["endpointPicker"]["properties"]
    assert set(pool) == {"enabled", "endpointPicker"}
    assert set(picker) == {"name", "port", "failureMode"}
    defaults = routing_spec.EndpointPickerSpec()
    assert pool["enabled"]["default"] == routing_spec.InferencePoolSpec().enabled
    assert (picker["port"]["default"], picker["failureMode"]["default"]) == (defaults.port, defaults.failure_mode)
    assert "default" not in picker["name"]  # unset: derived from the service's name
    assert tuple(picker["failureMode"]["enum"]) == routing_spec.FAILURE_MODES
    assert picker["name"]["pattern"] == routing_spec.SERVICE_NAME.pattern
    assert (picker["port"]["minimum"], picker["port"]["maximum"], picker["name"]["maxLength"]) == (1, 65535, 63)
