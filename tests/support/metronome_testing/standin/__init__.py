"""A stand-in for the kubelet's container runtime, for Metronome's server pods only (kwok runs no containers).

kwok makes server Pods Running without running anything; KubeletStandIn runs a real `metronome serve` for each of
them on 127.0.0.x, keeps its config folder in sync with the pod's ConfigMap by the `..data` swap (after a
kubelet-like delay, propagation.py), and publishes Prometheus file_sd targets with the labels
namespace/service/pod. See standin.py.
"""
from .podspec import PodSpecError, ServerPod, local_argv, server_pod
from .propagation import KUBELET_DEFAULT, ConfigUpdate, DelayRange
from .standin import KubeletStandIn, ServerInfo, StandInError, StandInOptions
from .targets import Target, file_sd_groups, scrape_config, write_file_sd

__all__ = ["KUBELET_DEFAULT", "ConfigUpdate", "DelayRange", "KubeletStandIn", "PodSpecError", "ServerInfo",
           "ServerPod", "StandInError", "StandInOptions", "Target", "file_sd_groups", "local_argv", "scrape_config",
           "server_pod", "write_file_sd"]
