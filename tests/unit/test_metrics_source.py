"""The Prometheus source: PromQL built from the shared metric names, canned JSON parsed into Observations, and
the real prometheus-api-client path against a small fake Prometheus on 127.0.0.1 (answers, errors, timeouts,
and nobody listening)."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from metronome.contract import metric_names as names
from metronome.operator import metrics_source as ms
from metronome.operator.metrics_source import (
    MetricsUnavailable,
    PrometheusMetricsSource,
    QueryWindow,
    ServiceSelector,
    build_queries,
    observation_from_results,
    parse_duration,
    try_observe,
)

SELECTOR = ServiceSelector(namespace="demo", service="tiny")
WINDOW = QueryWindow(window_seconds=60, sub_window_seconds=15)
NOW = 1_800_000_000.0


def _instant(value, **labels):
    return {"metric": labels, "value": [NOW, str(value)]}


def _range(points, **labels):
    return {"metric": labels, "values": [[NOW - 15 * (len(points) - 1 - i), str(v)] for i, v in enumerate(points)]}


def canned_results() -> dict:
    """What Prometheus answers for two busy pods (step rates per sub-window: tokens/s, seconds/s, steps/s)."""
    return {
        ms.TBT_P99: [_instant(0.0412)],
        ms.TBT_COUNT: [_instant(12345.0)],
        ms.TTFT_P99: [_instant(0.35)],
        ms.OUTPUT_TOKENS_RATE: [_instant(850.5)],
        ms.PROMPT_TOKENS_RATE: [_instant(4000.0)],
        ms.REQUESTS_RATE: [_instant(4.0)],
        ms.RUNNING_PER_POD: [_instant(24.0)],
        ms.STEP_TOKENS_RATE: [_range([20000, 30000], pod="tiny-a", instance="10.0.0.1:8000"),
                              _range([15000, 25000], pod="tiny-b", instance="10.0.0.2:8000")],
        ms.STEP_SECONDS_RATE: [_range([0.9, 0.95], pod="tiny-a", instance="10.0.0.1:8000"),
                               _range([0.85, 0.93], pod="tiny-b", instance="10.0.0.2:8000")],
        ms.STEP_COUNT_RATE: [_range([50, 40], pod="tiny-a", instance="10.0.0.1:8000"),
                             _range([60, "NaN"], pod="tiny-b", instance="10.0.0.2:8000")],
        ms.GENERATION_BY_POD: [_instant(3, pod="tiny-a", instance="10.0.0.1:8000"),
                               _instant(2, pod="tiny-b", instance="10.0.0.2:8000")],
        ms.TBT_P99_BY_LANE: [_instant(0.031, lane="short"), _instant(0.0455, lane="long")],
        ms.PROMPTS_BY_LANE: [_instant(180.0, lane="short"), _instant(60.0, lane="long")],
        ms.APPLIED_BY_POD: [_instant(1.7e9, pod="tiny-a", instance="10.0.0.1:8000"),
                            _instant(1.7e9 + 40, pod="tiny-b", instance="10.0.0.2:8000")],
        ms.WAITING: [_instant(3.0)],
        ms.WAITING_GROWTH: [_instant(-1.0)],
        ms.PREFILLING: [_instant(2.5)],
    }


# --- PromQL ------------------------------------------------------------------------------------------------

def test_queries_use_the_shared_metric_names_and_select_one_service():
    queries = build_queries(SELECTOR, WINDOW)
    assert set(queries) == set(ms.QUERY_KEYS)
    assert queries[ms.TBT_P99] == (
        f'histogram_quantile(0.99, sum by (le) (rate({names.TIME_BETWEEN_TOKENS}_bucket'
        f'{{namespace="demo",model="tiny"}}[60s])))')
    assert f"{names.TIME_TO_FIRST_TOKEN}_bucket" in queries[ms.TTFT_P99]
    assert f"rate({names.GENERATION_TOKENS}{{" in queries[ms.OUTPUT_TOKENS_RATE]
    assert names.PROMPT_TOKENS in queries[ms.PROMPT_TOKENS_RATE]
    assert f"{names.REQUEST_E2E}_count" in queries[ms.REQUESTS_RATE]
    assert names.REQUESTS_RUNNING in queries[ms.RUNNING_PER_POD]
    assert f"{names.STEP_TOKENS}_sum" in queries[ms.STEP_TOKENS_RATE]
    assert f"{names.STEP_DURATION}_sum" in queries[ms.STEP_SECONDS_RATE]
    assert queries[ms.STEP_COUNT_RATE].endswith("[15s])))[60s:15s]")
    assert names.CONFIG_GENERATION in queries[ms.GENERATION_BY_POD]
    used = {name for name in names.ALL_NAMES if any(name in q for q in queries.values())}
    for query in queries.values():
        # Every metric a query names is one of the shared names (plus a histogram suffix).
        for token in query.replace("(", " ").replace("{", " ").split():
            if token.startswith(names.PREFIX):
                base = token.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
                assert token in names.ALL_NAMES or base in names.ALL_NAMES, token
        assert '{namespace="demo",model="tiny"}' in query
    assert used == {names.TIME_BETWEEN_TOKENS, names.TIME_TO_FIRST_TOKEN, names.GENERATION_TOKENS, names.PROMPT_TOKENS,
                    names.REQUEST_E2E, names.REQUESTS_RUNNING, names.STEP_TOKENS, names.STEP_DURATION,
                    names.CONFIG_GENERATION, names.PROMPTS, names.CONFIG_APPLIED_TIME,
                    names.REQUESTS_WAITING, names.REQUESTS_PREFILLING}  # each feeds the Observation


def test_selector_label_names_are_parameters_and_values_are_escaped():
    selector = ServiceSelector(namespace="ns", service='we"ird\\name', namespace_label="kubernetes_namespace",
                               service_label="app_kubernetes_io_instance", pod_label="kubernetes_pod_name")
    queries = build_queries(selector, QueryWindow(30, 10))
    assert '{kubernetes_namespace="ns",app_kubernetes_io_instance="we\\"ird\\\\name"}' in queries[ms.TBT_P99]
    assert "by (kubernetes_pod_name, instance)" in queries[ms.GENERATION_BY_POD]
    assert "[30s]" in queries[ms.TBT_P99] and "[30s:10s]" in queries[ms.STEP_TOKENS_RATE]


@pytest.mark.parametrize("bad", [dict(namespace="", service="x"),
                                 dict(namespace="a", service="x", pod_label="bad-label")])
def test_selector_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        ServiceSelector(**bad)


def test_window_from_spec_and_durations():
    from metronome.operator.spec import MetricsSpec

    assert QueryWindow.for_window(MetricsSpec().window_seconds) == QueryWindow(60.0, 15.0)  # spec.metrics default
    assert QueryWindow.for_window(120) == QueryWindow(120.0, 30.0)
    assert QueryWindow.for_window(12) == QueryWindow(12.0, 5.0)
    assert QueryWindow.for_window("2m", "20s") == QueryWindow(120.0, 20.0)
    assert QueryWindow.for_window(240, scrape_interval_seconds=15) == QueryWindow(240.0, 60.0)
    # Every range spans at least 4 scrape intervals: a 30 s scrape interval widens a 60 s window to 2 min.
    assert QueryWindow.for_window(60, scrape_interval_seconds=30) == QueryWindow(120.0, 120.0)
    # A fast scrape lets a short window have several step-fit points (5 s is the floor only when it is unknown).
    assert QueryWindow.for_window(6, scrape_interval_seconds=0.5) == QueryWindow(6.0, 2.0)
    assert parse_duration("500ms") == 0.5 and parse_duration("1h") == 3600
    assert ms.format_duration(2.5) == "2500ms" and ms.format_duration(60) == "60s"
    for bad in ("soon", "-5s", 0, "5d"):
        with pytest.raises(ValueError):
            parse_duration(bad, "spec.metrics.window")
    with pytest.raises(ValueError):
        QueryWindow(window_seconds=10, sub_window_seconds=20)


# --- parsing -----------------------------------------------------------------------------------------------

def test_canned_results_become_an_observation():
    obs = observation_from_results(canned_results(), WINDOW, SELECTOR)
    assert obs.window_seconds == 60
    assert obs.sample_count == 12345
    assert obs.tbt_p99_s == pytest.approx(0.0412)
    assert obs.ttft_p99_s == pytest.approx(0.35)
    assert obs.output_tokens_per_s == pytest.approx(850.5)
    assert obs.mean_prompt_tokens == pytest.approx(1000.0)
    assert obs.long_prompt_share == pytest.approx(60 / 240)  # the long lane's share of prompts
    assert obs.decode_batch_size == 24.0
    assert (obs.waiting_requests, obs.waiting_growth, obs.prefilling_requests) == (3.0, -1.0, 2.5)
    assert obs.pod_generations == {"tiny-a": 3, "tiny-b": 2}
    # Three sub-windows had steps (tiny-b's last one is NaN: no steps, dropped): mean tokens and seconds per step.
    points = sorted((s.pod, round(s.tokens_per_step, 3), round(s.step_seconds, 5), s.steps) for s in obs.step_samples)
    assert points == [("tiny-a", 400.0, 0.018, 750.0), ("tiny-a", 750.0, 0.02375, 600.0),
                      ("tiny-b", 250.0, 0.01417, 900.0)]


def test_pods_fall_back_to_the_instance_label():
    results = canned_results()
    results[ms.GENERATION_BY_POD] = [_instant(5, instance="127.0.0.2:8000")]
    obs = observation_from_results(results, WINDOW, SELECTOR)
    assert obs.pod_generations == {"127.0.0.2:8000": 5}


def test_idle_service_gives_an_observation_without_samples():
    results = {key: [] for key in ms.QUERY_KEYS}
    results[ms.TBT_P99] = [_instant("NaN")]
    results[ms.TBT_COUNT] = [_instant(0)]
    results[ms.OUTPUT_TOKENS_RATE] = [_instant(0)]
    results[ms.REQUESTS_RATE] = [_instant(0)]
    results[ms.PROMPT_TOKENS_RATE] = [_instant(0)]
    results[ms.GENERATION_BY_POD] = [_instant(1, pod="tiny-a")]
    obs = observation_from_results(results, WINDOW, SELECTOR)
    assert obs.sample_count == 0 and obs.tbt_p99_s is None
    assert obs.mean_prompt_tokens is None and obs.long_prompt_share is None
    assert obs.step_samples == () and obs.pod_generations == {"tiny-a": 1}


def test_no_series_at_all_is_unavailable():
    with pytest.raises(MetricsUnavailable) as caught:
        observation_from_results({key: [] for key in ms.QUERY_KEYS}, WINDOW, SELECTOR)
    assert caught.value.reason == MetricsUnavailable.NO_SERIES
    assert "demo/tiny" in caught.value.message


@pytest.mark.parametrize("corrupt", [
    lambda r: r.pop(ms.TBT_P99),
    lambda r: r.__setitem__(ms.TBT_COUNT, {"not": "a list"}),
    lambda r: r.__setitem__(ms.TBT_P99, [{"metric": {}, "value": ["x"]}]),
    lambda r: r.__setitem__(ms.STEP_COUNT_RATE, [{"metric": {}, "value": [NOW, "1"]}]),
    lambda r: r.__setitem__(ms.TTFT_P99, [{"metric": {}}]),
])
def test_malformed_results_are_bad_responses(corrupt):
    results = canned_results()
    corrupt(results)
    with pytest.raises(MetricsUnavailable) as caught:
        observation_from_results(results, WINDOW, SELECTOR)
    assert caught.value.reason == MetricsUnavailable.BAD_RESPONSE


# --- the real client against a fake Prometheus -------------------------------------------------------------

class FakePrometheus:
    """/api/v1/query on 127.0.0.1: answers from canned results by query, or misbehaves as told."""

    def __init__(self, results: dict):
        by_query = {query: results[key] for key, query in build_queries(SELECTOR, WINDOW).items()}
        self.mode = "ok"
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                url = urlparse(self.path)
                params = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append(params)
                if fake.mode == "slow":
                    time.sleep(0.6)
                if url.path != "/api/v1/query" or fake.mode == "error":
                    return self._send(400 if fake.mode == "error" else 404,
                                      {"status": "error", "errorType": "bad_data", "error": "parse error"})
                if fake.mode == "unavailable":
                    return self._send(503, {"status": "error", "error": "overloaded"})
                if fake.mode == "garbage":
                    return self._send(200, None, raw=b"<html>not prometheus</html>")
                if params.get("query") not in by_query:
                    return self._send(400, {"status": "error", "error": f"unexpected query {params.get('query')}"})
                self._send(200, {"status": "success", "data": {"resultType": "vector",
                                                               "result": by_query[params["query"]]}})

            def _send(self, status, body, raw=None):
                data = raw if raw is not None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_prometheus():
    with FakePrometheus(canned_results()) as fake:
        yield fake


def test_client_path_gives_the_same_observation(fake_prometheus):
    source = PrometheusMetricsSource(fake_prometheus.url, timeout_seconds=2, retries=0)
    obs = source.observe(SELECTOR, WINDOW, now=NOW)
    assert obs == observation_from_results(canned_results(), WINDOW, SELECTOR)
    assert len(fake_prometheus.requests) == len(ms.QUERY_KEYS)
    assert {r["time"] for r in fake_prometheus.requests} == {f"{NOW:.3f}"}  # one instant for every query
    source.close()


@pytest.mark.parametrize("mode,reason", [
    ("error", MetricsUnavailable.QUERY_FAILED),
    ("unavailable", MetricsUnavailable.QUERY_FAILED),
    ("garbage", MetricsUnavailable.BAD_RESPONSE),
    ("slow", MetricsUnavailable.TIMEOUT),
])
def test_misbehaving_prometheus_is_unavailable(fake_prometheus, mode, reason):
    fake_prometheus.mode = mode
    source = PrometheusMetricsSource(fake_prometheus.url, timeout_seconds=0.2, retries=1)
    observation, error = try_observe(source, SELECTOR, WINDOW, now=NOW)
    assert observation is None
    assert error is not None and error.reason == reason, error
    assert fake_prometheus.url in error.message


def test_prometheus_down_is_unreachable():
    with socket.socket() as probe:  # a port that nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    source = PrometheusMetricsSource(f"http://127.0.0.1:{port}", timeout_seconds=1, retries=0)
    with pytest.raises(MetricsUnavailable) as caught:
        source.observe(SELECTOR, WINDOW)
    assert caught.value.reason == MetricsUnavailable.UNREACHABLE


def test_bad_url_is_rejected():
    with pytest.raises(ValueError):
        PrometheusMetricsSource("prometheus:9090")


def test_relabeling_rules_produce_the_selector_labels():
    selector = ServiceSelector("ns", "svc")
    targets = {rule["targetLabel"] for rule in ms.podmonitor_relabelings()}
    assert targets == {selector.namespace_label, selector.pod_label}
    # The service is matched by the label the server sets itself, so no relabeling of ours creates it.
    assert selector.service_label == names.MODEL_LABEL
    assert {tuple(rule["sourceLabels"]) for rule in ms.podmonitor_relabelings()} == {
        ("__meta_kubernetes_namespace",), ("__meta_kubernetes_pod_name",)}
