"""The runtime against the in-memory API of kube_fakes: a reconcile brings children and status in line and a second
one sends nothing; a transition is announced once; watch events queue the owner; a spec the operator cannot use
is reported once per generation; a failure is retried after a doubling pause; a lost Lease stops the workers; an
experiment is stepped inside the reconcile and its record reaches status; the loop's scale is a fenced patch of
spec.replicas that the next reconcile carries to the Deployment."""
from __future__ import annotations

import copy

from kube_fakes import MemoryKube
from test_control_loop import LOCAL, apply_body, prometheus  # noqa: F401 - the fixture
from test_reconcile import body

from metronome.contract import variant
from metronome.operator import builders, kinds, runtime
from metronome.operator.k8s import KubeError, LeadershipLost
from metronome.operator.options import OperatorOptions


def started(kube: MemoryKube, owner: dict) -> runtime.Runtime:
    kube.put(owner)
    return runtime.Runtime(kube, OperatorOptions(), cache=kube.cache)


def owner_now(kube: MemoryKube) -> dict:
    return kube.objects[("InferenceService", "ml", "chat")]


def test_a_reconcile_writes_children_and_status_and_the_next_one_sends_nothing():
    kube = MemoryKube()
    rt = started(kube, body())
    rt.reconcile("ml", "chat")
    assert {k[0] for k in kube.objects} >= {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    status = owner_now(kube)["status"]
    assert status["observedGeneration"] == 1 and status["configGeneration"] == 1
    kube.requests, kube.events = [], []
    rt.reconcile("ml", "chat")
    assert kube.requests == [] and kube.events == []


def test_pods_becoming_ready_are_announced_once():
    kube = MemoryKube()
    rt = started(kube, body())
    rt.reconcile("ml", "chat")
    deployment = copy.deepcopy(kube.objects[("Deployment", "ml", "chat")])
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "availableReplicas": 2,
                            "updatedReplicas": 2}
    kube.put(deployment)
    for _ in range(3):
        rt.reconcile("ml", "chat")
    reasons = [reason for _, reason, _ in kube.events]
    assert reasons.count("AllReplicasReady") == 1 and reasons.count("Created") == 3


def test_watch_events_queue_the_owner_and_an_optional_crd_queues_every_service():
    kube = MemoryKube()
    rt = started(kube, body())
    pod = {"kind": "Pod", "metadata": {"name": "chat-a", "namespace": "ml", "labels": builders.labels("chat")}}
    rt.observe(kinds.POD, "MODIFIED", pod)
    assert rt.queue.get(0) == ("ml", "chat") and rt.cache.owned("Pod", "ml", "chat")
    rt.queue.done(("ml", "chat"))
    rt.observe(kinds.POD, "DELETED", pod)
    assert rt.cache.owned("Pod", "ml", "chat") == []
    rt.queue.get(0)
    rt.queue.done(("ml", "chat"))
    crd = {"metadata": {"name": kinds.POD_MONITOR.crd, "resourceVersion": "9"},
           "status": {"conditions": [{"type": "Established", "status": "True"}]}}
    rt.observe(kinds.CRD, None, crd)
    assert rt.crd_served(kinds.POD_MONITOR.crd) and rt.queue.get(0) == ("ml", "chat")
    rt.queue.done(("ml", "chat"))
    # Being deleted: still Established while its objects go, but no longer a kind to write.
    terminating = {**crd, "metadata": {**crd["metadata"], "deletionTimestamp": "2026-12-03T07:43:48Z"}}
    rt.observe(kinds.CRD, "MODIFIED", terminating)
    assert not rt.crd_served(kinds.POD_MONITOR.crd) and rt.queue.get(0) == ("ml", "chat")


def test_a_spec_the_operator_cannot_use_is_reported_once_per_generation():
    kube = MemoryKube()
    bad = body(engine={"extraArgs": ["--port=9"]})  # the CRD refuses it; a body from elsewhere may not
    rt = started(kube, bad)
    rt.reconcile("ml", "chat")
    rt.reconcile("ml", "chat")
    ready = next(c for c in owner_now(kube)["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec") and "--port" in ready["message"]
    assert [(t, r) for t, r, _ in kube.events] == [("Warning", "InvalidSpec")]
    assert "observedGeneration" not in owner_now(kube)["status"]
    assert not any(key[0] == "Deployment" for key in kube.objects)


def test_a_failed_reconcile_is_retried_after_a_doubling_pause(monkeypatch):
    kube = MemoryKube()
    rt = started(kube, body())
    pauses = []
    monkeypatch.setattr(rt.queue, "add_after", lambda key, delay: pauses.append(delay))

    def away(*args, **kwargs):
        raise KubeError(503, "ServiceUnavailable", "the API server is starting", "PATCH")

    monkeypatch.setattr(kube, "apply", away)
    for _ in range(3):
        rt.queue.add(("ml", "chat"))
        assert rt.process_next(0)
    assert pauses == [1.0, 2.0, 4.0]


def test_a_fenced_write_leaves_nothing_written_and_the_service_queued_again(monkeypatch):
    kube = MemoryKube()
    rt = started(kube, body())
    later = []
    monkeypatch.setattr(rt.queue, "add_after", lambda key, delay: later.append((key, delay)))

    def fenced(*args, **kwargs):
        raise LeadershipLost("the Lease was not renewed in time")

    kube.apply = fenced
    rt.queue.add(("ml", "chat"))
    assert rt.process_next(0)
    assert not any(key[0] == "Deployment" for key in kube.objects) and kube.events == []
    assert later == [(("ml", "chat"), runtime.FENCED_RETRY_S)]
    rt.queue.shutdown()  # what main.py does once the renew thread finds the Lease gone
    rt.queue.add(("ml", "other"))
    assert rt.process_next(0) is False


def test_an_experiment_is_stepped_in_the_reconcile_and_its_record_and_condition_reach_status():
    kube = MemoryKube()
    rt = started(kube, body(experiment={"candidate": {"chunkSize": 256}, "windowSeconds": 30, "windows": 5}))
    for name in ("chat-a", "chat-b"):
        kube.put({"apiVersion": "v1", "kind": "Pod",
                  "metadata": {"name": name, "namespace": "ml", "labels": builders.labels("chat")},
                  "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    rt.reconcile("ml", "chat")
    status = owner_now(kube)["status"]
    # No Prometheus: which generation each pod serves is unknown, so the experiment waits and touches no pod.
    assert (status["experiment"]["phase"], status["experiment"]["reason"]) == ("Pending", "GenerationsUnknown")
    experiment = next(c for c in status["conditions"] if c["type"] == "Experiment")
    assert (experiment["status"], experiment["reason"]) == ("False", "GenerationsUnknown")
    assert [reason for _, reason, _ in kube.events].count("ExperimentPending") == 1
    assert not any(variant.LABEL in kube.objects[("Pod", "ml", name)]["metadata"]["labels"]
                   for name in ("chat-a", "chat-b"))
    kube.requests, kube.events = [], []
    rt.reconcile("ml", "chat")  # no reading due: nothing to step, nothing sent
    assert kube.requests == [] and kube.events == []


def test_the_loops_scale_is_the_runtimes_fenced_patch_of_spec_replicas_and_the_deployment_follows(prometheus):  # noqa: F811
    kube, owner = MemoryKube(), apply_body(minChunkSize=1024, scaleReplicas=True)  # at its floor, over the SLO
    kube.put(owner)
    rt = runtime.Runtime(kube, OperatorOptions(prometheus=LOCAL), cache=kube.cache)
    later = []
    rt.queue.add_after = lambda key, delay: later.append((key, delay))
    leading = [False]

    def fence():
        if not leading[0]:
            raise LeadershipLost("another replica holds the Lease")

    kube.fence = fence
    rt.queue.add(("ml", "chat"))
    assert rt.process_next(0)
    assert kube.requests == [] and prometheus["reads"] == 0  # no write, and no reading that would want one
    assert later == [(("ml", "chat"), runtime.FENCED_RETRY_S)]
    leading[0] = True
    rt.reconcile("ml", "chat")
    assert owner_now(kube)["spec"]["replicas"] == 3 and ("patch", "InferenceService") in kube.requests
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 2
    assert rt.queue.get(0) == ("ml", "chat")  # queued again: its next reconcile scales the Deployment
    rt.reconcile("ml", "chat")
    assert kube.objects[("Deployment", "ml", "chat")]["spec"]["replicas"] == 3
