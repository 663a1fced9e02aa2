"""Command lines of the control-plane components (pure functions: paths and ports in, argv out).

Everything binds to 127.0.0.1. The service and pod ranges are 10.x addresses that only exist as API data:
nothing routes to them and nothing here ever connects to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .pki import Pki
from .procs import LOOPBACK
from .tools import ToolSet

SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node=fake"
NODE_LEASE_SECONDS = 40


@dataclass(frozen=True)
class Layout:
    """Files and folders under the cluster's state dir."""

    state_dir: Path

    pki_dir = property(lambda self: self.state_dir / "pki")
    etcd_data = property(lambda self: self.state_dir / "etcd-data")
    prometheus_data = property(lambda self: self.state_dir / "prometheus-data")
    logs_dir = property(lambda self: self.state_dir / "logs")
    bin_dir = property(lambda self: self.state_dir / "bin")
    kubeconfig = property(lambda self: self.state_dir / "kubeconfig")
    state_file = property(lambda self: self.state_dir / "state.json")
    lock_file = property(lambda self: self.state_dir / ".lock")

    def log(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @property
    def api_url(self) -> str:
        return f"https://{LOOPBACK}:{self.apiserver}"

    @property
    def etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.etcd_client}"


def etcd_argv(tools: ToolSet, layout: Layout, ports: Ports) -> list[str]:
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return [
        str(tools.path("etcd")),
        "--name=metronome",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={ports.etcd_url}",
        f"--advertise-client-urls={ports.etcd_url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=metronome={peer}",
        "--initial-cluster-state=new",
        "--unsafe-no-fsync=true",  # test data: speed over durability
        "--log-level=warn",
    ]


def apiserver_argv(tools: ToolSet, pki: Pki, ports: Ports) -> list[str]:
    return [
        str(tools.path("kube-apiserver")),
        f"--etcd-servers={ports.etcd_url}",
        f"--bind-address={LOOPBACK}",
        f"--advertise-address={LOOPBACK}",  # no default route here, so it cannot pick one itself
        f"--secure-port={ports.apiserver}",
        f"--tls-cert-file={pki.serving_cert}",
        f"--tls-private-key-file={pki.serving_key}",
        f"--client-ca-file={pki.ca_cert}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        # The endpoint reconciler would publish 127.0.0.1 as the `kubernetes` Service's endpoint, which
        # Endpoints validation rejects; nothing in this cluster routes to Services anyway.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
    ]


def controller_manager_argv(tools: ToolSet, pki: Pki, kubeconfig: Path, ports: Ports) -> list[str]:
    return [
        str(tools.path("kube-controller-manager")),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.controller_manager}",
        "--leader-elect=false",
        f"--root-ca-file={pki.ca_cert}",
        f"--service-account-private-key-file={pki.sa_key}",
        f"--cluster-signing-cert-file={pki.ca_cert}",
        f"--cluster-signing-key-file={pki.ca_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--profiling=false",
    ]


def scheduler_argv(tools: ToolSet, kubeconfig: Path, ports: Ports) -> list[str]:
    return [
        str(tools.path("kube-scheduler")),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={ports.scheduler}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def kwok_argv(tools: ToolSet, kubeconfig: Path, stages: Path, ports: Ports) -> list[str]:
    return [
        str(tools.path("kwok")),
        f"--kubeconfig={kubeconfig}",
        f"--config={stages}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}",
        f"--cidr={POD_CIDR}",  # fake pod IPs: data only, never contacted
        f"--node-ip={LOOPBACK}",
        f"--node-port={ports.kwok}",
        f"--server-address={LOOPBACK}:{ports.kwok}",
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
    ]


def prometheus_argv(binary: Path, config: Path, data_dir: Path, port: int) -> list[str]:
    return [
        str(binary),
        f"--config.file={config}",
        f"--web.listen-address={LOOPBACK}:{port}",
        f"--storage.tsdb.path={data_dir}",
        "--storage.tsdb.retention.time=1d",
        "--web.enable-lifecycle",
    ]
