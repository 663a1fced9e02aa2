"""Small helpers of the e2e tests: a service's namespace, starting Prometheus, Prometheus queries, the operator's
view, the servers' /v1/config, the resource's columns, the TBT target measured from a running load.
Everything here talks to 127.0.0.0/8 only (the API server through kubectl, Prometheus, the stand-in's servers)."""
from __future__ import annotations

import contextlib
import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metronome.operator.metrics_source import PrometheusMetricsSource, QueryWindow, ServiceSelector
from metronome.server.bench.load.stats import percentile
from metronome.server.bench.processes import free_port, http_ok
from metronome_testing.closedloop.slo import Calibration, CalibrationError, choose_tbt_target
from metronome_testing.localcluster.components import prometheus_argv
from metronome_testing.localcluster.procs import start_process, stop_process
from metronome_testing.polling import wait_for

SCRAPE_INTERVAL_S = 1  # every e2e Prometheus scrapes each second; the operator's windows are read at that step


@contextlib.contextmanager
def service_namespace(cluster, base: str, manifest: str) -> Iterator[str]:
    """A new namespace `<base>-<random>` holding `manifest`; deleted (not waited for) afterwards."""
    namespace = cluster.namespace(base)
    cluster.apply(manifest, namespace)
    try:
        yield namespace
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@contextlib.contextmanager
def session_prometheus(cluster, work: Path, scrape_config: str) -> Iterator[str]:
    """The cluster's Prometheus (Debian's), restarted with `scrape_config`; yields its URL."""
    config = work / "prometheus.yml"
    config.write_text(scrape_config)
    url = cluster.start_prometheus(config)
    try:
        yield url
    finally:
        cluster.stop_prometheus()


@contextlib.contextmanager
def own_prometheus(name: str, binary: Path, work: Path, scrape_config: str) -> Iterator[str]:
    """A Prometheus of the caller's (`binary`, config, data and log in `work`) on a free loopback port, next to
    the session's; yields its URL once /-/ready answers."""
    config = work / "prometheus.yml"
    config.write_text(scrape_config)
    port = free_port()
    record = start_process(name, prometheus_argv(binary, config, work / "data", port), work / "log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_ok(f"{url}/-/ready"), f"{name} to be ready (log {work / 'log'})", timeout=60)
        yield url
    finally:
        stop_process(record)


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def prom_query(prometheus_url: str, promql: str) -> list[dict]:
    """An instant query's `data.result`."""
    body = get_json(f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {promql!r}: {body}")
    return body["data"]["result"]


def prom_query_range(prometheus_url: str, promql: str, start: float, end: float, step_s: float) -> list[dict]:
    """A range query's `data.result` (what a Grafana panel asks)."""
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}s"}
    body = get_json(f"{prometheus_url}/api/v1/query_range?{urllib.parse.urlencode(params)}")
    if body.get("status") != "success":
        raise AssertionError(f"Prometheus refused {promql!r}: {body}")
    return body["data"]["result"]


def pod_generations(prometheus_url: str, selector: str) -> dict[str, int]:
    """`metronome_config_generation{<selector>}` as {pod: generation}."""
    result = prom_query(prometheus_url, f"metronome_config_generation{{{selector}}}")
    return {series["metric"]["pod"]: int(float(series["value"][1])) for series in result}


def operator_view(prometheus_url: str, namespace: str, name: str, window_s: int = 20):
    """What the operator's query path reads for one service over `window_s`."""
    source = PrometheusMetricsSource(prometheus_url)
    try:
        window = QueryWindow.for_window(window_s, scrape_interval_seconds=SCRAPE_INTERVAL_S)
        return source.observe(ServiceSelector(namespace, name), window)
    finally:
        source.close()


def server_config(base_url: str) -> dict:
    """A server's /v1/config (generation and scheduler it applies)."""
    return get_json(f"{base_url}/v1/config")


def isvc_columns(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get inferenceservices.metronome.dev NAME` as {column: value}."""
    lines = cluster.kubectl("get", "inferenceservices.metronome.dev", name, "-n", namespace).stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    return dict(zip(header, row))


def isvc(cluster, namespace: str, name: str) -> dict:
    return cluster.kubectl_json("get", "inferenceservices.metronome.dev", name, "-n", namespace)


def config_map_generation(cluster, namespace: str, name: str) -> int:
    import yaml

    config_map = cluster.kubectl_json("get", "configmap", f"{name}-config", "-n", namespace)
    return int(yaml.safe_load(config_map["data"]["server.yaml"])["generation"])


def measure_gaps(load, seconds: float) -> list[float]:
    """Token gaps of the next `seconds` of `load` (a LoadDriver or a ServiceLoad; at least 100 of them)."""
    mark = load.now()
    wait_for(lambda: load.now() - mark >= seconds and len(load.gaps_since(mark)) >= 100,
             f"{seconds:g} s and 100 token gaps of load", timeout=seconds + 180, interval=1.0)
    return load.gaps_since(mark)


def calibrate(load, initial_chunk: int, floor_chunk: int, seconds: float, attempts: int = 3) -> tuple[Calibration,
                                                                                                      list[float]]:
    """A TBT target the initial chunk violates, from its measured gaps (closedloop/slo.py). A busy spell on a shared
    machine can flatten one measurement (a CI run once saw a 619 ms median gap, where the chunk barely moved the
    p99): measure again."""
    for attempt in range(1, attempts + 1):
        gaps = measure_gaps(load, seconds)
        assert not load.errors(), load.errors()[:5]
        try:
            return choose_tbt_target(percentile(gaps, 50), percentile(gaps, 99), initial_chunk, floor_chunk), gaps
        except CalibrationError as exc:
            if attempt == attempts:
                raise
            print(f"\ncalibration attempt {attempt}: {exc}; measuring again")
    raise AssertionError("unreachable")
