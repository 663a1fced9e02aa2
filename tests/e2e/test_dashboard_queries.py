"""Every query of the Grafana dashboard (charts/metronome/dashboards/metronome.json: each panel's PromQL and the
annotation of the loop's decisions) returns series from a real Prometheus that scrapes real servers and the
operator's own /metrics, while the loop runs.

A service of one replica (random tiny weights on the CPU) with a TBT target no CPU meets and the multiplicative
policy, so the loop decides to shrink the chunk at each reading; load through the stand-in's server; a Prometheus of
this test's own scraping the stand-in's targets and the session operator's --metrics-port each second. Every query
is run as Grafana runs it (a range query, the dashboard's variables filled in) and must return at least one
series with samples.
"""
from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from e2e_helpers import SCRAPE_INTERVAL_S, own_prometheus, prom_query_range, service_namespace

from metronome.contract import metric_names as names
from metronome_testing.checkout import ROOT
from metronome_testing.closedloop import LoadDriver, LoadSpec
from metronome_testing.localcluster.local import prometheus_binary
from metronome_testing.polling import wait_for
from metronome_testing.standin import scrape_config

DASHBOARD = ROOT / "charts" / "metronome" / "dashboards" / "metronome.json"
NAME = "dash"
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval at a 1 s scrape: at least 4 scrapes


def manifest() -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {
            "model": {"source": "random:tiny"},
            "replicas": 1,
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "server": {"chunkSize": 512, "queuePolicy": "fcfs", "maxNumSeqs": 8},
            "slo": {"tbtP99Ms": 1, "ttftP99Ms": 100},
            "autotune": {"mode": "apply", "policy": "multiplicative", "intervalSeconds": 5, "cooldownSeconds": 0,
                         "minChunkSize": 32, "maxChunkSize": 1024, "chunkGranularity": 32,
                         "policySwitching": False},
            "metrics": {"windowSeconds": 10},
        },
    })


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and Prometheus annotation, the variables filled in."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dashboard["panels"]
               for t in p.get("targets", [])]
    queries += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    (goodput_bucket,) = [v["current"]["value"] for v in dashboard["templating"]["list"] if v["name"] == "tbt_slo_le"]
    values = {"namespace": namespace, "model": NAME, "tbt_slo_le": goodput_bucket, "__rate_interval": RATE_INTERVAL}
    filled = [(where, re.sub(r"\$(\w+)", lambda m: values[m.group(1)], expr)) for where, expr in queries]
    assert not [q for q in filled if "$" in q[1]], filled
    return filled


@pytest.fixture(scope="module")
def ns(cluster, operator):
    with service_namespace(cluster, "e2e-dash", manifest()) as namespace:
        yield namespace


@pytest.fixture(scope="module")
def dashboard_prometheus(standin, operator, e2e_dir):
    """A Prometheus of this test's: the servers (the stand-in's targets) and the operator's own /metrics."""
    config = scrape_config(standin.options.targets_path, SCRAPE_INTERVAL_S) + f"""- job_name: metronome-operator
  static_configs:
  - targets: ["127.0.0.1:{operator.metrics_port}"]
"""
    work = e2e_dir / "dashboard-prometheus"
    work.mkdir()
    binary = prometheus_binary()
    assert binary is not None, "no prometheus binary (make prometheus)"
    with own_prometheus("prometheus-dashboard", binary, work, config) as url:
        yield url


def test_every_panel_and_annotation_query_returns_series(standin, ns, dashboard_prometheus):
    (server,) = standin.wait_for_servers(1, namespace=ns, service=NAME, timeout_s=300)
    start = time.time()
    load = LoadDriver([server.base_url], LoadSpec(concurrency_per_server=4, long_fraction=0.3, long_prompt_len=256,
                                                   output_len=32)).start()
    try:
        decisions = (f'sum(increase({names.OPERATOR_DECISIONS}{{{names.SERVICE_NAMESPACE_LABEL}="{ns}", '
                     f'{names.SERVICE_LABEL}="{NAME}", action="chunk_down"}}[1m]))')
        wait_for(lambda: [s for s in prom_query_range(dashboard_prometheus, decisions, start, time.time(), 5)
                          if any(float(v) > 0 for _, v in s["values"])],
                 "the loop to shrink the chunk, as the operator's /metrics tells", timeout=240, interval=2.0)
        empty = []
        for where, expr in dashboard_queries(ns):
            series = prom_query_range(dashboard_prometheus, expr, start, time.time(), 5)
            if not any(s["values"] for s in series):
                empty.append(f"{where}: {expr}")
    finally:
        load.stop()
    assert not empty, "queries without series:\n" + "\n".join(empty)
