"""The loop's body (control_loop.tick) against the in-memory API of kube_fakes and a canned reading: it reads
when due, serves the decision as a new server.yaml generation, scales, announces a blocked loop once, and hands
the CR's own changes (spec.replicas, status.lastDecision) back to the handler."""
from __future__ import annotations

import pytest
import yaml
from kube_fakes import MemoryKube
from test_reconcile import body

from metronome.operator import control_loop, reconcile
from metronome.operator.metrics_source import PrometheusSettings
from metronome.operator.spec import parse_service
from metronome.operator.tuning import autotune
from metronome.operator.tuning.observation import Observation

LOCAL = PrometheusSettings(url="http://127.0.0.1:1")


def reading(tbt_ms: float) -> Observation:
    return Observation(window_seconds=20, sample_count=5000, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=900.0,
                       pod_generations={"chat-a": 1, "chat-b": 1})


@pytest.fixture
def prometheus(monkeypatch):
    """reconcile.read_metrics answering with `state["observation"]`; counts the readings."""
    state = {"observation": reading(60.0), "reads": 0}

    def read_metrics(settings, url, service, now):
        state["reads"] += 1
        return state["observation"], None

    monkeypatch.setattr(reconcile, "read_metrics", read_metrics)
    return state


def apply_body(**autotune_fields) -> dict:
    return body(server={"chunkSize": 1024, "queuePolicy": "fcfs"}, minReplicas=1, maxReplicas=3,
                slo={"tbtP99Ms": 30}, metrics={"windowSeconds": 20},
                autotune={"mode": "apply", "policy": "multiplicative", "policySwitching": False, **autotune_fields})


def sync(kube: MemoryKube, service, owner, configs: reconcile.ConfigMemory | None = None) -> None:
    reconcile.sync_children(kube.children(), service, owner, configs or reconcile.ConfigMemory(),
                            reconcile.SyncMemory(), 0.0)


def served(kube: MemoryKube) -> dict:
    return yaml.safe_load(kube.objects[("ConfigMap", "ml", "chat-config")]["data"]["server.yaml"])


def test_a_due_reading_is_served_as_a_new_generation_and_recorded(prometheus):
    kube, owner = MemoryKube(), apply_body()
    service = parse_service(owner)
    sync(kube, service, owner)
    memory = autotune.TunerMemory()
    result = control_loop.tick(kube, service, owner, reconcile.observe(kube.cache, service), memory, LOCAL)
    assert served(kube)["generation"] == 2 and served(kube)["scheduler"]["chunk_size"] == 922  # 1024 x 0.9
    assert result.observed.served_config.generation == 2 and result.observed.metrics.available
    assert result.last_decision["applied"] is True and result.last_decision["to"]["chunkSize"] == 922
    assert result.replicas is None
    assert "ConfigUpdated" in [reason for _, reason, _ in kube.events]

    again = control_loop.tick(kube, service, owner, result.observed, memory, LOCAL)
    assert prometheus["reads"] == 1  # not due: status gets the last reading, nothing is decided
    assert again.last_decision is None and again.observed.metrics.tbt_p99_ms == pytest.approx(60.0)
    assert served(kube)["generation"] == 2


def test_the_next_generation_is_written_from_the_config_observed_not_read_back(prometheus):
    kube, owner = MemoryKube(), apply_body()
    service = parse_service(owner)
    configs = reconcile.ConfigMemory()
    sync(kube, service, owner, configs)
    observed = reconcile.observe(kube.cache, service, configs)
    kube.requests = []
    result = control_loop.tick(kube, service, owner, observed, autotune.TunerMemory(), LOCAL, configs)
    assert kube.requests == [("apply", "ConfigMap")]  # nothing read back, one write
    assert served(kube)["generation"] == 2 and served(kube)["scheduler"]["chunk_size"] == 922
    assert result.observed.served_config is configs.written.config
    assert reconcile.observe(kube.cache, service, configs).served_config is configs.written.config


def test_a_chunk_at_its_floor_scales_and_hands_back_the_replica_patch(prometheus):
    kube, owner = MemoryKube(), apply_body(minChunkSize=1024, scaleReplicas=True)
    service = parse_service(owner)
    sync(kube, service, owner)
    result = control_loop.tick(kube, service, owner, reconcile.observe(kube.cache, service), autotune.TunerMemory(),
                               LOCAL)
    assert result.replicas == 3  # the runtime patches spec.replicas; its next reconcile scales the Deployment
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    assert "AutotuneScaled" in [reason for _, reason, _ in kube.events]


def test_a_blocked_loop_is_announced_once(prometheus):
    kube, owner = MemoryKube(), apply_body()
    service = parse_service(owner)
    sync(kube, service, owner)
    memory = autotune.TunerMemory()
    observed = reconcile.observe(kube.cache, service)
    first = control_loop.tick(kube, service, owner, observed, memory, PrometheusSettings())
    assert not first.observed.metrics.available and prometheus["reads"] == 0
    memory.next_reading = 0.0  # due again
    control_loop.tick(kube, service, owner, observed, memory, PrometheusSettings())
    blocked = [message for _, reason, message in kube.events if reason == "AutotuneBlocked"]
    assert len(blocked) == 1 and "--prometheus-url" in blocked[0]
