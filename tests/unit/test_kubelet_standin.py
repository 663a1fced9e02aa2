"""The kubelet stand-in's pure parts (metronome_testing.standin): a server Pod as the operator builds it → the local
`metronome serve` command line; ConfigMap projection by the `..data` swap; Prometheus file_sd targets."""
from __future__ import annotations

import json
import os

import pytest

from metronome.contract import variant
from metronome.operator import builders
from metronome.operator.spec import parse_service
from metronome.server.api.serve_cli import configure
from metronome.server.bench.configfile import DATA_LINK, current_files, project
from metronome_testing.standin.podspec import LocalMounts, PodSpecError, is_running, local_argv, server_pod
from metronome_testing.standin.targets import Target, file_sd_groups, scrape_config, write_file_sd


def pod_for(spec: dict, phase: str = "Running", name: str = "chat-abc") -> dict:
    body = {"apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 1}, "spec": spec}
    template = builders.pod_template(parse_service(body))
    return {"metadata": {**template["metadata"], "name": name, "namespace": "ml", "uid": "0123456789abcdef"},
            "spec": template["spec"], "status": {"phase": phase}}


def serve_parser():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    configure(parser)
    return parser


def test_a_gpu_pod_becomes_a_cpu_server_on_its_loopback_address():
    pod = server_pod(pod_for({"model": {"source": "random:tiny"}, "replicas": 2, "resources": {"gpus": 2},
                              "engine": {"blockSize": 32}}))
    assert (pod.namespace, pod.service, pod.grace_seconds, pod.pre_stop_seconds) == ("ml", "chat", 60.0, 15.0)
    quick = server_pod(pod_for({"model": {"source": "default"}, "shutdown": {"preStopSleepSeconds": 0}}))
    assert quick.pre_stop_seconds == 0.0  # no preStop hook: SIGTERM at once
    mounts = LocalMounts((("/etc/metronome", "/work/cfg"),))
    argv = local_argv(pod, ["/venv/bin/metronome"], "127.0.0.3", 41000, "cpu", mounts, ("--kv-cache-memory-gb", "0.5"))
    assert argv[0] == "/venv/bin/metronome"
    args = serve_parser().parse_args(argv[1:])  # the real `metronome serve` flags accept every word
    assert (args.host, args.port, args.device) == ("127.0.0.3", 41000, "cpu")
    assert args.config == "/work/cfg/server.yaml"
    assert (args.model, args.block_size, args.kv_cache_memory_gb) == ("random:tiny", 32, 0.5)
    assert "0.0.0.0" not in argv and "cuda" not in argv and "8000" not in argv


def test_the_default_model_pod_passes_no_model_and_maps_hostpath_files(tmp_path):
    default = server_pod(pod_for({"model": {"source": "default"}}))
    argv = local_argv(default, ["m"], "127.0.0.2", 1, "cpu", LocalMounts(()))
    assert argv[argv.index("--model") + 1] == "default"
    gguf = server_pod(pod_for({"model": {"source": "gguf:/data/models/small.gguf"}}))
    assert ("/models/small.gguf", "/data/models/small.gguf") in gguf.host_paths
    mounts = LocalMounts(gguf.host_paths)
    argv = local_argv(gguf, ["m"], "127.0.0.2", 1, "cpu", mounts)
    assert argv[argv.index("--model") + 1] == "/data/models/small.gguf"


def test_flag_equals_value_and_longest_mount_win():
    mounts = LocalMounts((("/etc", "/a"), ("/etc/metronome", "/b")))
    assert mounts.translate("/etc/metronome/server.yaml") == "/b/server.yaml"
    assert mounts.translate("/etc/hosts") == "/a/hosts"
    assert mounts.translate("/etcetera") == "/etcetera"
    pod = server_pod(pod_for({"model": {"source": "default"}}))
    pod = type(pod)(**{**pod.__dict__, "args": ("serve", "--config=/etc/metronome/server.yaml", "--port=8000")})
    assert local_argv(pod, ["m"], "127.0.0.2", 7, "cpu", mounts)[:3] == ["m", "serve", "--config=/b/server.yaml"]


def test_pods_that_cannot_be_played_say_why():
    raw = pod_for({"model": {"source": "pvc:weights/llama"}})
    with pytest.raises(PodSpecError, match="persistentVolumeClaim"):
        server_pod(raw)
    raw = pod_for({"model": {"source": "default"}})
    raw["spec"]["containers"][0]["name"] = "sidecar"
    with pytest.raises(PodSpecError, match="no container named 'server'"):
        server_pod(raw)
    raw = pod_for({"model": {"source": "default"}})
    raw["spec"]["containers"][0]["command"] = ["python"]
    with pytest.raises(PodSpecError, match="not `metronome`"):
        local_argv(server_pod(raw), ["m"], "127.0.0.2", 1, "cpu", LocalMounts(()))


def test_only_running_pods_that_are_not_being_deleted_are_played():
    assert is_running(pod_for({"model": {"source": "default"}}))
    assert not is_running(pod_for({"model": {"source": "default"}}, phase="Pending"))
    deleting = pod_for({"model": {"source": "default"}})
    deleting["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert not is_running(deleting)


def test_config_volume_projects_its_items_and_the_pods_labels():
    raw = pod_for({"model": {"source": "default"}})
    raw["metadata"]["labels"][variant.LABEL] = variant.CANDIDATE
    pod = server_pod(raw)
    ((mount, volume),) = pod.config_maps
    assert (mount, volume.config_map) == ("/etc/metronome", "chat-config")
    files = volume.files({"chat-config": {"server.yaml": "a", "other": "b"}, "chat-candidate-config": None},
                         dict(pod.labels))
    assert set(files) == {"server.yaml", "pod-labels"} and files["server.yaml"] == "a"
    assert variant.parse_labels(files["pod-labels"]) == raw["metadata"]["labels"]
    files = volume.files({"chat-config": {"server.yaml": "a"}, "chat-candidate-config": {"server.yaml": "c"}}, {})
    assert (files["candidate.yaml"], files["pod-labels"]) == ("c", "")
    plain = {"name": "config", "configMap": {"name": "x", "items": [{"key": "server.yaml", "path": "server.yaml"}]}}
    raw["spec"]["volumes"] = [plain if v["name"] == "config" else v for v in raw["spec"]["volumes"]]
    ((_, volume),) = server_pod(raw).config_maps
    assert volume.files({"x": {"server.yaml": "a", "other": "b"}}) == {"server.yaml": "a"}


def test_a_projected_source_the_standin_cannot_play_is_named():
    raw = pod_for({"model": {"source": "default"}})
    config = next(v for v in raw["spec"]["volumes"] if v["name"] == "config")
    config["projected"]["sources"].append({"serviceAccountToken": {"path": "token"}})
    with pytest.raises(PodSpecError, match="projected source serviceAccountToken"):
        server_pod(raw)


def test_projection_swaps_data_atomically_and_keeps_stable_names(tmp_path):
    folder = tmp_path / "config"
    assert project(folder, {"server.yaml": "generation: 1\n"})
    first = os.readlink(folder / DATA_LINK)
    assert os.readlink(folder / "server.yaml") == f"{DATA_LINK}/server.yaml"
    assert (folder / "server.yaml").read_text() == "generation: 1\n"
    assert not project(folder, {"server.yaml": "generation: 1\n"})  # unchanged: nothing touched
    assert os.readlink(folder / DATA_LINK) == first

    assert project(folder, {"server.yaml": "generation: 2\n"})
    second = os.readlink(folder / DATA_LINK)
    assert second != first and second.startswith("..")
    assert (folder / "server.yaml").read_text() == "generation: 2\n"
    assert not (folder / first).exists()  # the old version is removed after the swap
    assert current_files(folder) == {"server.yaml": "generation: 2\n"}
    assert sorted(p.name for p in folder.iterdir()) == sorted([DATA_LINK, second, "server.yaml"])


def test_projection_drops_names_of_removed_keys_and_refuses_escapes(tmp_path):
    folder = tmp_path / "config"
    project(folder, {"a.yaml": "1", "b.yaml": "2"})
    project(folder, {"a.yaml": "3"})
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith("..")) == ["a.yaml"]
    with pytest.raises(ValueError, match="leave the volume"):
        project(folder, {"../escape": "x"})


def test_file_sd_targets_carry_the_label_contract(tmp_path):
    from metronome.operator.metrics_source import POD_RELABELING

    targets = [Target("127.0.0.3:9001", "ml", "chat", "chat-b"), Target("127.0.0.2:9000", "ml", "chat", "chat-a")]
    groups = file_sd_groups(targets)
    assert [g["targets"] for g in groups] == [["127.0.0.2:9000"], ["127.0.0.3:9001"]]
    assert set(groups[0]["labels"]) >= {target for _, target in POD_RELABELING}
    assert groups[0]["labels"] == {"namespace": "ml", "service": "chat", "pod": "chat-a"}
    path = tmp_path / "targets.json"
    assert write_file_sd(path, targets)
    assert not write_file_sd(path, list(reversed(targets)))  # same set: file untouched
    assert json.loads(path.read_text()) == groups


def test_scrape_config_reads_the_targets_file(tmp_path):
    import yaml

    config = yaml.safe_load(scrape_config(tmp_path / "t.json", 1.0))
    assert config["global"]["scrape_interval"] == "1000ms"
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "t.json")]
    with pytest.raises(ValueError):
        scrape_config(tmp_path / "t.json", 0)


# --- the kubelet's ConfigMap propagation delay (propagation.py) ---------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_delay_range_parses_ranges_and_names_bad_input():
    from metronome_testing.standin.propagation import ENV, KUBELET_DEFAULT, DelayRange

    assert DelayRange.parse("30-90") == DelayRange(30, 90) == KUBELET_DEFAULT
    assert DelayRange.parse("5") == DelayRange(5, 5) and DelayRange.parse("0").describe() == "immediate"
    assert DelayRange.parse(" 5 - 15 ") == DelayRange(5, 15)
    assert DelayRange.from_env({}) == KUBELET_DEFAULT
    assert DelayRange.from_env({ENV: "2-3"}) == DelayRange(2, 3)
    for bad in ("", "-5", "abc", "9-3", "1-2-3"):
        with pytest.raises(ValueError, match=ENV):
            DelayRange.parse(bad)


def test_a_change_lands_after_its_drawn_delay_with_the_newest_content():
    import random

    from metronome_testing.standin.propagation import DelayRange, Propagation

    clock = Clock()
    propagation = Propagation(DelayRange(30, 90), random.Random(7), clock)
    first = {"server.yaml": "generation: 1\n"}
    assert propagation.ready("pod-a /etc/metronome", first, None)  # the first mount is immediate
    assert not propagation.ready("pod-a /etc/metronome", first, first)
    second = {"server.yaml": "generation: 2\n"}
    assert not propagation.ready("pod-a /etc/metronome", second, first)
    (pending,) = propagation.pending()
    assert 30 <= pending.delay_s <= 90 and pending.summary == "server.yaml generation 2"
    clock.now = pending.due_at - 0.5
    third = {"server.yaml": "generation: 3\n"}
    assert not propagation.ready("pod-a /etc/metronome", third, first)  # rewritten meanwhile: same deadline
    assert propagation.pending()[0].due_at == pending.due_at
    clock.now = pending.due_at
    assert propagation.ready("pod-a /etc/metronome", third, first)
    (applied,) = propagation.history()
    assert applied.applied_at == pending.due_at and applied.summary == "server.yaml generation 3"
    assert propagation.pending() == []


def test_each_pod_draws_its_own_delay_and_a_revert_cancels():
    import random

    from metronome_testing.standin.propagation import DelayRange, Propagation

    clock = Clock()
    propagation = Propagation(DelayRange(30, 90), random.Random(1), clock)
    old, new = {"f": "a"}, {"f": "b"}
    for pod in ("p1", "p2", "p3"):
        assert not propagation.ready(pod, new, old)
    delays = {u.volume: u.delay_s for u in propagation.pending()}
    assert len(set(delays.values())) == 3 and all(30 <= d <= 90 for d in delays.values())
    assert not propagation.ready("p1", old, old)  # written back before the sync: nothing pending for p1
    propagation.forget("p2")
    assert [u.volume for u in propagation.pending()] == ["p3"]
    immediate = Propagation(DelayRange(0, 0), random.Random(1), clock)
    assert immediate.ready("p1", new, old) and immediate.history()[0].delay_s == 0


def test_pod_network_addresses_are_the_pods_container_port_on_a_loopback_address_where_that_port_is_free():
    """What `pod_network` plays: each server on its pod's container port (what an InferencePool's targetPort
    names), at the lowest loopback address where that port is free."""
    import socket

    from metronome_testing.standin.loopback import AddressPool, port_is_free

    pod = server_pod(pod_for({"model": {"source": "random:tiny"}}))
    assert pod.container_port == builders.SERVER_PORT
    with socket.socket() as busy:
        busy.bind(("127.0.0.2", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert not port_is_free("127.0.0.2", port) and port_is_free("127.0.0.3", port)
        pool = AddressPool("127.0.0.2", "127.0.0.9")
        assert pool.take(lambda address: port_is_free(address, port)) == "127.0.0.3"
        assert pool.take() == "127.0.0.2"  # no port asked for: the lowest free address
