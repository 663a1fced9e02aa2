"""The cluster a pytest session uses: its own local cluster, or an existing one named by KUBECONFIG.

tests/conftest.py wraps this in the session-scoped `cluster` fixture.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import ClusterError
from .kubetools import KubeTools
from .local import LocalCluster
from .tools import ToolSet, default_cache_dir

USE_EXISTING_ENV = "METRONOME_USE_EXISTING_CLUSTER"
STATE_DIR_ENV = "METRONOME_CLUSTER_STATE_DIR"
SESSION_PREFIX = "pytest-"


@dataclass
class SessionCluster(KubeTools):
    """KubeTools plus Prometheus control and teardown bookkeeping."""

    local: LocalCluster | None = None  # runs Prometheus; also the control plane unless using an existing one
    owns_control_plane: bool = False
    kubernetes_version: str = ""

    def start_prometheus(self, scrape_config: Path | str) -> str:
        """Starts (or restarts) prometheus on 127.0.0.1 with `scrape_config`; returns its base URL."""
        if self.local is None:
            raise ClusterError("this test cluster has no state dir to run prometheus from")
        self.prometheus_url = self.local.start_prometheus(scrape_config)
        return self.prometheus_url

    def stop_prometheus(self) -> None:
        if self.local is not None:
            self.local.stop_prometheus()
        self.prometheus_url = None

    def close(self) -> None:
        """Stops what this session started; a cluster found already running is left running."""
        if self.owns_control_plane and self.local is not None:
            self.local.down()
            return
        self.stop_prometheus()
        self.delete_created_namespaces()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_dead_sessions(root: Path) -> list[Path]:
    """Stops the clusters of earlier test sessions that died without tearing down. A session's dir is named
    after its pid, so a live session (even one still starting, without a state file yet) is never touched."""
    reaped = []
    if not root.is_dir():
        return reaped
    for state_dir in sorted(root.glob(f"{SESSION_PREFIX}*")):
        owner = state_dir.name.removeprefix(SESSION_PREFIX)
        if owner.isdigit() and _pid_alive(int(owner)):
            continue
        try:
            LocalCluster(state_dir, build=False).down()
        except ClusterError:
            pass  # an unreadable state file names no pids we could stop; the folder goes anyway
        shutil.rmtree(state_dir, ignore_errors=True)
        reaped.append(state_dir)
    return reaped


def _session_state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit)
    root = default_cache_dir() / "clusters"
    reap_dead_sessions(root)
    return root / f"{SESSION_PREFIX}{os.getpid()}"


def _existing_cluster(tools: ToolSet, bin_dir: Path) -> SessionCluster:
    kubeconfig = os.environ.get("KUBECONFIG", "")
    if not kubeconfig or not Path(kubeconfig).is_file():
        raise ClusterError(f"{USE_EXISTING_ENV}=1 needs KUBECONFIG to name an existing kubeconfig file "
                           f"(got {kubeconfig!r})")
    tools.link_dir(bin_dir)
    handle = SessionCluster(kubeconfig=Path(kubeconfig), bin_dir=bin_dir, api_url="",
                         local=LocalCluster(bin_dir.parent / "prometheus-only", tools=tools))
    try:
        handle.api_url = handle.kubectl("config", "view", "--minify", "-o",
                                        "jsonpath={.clusters[0].cluster.server}").stdout.strip()
        handle.kubectl("get", "--raw", "/readyz")
        version = handle.kubectl_json("version")
    except (ClusterError, subprocess.TimeoutExpired) as error:
        raise ClusterError(f"the cluster named by KUBECONFIG={kubeconfig} does not answer: {error}") from error
    handle.kubernetes_version = version.get("serverVersion", {}).get("gitVersion", "")
    return handle


def open_test_cluster(scratch_dir: Path, build: bool = True) -> SessionCluster:
    """The session's cluster: an existing one (KUBECONFIG + METRONOME_USE_EXISTING_CLUSTER=1) or a fresh local
    one (tools built first when missing). `scratch_dir` holds per-session files such as tool links."""
    tools = ToolSet.default()
    tools.ensure_built(build)
    if os.environ.get(USE_EXISTING_ENV) == "1":
        return _existing_cluster(tools, scratch_dir / "bin")
    local = LocalCluster(_session_state_dir(), tools=tools)
    info = local.up()
    return SessionCluster(kubeconfig=info.kubeconfig, bin_dir=info.bin_dir, api_url=info.api_url,
                       logs_dir=info.logs_dir, prometheus_url=info.prometheus_url, local=local,
                       owns_control_plane=not info.reused, kubernetes_version=info.kubernetes_version)


@contextmanager
def private_cluster(state_dir: Path) -> Iterator[SessionCluster]:
    """A control plane of a test module's own in `state_dir`, down when the block ends: for tests that disturb the
    API server (an outage) or measure its load (idle cost), which the session's cluster must not share."""
    local = LocalCluster(state_dir, tools=ToolSet.default())
    info = local.up()
    handle = SessionCluster(kubeconfig=info.kubeconfig, bin_dir=info.bin_dir, api_url=info.api_url,
                            logs_dir=info.logs_dir, local=local, owns_control_plane=True,
                            kubernetes_version=info.kubernetes_version)
    try:
        yield handle
    finally:
        handle.close()
