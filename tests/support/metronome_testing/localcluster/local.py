"""LocalCluster: bring the loopback control plane up (idempotently) and down (no orphans)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from metronome.server.bench.processes import free_port, http_ok, log_tail

from . import components as comp
from .api import ApiClient
from .errors import ClusterError, ClusterStartError
from .nodes import default_nodes, is_ready, node_manifest
from .pki import Pki, kubeconfig_text, make_pki
from .procs import LOOPBACK, is_running, start_process, stop_process
from .state import ClusterState, load_state, save_state
from .tools import ToolSet, default_state_dir

STAGES_FILE = Path(__file__).resolve().parent / "kwok-stages.yaml"  # kwok's node and pod lifecycles
PROMETHEUS_FALLBACK = Path("/usr/bin/prometheus")


@dataclass(frozen=True)
class ClusterInfo:
    kubeconfig: Path
    api_url: str
    bin_dir: Path  # symlinks to kubectl, helm, kube-*, etcd, kwok: put it first on PATH
    kubectl: Path
    helm: Path
    logs_dir: Path
    state_dir: Path
    kubernetes_version: str
    prometheus_url: str | None = None
    reused: bool = False  # up() found this cluster already running and left it as it was


def _log(message: str) -> None:
    print(f"[localcluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prometheus_binary() -> Path | None:
    found = shutil.which("prometheus")
    if found:
        return Path(found)
    return PROMETHEUS_FALLBACK if os.access(PROMETHEUS_FALLBACK, os.X_OK) else None


def default_scrape_config(pki: Pki, api_url: str) -> str:
    """Scrapes the API server's own /metrics with the admin certificate (used by `up --with-prometheus`)."""
    host = api_url.removeprefix("https://")
    return f"""global:
  scrape_interval: 5s
scrape_configs:
- job_name: kube-apiserver
  scheme: https
  tls_config:
    ca_file: {pki.ca_cert}
    cert_file: {pki.admin_cert}
    key_file: {pki.admin_key}
  static_configs:
  - targets: ["{host}"]
"""


class LocalCluster:
    def __init__(self, state_dir: Path | str | None = None, tools: ToolSet | None = None, node_count: int = 2,
                 build: bool = True, ready_timeout_s: float = 180.0):
        if node_count < 1:
            raise ClusterError(f"node_count must be at least 1, got {node_count}")
        self.layout = comp.Layout(Path(state_dir) if state_dir else default_state_dir())
        self.tools = tools or ToolSet.default()
        self.node_count = node_count
        self.build = build
        self.ready_timeout_s = ready_timeout_s

    # ---- public API -------------------------------------------------------------------------------------

    def up(self, with_prometheus: bool = False, prometheus_config: Path | str | None = None) -> ClusterInfo:
        """Starts the cluster, or reuses the one this state dir already runs; waits until it is ready."""
        self.tools.ensure_built(self.build)
        with self._locked():
            state = load_state(self.layout.state_file)
            reused = state is not None and self._control_plane_healthy(state)
            if reused:
                _log(f"reusing the running cluster at {state.api_url}")
            else:
                if state is not None:
                    _log("stale cluster state found: stopping what is left of it")
                    self._stop_everything(state)
                state = self._start_fresh_retrying_ports()
            if with_prometheus or prometheus_config:
                config = Path(prometheus_config) if prometheus_config else self._write_default_scrape_config(state)
                if not (reused and state.prometheus_config == str(config) and self._prometheus_healthy(state)):
                    self._start_prometheus(state, config)
            return self._info(state, reused)

    def down(self) -> None:
        """Stops every process it started (SIGTERM, then SIGKILL) and removes the data dirs; keeps the logs."""
        with self._locked():
            state = load_state(self.layout.state_file)
            if state is not None:
                self._stop_everything(state)
            for path in (self.layout.etcd_data, self.layout.prometheus_data, self.layout.pki_dir,
                         self.layout.bin_dir):
                shutil.rmtree(path, ignore_errors=True)
            for path in (self.layout.kubeconfig, self.layout.state_file, self._default_scrape_config_path()):
                path.unlink(missing_ok=True)

    def info(self) -> ClusterInfo:
        """The running cluster's info; raises ClusterError when it is not up."""
        state = load_state(self.layout.state_file)
        if state is None or not self._control_plane_healthy(state):
            raise ClusterError(f"no healthy cluster in {self.layout.state_dir} (run `hack/cluster.py up`)")
        return self._info(state, reused=True)

    def status(self) -> dict:
        state = load_state(self.layout.state_file)
        if state is None:
            return {"state_dir": str(self.layout.state_dir), "up": False, "processes": {}}
        records = state.processes + ([state.prometheus] if state.prometheus else [])
        return {
            "state_dir": str(self.layout.state_dir),
            "up": self._control_plane_healthy(state),
            "api_url": state.api_url,
            "kubeconfig": str(self.layout.kubeconfig),
            "kubernetes_version": state.kubernetes_version,
            "prometheus_url": state.prometheus_url,
            "processes": {r.name: {"pid": r.pid, "running": is_running(r), "log": r.log} for r in records},
        }

    def start_prometheus(self, scrape_config: Path | str) -> str:
        """(Re)starts Debian's prometheus on a free loopback port with `scrape_config`; returns its URL."""
        with self._locked():
            state = load_state(self.layout.state_file) or ClusterState(owner_pid=os.getpid())
            return self._start_prometheus(state, Path(scrape_config))

    def stop_prometheus(self) -> None:
        with self._locked():
            state = load_state(self.layout.state_file)
            if state is not None:
                self._stop_prometheus(state)

    # ---- starting ---------------------------------------------------------------------------------------

    def _start_fresh_retrying_ports(self) -> ClusterState:
        """Free ports are picked before the processes bind them, so another program can take one meanwhile;
        that rare race costs one retry with new ports."""
        try:
            return self._start_fresh()
        except ClusterStartError as error:
            if "address already in use" not in str(error):
                raise
            _log("a port was taken while starting; retrying once with new ports")
            return self._start_fresh()

    def _start_fresh(self) -> ClusterState:
        started = time.monotonic()
        for path in (self.layout.etcd_data, self.layout.prometheus_data, self.layout.logs_dir):
            shutil.rmtree(path, ignore_errors=True)
        self.layout.logs_dir.mkdir(parents=True)
        pki = make_pki(self.layout.pki_dir)
        ports = self._pick_ports()
        state = ClusterState(api_url=ports.api_url, ports=vars(ports).copy(),
                             kubernetes_version=self.tools.kubernetes_version, owner_pid=os.getpid())
        self.layout.kubeconfig.write_text(kubeconfig_text(pki, ports.api_url), encoding="utf-8")
        self.layout.kubeconfig.chmod(0o600)
        self.tools.link_dir(self.layout.bin_dir)
        try:
            self._start_control_plane(state, pki, ports)
        except BaseException:
            _log("start failed: stopping the processes started so far")
            self._stop_everything(state)
            raise
        _log(f"cluster ready in {time.monotonic() - started:.1f} s at {ports.api_url}")
        return state

    def _start_control_plane(self, state: ClusterState, pki: Pki, ports: comp.Ports) -> None:
        kubeconfig = self.layout.kubeconfig
        self._spawn(state, "etcd", comp.etcd_argv(self.tools, self.layout, ports))
        self._wait_until(state, "etcd /readyz", lambda: http_ok(f"{ports.etcd_url}/readyz"))
        self._spawn(state, "kube-apiserver", comp.apiserver_argv(self.tools, pki, ports))
        api = ApiClient(ports.api_url, pki)
        self._wait_until(state, "kube-apiserver /readyz", lambda: _answers(api, "/readyz"))
        self._spawn(state, "kube-controller-manager",
                    comp.controller_manager_argv(self.tools, pki, kubeconfig, ports))
        self._spawn(state, "kube-scheduler", comp.scheduler_argv(self.tools, kubeconfig, ports))
        self._spawn(state, "kwok", comp.kwok_argv(self.tools, kubeconfig, STAGES_FILE, ports))
        nodes = default_nodes(self.node_count)
        for spec in nodes:
            response = api.create("/api/v1/nodes", node_manifest(spec))
            if response.status not in (201, 409):
                raise ClusterStartError(f"creating node {spec.name} failed: HTTP {response.status} {response.body}")
        names = {spec.name for spec in nodes}
        self._wait_until(state, f"{len(names)} kwok GPU nodes Ready", lambda: _nodes_ready(api, names))
        self._wait_until(state, "the default ServiceAccount",
                         lambda: _answers(api, "/api/v1/namespaces/default/serviceaccounts/default"))

    def _spawn(self, state: ClusterState, name: str, argv: list[str]) -> None:
        _log(f"starting {name}")
        state.processes.append(start_process(name, argv, self.layout.log(name)))
        save_state(self.layout.state_file, state)  # saved at once, so `down` can stop a half-started cluster

    def _wait_until(self, state: ClusterState, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            dead = [r for r in state.processes if not is_running(r)]
            if dead:
                record = dead[0]
                raise ClusterStartError(f"{record.name} exited while waiting for {what}; last lines of "
                                        f"{record.log}:\n{log_tail(record.log)}")
            if ready():
                return
            time.sleep(0.25)
        logs = "\n".join(f"--- {r.name} ({r.log}):\n{log_tail(r.log, 10)}" for r in state.processes)
        raise ClusterStartError(f"timed out after {self.ready_timeout_s:.0f} s waiting for {what}\n{logs}")

    def _pick_ports(self) -> comp.Ports:
        ports: set[int] = set()
        while len(ports) < 6:
            ports.add(free_port())
        return comp.Ports(*sorted(ports))

    # ---- prometheus -------------------------------------------------------------------------------------

    def _default_scrape_config_path(self) -> Path:
        return self.layout.state_dir / "prometheus-default.yml"

    def _write_default_scrape_config(self, state: ClusterState) -> Path:
        path = self._default_scrape_config_path()
        path.write_text(default_scrape_config(Pki(self.layout.pki_dir), state.api_url), encoding="utf-8")
        return path

    def _prometheus_healthy(self, state: ClusterState) -> bool:
        return (state.prometheus is not None and is_running(state.prometheus)
                and state.prometheus_url is not None and http_ok(f"{state.prometheus_url}/-/ready"))

    def _start_prometheus(self, state: ClusterState, config: Path) -> str:
        binary = prometheus_binary()
        if binary is None:
            raise ClusterError("`prometheus` is not installed (run `make prometheus` / hack/install-prometheus.sh)")
        if not config.is_file():
            raise ClusterError(f"prometheus scrape config not found: {config}")
        self._stop_prometheus(state)
        shutil.rmtree(self.layout.prometheus_data, ignore_errors=True)
        port = free_port()
        url = f"http://{LOOPBACK}:{port}"
        argv = comp.prometheus_argv(binary, config.resolve(), self.layout.prometheus_data, port)
        _log(f"starting prometheus on {url} with {config}")
        state.prometheus = start_process("prometheus", argv, self.layout.log("prometheus"))
        state.prometheus_url, state.prometheus_config = url, str(config)
        save_state(self.layout.state_file, state)
        deadline = time.monotonic() + self.ready_timeout_s
        while not http_ok(f"{url}/-/ready"):
            if not is_running(state.prometheus) or time.monotonic() > deadline:
                log = state.prometheus.log
                self._stop_prometheus(state)
                raise ClusterStartError(f"prometheus did not become ready; last lines of {log}:\n{log_tail(log)}")
            time.sleep(0.25)
        return url

    def _stop_prometheus(self, state: ClusterState) -> None:
        if state.prometheus is not None:
            stop_process(state.prometheus)
        state.prometheus = state.prometheus_url = state.prometheus_config = None
        if state.processes or self.layout.state_file.exists():
            save_state(self.layout.state_file, state)

    # ---- stopping and checking --------------------------------------------------------------------------

    def _stop_everything(self, state: ClusterState) -> None:
        if state.prometheus is not None:
            stop_process(state.prometheus)
            state.prometheus = None
        for record in reversed(state.processes):  # kwok and controllers first, etcd last
            stop_process(record)
        state.processes = []
        save_state(self.layout.state_file, state)

    def _control_plane_healthy(self, state: ClusterState) -> bool:
        if not state.processes or not all(is_running(r) for r in state.processes):
            return False
        if not Pki(self.layout.pki_dir).complete():
            return False
        try:
            return _answers(ApiClient(state.api_url, Pki(self.layout.pki_dir)), "/readyz")
        except OSError:
            return False

    def _info(self, state: ClusterState, reused: bool) -> ClusterInfo:
        return ClusterInfo(
            kubeconfig=self.layout.kubeconfig,
            api_url=state.api_url,
            bin_dir=self.layout.bin_dir,
            kubectl=self.layout.bin_dir / "kubectl",
            helm=self.layout.bin_dir / "helm",
            logs_dir=self.layout.logs_dir,
            state_dir=self.layout.state_dir,
            kubernetes_version=state.kubernetes_version,
            prometheus_url=state.prometheus_url,
            reused=reused,
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One up/down at a time per state dir (two test sessions or a test and `make cluster-up`)."""
        self.layout.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.layout.lock_file, "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _answers(api: ApiClient, path: str) -> bool:
    try:
        return api.get(path).status == 200
    except OSError:
        return False


def _nodes_ready(api: ApiClient, names: set[str]) -> bool:
    try:
        response = api.get("/api/v1/nodes")
    except OSError:
        return False
    if response.status != 200:
        return False
    ready = {item["metadata"]["name"] for item in response.json().get("items", []) if is_ready(item)}
    return names <= ready
