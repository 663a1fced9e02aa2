"""Each service's SLO alerts (operator/alerts.py): its own targets, its own series, the monitors' labels."""
from __future__ import annotations

from metronome.contract import metric_names as names
from metronome.operator import builders
from metronome.operator.alerts import RuleSettings, slo_alerts
from metronome.operator.spec import parse_service


def service(**spec):
    return parse_service({"metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 1},
                          "spec": {"model": {"source": "default"}, **spec}})


def test_each_target_of_the_slo_is_an_alert_on_the_services_own_series():
    rules = slo_alerts(service(slo={"tbtP99Ms": 40, "ttftP99Ms": 900, "minThroughputTokensPerSecond": 250}), 10)
    by_name = {r["alert"]: r for r in rules}
    assert set(by_name) == {"MetronomeTBTSLOViolated", "MetronomeTTFTSLOViolated", "MetronomeThroughputBelowSLO"}
    tbt = by_name["MetronomeTBTSLOViolated"]
    assert f'{names.TIME_BETWEEN_TOKENS}_bucket{{namespace="ml",model="chat"}}' in tbt["expr"]
    assert tbt["expr"].endswith("* 1000 > 40") and tbt["for"] == "10m"
    assert tbt["labels"] == {"severity": "warning", "namespace": "ml", "inferenceservice": "chat"}
    assert by_name["MetronomeTTFTSLOViolated"]["expr"].endswith("> 900")
    assert by_name["MetronomeThroughputBelowSLO"]["expr"].endswith("< 250")
    assert [r["alert"] for r in slo_alerts(service(slo={"tbtP99Ms": 40}), 5)] == ["MetronomeTBTSLOViolated"]
    assert slo_alerts(service(), 5) == []


def test_the_rule_is_a_child_with_the_monitors_labels():
    settings = RuleSettings(labels=(("release", "kube-prometheus-stack"),), for_minutes=3)
    (rule,) = [c for c in builders.workload_children(service(slo={"tbtP99Ms": 40}), rules=settings)
               if c["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"][builders.LABEL_SERVICE] == "chat"
    assert rule["metadata"]["ownerReferences"][0]["name"] == "chat"
    assert rule["spec"]["groups"][0]["rules"][0]["for"] == "3m"
