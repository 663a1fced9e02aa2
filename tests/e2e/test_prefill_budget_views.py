"""Every view of the prefill budget says the number the engine enforces, under every queue policy: the CHUNK column
of `kubectl get inferenceservices` (status.chunkSize), the real server's `metronome_chunk_size` on /metrics, and the
budget of the scheduler the engine reports running (/v1/config); split's two sizes, where they differ, in the
SPLIT column (`-o wide`) and in `metronome_lane_chunk_size{lane}`.

One InferenceService (random tiny weights, one pod, its `metronome serve` started by the kubelet stand-in), walked
through split with lanes of different sizes, fcfs, sjf, and split again at the CRD's defaults, by edits of
spec.server.
"""
from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml
from e2e_helpers import config_map_generation, server_config, service_namespace
from prometheus_client.parser import text_string_to_metric_families

from metronome.contract import metric_names as names
from metronome.contract.budget import lane_budgets, prefill_budget, split_sizes
from metronome.contract.config import SchedulerConfig
from metronome_testing.polling import wait_for

NAME = "views"
SPLIT_1024_256 = {"queuePolicy": "split", "shortChunkSize": 1024, "longChunkSize": 256, "maxNumSeqs": 16}
# Each step replaces spec.server as a whole (a merge patch sets the keys given; null removes one).
STEPS = [
    pytest.param({"queuePolicy": "fcfs", "chunkSize": 192, "shortChunkSize": None, "longChunkSize": None}, id="fcfs"),
    pytest.param({"queuePolicy": "sjf", "chunkSize": 320}, id="sjf"),
    pytest.param({"queuePolicy": "split", "chunkSize": None}, id="split-crd-defaults"),  # 2048 short, 512 long
]


def manifest() -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {"model": {"source": "random:tiny"}, "replicas": 1,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"}, "server": SPLIT_1024_256},
    })


@pytest.fixture(scope="module")
def ns(cluster, operator):
    with service_namespace(cluster, "e2e-budget", manifest()) as namespace:
        yield namespace


def columns(cluster, ns, *flags: str) -> dict[str, str]:
    """The printed row of `kubectl get inferenceservices`, cut at the header's column offsets (empty cells
    print as nothing)."""
    header, row = cluster.kubectl("get", "inferenceservices.metronome.dev", NAME, "-n", ns,
                                  *flags).stdout.splitlines()[:2]
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:] + [None])}


def gauges(base_url: str) -> tuple[float, dict[str, float]]:
    """The server's metronome_chunk_size and metronome_lane_chunk_size by lane."""
    budget, lanes = None, {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == names.CHUNK_SIZE:
                budget = sample.value
            elif sample.name == names.LANE_CHUNK_SIZE:
                lanes[sample.labels[names.LANE_LABEL]] = sample.value
    return budget, lanes


def served_everywhere(cluster, ns, server) -> SchedulerConfig | None:
    """The scheduler the server applies, once it applies the ConfigMap's generation and the engine runs it."""
    generation = config_map_generation(cluster, ns, NAME)
    config = server_config(server.base_url)
    if config["generation"] != generation:
        return None
    # The engine swaps configs at a step boundary: one short request makes it take a step.
    httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
    running = server_config(server.base_url)["engine_scheduler"]
    return SchedulerConfig(**running) if running == config["scheduler"] else None


def check_views(cluster, ns, server) -> None:
    scheduler = wait_for(lambda: served_everywhere(cluster, ns, server),
                         "the server and its engine to run the ConfigMap's generation", timeout=90)
    enforced = prefill_budget(scheduler)
    wait_for(lambda: columns(cluster, ns)["CHUNK"] == str(enforced), f"the CHUNK column to show {enforced}",
             timeout=30)
    budget, lanes = gauges(server.base_url)
    assert int(columns(cluster, ns)["CHUNK"]) == int(budget) == enforced
    assert {lane: int(size) for lane, size in lanes.items()} == lane_budgets(scheduler)
    assert columns(cluster, ns, "-o", "wide")["SPLIT"] == (split_sizes(scheduler) or "")


def test_split_with_lanes_of_different_sizes(cluster, standin, ns):
    (server,) = standin.wait_for_servers(1, namespace=ns, timeout_s=180)
    check_views(cluster, ns, server)
    assert columns(cluster, ns)["CHUNK"] == "1024" and columns(cluster, ns, "-o", "wide")["SPLIT"] == "1024/256"


@pytest.mark.parametrize("server_fields", STEPS)
def test_every_policy(cluster, standin, ns, server_fields):
    (server,) = standin.wait_for_servers(1, namespace=ns, timeout_s=60)
    before = config_map_generation(cluster, ns, NAME)
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"server": server_fields}}))
    wait_for(lambda: config_map_generation(cluster, ns, NAME) > before, "a new server.yaml generation", timeout=60)
    check_views(cluster, ns, server)
