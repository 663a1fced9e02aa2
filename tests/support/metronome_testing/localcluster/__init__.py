"""A real Kubernetes control plane on 127.0.0.1 (etcd, kube-apiserver, controller-manager, scheduler, kwok).

Built from Go modules by hack/build-tools.sh; started and stopped by hack/cluster.py or from Python:

    cluster = LocalCluster(state_dir)
    info = cluster.up()          # ClusterInfo(kubeconfig, api_url, bin_dir, kubectl, helm, logs_dir, ...)
    cluster.down()
"""

from .errors import ClusterError, ClusterStartError, ToolsMissingError
from .kubetools import KubeTools
from .local import ClusterInfo, LocalCluster
from .tools import ToolSet, default_cache_dir, default_state_dir

__all__ = [
    "ClusterError",
    "ClusterInfo",
    "ClusterStartError",
    "KubeTools",
    "LocalCluster",
    "ToolSet",
    "ToolsMissingError",
    "default_cache_dir",
    "default_state_dir",
]
