"""The operator's own series: the loop's decisions by action, the SLO targets, and a deleted service's series
gone; served over HTTP on 127.0.0.1 as Prometheus scrapes them."""
from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from metronome.contract import metric_names as names
from metronome.operator.operator_metrics import OperatorMetrics
from metronome.operator.spec import parse_service
from metronome.operator.tuning.decision import ActionKind, Decision


def service(slo: dict | None = None, name: str = "chat"):
    spec = {"model": {"source": "default"}, **({"slo": slo} if slo else {})}
    return parse_service({"metadata": {"name": name, "namespace": "ml", "uid": "u"}, "spec": spec})


def decision(*actions: ActionKind, advisory: bool = False) -> Decision:
    return Decision(chunk_size=256, queue_policy="fcfs", replicas=1, reason="test", changed=not advisory,
                    actions=actions, advisory=advisory)


CHAT = {names.SERVICE_NAMESPACE_LABEL: "ml", names.SERVICE_LABEL: "chat"}


def value(metrics: OperatorMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {**CHAT, **labels})


def test_decisions_are_counted_by_action_and_whether_they_were_applied():
    metrics = OperatorMetrics()
    chat = service({"tbtP99Ms": 25})
    metrics.after_tick(chat, decision(ActionKind.CHUNK_DOWN, ActionKind.POLICY_SWITCH))
    metrics.after_tick(chat, decision(ActionKind.CHUNK_DOWN))
    metrics.after_tick(chat, decision(ActionKind.CHUNK_UP, advisory=True))
    metrics.after_tick(chat, None)  # no reading was due: nothing decided
    total = names.OPERATOR_DECISIONS
    assert value(metrics, total, action="chunk_down", applied="true") == 2
    assert value(metrics, total, action="policy_switch", applied="true") == 1
    assert value(metrics, total, action="chunk_up", applied="false") == 1
    assert value(metrics, total, action="hold", applied="true") is None


def test_slo_targets_follow_the_spec_in_seconds():
    metrics = OperatorMetrics()
    metrics.after_tick(service({"tbtP99Ms": 25, "ttftP99Ms": 2000}), None)
    assert value(metrics, names.OPERATOR_SLO_TARGET, objective="tbt_p99") == 0.025
    assert value(metrics, names.OPERATOR_SLO_TARGET, objective="ttft_p99") == 2.0
    metrics.after_tick(service({"tbtP99Ms": 30}), None)  # the TTFT target was dropped
    assert value(metrics, names.OPERATOR_SLO_TARGET, objective="tbt_p99") == 0.03
    assert value(metrics, names.OPERATOR_SLO_TARGET, objective="ttft_p99") is None
    metrics.after_tick(service(), None)  # no SLO at all
    assert value(metrics, names.OPERATOR_SLO_TARGET, objective="tbt_p99") is None


def test_a_deleted_service_leaves_no_series_and_others_keep_theirs():
    metrics = OperatorMetrics()
    metrics.after_tick(service({"tbtP99Ms": 25}), decision(ActionKind.CHUNK_DOWN))
    metrics.after_tick(service({"tbtP99Ms": 40}, name="other"), decision(ActionKind.HOLD))
    metrics.forget("ml", "chat")
    labelled = [s.labels for f in metrics.registry.collect() for s in f.samples]
    assert all(labels.get(names.SERVICE_LABEL) == "other" for labels in labelled), labelled
    assert labelled


def test_served_as_prometheus_scrapes_it():
    metrics = OperatorMetrics()
    metrics.after_tick(service({"tbtP99Ms": 25}), decision(ActionKind.SLO_UNREACHABLE))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = metrics.serve("127.0.0.1", port)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = [s for s in families[names.OPERATOR_DECISIONS.removesuffix("_total")].samples
                 if s.name == names.OPERATOR_DECISIONS]
    assert sample.labels == {**CHAT, "action": "slo_unreachable", "applied": "true"} and sample.value == 1


def test_the_desired_replicas_follow_the_loops_recommendation_whoever_scales():
    metrics = OperatorMetrics()
    chat = service({"tbtP99Ms": 25})
    recommended = Decision(chunk_size=256, queue_policy="fcfs", replicas=2, reason="test", changed=False,
                           actions=(ActionKind.SLO_UNREACHABLE,), recommended_replicas=3)
    metrics.after_tick(chat, recommended)
    assert value(metrics, names.OPERATOR_DESIRED_REPLICAS) == 3
    metrics.after_tick(chat, decision(ActionKind.HOLD))  # a reading not judged (settling): the last one stands
    assert value(metrics, names.OPERATOR_DESIRED_REPLICAS) == 3
    metrics.after_tick(chat, None)
    assert value(metrics, names.OPERATOR_DESIRED_REPLICAS) == 3
    metrics.forget("ml", "chat")
    assert value(metrics, names.OPERATOR_DESIRED_REPLICAS) is None
