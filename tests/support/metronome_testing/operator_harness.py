"""Helpers for the operator/chart/CRD integration tests: install the chart once per session, run the operator as a
local process under the chart's ServiceAccount (so a missing RBAC permission fails the tests), and poll.

Everything talks to the API server on 127.0.0.1 only; nothing here contacts pod or service IPs.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "metronome"
CRD_FILE = ROOT / "crds" / "inferenceservice.yaml"
EXAMPLE = ROOT / "examples" / "inferenceservice.yaml"
CRD_NAME = "inferenceservices.metronome.dev"
RELEASE = "metronome"


def ensure_crd(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    # Polled, not `kubectl wait`: that fails at once on a CRD the API server has not given a status yet.
    wait_for(lambda: _crd_established(cluster), "the CRD to be established", timeout=60)


# --- the chart, installed once per session ----------------------------------------------------------------------


@dataclass
class ChartRelease:
    namespace: str
    release: str
    service_account: str
    install_output: str


_RELEASES: dict[str, ChartRelease] = {}


def chart_release(cluster) -> ChartRelease:
    """`helm install` of charts/metronome (once per cluster and session)."""
    key = cluster.api_url
    if key not in _RELEASES:
        namespace = cluster.namespace("metronome-system")
        result = cluster.helm("install", RELEASE, str(CHART), "--namespace", namespace, timeout=180)
        wait_for(lambda: _crd_established(cluster), "the chart's CRD to be established")
        _RELEASES[key] = ChartRelease(
            namespace=namespace,
            release=RELEASE,
            service_account=f"{RELEASE}",  # fullname: the release name contains the chart name
            install_output=result.stdout,
        )
    return _RELEASES[key]


def _crd_established(cluster) -> bool:
    crd = cluster.kubectl_json("get", "crd", CRD_NAME)
    conditions = crd.get("status", {}).get("conditions", [])
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def service_account_kubeconfig(cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as `service_account` (a TokenRequest token) against the same API server."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=3h").stdout.strip()
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    context_name = admin.get("current-context") or admin["contexts"][0]["name"]
    context = next(c for c in admin["contexts"] if c["name"] == context_name)["context"]
    cluster_entry = next(c for c in admin["clusters"] if c["name"] == context["cluster"])["cluster"]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster_entry}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "local", "user": service_account}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


# --- the operator as a local process ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class OperatorProcess:
    """`metronome operator` (the venv's console script) with a given kubeconfig; logs to files."""

    kubeconfig: Path
    log_dir: Path
    scope_args: tuple[str, ...] = ("--all-namespaces",)
    extra_args: tuple[str, ...] = ()
    lifecycle_args: tuple[str, ...] = ("--standalone",)  # or --leader-elect and its Lease flags
    process: subprocess.Popen | None = None
    health_port: int = 0
    starts: int = 0
    logs: list[Path] = field(default_factory=list)

    def start(self) -> None:
        assert self.process is None, "already running"
        self.health_port = free_port()
        self.starts += 1
        log_path = self.log_dir / f"operator-{self.starts}.log"
        self.logs.append(log_path)
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        argv = [
            str(Path(sys.executable).parent / "metronome"), "operator", *self.scope_args, *self.lifecycle_args,
            "--health-host", "127.0.0.1", "--health-port", str(self.health_port),
            "--status-interval", "1", *self.extra_args,
        ]
        with open(log_path, "w") as log_file:
            self.process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_for(self._healthy, f"the operator's /healthz (log: {log_path})", timeout=60)

    def _healthy(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"the operator exited with {self.process.returncode}:\n{self.log_text()[-3000:]}")
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self, index: int = -1) -> str:
        return self.logs[index].read_text() if self.logs else ""

    def all_logs(self) -> str:
        return "\n".join(path.read_text() for path in self.logs)


# --- small kubectl helpers --------------------------------------------------------------------------------------


def get_json(cluster, *args: str) -> dict | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr or "not found" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def condition(obj: dict, type_: str) -> dict | None:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), None)


def events_for(cluster, namespace: str, name: str) -> list[dict]:
    items = cluster.kubectl_json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return items
