"""Pure status: conditions, READY/SLO columns, lastTransitionTime, minimal patches, transition Events."""
from __future__ import annotations

from metronome.contract.config import next_server_config
from metronome.operator.changes import describe_transitions
from metronome.operator.spec import parse_service
from metronome.operator.status import Observed, compute_status, status_patch
from metronome.operator.tuning.autotune import ServingMetrics

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def service(**spec):
    body = {
        "metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 7},
        "spec": {"model": {"source": "default"}, "replicas": 2, **spec},
    }
    return parse_service(body)


def deployment(ready: int, updated: int = 2, replicas: int = 2, generation: int = 1, observed: int = 1) -> dict:
    return {
        "metadata": {"generation": generation},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def conditions_by_type(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def served(svc):
    return next_server_config(None, svc.spec.server)


def test_all_ready_without_metrics():
    svc = service()
    status = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc)), now=T0)
    cond = conditions_by_type(status)
    assert status["ready"] == "2/2" and status["readyReplicas"] == 2 and status["replicas"] == 2
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "AllReplicasReady")
    assert cond["Progressing"]["status"] == "False"
    assert cond["MetricsAvailable"]["status"] == "Unknown"
    assert cond["ConfigApplied"]["status"] == "Unknown"
    assert cond["SLOMet"]["status"] == "Unknown" and status["slo"] == "Unknown"
    # The CRD's defaults: split with a short lane of 2048 and a long one of 512. CHUNK is the budget the servers
    # enforce (the larger lane), not spec.server.chunkSize (512), which split never reads.
    assert status["chunkSize"] == 2048 and status["queuePolicy"] == "split" and status["configGeneration"] == 1
    assert status["splitChunkSizes"] == "2048/512"
    assert status["selector"] == "app.kubernetes.io/name=metronome-server,metronome.dev/inferenceservice=chat"
    for c in status["conditions"]:
        assert c["observedGeneration"] == 7 and c["lastTransitionTime"] == T0
        assert set(c) == {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}


def test_not_ready_names_the_pod_problem():
    pending = {
        "metadata": {"name": "chat-abc"},
        "status": {
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}
            ]
        },
    }
    svc = service()
    status = compute_status(svc, Observed(deployment(ready=1), pods=(pending,), served_config=served(svc)), now=T0)
    ready = conditions_by_type(status)["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "Unschedulable") and status["ready"] == "1/2"
    assert "Insufficient nvidia.com/gpu" in ready["message"] and "chat-abc" in ready["message"]
    assert conditions_by_type(status)["Progressing"]["status"] == "True"


def test_rollout_in_progress_is_not_ready_even_with_enough_ready_pods():
    svc = service()
    status = compute_status(svc, Observed(deployment(ready=2, updated=1, replicas=3, generation=2, observed=2)), now=T0)
    cond = conditions_by_type(status)
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "RollingOut")
    assert cond["Progressing"]["reason"] == "RollingOut"


def test_missing_deployment_and_config():
    status = compute_status(service(), Observed(None), now=T0)
    cond = conditions_by_type(status)
    assert cond["Ready"]["reason"] == "DeploymentMissing" and status["ready"] == "0/2"
    assert cond["ConfigApplied"]["reason"] == "ConfigMapMissing"
    assert status["chunkSize"] is None


def test_invalid_config_is_a_false_configapplied():
    status = compute_status(service(), Observed(deployment(ready=2), config_error="bad chunk_size"), now=T0)
    cond = conditions_by_type(status)["ConfigApplied"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "InvalidConfig", "bad chunk_size")


def test_slo_met_and_violated_from_metrics():
    svc = service(slo={"tbtP99Ms": 50, "minThroughputTokensPerSecond": 100})
    good = ServingMetrics(available=True, tbt_p99_ms=31.26, throughput_tokens_per_second=850.04, pods_on_generation=2)
    status = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc), metrics=good), now=T0)
    cond = conditions_by_type(status)
    assert status["slo"] == "Met" and cond["SLOMet"]["status"] == "True"
    assert status["tbtP99Ms"] == 31.3 and status["throughputTokensPerSecond"] == 850.0
    assert cond["ConfigApplied"]["status"] == "True" and status["podsOnGeneration"] == 2
    assert cond["MetricsAvailable"]["status"] == "True"

    bad = ServingMetrics(available=True, tbt_p99_ms=80, throughput_tokens_per_second=40, pods_on_generation=1)
    status = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc), metrics=bad), now=T1)
    cond = conditions_by_type(status)
    assert status["slo"] == "Violated" and cond["SLOMet"]["reason"] == "SLOViolated"
    assert "TBT p99 80.0 ms > 50 ms" in cond["SLOMet"]["message"] and "throughput" in cond["SLOMet"]["message"]
    assert cond["ConfigApplied"]["reason"] == "PodsOnOlderGeneration"


def test_no_metrics_is_metrics_available_false_and_slo_unknown():
    svc = service(slo={"tbtP99Ms": 50})
    down = ServingMetrics(available=False, reason="PrometheusUnreachable", message="connection refused")
    status = compute_status(svc, Observed(deployment(ready=2), metrics=down), now=T0)
    cond = conditions_by_type(status)
    metrics = cond["MetricsAvailable"]
    assert (metrics["status"], metrics["reason"]) == ("False", "PrometheusUnreachable")
    assert status["slo"] == "Unknown" and status["tbtP99Ms"] is None


def test_transition_time_moves_only_when_status_flips_and_refresh_is_a_no_op():
    svc = service()
    first = compute_status(svc, Observed(deployment(ready=1)), now=T0)
    same = compute_status(svc, Observed(deployment(ready=1)), now=T1, previous_conditions=first["conditions"])
    assert status_patch(first, same) == {}
    ready = compute_status(svc, Observed(deployment(ready=2)), now=T1, previous_conditions=first["conditions"])
    patch = status_patch(first, ready)
    assert set(patch) >= {"conditions", "ready", "readyReplicas"}
    cond = conditions_by_type(ready)
    assert cond["Ready"]["lastTransitionTime"] == T1
    assert cond["MetricsAvailable"]["lastTransitionTime"] == T0


def test_transition_events():
    svc = service()
    first = compute_status(svc, Observed(deployment(ready=1), served_config=served(svc)), now=T0)
    events = describe_transitions([], first["conditions"])
    assert {e.reason for e in events} == {"ReplicasNotReady", "RollingOut"}  # Unknown first appearances are quiet
    assert {e.type for e in events} == {"Normal"}  # coming up is not a problem
    ready = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc)), now=T1,
                           previous_conditions=first["conditions"])
    events = describe_transitions(first["conditions"], ready["conditions"])
    assert [(e.type, e.reason) for e in events] == [("Normal", "AllReplicasReady"), ("Normal", "Stable")]
    assert describe_transitions(ready["conditions"], ready["conditions"]) == []
    lost = compute_status(svc, Observed(deployment(ready=1), served_config=served(svc)), now=T1,
                          previous_conditions=ready["conditions"])
    events = describe_transitions(ready["conditions"], lost["conditions"])
    assert ("Warning", "ReplicasNotReady") in [(e.type, e.reason) for e in events]


# --- why pods do not run -------------------------------------------------------------------------------------


def pod(name: str, *, phase: str = "Pending", init: list[dict] = (), containers: list[dict] = (),
        ready: bool = False) -> dict:
    return {"metadata": {"name": name}, "status": {
        "phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "initContainerStatuses": list(init), "containerStatuses": list(containers)}}


def waiting(name: str, reason: str, message: str = "", last: dict | None = None, image: str = "img:1") -> dict:
    status = {"name": name, "image": image, "ready": False, "restartCount": 3 if last else 0,
              "state": {"waiting": {"reason": reason, "message": message}}}
    if last:
        status["lastState"] = {"terminated": last}
    return status


def ready_of(*pods: dict, ready: int = 0) -> dict:
    svc = service()
    status = compute_status(svc, Observed(deployment(ready=ready), pods=pods, served_config=served(svc)), now=T0)
    return conditions_by_type(status)["Ready"]


def test_a_failing_model_download_is_named_with_its_exit_and_the_end_of_its_log():
    log = "Traceback ...\n" + "x" * 3000 + "\nmetronome fetch-model: error: hf://acme/m: access to this gated repo"
    crash = waiting("fetch-model", "CrashLoopBackOff", "back-off 40s restarting failed container",
                    last={"exitCode": 1, "reason": "Error", "message": log})
    cond = ready_of(pod("chat-a", init=[crash], containers=[waiting("server", "PodInitializing")]))
    assert (cond["status"], cond["reason"]) == ("False", "ModelDownloadFailed")
    assert "init container fetch-model (the model download): CrashLoopBackOff" in cond["message"]
    assert "exit code 1 (Error)" in cond["message"] and "gated repo" in cond["message"]
    assert len(cond["message"]) < 1000  # the end of the log, not all of it


def test_image_pulls_missing_secrets_and_crashes_are_named():
    pull = waiting("fetch-model", "ImagePullBackOff", 'Back-off pulling image "img:1"')
    assert ready_of(pod("chat-a", init=[pull]))["reason"] == "ImagePullFailed"
    secret = waiting("server", "CreateContainerConfigError", 'secret "hf-token" not found')
    cond = ready_of(pod("chat-a", phase="Running", containers=[secret]))
    assert cond["reason"] == "ContainerConfigError" and 'secret "hf-token" not found' in cond["message"]
    oom = waiting("server", "CrashLoopBackOff", "back-off", last={"exitCode": 137, "reason": "OOMKilled"})
    cond = ready_of(pod("chat-a", phase="Running", containers=[oom]))
    assert cond["reason"] == "PodsFailing" and "exit code 137 (OOMKilled)" in cond["message"]
    # The most specific problem names the condition, whatever the pods' order.
    both = ready_of(pod("chat-a", phase="Running", containers=[oom]), pod("chat-b", init=[pull]))
    assert both["reason"] == "ImagePullFailed" and "chat-a" in both["message"]


def test_pods_on_their_way_up_are_starting_and_a_ready_pod_gone_unready_is_not():
    creating = pod("chat-a", init=[waiting("fetch-model", "PodInitializing")])
    assert ready_of(creating, pod("chat-b", phase="Running", ready=True), ready=1)["reason"] == "PodsStarting"
    loading = pod("chat-a", phase="Running", containers=[{"name": "server", "ready": False, "started": False,
                                                          "restartCount": 0, "state": {"running": {}}}])
    assert ready_of(loading, ready=1)["reason"] == "PodsStarting"
    lost = pod("chat-a", phase="Running", containers=[{"name": "server", "ready": True, "started": True,
                                                       "restartCount": 0, "state": {"running": {}}}])
    assert ready_of(lost, pod("chat-b", phase="Running", ready=True), ready=1)["reason"] == "ReplicasNotReady"


def test_no_warning_for_a_scale_up_or_a_rollout_and_one_for_pods_that_went_unready():
    svc = service()
    ready = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc)), now=T0)
    bigger = service(replicas=4, maxReplicas=4)
    scaling = compute_status(bigger, Observed(deployment(ready=2, replicas=2)), now=T1,
                             previous_conditions=ready["conditions"])
    assert conditions_by_type(scaling)["Ready"]["reason"] == "PodsStarting"
    rolling = compute_status(svc, Observed(deployment(ready=2, updated=1, replicas=3)), now=T1,
                             previous_conditions=ready["conditions"])
    for after in (scaling, rolling):
        assert {e.type for e in describe_transitions(ready["conditions"], after["conditions"])} == {"Normal"}


def test_config_applied_counts_only_ready_pods():
    svc = service()
    metrics = ServingMetrics(available=True, tbt_p99_ms=20, pods_on_generation=3)
    after_outage = compute_status(svc, Observed(deployment(ready=0), served_config=served(svc), metrics=metrics),
                                  now=T0)
    cond = conditions_by_type(after_outage)["ConfigApplied"]
    assert (cond["status"], cond["reason"]) == ("Unknown", "NoReadyPods") and "3/0" not in cond["message"]
    two = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc), metrics=metrics), now=T0)
    assert conditions_by_type(two)["ConfigApplied"]["message"] == "2/2 ready pods serve generation 1"


def test_a_refused_generation_keeps_observed_generation_and_says_why():
    from metronome.operator.refusals import Refusal

    svc = service()
    refusal = Refusal("Deployment", "chat", 422, "the API server refused it: spec.resources.cpu: must be >= 0")
    status = compute_status(svc, Observed(deployment(ready=2), served_config=served(svc), refusal=refusal), now=T0,
                            applied_generation=6)
    cond = conditions_by_type(status)
    assert status["observedGeneration"] == 6 and cond["Ready"]["observedGeneration"] == 7
    assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("False", "SpecRejected")
    assert "generation 7 was not applied (2/2 pods ready" in cond["Ready"]["message"]
    assert "spec.resources.cpu" in cond["Ready"]["message"]
    assert cond["Progressing"]["reason"] == "SpecRejected" and cond["Progressing"]["status"] == "False"
    assert describe_transitions([], status["conditions"]) == [] or all(
        e.reason != "SpecRejected" for e in describe_transitions([], status["conditions"]))
