"""The e2e plumbing on its own, with a random tiny model (loads in a second): kwok pods → real servers on
127.0.0.x; a ConfigMap change → the `..data` swap → the servers' new generation; Prometheus sees each server with
the label contract the operator queries by; a deleted pod's server is stopped and its replacement started.

The tests of this module share one InferenceService and run in order.
"""
from __future__ import annotations

import ipaddress
import os
import signal

import pytest
import yaml
from e2e_helpers import config_map_generation, operator_view, pod_generations, server_config, service_namespace

from metronome_testing.polling import wait_for

NAME = "tiny"
LABEL = f"metronome.dev/inferenceservice={NAME}"


def manifest(chunk_size: int) -> str:
    return yaml.safe_dump({
        "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {"model": {"source": "random:tiny"}, "replicas": 2,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "1Gi"},
                 "server": {"chunkSize": chunk_size, "queuePolicy": "fcfs", "maxNumSeqs": 16}},
    })


@pytest.fixture(scope="module")
def ns(cluster, operator):
    with service_namespace(cluster, "e2e-standin", manifest(256)) as namespace:
        yield namespace


def running_pods(cluster, ns) -> list[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", LABEL)["items"]
    return sorted(p["metadata"]["name"] for p in pods
                  if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"))


def generation_series(prometheus, ns) -> dict[str, int]:
    return pod_generations(prometheus, f'namespace="{ns}",service="{NAME}"')


def test_running_pods_get_real_servers_on_their_own_loopback_addresses(cluster, standin, ns):
    pods = wait_for(lambda: len(running_pods(cluster, ns)) == 2 and running_pods(cluster, ns),
                    "2 Running server pods on kwok nodes", timeout=120)
    servers = standin.wait_for_servers(2, namespace=ns, timeout_s=180)
    assert sorted(s.pod for s in servers) == pods
    assert {s.service for s in servers} == {NAME}
    addresses = [ipaddress.ip_address(s.address) for s in servers]
    assert len(set(addresses)) == 2 and all(a in ipaddress.ip_network("127.0.0.0/8") for a in addresses)
    generation = config_map_generation(cluster, ns, NAME)
    for server in servers:
        config = server_config(server.base_url)
        assert config["generation"] == generation
        assert config["scheduler"]["chunk_size"] == 256
        assert config["scheduler"]["max_num_seqs"] == 16


def test_prometheus_scrapes_every_server_with_the_label_contract(standin, prometheus, ns):
    pods = {s.pod for s in standin.servers(namespace=ns)}
    series = wait_for(lambda: set(generation_series(prometheus, ns)) == pods and generation_series(prometheus, ns),
                      f"metronome_config_generation of pods {sorted(pods)} in Prometheus", timeout=60)
    assert len(set(series.values())) == 1
    # The operator's own query path reads the same series: one generation per pod.
    assert operator_view(prometheus, ns, NAME).pod_generations == series


def test_a_configmap_change_reaches_each_server_through_the_data_swap(cluster, standin, prometheus, ns):
    before = config_map_generation(cluster, ns, NAME)
    servers = standin.servers(namespace=ns)
    config_dir = servers[0].config_dirs[0]
    old_version = os.readlink(config_dir / "..data")
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"server": {"chunkSize": 128}}}')
    after = wait_for(lambda: (config_map_generation(cluster, ns, NAME) > before
                              and config_map_generation(cluster, ns, NAME)),
                     "the operator to write a new server.yaml generation", timeout=60)
    for server in servers:
        wait_for(lambda server=server: server_config(server.base_url)["generation"] == after,
                 f"{server.pod} to apply generation {after}", timeout=30)
        assert server_config(server.base_url)["scheduler"]["chunk_size"] == 128
    # The kubelet's layout: a new timestamped version behind ..data, server.yaml a link through ..data.
    new_version = os.readlink(config_dir / "..data")
    assert new_version != old_version and new_version.startswith("..")
    assert os.readlink(config_dir / "server.yaml") == "..data/server.yaml"
    assert not (config_dir / old_version).exists()
    wait_for(lambda: set(generation_series(prometheus, ns).values()) == {after},
             f"Prometheus to see generation {after} on every pod", timeout=30)


def test_a_server_that_dies_is_restarted_on_the_same_address(standin, ns):
    victim = standin.servers(namespace=ns)[0]
    os.kill(victim.pid, signal.SIGKILL)  # our own child, by its pid
    restarted = wait_for(lambda: [s for s in standin.ready_servers(namespace=ns) if s.pod == victim.pod
                                  and s.restarts == victim.restarts + 1],
                         f"{victim.pod}'s server to be restarted", timeout=60)
    assert restarted[0].base_url == victim.base_url and restarted[0].pid != victim.pid
    assert server_config(victim.base_url)["generation"] >= 1


def test_a_deleted_pod_stops_its_server_and_the_replacement_gets_one(cluster, standin, ns):
    victim = standin.servers(namespace=ns)[0]
    cluster.kubectl("delete", "pod", victim.pod, "-n", ns, "--wait=false")
    wait_for(lambda: victim.pod not in {s.pod for s in standin.servers(namespace=ns)},
             f"the stand-in to stop {victim.pod}'s server", timeout=60)
    servers = wait_for(lambda: (len(standin.servers(namespace=ns)) == 2
                                and standin.wait_for_servers(2, ns, timeout_s=60)),
                       "a server for the replacement pod", timeout=120)
    assert victim.pod not in {s.pod for s in servers}
    # The stopped server leaves servers() at once but exits after the pod's preStop sleep and its drain.
    assert victim.pid is not None
    wait_for(lambda: not os.path.exists(f"/proc/{victim.pid}"), f"{victim.pod}'s server to exit and be reaped",
             timeout=60)
