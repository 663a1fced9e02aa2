"""Two operator replicas on the real control plane: exactly one acts (the Lease holder), the other takes over
within the lease after the leader is killed, and no child is duplicated. Objects carry no finalizer, so a
resource deleted while no operator runs (a `helm uninstall` with resources left) goes at once. A leader paused
past its lease (SIGSTOP) writes nothing when it wakes, and the new leader applies every change.

Both operators run under the chart's ServiceAccount, so the chart's Lease RBAC is what they get.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import time
import uuid

import pytest
import yaml

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import EXAMPLE
from metronome_testing.kube_objects import condition, get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

NAME = "smollm2"  # examples/inferenceservice.yaml
LABEL = f"metronome.dev/inferenceservice={NAME}"
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 6, 4, 1


def _lease_args(namespace: str, lease: str) -> tuple[str, ...]:
    return ("--leader-elect", "--lease-namespace", namespace, "--lease-name", lease,
            "--lease-duration", str(LEASE_DURATION_S), "--lease-renew-deadline", str(RENEW_DEADLINE_S),
            "--lease-retry-period", str(RETRY_PERIOD_S))


def _identity(process: OperatorProcess) -> str:
    match = re.search(r"leader election: (\S+) waiting for Lease", process.log_text())
    assert match, process.log_text()[-2000:]
    return match.group(1)


def _lease(cluster, namespace: str, name: str) -> dict:
    return get_json(cluster, "lease", name, "-n", namespace) or {}


def _holder(cluster, namespace: str, name: str) -> str | None:
    return (_lease(cluster, namespace, name).get("spec") or {}).get("holderIdentity")


def _time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ")


def _children(cluster, ns: str) -> dict[str, list[str]]:
    def names(kind: str) -> list[str]:
        return sorted(i["metadata"]["name"] for i in cluster.kubectl_json("get", kind, "-n", ns, "-l", LABEL)["items"])

    return {kind: names(kind) for kind in ("deployments", "replicasets", "services", "configmaps")}


def _config_generation(cluster, ns: str) -> int:
    config_map = get_json(cluster, "configmap", f"{NAME}-config", "-n", ns)
    return yaml.safe_load(config_map["data"]["server.yaml"])["generation"]


@pytest.fixture
def replicas(cluster, tmp_path):
    release = chart_release(cluster)
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account,
                                            tmp_path / "kubeconfig")
    lease = f"metronome-test-{uuid.uuid4().hex[:8]}"
    processes = [OperatorProcess(kubeconfig=kubeconfig, log_dir=tmp_path / f"replica-{i}",
                                 lifecycle_args=_lease_args(release.namespace, lease)) for i in (1, 2)]
    for process in processes:
        process.log_dir.mkdir()
    yield release.namespace, lease, processes
    for process in processes:
        process.stop()
    logs = "\n".join(p.all_logs() for p in processes)
    # RBAC denials name the ServiceAccount (other 403s, e.g. Events in a namespace being deleted, do not).
    assert 'forbidden: User "system:serviceaccount' not in logs, logs[-4000:]


def test_one_replica_acts_and_the_other_takes_over_when_it_dies(cluster, k8s_namespace, replicas):
    lease_ns, lease, (first, second) = replicas
    first.start()
    wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(first), "the first replica to take the Lease")
    second.start()  # healthy while it waits: /healthz answers "standby"
    cluster.kubectl("apply", "-n", k8s_namespace, "-f", str(EXAMPLE))

    def ready():
        cond = condition(get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", k8s_namespace) or {}, "Ready")
        return cond is not None and cond["status"] == "True"

    wait_for(ready, "the leader to reconcile the example to Ready", timeout=120)
    assert _holder(cluster, lease_ns, lease) == _identity(first)
    assert "took Lease" not in second.log_text() and ": Created: " not in second.log_text()
    isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", k8s_namespace)
    assert not isvc["metadata"].get("finalizers")  # no timer, no finalizer
    before = _children(cluster, k8s_namespace)
    assert all(len(names) == 1 for names in before.values()), before

    last_renewal = _time(_lease(cluster, lease_ns, lease)["spec"]["renewTime"])
    first.process.kill()  # no release: the Lease must run out
    first.process.wait(timeout=10)
    wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(second), "the second replica to take over",
             timeout=LEASE_DURATION_S * 5)
    spec = _lease(cluster, lease_ns, lease)["spec"]
    # The takeover came within the lease (and the candidate's polling), measured by the Lease's own stamps.
    gap = (_time(spec["acquireTime"]) - last_renewal).total_seconds()
    assert LEASE_DURATION_S <= gap + RETRY_PERIOD_S and gap <= LEASE_DURATION_S + 4 * RETRY_PERIOD_S, gap
    assert spec["leaseTransitions"] >= 1

    # The new leader acts: a scheduler change becomes exactly one new generation, and no child is duplicated.
    generation = _config_generation(cluster, k8s_namespace)
    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", k8s_namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"server": {"chunkSize": 256}}}))
    wait_for(lambda: _config_generation(cluster, k8s_namespace) == generation + 1, "the new leader to serve the change")
    assert _children(cluster, k8s_namespace) == before

    # With no operator at all, deleting the resource is not blocked: owner references take the children.
    second.stop()
    cluster.kubectl("delete", "inferenceservices.metronome.dev", NAME, "-n", k8s_namespace, "--timeout=30s")
    wait_for(lambda: not any(_children(cluster, k8s_namespace).values()),
             "the garbage collector to remove the children", timeout=90)


def test_a_stopped_leader_hands_the_lease_over_at_once(cluster, replicas):
    lease_ns, lease, (first, second) = replicas
    first.start()
    wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(first), "the first replica to take the Lease")
    second.start()
    first.stop()  # SIGTERM: kopf stops, the Lease is released
    assert first.logs and "released Lease" in first.log_text()
    wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(second), "the second replica to take the Lease")
    spec = _lease(cluster, lease_ns, lease)["spec"]
    assert spec["leaseDurationSeconds"] == LEASE_DURATION_S


PAUSE_S = 20  # longer than a whole lease: the standby takes over while the leader sleeps
WRITES = ("Created", "Updated", "Scaled", "RollingUpdate", "ConfigCreated", "ConfigUpdated", "Deleted",
          "SpecRejected")


def test_a_paused_leader_writes_nothing_after_waking_and_the_next_change_is_applied(cluster, k8s_namespace,
                                                                                   replicas):
    lease_ns, lease, (first, second) = replicas
    ns = k8s_namespace
    first.start()
    wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(first), "the first replica to take the Lease")
    second.start()
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))

    def current(replicas: int):
        isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns) or {}
        ready = condition(isvc, "Ready") or {}
        status = isvc.get("status") or {}
        return (ready.get("status") == "True" and status.get("ready") == f"{replicas}/{replicas}"
                and status.get("observedGeneration") == isvc["metadata"]["generation"])

    wait_for(lambda: current(2), "the leader to reconcile the example to Ready", timeout=120)
    generation = _config_generation(cluster, ns)
    paused_at = time.monotonic()
    os.kill(first.process.pid, signal.SIGSTOP)
    try:
        cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
                        "-p", json.dumps({"spec": {"server": {"chunkSize": 256}}}))
        wait_for(lambda: _holder(cluster, lease_ns, lease) == _identity(second), "the standby to take over",
                 timeout=LEASE_DURATION_S * 5)
        wait_for(lambda: _config_generation(cluster, ns) == generation + 1, "the new leader to serve the change")
        time.sleep(max(0.0, PAUSE_S - (time.monotonic() - paused_at)))  # the pause itself
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    assert first.process.wait(timeout=30) == 1  # it found the Lease gone and stopped
    log = first.log_text()
    lost = log.index("lost Lease")
    assert not [line for line in log[lost:].splitlines() if any(f": {word}: " in line for word in WRITES)], log[lost:]

    cluster.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"replicas": 3}}))
    wait_for(lambda: current(3), "the new leader to scale to 3 with status current", timeout=120)
    assert get_json(cluster, "deployment", NAME, "-n", ns)["spec"]["replicas"] == 3
    assert _config_generation(cluster, ns) == generation + 1  # nothing written twice
    annotations = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)["metadata"].get(
        "annotations") or {}
    assert not [key for key in annotations if key.startswith("metronome.dev/")], annotations
    assert all(len(names) == 1 for names in _children(cluster, ns).values() if names), _children(cluster, ns)
