"""Progressing after an API-server outage: pods the node controller marked not ready while the control plane was
away start no rollout. Progressing follows the Deployment controller's own verdict; Ready carries the pods."""
from __future__ import annotations

from test_status import T0, T1, conditions_by_type, service

from metronome.operator.status import Observed, compute_status


def deployment(available: int, progressing_reason: str | None, *, updated: int = 2, replicas: int = 2,
               generation: int = 1, observed: int = 1) -> dict:
    conditions = [{"type": "Available", "status": "True" if available >= 2 else "False",
                   "reason": "MinimumReplicasAvailable" if available >= 2 else "MinimumReplicasUnavailable"}]
    if progressing_reason:
        conditions.append({"type": "Progressing", "status": "True", "reason": progressing_reason})
    return {"metadata": {"generation": generation},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": available,
                       "availableReplicas": available, "updatedReplicas": updated, "conditions": conditions}}


def conditions(dep: dict, previous=()) -> dict:
    return conditions_by_type(compute_status(service(), Observed(deployment=dep), now=T1, previous_conditions=previous))


def test_pods_unready_after_a_finished_rollout_are_not_a_rollout():
    after_outage = conditions(deployment(0, "NewReplicaSetAvailable"))
    assert after_outage["Progressing"]["status"] == "False"
    assert after_outage["Progressing"]["reason"] == "RolloutComplete"
    assert "2 pods on the current template, 0 available" in after_outage["Progressing"]["message"]
    assert (after_outage["Ready"]["status"], after_outage["Ready"]["reason"]) == ("False", "ReplicasNotReady")
    assert after_outage["Ready"]["message"] == "0/2 server pods ready"


def test_a_stale_rolling_out_from_before_the_outage_is_replaced():
    before = [{"type": "Progressing", "status": "True", "reason": "RollingOut", "message": "1/2 pods",
               "lastTransitionTime": T0}]
    now = conditions(deployment(2, "NewReplicaSetAvailable"), before)
    assert (now["Progressing"]["status"], now["Progressing"]["reason"]) == ("False", "Stable")
    assert now["Progressing"]["lastTransitionTime"] == T1
    assert now["Ready"]["status"] == "True"


def test_a_real_rollout_still_progresses():
    # The controller is rolling a new template: ReplicaSetUpdated, or the counts are not all on the template yet.
    assert conditions(deployment(1, "ReplicaSetUpdated"))["Progressing"]["reason"] == "RollingOut"
    assert conditions(deployment(2, "NewReplicaSetAvailable", updated=1, replicas=3))["Progressing"]["status"] == "True"
    # A spec the controller has not observed yet is a rollout about to start, whatever its old verdict says.
    assert conditions(deployment(0, "NewReplicaSetAvailable", generation=2))["Progressing"]["reason"] == "RollingOut"
    assert conditions(deployment(0, None))["Progressing"]["reason"] == "RollingOut"
