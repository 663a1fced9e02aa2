"""Pure parts of the local control plane: staging replaces, versions, argv, nodes, stages, state file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from metronome_testing.checkout import HACK
from metronome_testing.localcluster import components as comp
from metronome_testing.localcluster.errors import ClusterError
from metronome_testing.localcluster.local import STAGES_FILE
from metronome_testing.localcluster.nodes import FakeNodeSpec, default_nodes, is_ready, node_manifest
from metronome_testing.localcluster.pki import Pki
from metronome_testing.localcluster.procs import ProcessRecord
from metronome_testing.localcluster.state import ClusterState, load_state, save_state
from metronome_testing.localcluster.tools import ToolSet, parse_versions, tool_versions


def _staging_module():
    spec = importlib.util.spec_from_file_location("k8s_staging_replaces", HACK / "k8s_staging_replaces.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GO_MOD = """module k8s.io/kubernetes

go 1.26.0

require (
\tk8s.io/api v0.0.0
\tgithub.com/spf13/cobra v1.10.2
)

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/cri-streaming => ./staging/src/k8s.io/cri-streaming
\tgithub.com/example/fork => github.com/example/fork v1.2.3
)
"""


def test_staging_replaces_come_from_the_go_mod_and_use_the_published_minor():
    block = _staging_module().replace_block(GO_MOD, "v1.36.3")
    assert "\tk8s.io/api => k8s.io/api v0.36.3" in block
    assert "\tk8s.io/cri-streaming => k8s.io/cri-streaming v0.36.3" in block
    assert "example/fork" not in block
    assert block.count("=>") == 2


@pytest.mark.parametrize("tag", ["1.36.3", "v2.0.0", "v1.36", "latest"])
def test_staging_replaces_reject_non_release_tags(tag):
    with pytest.raises(ValueError, match="not a Kubernetes release tag"):
        _staging_module().replace_block(GO_MOD, tag)


def test_staging_replaces_reject_a_go_mod_without_staging_lines():
    with pytest.raises(ValueError, match="no './staging/src/' replace lines"):
        _staging_module().replace_block("module x\n", "v1.36.3")


def test_versions_file_names_every_tool():
    assert parse_versions("# c\nA=v1\n\n  B=2.0  \nnot a line\n") == {"A": "v1", "B": "2.0"}
    versions = tool_versions()
    assert set(versions) == {"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd",
                             "kwok", "helm"}
    assert versions["kube-apiserver"].startswith("v1.")


def test_tool_paths_follow_the_build_script_layout(tmp_path):
    tools = ToolSet(tmp_path, {"kwok": "v0.8.0"})
    assert tools.path("kwok") == tmp_path / "bin" / "kwok-v0.8.0" / "kwok"
    assert tools.missing() == ["kwok"]


def _ports() -> comp.Ports:
    return comp.Ports(etcd_client=2001, etcd_peer=2002, apiserver=2003, controller_manager=2004, scheduler=2005,
                      kwok=2006)


def _all_argv(tmp_path: Path) -> list[list[str]]:
    tools = ToolSet(tmp_path, tool_versions())
    layout = comp.Layout(tmp_path)
    pki = Pki(layout.pki_dir)
    ports = _ports()
    return [
        comp.etcd_argv(tools, layout, ports),
        comp.apiserver_argv(tools, pki, ports),
        comp.controller_manager_argv(tools, pki, layout.kubeconfig, ports),
        comp.scheduler_argv(tools, layout.kubeconfig, ports),
        comp.kwok_argv(tools, layout.kubeconfig, STAGES_FILE, ports),
        comp.prometheus_argv(Path("/usr/bin/prometheus"), tmp_path / "p.yml", tmp_path / "pd", 2007),
    ]


def test_every_component_listens_on_loopback_only(tmp_path):
    for argv in _all_argv(tmp_path):
        joined = " ".join(argv)
        assert "0.0.0.0" not in joined
        for flag in ("--bind-address=", "--advertise-address=", "--node-ip=", "--server-address=",
                     "--web.listen-address=", "--listen-client-urls=", "--listen-peer-urls="):
            for arg in argv:
                if arg.startswith(flag):
                    assert "127.0.0.1" in arg, arg


def test_apiserver_and_controllers_share_the_service_account_keys(tmp_path):
    argv = dict(arg.split("=", 1) for args in _all_argv(tmp_path)[1:3] for arg in args if "=" in arg)
    pki = Pki(tmp_path / "pki")
    assert argv["--service-account-key-file"] == str(pki.sa_pub)
    assert argv["--service-account-signing-key-file"] == str(pki.sa_key)
    assert argv["--service-account-private-key-file"] == str(pki.sa_key)
    assert argv["--authorization-mode"] == "RBAC"


def test_fake_nodes_offer_eight_gpus_and_are_handed_to_kwok():
    nodes = default_nodes(2)
    assert [n.name for n in nodes] == ["kwok-gpu-0", "kwok-gpu-1"]
    manifest = node_manifest(FakeNodeSpec(name="n"))
    assert manifest["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert manifest["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert manifest["status"]["allocatable"] == manifest["status"]["capacity"]
    assert not is_ready(manifest)
    manifest["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert is_ready(manifest)


def test_stage_file_defines_node_and_pod_lifecycles():
    stages = list(yaml.safe_load_all(STAGES_FILE.read_text()))
    kinds = {s["metadata"]["name"]: s["spec"]["resourceRef"]["kind"] for s in stages}
    assert kinds == {"node-ready": "Node", "node-renew": "Node", "pod-running": "Pod", "pod-succeed": "Pod",
                     "pod-remove": "Pod"}
    assert all(s["apiVersion"] == "kwok.x-k8s.io/v1alpha1" and s["kind"] == "Stage" for s in stages)


def test_state_file_round_trips_and_rejects_garbage(tmp_path):
    state = ClusterState(api_url="https://127.0.0.1:1", ports={"apiserver": 1},
                         processes=[ProcessRecord("etcd", 42, ["/bin/etcd", "--x"], "/l/etcd.log", 12345)],
                         kubernetes_version="v1.36.3", owner_pid=7)
    path = tmp_path / "state.json"
    save_state(path, state)
    assert load_state(path) == state
    assert load_state(tmp_path / "absent.json") is None
    path.write_text(json.dumps({"processes": [{"pid": 1}]}))
    with pytest.raises(ClusterError, match="unreadable cluster state"):
        load_state(path)


def test_process_records_follow_the_process_they_started(tmp_path):
    from metronome_testing.localcluster.procs import is_running, start_process, stop_process

    record = start_process("sleeper", ["/bin/sleep", "30"], tmp_path / "sleeper.log")
    assert is_running(record)
    impostor = ProcessRecord("sleeper", record.pid, record.argv, record.log, record.start_ticks + 1)
    assert not is_running(impostor)  # same pid, different start time: a reused pid is never ours
    stop_process(record)
    assert not is_running(record)
    assert "starting: /bin/sleep 30" in (tmp_path / "sleeper.log").read_text()


def test_reaping_removes_only_sessions_whose_owner_died(tmp_path):
    import os

    from metronome_testing.localcluster.session import reap_dead_sessions

    live = tmp_path / f"pytest-{os.getpid()}"
    dead = tmp_path / "pytest-999999999"  # above any pid_max: no such process
    for folder in (live, dead):
        (folder / "logs").mkdir(parents=True)
    assert reap_dead_sessions(tmp_path) == [dead]
    assert live.is_dir() and not dead.exists()
