"""`metronome operator` flags → OperatorOptions, and the sub-command's import stays light."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from metronome.operator import main
from metronome.operator.main import configure, options_from_args
from metronome.operator.spec import DEFAULT_IMAGE


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    configure(parser)
    return options_from_args(parser.parse_args(list(argv)))


@pytest.fixture(autouse=True)
def not_in_a_pod(monkeypatch, tmp_path):
    """The defaults as on a workstation, wherever the tests run (a CI pod has a service account namespace)."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.setattr(main, "SERVICE_ACCOUNT_NAMESPACE", tmp_path / "no-service-account" / "namespace")


def test_defaults_watch_every_namespace_standalone_with_health_endpoint():
    options = parse()
    assert options.clusterwide and options.namespaces == ()
    assert options.leader_election is None
    assert options.monitor.kind == "PodMonitor" and options.monitor.labels == ()
    assert options.prometheus.allowed_urls == () and options.prometheus.verify() is True
    assert options.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert options.log_level == "INFO"
    assert options.metrics_port == 0  # the operator's own /metrics only when asked for (the chart asks)


def test_namespaces_prometheus_log_level_health_and_leader_election():
    options = parse("--namespace", "a", "-n", "b", "-n", "a", "--prometheus-url", "http://127.0.0.1:9090",
                    "--log-level", "debug", "--health-port", "0", "--leader-elect", "--lease-namespace", "ops",
                    "--lease-duration", "8", "--lease-renew-deadline", "5", "--lease-retry-period", "1")
    assert options.namespaces == ("a", "b") and not options.clusterwide
    assert options.prometheus_url == "http://127.0.0.1:9090"
    assert options.log_level == "DEBUG"
    assert options.liveness_endpoint is None
    election = options.leader_election
    assert (election.namespace, election.name) == ("ops", "metronome-operator")
    assert (election.times.duration_s, election.times.renew_deadline_s, election.times.retry_period_s) == (8, 5, 1)
    assert election.identity and election.identity != parse("--leader-elect", "--lease-namespace", "ops"
                                                            ).leader_election.identity  # a new candidate each start


def test_leader_election_is_the_default_in_a_pod_only(monkeypatch, tmp_path):
    assert parse().leader_election is None  # a workstation: no pod namespace
    monkeypatch.setenv("POD_NAMESPACE", "metronome-system")
    assert parse().leader_election.namespace == "metronome-system"
    assert parse("--standalone").leader_election is None
    monkeypatch.delenv("POD_NAMESPACE")
    account = tmp_path / "namespace"
    account.write_text("ops\n")
    monkeypatch.setattr(main, "SERVICE_ACCOUNT_NAMESPACE", account)
    assert parse().leader_election.namespace == "ops"


def test_prometheus_client_and_monitor_flags():
    options = parse("--prometheus-url", "https://prom.monitoring:9090/", "--allow-prometheus-url",
                    "http://team-prom.ml:9090", "--prometheus-bearer-token-file", "/var/run/token",
                    "--prometheus-ca-file", "/etc/ca.pem", "--scrape-interval", "30",
                    "--monitor-label", "release=kube-prometheus-stack", "--monitor-kind", "PodMonitor")
    prometheus = options.prometheus
    assert prometheus.allowed_urls == ("http://team-prom.ml:9090",) and prometheus.verify() == "/etc/ca.pem"
    assert prometheus.bearer_token_file == "/var/run/token" and prometheus.scrape_interval_seconds == 30
    assert options.monitor.labels == (("release", "kube-prometheus-stack"),) and options.monitor.interval_seconds == 30
    assert parse("--monitor-kind", "none").monitor.pod_monitors is False
    assert parse("--prometheus-insecure-skip-verify").prometheus.verify() is False


@pytest.mark.parametrize(
    "argv",
    [["--namespace", "a", "--all-namespaces"], ["--standalone", "--leader-elect"], ["--log-level", "LOUD"],
     ["--monitor-kind", "ServiceMonitor"]],
)
def test_conflicting_or_bad_flags_exit_with_usage(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


@pytest.mark.parametrize("argv", [
    ["--health-port", "70000"], ["--metrics-port", "-1"], ["--metrics-port", "8080"], ["--status-interval", "0"],
    ["--monitor-label", "release"],
    ["--monitor-label", "bad key=x"], ["--prometheus-url", "prometheus:9090"],
    ["--allow-prometheus-url", "http://user:pw@prom:9090"], ["--scrape-interval", "0"],
    ["--prometheus-ca-file", "/ca.pem", "--prometheus-insecure-skip-verify"],
    ["--leader-elect", "--lease-namespace", "ops", "--lease-duration", "5", "--lease-renew-deadline", "5"],
    ["--leader-elect", "--lease-namespace", "ops", "--lease-renew-deadline", "2", "--lease-retry-period", "2"],
])
def test_out_of_range_values_exit_with_a_message(argv):
    with pytest.raises(SystemExit, match="metronome operator"):
        parse(*argv)


def test_configuring_the_subcommand_imports_neither_kopf_nor_the_client_nor_torch():
    code = (
        "import argparse, sys; from metronome.operator import main; main.configure(argparse.ArgumentParser()); "
        "heavy = [m for m in ('kopf', 'kubernetes', 'torch') if m in sys.modules]; print(heavy); "
        "sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_operator_package_never_imports_torch():
    code = (
        "import sys; import metronome.operator.handlers, metronome.operator.reconcile; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_server_image_defaults_to_the_environment_then_the_built_in_image(monkeypatch):
    monkeypatch.delenv("METRONOME_SERVER_IMAGE", raising=False)
    assert parse().server_image == DEFAULT_IMAGE
    monkeypatch.setenv("METRONOME_SERVER_IMAGE", "registry.example/metronome-server:7")
    assert parse().server_image == "registry.example/metronome-server:7"
    local = "localhost/metronome-server:latest"
    assert parse("--server-image", local).server_image == local


@pytest.mark.parametrize("bad", ["", "localhost/metronome server:latest"])
def test_a_bad_server_image_is_an_error_naming_the_flag(bad):
    with pytest.raises(SystemExit, match="--server-image"):
        parse("--server-image", bad)


def test_the_metrics_endpoint_flags():
    options = parse("--metrics-port", "8081", "--metrics-host", "127.0.0.1")
    assert (options.metrics_host, options.metrics_port) == ("127.0.0.1", 8081)
