"""The closed loop, end to end (issue 7 item 5): control plane + the operator (a local process under the chart's
ServiceAccount) + Debian's Prometheus scraping two real `metronome serve` processes with the default model
(SmolLM2-135M on CPU) on 127.0.0.x + the kubelet stand-in syncing their ConfigMap by the `..data` swap.

1. The service starts at chunk 512 (fcfs) with autotune off; long-short load runs against both servers.
2. The TBT target is chosen from the token gaps measured at chunk 512 (hack/closedloop/slo.py, docs/e2e.md):
   a bound of the TBT histogram that chunk 512 clearly violates and the floor chunk reaches with slack — a fixed
   number of milliseconds would be trivial on an idle machine and unreachable on a busy one.
3. With the SLO set and autotune on, the operator lowers the chunk size; both servers report the new config
   generation (their /v1/config and metronome_config_generation in Prometheus); the p99 TBT the load measures
   afterwards is under the target, and `kubectl get inferenceservices` shows CHUNK, TBT-P99 and SLO=Met.
"""
from __future__ import annotations

import json

import pytest
import yaml

from closedloop import LoadDriver, LoadSpec
from closedloop.slo import choose_tbt_target
from e2e_helpers import config_map_generation, isvc, isvc_columns, prom_query, server_config, wait_for

from metronome.operator.metrics_source import PrometheusMetricsSource, QueryWindow, ServiceSelector
from metronome.server.bench.stats import percentile

NAME = "smollm2"
INITIAL_CHUNK = 512
FLOOR_CHUNK = 32
WINDOW_S = 20
MEASURE_S = 20.0  # seconds of load per client-side measurement


def manifest() -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {
            "model": {"source": "default"},
            "replicas": 2,
            "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
            "server": {"chunkSize": INITIAL_CHUNK, "queuePolicy": "fcfs", "maxNumSeqs": 16},
            # Coarse TBT buckets at CPU speeds (0.3, 0.5, 1 s): a low dead band keeps the loop from growing the
            # chunk back on a reading that is only a bucket's interpolation.
            "autotune": {"mode": "off", "policy": "model", "intervalSeconds": 5, "cooldownSeconds": 10,
                         "minChunkSize": FLOOR_CHUNK, "maxChunkSize": 1024, "chunkGranularity": 32,
                         "deadbandLow": 0.3, "policySwitching": False},
            "metrics": {"windowSeconds": WINDOW_S},
        },
    })


@pytest.fixture(scope="module")
def ns(cluster, operator):
    namespace = cluster.namespace("e2e-loop")
    cluster.apply(manifest(), namespace)
    yield namespace
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


@pytest.fixture(scope="module")
def servers(standin, ns):
    return standin.wait_for_servers(2, namespace=ns, service=NAME, timeout_s=300)


@pytest.fixture(scope="module")
def load(servers):
    driver = LoadDriver([s.base_url for s in servers], LoadSpec()).start()
    yield driver
    driver.stop()


def measure_gaps(load: LoadDriver, seconds: float) -> list[float]:
    """Token gaps of the next `seconds` of load (at least 100 of them)."""
    mark = load.now()
    wait_for(lambda: load.now() - mark >= seconds and len(load.gaps_since(mark)) >= 100,
             f"{seconds:g} s and 100 token gaps of load", timeout=seconds + 180, interval=1.0)
    return load.gaps_since(mark)


def operator_view(prometheus: str, ns: str):
    source = PrometheusMetricsSource(prometheus)
    try:
        return source.observe(ServiceSelector(ns, NAME), QueryWindow.for_window(WINDOW_S, scrape_interval_seconds=1))
    finally:
        source.close()


def test_the_operator_retunes_the_chunk_size_until_the_slo_is_met(cluster, standin, prometheus, operator, ns,
                                                                  servers, load):
    # 1-2. Load at the initial chunk; a target that chunk violates, chosen from what it measured.
    wait_for(lambda: load.completed() >= 4, "the first requests to complete", timeout=180, interval=1.0)
    initial = measure_gaps(load, MEASURE_S)
    assert not load.errors(), load.errors()[:5]
    calibration = choose_tbt_target(percentile(initial, 50), percentile(initial, 99), INITIAL_CHUNK, FLOOR_CHUNK)
    print(f"\ncalibration ({len(initial)} gaps): {calibration.describe()}")
    target_ms = round(calibration.target_s * 1000)
    before = operator_view(prometheus, ns)
    assert before.tbt_p99_s is not None and before.tbt_p99_s > calibration.target_s, (
        f"Prometheus' p99 TBT at chunk {INITIAL_CHUNK} ({before.tbt_p99_s}) should violate {target_ms} ms")
    first_generation = config_map_generation(cluster, ns, NAME)

    # 3. SLO on, autotune on: the operator lowers the chunk size and the servers take the new config.
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"slo": {"tbtP99Ms": target_ms}, "autotune": {"mode": "apply"}}}))
    lowered = wait_for(lambda: (isvc(cluster, ns, NAME).get("status") or {}).get("chunkSize", INITIAL_CHUNK)
                       < INITIAL_CHUNK and isvc(cluster, ns, NAME)["status"],
                       "the operator to lower the chunk size", timeout=180, interval=1.0)
    print(f"first change: {lowered.get('lastDecision')}")
    assert config_map_generation(cluster, ns, NAME) > first_generation

    def settled():
        status = isvc(cluster, ns, NAME).get("status") or {}
        generation = config_map_generation(cluster, ns, NAME)
        return (status.get("slo") == "Met" and status.get("configGeneration") == generation
                and status.get("podsOnGeneration") == 2 and status.get("chunkSize", INITIAL_CHUNK) < INITIAL_CHUNK
                and status)

    status = wait_for(settled, f"SLO=Met on the new config (target {target_ms} ms)", timeout=300, interval=1.0)
    generation, chunk = status["configGeneration"], status["chunkSize"]
    for server in servers:  # each server, on its own loopback address
        config = server_config(server.base_url)
        assert (config["generation"], config["scheduler"]["chunk_size"]) == (generation, chunk), server.pod
    series = prom_query(prometheus, f'metronome_config_generation{{namespace="{ns}",service="{NAME}"}}')
    assert {s["metric"]["pod"]: int(float(s["value"][1])) for s in series} == {s.pod: generation for s in servers}

    # The load's own measurement after the change is under the target.
    after = measure_gaps(load, MEASURE_S)
    p99_after = percentile(after, 99)
    print(f"after: chunk {chunk}, generation {generation}, client p99 TBT {p99_after * 1e3:.0f} ms over {len(after)} "
          f"gaps (target {target_ms} ms); status {json.dumps({k: status.get(k) for k in ('tbtP99Ms', 'slo')})}")
    assert p99_after < calibration.target_s
    assert not load.errors(), load.errors()[:5]

    columns = isvc_columns(cluster, ns, NAME)
    print(cluster.kubectl("get", "inferenceservices.metronome.dev", "-n", ns).stdout)
    current = isvc(cluster, ns, NAME)["status"]
    assert columns["SLO"] == "Met"
    assert columns["CHUNK"] == str(current["chunkSize"]) and current["chunkSize"] < INITIAL_CHUNK
    assert float(columns["TBT-P99"]) <= target_ms
