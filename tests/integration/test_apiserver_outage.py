"""The API server goes away and comes back: the operator rides it out (its watches retry for as long as it takes)
and the resource's conditions then say what the children say — no stale `Progressing=True/RollingOut` for pods
that went unready without any rollout.

The outage is a stop and restart of the local control plane's kube-apiserver process (same flags, same etcd),
shorter than the two minutes of the field report. After a long outage the node controller finds the nodes'
heartbeats stale and marks their pods not ready; whether a short one gets that far depends on its timers, so
the test marks the pods not ready itself, the way the node controller does, when it has not.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from metronome_testing.chart import chart_release, service_account_kubeconfig
from metronome_testing.checkout import EXAMPLE
from metronome_testing.kube_objects import condition, get_json
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.polling import wait_for

NAME = "smollm2"  # examples/inferenceservice.yaml
LABEL = f"metronome.dev/inferenceservice={NAME}"
OUTAGE_S = 25


def _stop_and_restart_apiserver(cluster, outage_s: float) -> None:
    """Stops kube-apiserver, waits `outage_s`, starts it again with the same command line; the state file then
    names the new process, so the cluster's teardown stops it. kwok (the fake kubelets) is restarted with it: kwok
    v0.8's pod watch does not come back after its API server went away (a real kubelet's does), and the session's
    later tests need new pods to start. So is kube-controller-manager: its informers come back on their own, but
    only after client-go's reflector back-off (800 ms doubling to 30 s, with up to 100 % jitter), which after this
    outage held the Deployment controller blind for about a minute; a fresh one lists at once. The operator under
    test is not restarted: it rides the outage out on its own watches."""
    from metronome_testing.localcluster.procs import start_process, stop_process
    from metronome_testing.localcluster.state import load_state, save_state

    if cluster.local is None or not cluster.owns_control_plane:
        pytest.fail("this test restarts kube-apiserver: it needs the local control plane this session started "
                    "(not METRONOME_USE_EXISTING_CLUSTER)")
    state_file = cluster.local.layout.state_file
    state = load_state(state_file)
    index = {record.name: i for i, record in enumerate(state.processes)}
    apiserver = state.processes[index["kube-apiserver"]]
    stop_process(apiserver)
    time.sleep(outage_s)  # the outage itself: nothing to poll, the API server is down on purpose
    state.processes[index["kube-apiserver"]] = start_process(apiserver.name, apiserver.argv, Path(apiserver.log))
    wait_for(lambda: _api_ready(cluster), "kube-apiserver to answer again", timeout=120)
    for name in ("kwok", "kube-controller-manager"):
        record = state.processes[index[name]]
        stop_process(record)
        state.processes[index[name]] = start_process(record.name, record.argv, Path(record.log))
    save_state(state_file, state)


def _api_ready(cluster) -> bool:
    return cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0


def _conditions(cluster, ns) -> dict[str, dict]:
    isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns) or {}
    return {t: condition(isvc, t) or {} for t in ("Ready", "Progressing")}


def _pods(cluster, ns) -> list[dict]:
    return cluster.kubectl_json("get", "pods", "-n", ns, "-l", LABEL)["items"]


def _set_pod_ready(cluster, ns, pod: str, ready: bool) -> None:
    patch = {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                        "reason": None if ready else "NodeNotReady"}]}}
    cluster.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=strategic",
                    "-p", json.dumps(patch))


def _pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def _deployment_says(cluster, ns) -> tuple[int, str]:
    """(ready replicas, the Deployment controller's Progressing reason)."""
    status = (get_json(cluster, "deployment", NAME, "-n", ns) or {}).get("status") or {}
    reason = next((c["reason"] for c in status.get("conditions", []) if c["type"] == "Progressing"), "")
    return int(status.get("readyReplicas") or 0), reason


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A control plane of this module's own (it overrides the session's `cluster`): stopping kube-apiserver leaves
    nodes tainted and the scheduler backing off for minutes, which the session's later tests must not inherit."""
    from metronome_testing.localcluster.session import private_cluster

    with private_cluster(tmp_path_factory.mktemp("outage-cluster")) as handle:
        yield handle


@pytest.fixture
def operator(cluster, tmp_path):
    release = chart_release(cluster)
    kubeconfig = service_account_kubeconfig(cluster, release.namespace, release.service_account,
                                            tmp_path / "kubeconfig")
    process = OperatorProcess(kubeconfig=kubeconfig, log_dir=tmp_path)
    process.start()
    yield process
    process.stop()


def test_conditions_after_an_outage_follow_the_children(cluster, k8s_namespace, operator):
    ns = k8s_namespace
    cluster.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))

    def settled():
        conds = _conditions(cluster, ns)
        return conds["Ready"].get("status") == "True" and conds["Progressing"].get("reason") == "Stable"

    wait_for(settled, "the example to be Ready and Stable", timeout=120)

    _stop_and_restart_apiserver(cluster, OUTAGE_S)
    wait_for(lambda: _api_ready(cluster), "kube-apiserver to answer /readyz again", timeout=120)
    assert operator.process.poll() is None, operator.log_text()[-3000:]  # it waited the outage out

    # What the node controller does after a long outage, unless it already did.
    for pod in _pods(cluster, ns):
        if _pod_ready(pod):
            _set_pod_ready(cluster, ns, pod["metadata"]["name"], ready=False)
    # The Deployment controller (the restarted controller-manager's) counts them.
    wait_for(lambda: _deployment_says(cluster, ns)[0] == 0, "the Deployment to count no ready pod", timeout=240)
    ready_replicas, deployment_progress = _deployment_says(cluster, ns)
    assert deployment_progress == "NewReplicaSetAvailable"  # the Deployment controller: no rollout

    def unready_without_rollout():
        conds = _conditions(cluster, ns)
        return (conds["Ready"].get("status") == "False" and conds["Progressing"].get("status") == "False"
                and conds) or None

    conds = wait_for(unready_without_rollout, "conditions that say: pods unready, no rollout", timeout=60)
    assert conds["Ready"]["reason"] == "ReplicasNotReady" and conds["Ready"]["message"].startswith("0/2")
    assert conds["Progressing"]["reason"] == "RolloutComplete"
    isvc = get_json(cluster, "inferenceservices.metronome.dev", NAME, "-n", ns)
    assert isvc["status"]["readyReplicas"] == ready_replicas == 0 and isvc["status"]["ready"] == "0/2"

    # The pods recover (a real kubelet reports them ready again): status follows at once through the watches.
    for pod in _pods(cluster, ns):
        _set_pod_ready(cluster, ns, pod["metadata"]["name"], ready=True)
    # The Deployment controller counts them through the same informers as above.
    wait_for(settled, "Ready and Stable once the pods are ready again", timeout=240)
    log = operator.log_text()
    assert "Traceback" not in log, log[max(log.find("Traceback") - 1000, 0):][:4000]
