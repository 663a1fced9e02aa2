"""LocalCluster's lifecycle on its own state dir: up twice = one cluster, Prometheus on demand, down = no orphans."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from metronome_testing.localcluster import LocalCluster
from metronome_testing.localcluster.local import default_scrape_config
from metronome_testing.localcluster.pki import Pki
from metronome_testing.localcluster.procs import is_running
from metronome_testing.localcluster.state import load_state

CLUSTER_PY = Path(__file__).resolve().parents[2] / "hack" / "cluster.py"


def _query(prometheus_url: str, promql: str) -> list[dict]:
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as response:
        return json.load(response)["data"]["result"]


def _wait_for_sample(prometheus_url: str, promql: str, deadline_s: float = 90.0) -> list[dict]:
    deadline = time.monotonic() + deadline_s
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = _query(prometheus_url, promql)
        if result:
            return result
        time.sleep(1)
    return result


def test_up_twice_is_one_cluster_and_down_leaves_no_process(tmp_path):
    state_dir = tmp_path / "cluster"
    local = LocalCluster(state_dir, node_count=1)
    first = local.up()
    records = []
    try:
        assert not first.reused
        records = load_state(state_dir / "state.json").processes
        assert [r.name for r in records] == ["etcd", "kube-apiserver", "kube-controller-manager",
                                             "kube-scheduler", "kwok"]

        cli = subprocess.run([sys.executable, str(CLUSTER_PY), "up", "--state-dir", str(state_dir), "--no-build"],
                             capture_output=True, text=True, timeout=300)
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.strip().splitlines()[-1] == f"export KUBECONFIG={first.kubeconfig}"
        assert "[already running]" in cli.stdout
        assert [r.pid for r in load_state(state_dir / "state.json").processes] == [r.pid for r in records]

        scrape_config = tmp_path / "scrape.yml"
        scrape_config.write_text(default_scrape_config(Pki(state_dir / "pki"), first.api_url))
        prometheus_url = local.start_prometheus(scrape_config)
        assert prometheus_url.startswith("http://127.0.0.1:")
        samples = _wait_for_sample(prometheus_url, 'up{job="kube-apiserver"} == 1')
        assert samples and samples[0]["value"][1] == "1"
        prometheus = load_state(state_dir / "state.json").prometheus
        local.stop_prometheus()
        assert not is_running(prometheus)
    finally:
        local.down()

    assert records and not any(is_running(r) for r in records)
    assert not (state_dir / "etcd-data").exists()
    assert not (state_dir / "state.json").exists()
    assert (state_dir / "logs" / "kube-apiserver.log").is_file()
    assert local.status()["up"] is False
