"""Fixtures of the closed-loop tests (session scope, on the `cluster` fixture of tests/conftest.py):

- `standin`: the kubelet stand-in (metronome_testing.standin) running `metronome serve` on 127.0.0.x for every
  Running server pod, with a small KV budget and a short drain, applying ConfigMap changes 5-15 s after they are
  written (a real kubelet takes 30-90 s; this keeps the kubelet's lag in every test at a few minutes' cost in all);
- `prometheus`: Debian's Prometheus, started through the cluster helper, scraping the stand-in's file_sd targets
  every second;
- `operator`: the chart installed (release metronome-e2e), and the operator run as a local process under the
  chart's ServiceAccount, pointed at that Prometheus.
"""
from __future__ import annotations

import signal

import pytest
from e2e_helpers import SCRAPE_INTERVAL_S, session_prometheus

from metronome_testing.chart import install_chart, service_account_kubeconfig
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.standin import DelayRange, KubeletStandIn, StandInOptions, scrape_config

RELEASE = "metronome-e2e"
RELEASE_NAMESPACE = "metronome-e2e-system"
SERVER_ARGS = ("--kv-cache-memory-gb", "0.5", "--drain-seconds", "2", "--log-level", "warning")
CONFIG_DELAY = DelayRange(5.0, 15.0)  # seconds from a ConfigMap write to the servers' folders


def pytest_configure(config):
    # `timeout` and CI cancellations send SIGTERM: make it the Ctrl-C on which pytest still tears fixtures down,
    # so the servers, the operator and Prometheus are stopped by pid rather than left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@pytest.fixture(scope="session")
def e2e_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def standin(cluster, e2e_dir):
    harness = KubeletStandIn(cluster.kubeconfig, StandInOptions(work_dir=e2e_dir / "standin", extra_args=SERVER_ARGS,
                                                                config_delay=CONFIG_DELAY))
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture(scope="session")
def prometheus(cluster, standin, e2e_dir):
    with session_prometheus(cluster, e2e_dir, scrape_config(standin.options.targets_path, SCRAPE_INTERVAL_S)) as url:
        yield url


@pytest.fixture(scope="session")
def operator(cluster, prometheus, e2e_dir):
    service_account = install_chart(cluster, RELEASE, RELEASE_NAMESPACE).service_account
    kubeconfig = service_account_kubeconfig(cluster, RELEASE_NAMESPACE, service_account,
                                            e2e_dir / "operator.kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=e2e_dir, prometheus_url=prometheus,
                              status_interval_s=2.0)
    process.start()
    try:
        yield process
    finally:
        process.stop()
