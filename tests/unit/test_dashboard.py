"""The Grafana dashboard (charts/metronome/dashboards/metronome.json, the one source: the chart's ConfigMap includes
it, docs/operator.md links to it) against the metric contract. tests/e2e/test_dashboard_queries.py runs every query
against a real Prometheus."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.utils import floatToGoString

from metronome.contract import metric_names as names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "metronome" / "dashboards" / "metronome.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every Prometheus annotation."""
    out = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return out


def test_every_query_names_only_contract_metrics(dashboard):
    known = set(names.ALL_NAMES) | set(names.OPERATOR_NAMES)
    for where, expr in queries(dashboard):
        used = set(re.findall(r"\b(metronome_[a-z0-9_]+)", expr))
        assert used, where
        for metric in used:
            assert metric in known or re.sub(r"_(bucket|sum|count)$", "", metric) in known, (where, metric)


def test_every_query_selects_the_chosen_service(dashboard):
    for where, expr in queries(dashboard):
        for selector in re.findall(r"metronome_[a-z0-9_]+\{([^}]*)\}", expr):
            server = 'model="$model"' in selector  # the servers' labels, else the operator's
            namespace, service = ("namespace", "model") if server else (names.SERVICE_NAMESPACE_LABEL,
                                                                         names.SERVICE_LABEL)
            assert f'{namespace}="$namespace"' in selector and f'{service}="$model"' in selector, (where, selector)


def test_panels_cover_what_the_dashboard_promises(dashboard):
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", [])) for p in dashboard["panels"]}
    assert "slo_target_seconds" in exprs["TBT p99 vs SLO"] and names.TIME_BETWEEN_TOKENS in exprs["TBT p99 vs SLO"]
    assert names.TIME_TO_FIRST_TOKEN in exprs["TTFT p99 vs SLO"]
    assert 'le="$tbt_slo_le"' in exprs["Goodput and throughput"]
    assert names.REQUESTS_WAITING in exprs["Queue per pod"] and "by (pod)" in exprs["Queue per pod"]
    assert names.REQUESTS_PREFILLING in exprs["Queue per pod"]
    assert names.KV_CACHE_USAGE in exprs["KV cache usage per pod"]
    assert names.CHUNK_SIZE in exprs["Chunk size per pod"]
    assert names.QUEUE_POLICY_INFO in exprs["Queue policy per pod"]
    assert names.CONFIG_GENERATION in exprs["Config generation per pod"]
    (decisions,) = [a for a in dashboard["annotations"]["list"] if "expr" in a]
    assert names.OPERATOR_DECISIONS in decisions["expr"] and "action" in decisions["titleFormat"]


def test_the_goodput_bucket_choices_are_the_tbt_histograms_buckets(dashboard):
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "tbt_slo_le"]
    bounds = [floatToGoString(b) for b in names.TBT_BUCKETS]  # how the server writes its `le` labels
    assert [o["value"] for o in variable["options"]] == bounds
    assert variable["current"]["value"] in bounds


def test_panel_ids_are_unique_and_every_panel_uses_the_datasource_variable(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_chart_and_the_docs_use_this_file():
    template = (ROOT / "charts" / "metronome" / "templates" / "dashboards.yaml").read_text()
    assert '.Files.Get "dashboards/metronome.json"' in template
    assert "charts/metronome/dashboards/metronome.json" in (ROOT / "docs" / "operator.md").read_text()
