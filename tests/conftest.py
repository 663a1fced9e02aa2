"""Shared pytest fixtures. Kept light on purpose (unit tests load it too): no torch or server imports here.

`cluster` (session scope) is a real control plane on 127.0.0.1 for tests/integration and tests/e2e:
etcd + kube-apiserver + controller-manager + scheduler + kwok with two fake nodes of nvidia.com/gpu: 8.
It is started once per session and stopped at the end (only if this session started it). To use an existing
cluster instead: KUBECONFIG=<path> METRONOME_USE_EXISTING_CLUSTER=1 pytest ...

The object it yields (metronome_testing.localcluster.session.SessionCluster) offers
  .kubeconfig .api_url .bin_dir .logs_dir .env .kubernetes_version .prometheus_url
  .kubectl(*args, input=None, check=True) -> CompletedProcess[str]    .kubectl_json(*args) -> dict
  .helm(*args, input=None, check=True) -> CompletedProcess[str]       .apply(manifest_text, namespace=None)
  .namespace(base) -> "<base>-<random>" (created)
  .start_prometheus(cfg) -> url / .stop_prometheus()
"""

from __future__ import annotations

import sys

import pytest

OPERATOR_LOG_LINES = 60


def _localcluster():
    """Imported lazily so that unit-test-only runs never load the cluster code."""
    import metronome_testing.localcluster
    import metronome_testing.localcluster.session

    return metronome_testing.localcluster


def pytest_collection_finish(session: pytest.Session) -> None:
    """Builds missing Go tools before any test runs (outside per-test timeouts), with progress on the terminal,
    but only when a collected test needs the cluster."""
    if session.config.option.collectonly:
        return
    if not any("cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    tools = _localcluster().ToolSet.default()
    if not tools.missing():
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        tools.ensure_built(build=True)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    session_module = _localcluster().session
    handle = session_module.open_test_cluster(tmp_path_factory.mktemp("cluster-session"))
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture
def k8s_namespace(cluster) -> str:
    """A fresh namespace for one test (deleted afterwards without waiting)."""
    name = cluster.namespace("t")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing test that ran operators shows the end of each operator log written while it ran: in CI that
    log is the only account of what the operator did."""
    outcome = yield
    report = outcome.get_result()
    processes = sys.modules.get("metronome_testing.operator_process")
    if not report.failed or processes is None:
        return
    from metronome.server.bench.processes import log_tail

    for path in processes.logs_written_since(call.start):
        report.sections.append((f"operator log {path} (last {OPERATOR_LOG_LINES} lines)",
                                log_tail(path, OPERATOR_LOG_LINES)))
