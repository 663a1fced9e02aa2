"""An experiment's glue (experiment_sync.sync) against the in-memory API of kube_fakes: the pods come from the
watch cache (never listed), the candidate ConfigMap and the pods' labels are written only where the cache differs
from what the step wants (one deleted by hand is put back), the ConfigMap is deleted only while the cache holds it,
and a service without an experiment sends nothing at all."""
from __future__ import annotations

from kube_fakes import MemoryKube
from test_reconcile import body

from metronome.contract import variant
from metronome.contract.rfc3339 import format_time
from metronome.operator import builders, experiment_sync, reconcile
from metronome.operator.metrics_source import PrometheusSettings
from metronome.operator.spec import parse_service
from metronome.operator.tuning.observation import Observation

NO_PROMETHEUS = PrometheusSettings()
CANDIDATE_CM = ("ConfigMap", "ml", "chat-candidate-config")
EXPERIMENT = {"name": "small-chunk", "candidate": {"chunkSize": 256}, "windowSeconds": 30, "windows": 5}
T0 = 1_800_000_000.0


def settled(kube: MemoryKube, owner: dict) -> None:
    """The children written, and the Deployment's two pods ready, as the pod watch delivers them."""
    reconcile.sync_children(kube.children(), parse_service(owner), owner, reconcile.ConfigMemory(),
                            reconcile.SyncMemory(), 0.0)
    for name in ("chat-a", "chat-b"):
        kube.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": "ml", "labels": builders.labels("chat")},
                  "status": {"conditions": [{"type": "Ready", "status": "True"}]}})


def generations(a: int, b: int) -> Observation:
    return Observation(window_seconds=30, sample_count=0, tbt_p99_s=None, pod_generations={"chat-a": a, "chat-b": b},
                       config_applied_at={"chat-a": T0 - 60, "chat-b": T0 - 60})


def step(kube: MemoryKube, owner: dict, observation: Observation, now: float) -> experiment_sync.ExperimentTick:
    """One step, status.experiment kept in the owner as the runtime's status patch would."""
    service = parse_service(owner)
    observed = reconcile.observe(kube.cache, service)
    result = experiment_sync.sync(kube, kube.cache, service, owner, observed.pods, observed.served_config,
                                  observation, NO_PROMETHEUS, None, now)
    if result.status is not None:
        owner.setdefault("status", {})["experiment"] = result.status
    return result


def variants(kube: MemoryKube) -> dict[str, str | None]:
    return {name: (kube.objects[("Pod", "ml", name)]["metadata"]["labels"]).get(variant.LABEL)
            for name in ("chat-a", "chat-b")}


def test_a_service_without_an_experiment_sends_nothing():
    kube, owner = MemoryKube(), body()
    settled(kube, owner)
    kube.requests = []
    result = step(kube, owner, generations(1, 1), T0)
    assert result.record is None and result.status is None and not result.pause_tuner
    assert kube.requests == []


def test_the_slice_is_written_once_from_the_cache_and_a_deleted_candidate_config_is_put_back():
    kube, owner = MemoryKube(), body(experiment=EXPERIMENT)
    settled(kube, owner)
    kube.requests = []
    first = step(kube, owner, generations(1, 1), T0)
    assert first.record.phase.value == "Starting" and first.pause_tuner
    assert sorted(kube.requests) == [("apply", "ConfigMap"), ("patch", "Pod"), ("patch", "Pod")]
    assert variants(kube) == {"chat-a": variant.CANDIDATE, "chat-b": variant.CONTROL}
    assert "chunk_size: 256" in kube.objects[CANDIDATE_CM]["data"]["server.yaml"]

    kube.requests = []
    step(kube, owner, generations(1, 1), T0 + 10)  # the candidate not applied yet: nothing new to write
    assert kube.requests == []

    written = kube.objects[CANDIDATE_CM]["data"]
    kube.delete("v1", "ConfigMap", "ml", CANDIDATE_CM[2])  # someone deletes it; the watch drops it from the cache
    kube.requests = []
    step(kube, owner, generations(1, 1), T0 + 20)
    assert kube.requests == [("apply", "ConfigMap")] and kube.objects[CANDIDATE_CM]["data"] == written


def test_the_end_relabels_and_deletes_the_candidate_config_once():
    kube, owner = MemoryKube(), body(experiment=EXPERIMENT)
    settled(kube, owner)
    step(kube, owner, generations(1, 1), T0)
    del owner["spec"]["experiment"]
    kube.requests = []
    ended = step(kube, owner, generations(2, 1), T0 + 10)
    assert (ended.record.phase.value, ended.record.reason) == ("Aborted", "Cancelled")
    assert sorted(kube.requests) == [("delete", "ConfigMap"), ("patch", "Pod")]
    assert variants(kube) == {"chat-a": variant.CONTROL, "chat-b": variant.CONTROL}
    assert CANDIDATE_CM not in kube.objects and ("Warning", "ExperimentAborted") in [
        (type_, reason) for type_, reason, _ in kube.events]

    kube.requests = []
    after = step(kube, owner, generations(1, 1), T0 + 20)  # still recent: the cache says nothing is left to delete
    assert kube.requests == [] and after.status is None
    assert owner["status"]["experiment"]["decidedAt"] == format_time(T0 + 10)


def test_a_pod_deleted_before_its_label_is_set_does_not_stop_the_step():
    kube, owner = MemoryKube(), body(experiment=EXPERIMENT)
    settled(kube, owner)
    del kube.objects[("Pod", "ml", "chat-b")]  # deleted; the watch has not said so yet
    first = step(kube, owner, generations(1, 1), T0)
    assert first.record.phase.value == "Starting" and first.status is not None
    assert kube.objects[("Pod", "ml", "chat-a")]["metadata"]["labels"][variant.LABEL] == variant.CANDIDATE
    assert kube.cache.get("Pod", "ml", "chat-b") is None  # the 404 said it is gone


def test_a_new_candidate_removes_the_fields_an_earlier_one_set_from_status():
    kube, owner = MemoryKube(), body(experiment={**EXPERIMENT, "candidate": {"chunkSize": 256,
                                                                              "maxNumBatchedTokens": 8192}})
    settled(kube, owner)
    kube.put(owner)
    first = step(kube, owner, generations(1, 1), T0)
    kube.patch("metronome.dev/v1alpha1", "InferenceService", "ml", "chat", {"status": {"experiment": first.status}})
    owner["spec"]["experiment"] = {**EXPERIMENT, "name": "unbounded"}  # a new one, without maxNumBatchedTokens
    step(kube, owner, generations(2, 1), T0 + 10)  # the first one is superseded
    second = step(kube, owner, generations(1, 1), T0 + 20)
    assert second.record.phase.value == "Starting" and second.record.name == "unbounded"
    stored = kube.patch("metronome.dev/v1alpha1", "InferenceService", "ml", "chat",
                        {"status": {"experiment": second.status}})["status"]["experiment"]
    assert first.record.candidate["maxNumBatchedTokens"] == 8192
    assert stored["candidate"] == second.record.candidate and "maxNumBatchedTokens" not in stored["candidate"]
