"""Reconciliation steps against the in-memory API of kube_fakes (server-side apply: the same object → the same
resourceVersion). The real API server is exercised in tests/integration; this pins the children's sync (write
only what differs, put back what was deleted or edited, nothing of a refused change), the ConfigMap generation
rules and the Events cheaply."""
from __future__ import annotations

import copy

import yaml
from kube_fakes import MemoryKube

from metronome.contract.config import ServerConfigFile
from metronome.operator import builders, configmap, drift, reconcile
from metronome.operator.monitoring import MonitorSettings
from metronome.operator.spec import parse_service
from metronome.operator.tuning.actuation import scheduler_for
from metronome.operator.tuning.decision import Decision

CM = ("ConfigMap", "ml", "chat-config")


def body(generation: int = 1, **spec) -> dict:
    return {
        "apiVersion": "metronome.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u1", "generation": generation},
        "spec": {"model": {"source": "default"}, "replicas": 2, **spec},
    }


def served(kube: MemoryKube) -> dict:
    return yaml.safe_load(kube.objects[CM]["data"]["server.yaml"])


def sync(kube: MemoryKube, owner: dict, memory: reconcile.ConfigMemory | None = None,
         refused: reconcile.SyncMemory | None = None, now: float = 0.0, **settings) -> reconcile.SyncOutcome:
    return reconcile.sync_children(kube.children(**settings), parse_service(owner), owner,
                                   memory or reconcile.ConfigMemory(), refused or reconcile.SyncMemory(), now)


def test_first_sync_dry_runs_then_creates_every_child_with_events():
    kube = MemoryKube(crds=(builders.PODMONITOR_CRD,))
    outcome = sync(kube, body())
    assert outcome.config.generation == 1 and outcome.refusal is None
    assert {k[0] for k in kube.objects} == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor"}
    reasons = [reason for _, reason, _ in kube.events]
    assert reasons.count("Created") == 4 and reasons.count("ConfigCreated") == 1
    dry_runs = [kind for verb, kind in kube.requests if verb == "dry-run"]
    assert sorted(dry_runs) == sorted(k[0] for k in kube.objects)  # every write tried first, before any is made
    assert kube.requests.index(("apply", "ConfigMap")) > max(
        i for i, (verb, _) in enumerate(kube.requests) if verb == "dry-run")


def test_a_second_sync_sends_nothing_and_says_nothing():
    kube = MemoryKube()
    owner = body()
    memory = reconcile.ConfigMemory()
    sync(kube, owner, memory)
    snapshot, kube.events, kube.requests = copy.deepcopy(kube.objects), [], []
    sync(kube, owner, memory)
    assert kube.objects == snapshot and kube.events == [] and kube.requests == []


def test_a_new_operator_whose_cache_lacks_the_configmap_continues_the_served_generation():
    # A restart or a new leader: its watches have listed the service but not yet the ConfigMaps.
    kube = MemoryKube()
    owner = body()
    sync(kube, owner)
    owner["status"] = {"configGeneration": 1}
    kube.cache.forget(*CM)
    kube.events, kube.requests = [], []
    outcome = sync(kube, owner, reconcile.ConfigMemory())
    assert outcome.config.generation == 1 and served(kube)["generation"] == 1
    assert kube.events == [] and ("get", "ConfigMap") in kube.requests and ("apply", "ConfigMap") not in kube.requests
    assert kube.cache.get(*CM) is not None


def test_a_deleted_or_edited_child_is_written_again_and_foreign_additions_are_left():
    kube = MemoryKube()
    owner = body()
    memory = reconcile.ConfigMemory()
    sync(kube, owner, memory)
    service = kube.objects[("Service", "ml", "chat")]
    kube.delete("v1", "Service", "ml", "chat")
    edited = copy.deepcopy(kube.objects[("Deployment", "ml", "chat")])
    edited["spec"]["replicas"] = 5
    edited["metadata"]["annotations"]["team"] = "a"  # someone else's: not the operator's business
    kube.put(edited)
    kube.events = []
    sync(kube, owner, memory)
    assert kube.objects[("Service", "ml", "chat")]["spec"] == service["spec"]
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    assert [reason for _, reason, _ in kube.events] == ["Scaled", "Created"]

    foreign = copy.deepcopy(kube.objects[("Service", "ml", "chat")])
    foreign["spec"]["ports"].append({"name": "metrics", "port": 9100})
    foreign["metadata"]["labels"]["team"] = "a"
    kube.put(foreign)
    kube.requests = []
    sync(kube, owner, memory)
    assert kube.requests == []


def test_a_child_the_spec_stops_asking_for_is_rewritten_without_the_field():
    kube = MemoryKube()
    memory = reconcile.ConfigMemory()
    sync(kube, body(resources={"nodeSelector": {"pool": "a100"}}), memory)
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "a100"}
    kube.events = []
    sync(kube, body(generation=2), memory)
    assert "nodeSelector" not in kube.objects[("Deployment", "ml", "chat")]["spec"]["template"]["spec"]
    assert [reason for _, reason, _ in kube.events] == ["RollingUpdate"]


def test_a_refused_change_writes_nothing_is_announced_once_and_is_not_retried_until_it_changes():
    kube = MemoryKube()
    memory, refused = reconcile.ConfigMemory(), reconcile.SyncMemory()
    sync(kube, body(), memory, refused)
    before = copy.deepcopy(kube.objects)
    cause = {"field": "spec.template.spec.tolerations[0].value", "message": "Invalid value: \"present\": value "
             "must be empty when `operator` is 'Exists'"}
    kube.refuse["Deployment"] = (422, "Deployment.apps \"chat\" is invalid", [cause])
    changed = body(generation=2, server={"chunkSize": 256},
                   resources={"tolerations": [{"key": "gpu", "operator": "Exists", "value": "present"}]})
    outcome = sync(kube, changed, memory, refused, now=10.0)
    assert outcome.refusal is not None and kube.objects == before  # not even the new spec.server was served
    assert "spec.resources.tolerations[0].value" in outcome.refusal.message
    assert [(t, r) for t, r, _ in kube.events][-1] == ("Warning", "SpecRejected")

    kube.requests, kube.events = [], []
    again = sync(kube, changed, memory, refused, now=20.0)
    assert again.refusal == outcome.refusal and kube.requests == [] and kube.events == []
    sync(kube, changed, memory, refused, now=10.0 + reconcile.RETRY_REFUSED_S)
    assert ("dry-run", "Deployment") in kube.requests and kube.events == []  # tried again, not announced again

    del kube.refuse["Deployment"]
    fixed = sync(kube, body(generation=3, server={"chunkSize": 256}), memory, refused, now=30.0)
    assert fixed.refusal is None and refused.refusal is None and served(kube)["generation"] == 2


def test_sync_keeps_a_retuned_config_and_serves_a_changed_spec_server_as_a_new_generation():
    kube = MemoryKube()
    owner = body(server={"chunkSize": 512, "queuePolicy": "fcfs"})
    service = parse_service(owner)
    memory = reconcile.ConfigMemory()
    first = sync(kube, owner, memory).config
    decision = Decision(192, first.scheduler.queue_policy.value, 1, "test", changed=True)
    tuned = ServerConfigFile(generation=2, scheduler=scheduler_for(decision, first.scheduler))
    reconcile.write_config(kube, service, owner, first, tuned, why="autotune", memory=memory)
    assert served(kube)["generation"] == 2 and served(kube)["scheduler"]["chunk_size"] == 192

    # A later reconcile (replicas changed) must not undo the tuning.
    sync(kube, body(generation=2, server={"chunkSize": 512, "queuePolicy": "fcfs"}, replicas=3), memory)
    assert served(kube)["scheduler"]["chunk_size"] == 192

    # The user changing spec.server wins, as a new generation, after a restart too (nothing kept in memory).
    sync(kube, body(generation=3, server={"chunkSize": 1024, "queuePolicy": "fcfs"}), reconcile.ConfigMemory())
    assert (served(kube)["generation"], served(kube)["scheduler"]["chunk_size"]) == (3, 1024)
    assert any(reason == "ConfigUpdated" and "chunkSize 192 -> 1024" in msg for _, reason, msg in kube.events)


def test_a_configmap_from_before_the_spec_server_digest_is_adopted_as_it_is():
    kube = MemoryKube()
    owner = body(server={"chunkSize": 512, "queuePolicy": "fcfs"})
    sync(kube, owner)
    old = copy.deepcopy(kube.objects[CM])
    old["data"]["server.yaml"] = old["data"]["server.yaml"].replace("chunk_size: 512", "chunk_size: 320")
    del old["metadata"]["annotations"][configmap.ANNOTATION_SPEC_SERVER]
    del old["metadata"]["annotations"][drift.ANNOTATION_APPLIED]
    kube.put(old)
    kube.events = []
    sync(kube, owner)
    assert served(kube)["scheduler"]["chunk_size"] == 320 and served(kube)["generation"] == 1
    assert kube.objects[CM]["metadata"]["annotations"][configmap.ANNOTATION_SPEC_SERVER]
    assert kube.events == []


def test_an_invalid_server_yaml_is_rewritten_with_a_higher_generation():
    kube = MemoryKube()
    owner = body()
    sync(kube, owner)
    cm = copy.deepcopy(kube.objects[CM])
    cm["data"]["server.yaml"] = "generation: 5\nscheduler: {chunk_size: -1}\n"
    cm["metadata"]["annotations"][configmap.ANNOTATION_CONFIG_GENERATION] = "5"
    kube.put(cm)
    sync(kube, owner)
    assert served(kube)["generation"] == 6 and served(kube)["scheduler"]["chunk_size"] == 512
    assert ("Warning", "InvalidConfig") in [(t, r) for t, r, _ in kube.events]


def test_retired_children_are_deleted_once():
    kube = MemoryKube(crds=(builders.PODMONITOR_CRD,))
    memory = reconcile.ConfigMemory()
    sync(kube, body(), memory)
    kube.events = []
    sync(kube, body(generation=2, disruption={"enabled": False}), memory)
    assert ("PodDisruptionBudget", "ml", "chat") not in kube.objects
    assert [reason for _, reason, _ in kube.events] == ["Deleted"]
    sync(kube, body(generation=2, disruption={"enabled": False}), memory, monitor=MonitorSettings(kind="none"))
    assert ("PodMonitor", "ml", "chat") not in kube.objects
    kube.events, kube.requests = [], []
    sync(kube, body(generation=2, disruption={"enabled": False}), memory, monitor=MonitorSettings(kind="none"))
    assert kube.events == [] and kube.requests == []


def test_observe_reads_the_cache_and_what_the_operator_wrote_is_not_parsed_again(monkeypatch):
    kube, owner = MemoryKube(), body()
    service = parse_service(owner)
    memory = reconcile.ConfigMemory()
    written = sync(kube, owner, memory).config
    pod = {"kind": "Pod", "metadata": {"name": "chat-a", "namespace": "ml",
                                       "labels": builders.labels("chat")}, "status": {"phase": "Pending"}}
    kube.put(pod)
    parsed = []
    real_parse = configmap.parse_server_config
    monkeypatch.setattr(configmap, "parse_server_config", lambda *a, **k: parsed.append(a) or real_parse(*a, **k))
    kube.requests = []
    observed = reconcile.observe(kube.cache, service, memory)
    assert observed.served_config is memory.written.config == written and parsed == []
    assert observed.deployment["kind"] == "Deployment" and [p["metadata"]["name"] for p in observed.pods] == ["chat-a"]
    assert kube.requests == []

    cm = copy.deepcopy(kube.objects[CM])
    cm["data"]["server.yaml"] = "generation: 1\nscheduler: {chunk_size: 96, queue_policy: fcfs}\n"
    kube.put(cm)
    edited = reconcile.observe(kube.cache, service, memory).served_config
    assert edited.scheduler.chunk_size == 96 and len(parsed) == 1


def test_scrape_annotations_only_while_no_pod_monitor_scrapes_the_pods():
    def annotated(crds: tuple[str, ...], **monitor) -> bool:
        kube = MemoryKube(crds=crds)
        children, _ = reconcile.desired_children(kube.children(monitor=MonitorSettings(**monitor)),
                                                 parse_service(body()))
        deployment = next(c for c in children if c["kind"] == "Deployment")
        return "prometheus.io/scrape" in (deployment["spec"]["template"]["metadata"].get("annotations") or {})

    served = (builders.PODMONITOR_CRD,)
    assert not annotated(served) and annotated(())  # auto: a PodMonitor scrapes them, or nothing else would
    assert annotated(served, kind="none") and annotated(served, scrape_annotations="always")
    assert not annotated((), kind="none", scrape_annotations="never")


def test_what_the_api_server_leaves_out_or_rewrites_is_no_drift():
    desired = {"spec": {"readOnly": False, "labels": {}, "cpu": "0.5", "memory": "1Gi", "replicas": 2}}
    stored = {"spec": {"cpu": "500m", "memory": "1Gi", "replicas": 2, "defaulted": "by the API server"}}
    assert drift.contains(stored, desired)
    assert not drift.contains({"spec": {**stored["spec"], "cpu": "600m"}}, desired)
    assert not drift.contains({"spec": {**stored["spec"], "readOnly": True}}, desired)
    assert not drift.contains({"spec": {k: v for k, v in stored["spec"].items() if k != "replicas"}}, desired)


def test_a_child_stored_in_another_form_than_written_is_not_written_again_and_again():
    kube = MemoryKube()
    owner = body()
    memory, refused = reconcile.ConfigMemory(), reconcile.SyncMemory()
    sync(kube, owner, memory, refused)
    stored = kube.objects[("Deployment", "ml", "chat")]
    stored["spec"]["revisionHistoryLimit"] = "3"  # as if the API server had its own rendering of a value
    kube.cache.put("Deployment", copy.deepcopy(stored))
    kube.requests = []
    sync(kube, owner, memory, refused)
    assert kube.requests == []  # the same resourceVersion as written: nobody changed it
    kube.put(stored)  # someone did write it since
    sync(kube, owner, memory, refused)
    assert ("apply", "Deployment") in kube.requests


def test_a_child_deleted_before_its_watch_ran_is_looked_up_once_and_written_again(monkeypatch):
    monkeypatch.setattr(reconcile, "CONFIRM_S", 0.0)
    kube = MemoryKube()
    owner = body()
    memory, refused = reconcile.ConfigMemory(), reconcile.SyncMemory()
    sync(kube, owner, memory, refused)
    service = kube.objects.pop(("Service", "ml", "chat"))  # deleted; no watch of Services to say so
    kube.cache.put("Service", service, written=True)  # as the operator's own write left it: unconfirmed
    kube.events, kube.requests = [], []
    sync(kube, owner, memory, refused)
    assert ("Service", "ml", "chat") in kube.objects and [r for _, r, _ in kube.events] == ["Created"]
    kube.requests = []
    sync(kube, owner, memory, refused)
    assert kube.requests == []  # confirmed by the lookup (the fake's writes count as delivered)
