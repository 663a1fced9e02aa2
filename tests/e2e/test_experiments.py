"""Live A/B experiments end to end: the operator (a local process under the chart's ServiceAccount), Debian's
Prometheus scraping two real `metronome serve` processes, the kubelet stand-in projecting each pod's config volume
(both ConfigMaps and the pod's own labels) with its 5-15 s delay, and load on both servers.

The model is random:tiny: a step costs ~1-10 ms plus ~0.1 ms per prefill token, so each server gives thousands of
token gaps per 10 s window and the prefill chunk still decides the slow steps. Prompts are 3,000 tokens long for
half the requests, so a chunk of 4096 prefills a whole prompt in one step (a gap of a few hundred ms for every
running stream) where 1024 takes three steps of a third of that. Each server gets the same request stream
(`LoadDriver`s with one seed): the groups differ by their config, not by their luck of the draw, as a Service's
random spread gives them the same mix on average in a real cluster.

One service, three experiments in order (the service starts at chunk 4096, fcfs):
1. candidate chunk 512 — TBT p99 about a third of the control's, TTFT a little longer (the experiment allows
   +100 %): promoted, and then served to both pods;
2. candidate chunk 4096 against the promoted 512 — reverted for TBT, the control's config never touched;
3. candidate max_num_seqs 32 against 16, with 4 requests per server (never binding) — "no difference" after its 5
   windows, rather than a flip either way.
Margins are 30 % (the gates and the minimum improvement): on this shared 2-core machine one window's TBT p99 moves
by up to ±30 % between two identical servers (docs/perf/experiments-cpu.md), and the effects are 2-3x.
Throughout: no failed request, no server restarted, no pod replaced; the labels, the candidate ConfigMap and the
servers' /v1/config show what the experiment says.
"""
from __future__ import annotations

import json
import time

import pytest
import yaml
from e2e_helpers import isvc, isvc_columns, server_config, service_namespace

from metronome.contract import variant
from metronome_testing.closedloop import LoadDriver, LoadSpec
from metronome_testing.polling import wait_for

NAME = "abtest"
WINDOW_S = 10
FINAL = ("Promoted", "Reverted", "NoDifference", "Aborted")
LOAD = LoadSpec(concurrency_per_server=4, long_fraction=0.5, long_prompt_len=3000, short_prompt_len=32, output_len=64,
                request_timeout_s=120.0, seed=7)


def manifest() -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {"model": {"source": "random:tiny", "maxModelLen": 4096}, "replicas": 2,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"},
                 "server": {"chunkSize": 4096, "queuePolicy": "fcfs", "maxNumSeqs": 16},
                 "autotune": {"intervalSeconds": 5}, "metrics": {"windowSeconds": WINDOW_S}},
    })


def experiment(name: str, candidate: dict, windows: int) -> dict:
    return {"name": name, "candidate": candidate, "windowSeconds": WINDOW_S, "windows": windows,
            "minSamplesPerWindow": 200, "minImprovementPercent": 15,
            "gates": {"tbtP99WorsePercent": 25, "ttftP99WorsePercent": 200, "goodputLowerPercent": 30}}


@pytest.fixture(scope="module")
def ns(cluster, operator):
    with service_namespace(cluster, "e2e-ab", manifest()) as namespace:
        yield namespace


@pytest.fixture(scope="module")
def servers(standin, ns):
    return standin.wait_for_servers(2, namespace=ns, service=NAME, timeout_s=180)


@pytest.fixture(scope="module")
def loads(servers):
    drivers = [LoadDriver([s.base_url], LOAD).start() for s in servers]
    wait_for(lambda: all(d.completed() >= 4 for d in drivers), "the first requests to complete", timeout=120)
    yield drivers
    for driver in drivers:
        driver.stop()


@pytest.fixture(scope="module")
def processes(servers):
    """Each server's pid at the start: no experiment may restart one."""
    return {s.pod: s.pid for s in servers}


def pods(cluster, ns) -> dict[str, dict]:
    items = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"metronome.dev/inferenceservice={NAME}")["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def served(cluster, ns) -> dict:
    config_map = cluster.kubectl_json("get", "configmap", f"{NAME}-config", "-n", ns)
    return yaml.safe_load(config_map["data"]["server.yaml"])


def candidate_config_map_exists(cluster, ns) -> bool:
    return cluster.kubectl("get", "configmap", f"{NAME}-candidate-config", "-n", ns, check=False).returncode == 0


def events(cluster, ns) -> list[str]:
    items = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={NAME}")["items"]
    return [e["reason"] for e in sorted(items, key=lambda e: e.get("firstTimestamp") or "")]


def run(cluster, ns, standin, loads, spec: dict, watch) -> dict:
    """Start the experiment; call `watch(status.experiment)` at each poll while it runs; return its final status."""
    # A JSON patch replaces spec.experiment whole; a merge patch would merge the new candidate into the last one's.
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=json", "-p",
                    json.dumps([{"op": "add", "path": "/spec/experiment", "value": spec}]))
    started = time.monotonic()

    def ended():
        record = (isvc(cluster, ns, NAME).get("status") or {}).get("experiment") or {}
        if record.get("name") != spec["name"]:
            return None
        watch(record)
        return record if record.get("phase") in FINAL else None

    record = wait_for(ended, f"experiment {spec['name']} to end", timeout=600, interval=2.0)
    took = time.monotonic() - started
    print(f"\nexperiment {spec['name']}: {record['phase']} ({record['reason']}) after {took:.0f} s "
          f"({record.get('windows')} windows counted, {record.get('windowsSkipped')} skipped): {record['message']}")
    print(json.dumps(record.get("ratios"), indent=1))
    assert not [e for d in loads for e in d.errors()], [e for d in loads for e in d.errors()][:5]
    return record


def back_to_control(cluster, ns, servers, chunk: int) -> None:
    """Every pod labelled control again, the candidate ConfigMap gone, every server on the served config."""
    def settled():
        labels = [p["metadata"]["labels"].get(variant.LABEL) for p in pods(cluster, ns).values()]
        configs = [server_config(s.base_url) for s in servers]
        generation = served(cluster, ns)["generation"]
        return (labels == [variant.CONTROL] * 2 and not candidate_config_map_exists(cluster, ns)
                and all(c["variant"] == variant.CONTROL and c["generation"] == generation
                        and c["scheduler"]["chunk_size"] == chunk for c in configs))

    wait_for(settled, "both pods back on the service's config", timeout=120, interval=1.0)


def test_a_clearly_better_candidate_is_promoted(cluster, standin, ns, servers, loads, processes):
    before = served(cluster, ns)
    seen = {"candidate_on_512": False, "control_on_4096": True}
    endpoints: list[set[str]] = []

    def watch(record):
        if record.get("phase") != "Running":
            return
        (candidate,) = record["candidatePods"]
        labels = {name: p["metadata"]["labels"].get(variant.LABEL) for name, p in pods(cluster, ns).items()}
        assert labels[candidate] == variant.CANDIDATE and list(labels.values()).count(variant.CONTROL) == 1
        for server in servers:
            config = server_config(server.base_url)
            if server.pod == candidate:
                seen["candidate_on_512"] |= config["scheduler"]["chunk_size"] == 512
            elif served(cluster, ns)["generation"] == before["generation"]:  # the control untouched while it runs
                seen["control_on_4096"] &= config["scheduler"]["chunk_size"] == 4096 and (
                    config["generation"] == before["generation"])
        # Routing stays fair: the Service's endpoints are both pods, whatever their variant.
        slices = cluster.kubectl_json("get", "endpointslices", "-n", ns, "-l",
                                      f"kubernetes.io/service-name={NAME}")["items"]
        endpoints.append({(e.get("targetRef") or {}).get("name") for s in slices for e in s.get("endpoints") or []})

    record = run(cluster, ns, standin, loads, experiment("better", {"chunkSize": 512}, windows=10), watch)
    assert (record["phase"], record["reason"]) == ("Promoted", "Better"), record["message"]
    assert record["ratios"]["tbtP99"]["state"] == "better" and record["ratios"]["tbtP99"]["ratio"] < 0.7
    assert seen["candidate_on_512"] and seen["control_on_4096"]
    assert endpoints and all(names == set(pods(cluster, ns)) for names in endpoints[-1:]), endpoints[-3:]
    promoted = served(cluster, ns)
    assert promoted["scheduler"]["chunk_size"] == 512 and promoted["generation"] > record["candidateGeneration"]
    back_to_control(cluster, ns, servers, chunk=512)
    assert isvc_columns(cluster, ns, NAME)["EXPERIMENT"] == "Promoted"
    assert {"ExperimentStarted", "ExperimentMeasuring", "ExperimentPromoted"} <= set(events(cluster, ns))
    assert {s.pod: s.pid for s in standin.servers(namespace=ns)} == processes  # nothing restarted
    print(cluster.kubectl("get", "inferenceservices.metronome.dev", "-n", ns).stdout)


def test_a_clearly_worse_candidate_is_reverted_and_the_control_is_untouched(cluster, standin, ns, servers, loads,
                                                                           processes):
    before = served(cluster, ns)
    control_configs = []

    def watch(record):
        if record.get("phase") == "Running":
            (candidate,) = record["candidatePods"]
            control_configs.extend(server_config(s.base_url) for s in servers if s.pod != candidate)

    record = run(cluster, ns, standin, loads, experiment("worse", {"chunkSize": 4096}, windows=10), watch)
    assert (record["phase"], record["reason"]) == ("Reverted", "TBTWorse"), record["message"]
    assert record["ratios"]["tbtP99"]["state"] == "worse"
    assert served(cluster, ns) == before  # the service's config was never rewritten
    assert control_configs and all((c["generation"], c["scheduler"]["chunk_size"]) == (before["generation"], 512)
                                   for c in control_configs)
    back_to_control(cluster, ns, servers, chunk=512)
    assert "ExperimentReverted" in events(cluster, ns)
    assert {s.pod: s.pid for s in standin.servers(namespace=ns)} == processes


def test_an_equal_candidate_ends_no_difference(cluster, standin, ns, servers, loads, processes):
    before = served(cluster, ns)
    record = run(cluster, ns, standin, loads, experiment("equal", {"maxNumSeqs": 32}, windows=5), lambda r: None)
    assert (record["phase"], record["reason"]) == ("NoDifference", "NoDifference"), record["message"]
    assert record["windows"] == 5 and served(cluster, ns) == before
    back_to_control(cluster, ns, servers, chunk=512)
    assert isvc_columns(cluster, ns, NAME)["EXPERIMENT"] == "NoDifference"
    assert {s.pod: s.pid for s in standin.servers(namespace=ns)} == processes
