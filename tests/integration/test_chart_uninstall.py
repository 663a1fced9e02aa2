"""`helm uninstall` stops the operator while its permissions are still in place: the chart's pre-delete hook scales it
to 0 and waits for its pod, which hands its Lease back on SIGTERM, then deletes the Lease; a reinstall takes over
at once instead of after a whole lease.

kwok runs no containers, so this test plays the kubelet of the two pods that matter (annotated HELD_BY_TEST, kwok
leaves them alone): the hook Job's pod runs its own command line here, as the hook's ServiceAccount; the operator's
pod is this test's operator process, which gets SIGTERM when its pod is deleted, as a kubelet would send it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import CHART
from metronome_testing.kube_objects import HELD_BY_TEST, get_json, set_pod_status
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

METRONOME = str(Path(sys.executable).parent / "metronome")
RELEASE = "metronome-u"  # the chart's full name is the release name (it contains "metronome")
LEASE = "metronome-operator"
# A long lease: a reinstall that had to wait it out could not pass for one that took over at once.
LEASE_DURATION_S, RENEW_DEADLINE_S, RETRY_PERIOD_S = 120, 60, 2
HELD_KEY = next(iter(HELD_BY_TEST)).replace(".", "\\.")


def install(cluster, namespace: str) -> None:
    cluster.helm("install", RELEASE, str(CHART), "-n", namespace,
                 "--set", f"podAnnotations.{HELD_KEY}=test", "--set", f"uninstallHook.podAnnotations.{HELD_KEY}=test",
                 "--set", f"leaderElection.leaseDurationSeconds={LEASE_DURATION_S}",
                 "--set", f"leaderElection.renewDeadlineSeconds={RENEW_DEADLINE_S}")


def operator_process(cluster, namespace: str, work: Path) -> OperatorProcess:
    kubeconfig = service_account_kubeconfig(cluster, namespace, RELEASE, work / "kubeconfig")
    lease = ("--leader-elect", "--lease-namespace", namespace, "--lease-name", LEASE,
             "--lease-duration", str(LEASE_DURATION_S), "--lease-renew-deadline", str(RENEW_DEADLINE_S),
             "--lease-retry-period", str(RETRY_PERIOD_S))
    work.mkdir(parents=True, exist_ok=True)
    return OperatorProcess(kubeconfig=kubeconfig, log_dir=work, lifecycle_args=lease)


def holder(cluster, namespace: str) -> str | None:
    return ((get_json(cluster, "lease", LEASE, "-n", namespace) or {}).get("spec") or {}).get("holderIdentity")


def identity(process: OperatorProcess) -> str:
    return process.log_text().split("leader election: ", 1)[1].split(" waiting for Lease", 1)[0]


def pods(cluster, namespace: str, name: str) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/name={name}")["items"]


class Kubelet:
    """Plays the kubelet of the held pods while `helm uninstall` runs: the hook's pod runs its command here and is
    marked Succeeded when it exits 0; the operator's pod being deleted stops the operator process (SIGTERM), then
    its deletion is finished."""

    def __init__(self, cluster, namespace: str, operator: OperatorProcess, work: Path):
        self.cluster, self.namespace, self.operator, self.work = cluster, namespace, operator, work
        self.hook: subprocess.Popen | None = None
        self.hook_pod: str | None = None
        self.operator_stopped = False

    def step(self) -> None:
        if self.hook is None:
            for pod in pods(self.cluster, self.namespace, "metronome-uninstall"):
                self._run_hook(pod)
        elif self.hook.poll() is not None and self.hook_pod:
            assert self.hook.returncode == 0, (self.work / "hook.log").read_text()
            set_pod_status(self.cluster, self.namespace, self.hook_pod, {
                "phase": "Succeeded",
                "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
                "containerStatuses": [{"name": "operator-stop", "image": "operator", "imageID": "", "ready": False,
                                       "restartCount": 0, "state": {"terminated": {
                                           "exitCode": 0, "reason": "Completed",
                                           "startedAt": "2026-12-01T10:00:00Z",
                                           "finishedAt": "2026-12-01T10:00:05Z"}}}]})
            self.hook_pod = None
        if not self.operator_stopped:
            for pod in pods(self.cluster, self.namespace, "metronome-operator"):
                if pod["metadata"].get("deletionTimestamp"):
                    self.operator.stop()
                    self.operator_stopped = True
                    self.cluster.kubectl("delete", "pod", pod["metadata"]["name"], "-n", self.namespace, "--force",
                                         "--grace-period=0", check=False)

    def _run_hook(self, pod: dict) -> None:
        (container,) = pod["spec"]["containers"]
        kubeconfig = service_account_kubeconfig(self.cluster, self.namespace, pod["spec"]["serviceAccountName"],
                                                self.work / "hook-kubeconfig")
        with open(self.work / "hook.log", "w") as log:
            self.hook = subprocess.Popen([METRONOME, *container["args"]], stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "KUBECONFIG": str(kubeconfig)})
        self.hook_pod = pod["metadata"]["name"]


def test_uninstall_hands_the_lease_back_before_the_rbac_goes_and_a_reinstall_takes_over_at_once(cluster, tmp_path):
    chart_release(cluster)  # the CRD (a second install skips crds/)
    namespace = cluster.namespace("metronome-u")
    install(cluster, namespace)
    first = operator_process(cluster, namespace, tmp_path / "first")
    first.start()
    wait_for(lambda: holder(cluster, namespace) == identity(first), "the operator to take the Lease")

    uninstall = subprocess.Popen([str(cluster.helm_path), "uninstall", RELEASE, "-n", namespace, "--timeout", "3m"],
                                 env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kubelet = Kubelet(cluster, namespace, first, tmp_path)
    try:
        while uninstall.poll() is None:
            kubelet.step()
            time.sleep(0.5)  # a kubelet's own pace; what is awaited is the uninstall above
    finally:
        if uninstall.poll() is None:
            uninstall.kill()
        first.stop()
    output = uninstall.stdout.read()
    assert uninstall.returncode == 0, output
    log = first.log_text()
    assert "released Lease" in log and "Forbidden" not in log and "Unauthorized" not in log, log[-3000:]
    assert get_json(cluster, "lease", LEASE, "-n", namespace) is None  # nothing left behind

    install(cluster, namespace)
    second = operator_process(cluster, namespace, tmp_path / "second")
    second.start()
    try:
        wait_for(lambda: holder(cluster, namespace) == identity(second), "the reinstalled operator to take the Lease",
                 timeout=LEASE_DURATION_S / 4)
    finally:
        second.stop()
        cluster.helm("uninstall", RELEASE, "-n", namespace, "--no-hooks", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
