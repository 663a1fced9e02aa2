"""`metronome operator` flags → OperatorOptions, and the sub-command's import stays light."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from metronome.operator.main import configure, options_from_args


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    configure(parser)
    return options_from_args(parser.parse_args(list(argv)))


def test_defaults_watch_every_namespace_standalone_with_health_endpoint():
    options = parse()
    assert options.clusterwide and options.namespaces == ()
    assert options.peering is None
    assert options.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert options.log_level == "INFO"


def test_namespaces_prometheus_log_level_health_and_peering():
    options = parse("--namespace", "a", "-n", "b", "-n", "a", "--prometheus-url", "http://127.0.0.1:9090",
                    "--log-level", "debug", "--health-port", "0", "--peering", "metronome")
    assert options.namespaces == ("a", "b") and not options.clusterwide
    assert options.prometheus_url == "http://127.0.0.1:9090"
    assert options.log_level == "DEBUG"
    assert options.liveness_endpoint is None
    assert options.peering == "metronome"


@pytest.mark.parametrize(
    "argv",
    [["--namespace", "a", "--all-namespaces"], ["--standalone", "--peering", "x"], ["--log-level", "LOUD"]],
)
def test_conflicting_or_bad_flags_exit_with_usage(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


@pytest.mark.parametrize("argv", [["--health-port", "70000"], ["--status-interval", "0"]])
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
