"""Reconciliation steps against an in-memory store that behaves like server-side apply (same object → same
resourceVersion). The real API server is exercised in tests/integration/test_operator.py; this pins the
ConfigMap generation rules and the Events cheaply."""
from __future__ import annotations

import copy

import yaml

from metronome.operator import builders, configmap, reconcile
from metronome.operator.k8s import Action, Applied
from metronome.operator.spec import parse_service
from metronome.operator.tuning.actuation import scheduler_for
from metronome.operator.tuning.decision import Decision


class MemoryKube:
    def __init__(self, crds: tuple[str, ...] = ()):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.crds = set(crds)
        self.events: list[tuple[str, str, str]] = []
        self.version = 0

    def get(self, api_version, kind, namespace, name):
        obj = self.objects.get((kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def apply(self, obj):
        key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        before = self.objects.get(key)
        desired = copy.deepcopy(dict(obj))
        if before is not None and {k: v for k, v in before.items() if k != "metadata"} == {
            k: v for k, v in desired.items() if k != "metadata"
        } and before["metadata"].get("annotations") == desired["metadata"].get("annotations"):
            return Applied(Action.UNCHANGED, copy.deepcopy(before), copy.deepcopy(before))
        self.version += 1
        desired["metadata"]["resourceVersion"] = str(self.version)
        self.objects[key] = desired
        action = Action.CREATED if before is None else Action.UPDATED
        return Applied(action, copy.deepcopy(before), copy.deepcopy(desired))

    def list(self, api_version, kind, namespace, label_selector):
        return [copy.deepcopy(obj) for (k, ns, _), obj in self.objects.items() if k == kind and ns == namespace]

    def crd_exists(self, name):
        return name in self.crds

    def emit_event(self, owner, type_, reason, message):
        self.events.append((type_, reason, message))


def body(**spec) -> dict:
    return {
        "apiVersion": "metronome.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "generation": 1},
        "spec": {"model": {"source": "default"}, "replicas": 2, **spec},
    }


def served(kube: MemoryKube) -> dict:
    return yaml.safe_load(kube.objects[("ConfigMap", "ml", "chat-config")]["data"]["server.yaml"])


def test_first_sync_creates_every_child_with_events():
    kube = MemoryKube(crds=(builders.PODMONITOR_CRD,))
    owner = body()
    config = reconcile.sync_children(kube, parse_service(owner), owner)
    assert config.generation == 1
    assert {k[0] for k in kube.objects} == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor"}
    reasons = [reason for _, reason, _ in kube.events]
    assert reasons.count("Created") == 4 and reasons.count("ConfigCreated") == 1


def test_second_sync_changes_nothing_and_says_nothing():
    kube = MemoryKube()
    owner = body()
    reconcile.sync_children(kube, parse_service(owner), owner)
    snapshot, kube.events = copy.deepcopy(kube.objects), []
    reconcile.sync_children(kube, parse_service(owner), owner)
    assert kube.objects == snapshot and kube.events == []


def test_sync_keeps_a_retuned_config_and_serve_scheduler_bumps_the_generation():
    kube = MemoryKube()
    owner = body(server={"chunkSize": 512})
    service = parse_service(owner)
    first = reconcile.sync_children(kube, service, owner)
    decision = Decision(192, first.scheduler.queue_policy.value, 1, "test", changed=True)
    tuned = scheduler_for(decision, first.scheduler)
    reconcile.serve_scheduler(kube, service, owner, tuned, why="autotune")
    assert served(kube)["generation"] == 2 and served(kube)["scheduler"]["chunk_size"] == 192

    # A later reconcile (e.g. replicas changed) must not undo the tuning.
    reconcile.sync_children(kube, parse_service(body(server={"chunkSize": 512}, replicas=3)), owner)
    assert served(kube)["scheduler"]["chunk_size"] == 192

    # The user changing spec.server wins, as a new generation.
    changed = parse_service(body(server={"chunkSize": 1024}))
    reconcile.serve_scheduler(kube, changed, owner, changed.spec.server, why="spec.server changed")
    assert (served(kube)["generation"], served(kube)["scheduler"]["chunk_size"]) == (3, 1024)
    assert any(reason == "ConfigUpdated" and "chunkSize 192 -> 1024" in msg for _, reason, msg in kube.events)


def test_an_invalid_server_yaml_is_rewritten_with_a_higher_generation():
    kube = MemoryKube()
    owner = body()
    service = parse_service(owner)
    reconcile.sync_children(kube, service, owner)
    cm = kube.objects[("ConfigMap", "ml", "chat-config")]
    cm["data"]["server.yaml"] = "generation: 5\nscheduler: {chunk_size: -1}\n"
    cm["metadata"]["annotations"][configmap.ANNOTATION_CONFIG_GENERATION] = "5"
    reconcile.sync_children(kube, service, owner)
    assert served(kube)["generation"] == 6 and served(kube)["scheduler"]["chunk_size"] == 512
    assert ("Warning", "InvalidConfig") in [(t, r) for t, r, _ in kube.events]


def test_observe_reads_deployment_and_config():
    kube = MemoryKube()
    owner = body()
    service = parse_service(owner)
    reconcile.sync_children(kube, service, owner)
    observed = reconcile.observe(kube, service)
    assert observed.deployment["kind"] == "Deployment"
    assert observed.served_config.generation == 1 and observed.config_error is None


def test_what_the_operator_wrote_is_read_back_without_parsing_and_a_hand_edit_is_parsed(monkeypatch):
    kube, owner = MemoryKube(), body()
    service = parse_service(owner)
    memory = reconcile.ConfigMemory()
    written = reconcile.sync_children(kube, service, owner, memory=memory)
    assert memory.written.config == written

    parsed = []
    real_parse = configmap.parse_server_config
    monkeypatch.setattr(configmap, "parse_server_config", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    assert reconcile.observe(kube, service, memory).served_config is written and parsed == []
    reconcile.sync_children(kube, service, owner, memory=memory)
    assert parsed == []

    cm = kube.objects[("ConfigMap", "ml", "chat-config")]
    cm["data"]["server.yaml"] = "generation: 1\nscheduler: {chunk_size: 96, queue_policy: fcfs}\n"
    edited = reconcile.observe(kube, service, memory).served_config
    assert edited.scheduler.chunk_size == 96 and len(parsed) == 1
    assert reconcile.observe(kube, service).served_config == edited  # without memory: parsed, the same config
