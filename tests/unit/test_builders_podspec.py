"""The pod as real clusters need it: rollout strategy, the PodDisruptionBudget child, the preStop sleep and the
grace period around the server's drain, /dev/shm, extra server flags, the overlay in the Deployment; and a
Deployment's ReplicaFailure in the Ready condition."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from metronome.contract.serve_flags import OPERATOR_OWNED
from metronome.operator import builders
from metronome.operator.spec import ShutdownSpec, SpecError, StrategySpec, parse_service
from metronome.operator.status import Rollout, ready_condition, rollout_of

ROOT = Path(__file__).resolve().parents[2]


def body(**spec) -> dict:
    return {
        "apiVersion": "metronome.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-1", "generation": 2},
        "spec": {"model": {"source": "default"}, "replicas": 2, **spec},
    }


def service_of(**spec):
    return parse_service(body(**spec))


def pod_of(**spec) -> dict:
    return builders.deployment(service_of(**spec))["spec"]["template"]["spec"]


def server_of(**spec) -> dict:
    return next(c for c in pod_of(**spec)["containers"] if c["name"] == "server")


def children_kinds(**spec) -> list[str]:
    return [c["kind"] for c in builders.workload_children(service_of(**spec))]


# --- rollout strategy ----------------------------------------------------------------------------------------


def test_default_strategy_surges_one_pod_and_keeps_every_replica():
    strategy = builders.deployment(service_of())["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert (StrategySpec().max_surge, StrategySpec().max_unavailable) == (1, 0)


@pytest.mark.parametrize(("given", "expected"), [
    ({"maxSurge": 0, "maxUnavailable": 1}, {"maxSurge": 0, "maxUnavailable": 1}),  # a full GPU pool
    ({"maxSurge": "25%", "maxUnavailable": "25%"}, {"maxSurge": "25%", "maxUnavailable": "25%"}),
    ({"maxUnavailable": 2}, {"maxSurge": 1, "maxUnavailable": 2}),
])
def test_strategy_comes_from_the_spec(given, expected):
    rolling = builders.deployment(service_of(strategy=given))["spec"]["strategy"]["rollingUpdate"]
    assert rolling == expected


@pytest.mark.parametrize("given", [
    {"maxSurge": 0, "maxUnavailable": 0}, {"maxSurge": "0%", "maxUnavailable": 0}, {"maxSurge": 0},
    {"maxUnavailable": "150%"}, {"maxSurge": "many"}, {"maxSurge": -1}, {"maxSurge": True},
])
def test_bad_strategies_are_refused_naming_the_field(given):
    with pytest.raises(SpecError, match=r"^spec\.strategy"):
        service_of(strategy=given)


def test_a_strategy_change_rolls_nothing_by_itself():
    before = builders.deployment(service_of())
    after = builders.deployment(service_of(strategy={"maxSurge": 0, "maxUnavailable": 1}))
    assert before["spec"]["template"] == after["spec"]["template"]


# --- the PodDisruptionBudget ---------------------------------------------------------------------------------


def test_a_disruption_budget_by_default_one_pod_at_a_time():
    service = service_of()
    pdb = builders.pod_disruption_budget(service)
    assert children_kinds() == ["Deployment", "Service", "PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1" and pdb["metadata"]["name"] == "chat"
    assert pdb["metadata"]["ownerReferences"] == [service.owner_reference]
    assert pdb["spec"] == {
        "selector": builders.deployment(service)["spec"]["selector"],
        "maxUnavailable": 1,
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }


@pytest.mark.parametrize(("given", "budget"), [
    ({"maxUnavailable": "50%"}, {"maxUnavailable": "50%"}),
    ({"minAvailable": 1}, {"minAvailable": 1}),
    ({"minAvailable": "75%"}, {"minAvailable": "75%"}),
])
def test_the_budget_comes_from_the_spec(given, budget):
    spec = builders.pod_disruption_budget(service_of(disruption=given))["spec"]
    assert {k: v for k, v in spec.items() if k in ("maxUnavailable", "minAvailable")} == budget


def test_disabled_disruption_means_no_budget():
    assert "PodDisruptionBudget" not in children_kinds(disruption={"enabled": False})


@pytest.mark.parametrize("given", [{"maxUnavailable": 1, "minAvailable": 1}, {"minAvailable": "101%"},
                                   {"enabled": "no"}, {"maxUnavailable": "one"}])
def test_bad_budgets_are_refused_naming_the_field(given):
    with pytest.raises(SpecError, match=r"^spec\.disruption"):
        service_of(disruption=given)


# --- shutdown ------------------------------------------------------------------------------------------------


def test_pre_stop_sleep_then_drain_within_the_grace_period():
    server, pod = server_of(), pod_of()
    defaults = ShutdownSpec()
    assert server["lifecycle"] == {"preStop": {"sleep": {"seconds": defaults.pre_stop_sleep_seconds}}}
    assert server["args"][server["args"].index("--drain-seconds") + 1] == str(defaults.drain_seconds)
    assert pod["terminationGracePeriodSeconds"] == defaults.pre_stop_sleep_seconds + defaults.drain_seconds + 15
    assert defaults.pre_stop_sleep_seconds >= 5  # longer than kube-proxy's and most ingresses' propagation


def test_shutdown_comes_from_the_spec():
    shutdown = {"preStopSleepSeconds": 30, "drainSeconds": 120}
    server, pod = server_of(shutdown=shutdown), pod_of(shutdown=shutdown)
    assert server["lifecycle"]["preStop"]["sleep"]["seconds"] == 30
    assert server["args"][server["args"].index("--drain-seconds") + 1] == "120"
    assert pod["terminationGracePeriodSeconds"] == 30 + 120 + 15


def test_no_pre_stop_hook_when_the_sleep_is_zero():
    server = server_of(shutdown={"preStopSleepSeconds": 0, "drainSeconds": 0})
    assert "lifecycle" not in server and pod_of(shutdown={"preStopSleepSeconds": 0, "drainSeconds": 0})[
        "terminationGracePeriodSeconds"] == 15


def test_negative_shutdown_times_are_refused():
    with pytest.raises(SpecError, match=r"^spec\.shutdown\.drainSeconds"):
        service_of(shutdown={"drainSeconds": -1})


# --- /dev/shm and extra flags --------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [0, 1, 4])
def test_every_pod_gets_a_bounded_shared_memory(gpus):
    pod = pod_of(resources={"gpus": gpus})
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server_of(resources={"gpus": gpus})["volumeMounts"]


def test_extra_args_are_appended_and_parsed_by_the_server():
    from metronome.server.api import serve_cli

    args = server_of(engine={"extraArgs": ["--log-level", "debug", "--config-poll-seconds=2"]})["args"]
    assert args[-3:] == ["--log-level", "debug", "--config-poll-seconds=2"]
    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    parsed = parser.parse_args(args[1:])
    assert (parsed.log_level, parsed.config_poll_seconds) == ("debug", 2.0)


@pytest.mark.parametrize("arg", ["--port", "--model=x", "--drain-seconds=5", "--dtype"])
def test_extra_args_may_not_repeat_the_operators_flags(arg):
    with pytest.raises(SpecError, match=r"^spec\.engine\.extraArgs\[1\]"):
        service_of(engine={"extraArgs": ["--log-level=debug", arg]})


def test_owned_flags_are_what_the_builder_writes_and_the_crd_refuses():
    full = service_of(model={"source": "default", "maxModelLen": 4096, "quantization": "fp8"}, resources={"gpus": 2},
                      engine={"blockSize": 16, "attentionBackend": "torch", "maxWaiting": 8, "kvCacheDtype": "fp8",
                              "maxRequestBodyBytes": 65536, "maxWaitingPerClient": 2, "maxRunningPerClient": 4,
                              "maxPromptTokensPerSecondPerClient": 1000, "promptTokenBurstPerClient": 4000})
    written = {a for a in builders.server_args(full) if a.startswith("--")}
    assert written == set(OPERATOR_OWNED)
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    (rule,) = engine["properties"]["extraArgs"]["x-kubernetes-validations"]
    listed = re.findall(r"'(--[a-z-]+)'", rule["rule"])
    assert listed == list(OPERATOR_OWNED)
    assert re.findall(r"'(--[a-z-]+)='", rule["rule"]) == list(OPERATOR_OWNED)


def test_precision_fields_become_server_flags_and_bad_values_name_the_field():
    from metronome.contract.precision import KV_CACHE_DTYPES, QUANTIZATIONS

    args = builders.server_args(service_of(model={"source": "default", "quantization": "fp8"},
                                           engine={"kvCacheDtype": "fp8"}))
    assert args[args.index("--quantization") + 1] == "fp8" and args[args.index("--kv-cache-dtype") + 1] == "fp8"
    plain = builders.server_args(service_of())
    assert "--quantization" not in plain and "--kv-cache-dtype" not in plain  # the server's own defaults
    with pytest.raises(SpecError, match=r"^spec\.model\.quantization: must be one of fp8, got 'int4'"):
        service_of(model={"source": "default", "quantization": "int4"})
    with pytest.raises(SpecError, match=r"^spec\.engine\.kvCacheDtype: must be one of auto, bf16, fp8"):
        service_of(engine={"kvCacheDtype": "fp16"})
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert tuple(spec["model"]["properties"]["quantization"]["enum"]) == QUANTIZATIONS
    assert tuple(spec["engine"]["properties"]["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES


def test_a_token_burst_needs_a_token_rate():
    with pytest.raises(SpecError, match=r"^spec\.engine\.promptTokenBurstPerClient: needs "
                                        r"maxPromptTokensPerSecondPerClient"):
        service_of(engine={"promptTokenBurstPerClient": 4000})


def test_the_crd_defaults_are_the_operators():
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    strategy, shutdown = StrategySpec(), ShutdownSpec()
    assert spec["strategy"]["properties"]["maxSurge"]["default"] == strategy.max_surge
    assert spec["strategy"]["properties"]["maxUnavailable"]["default"] == strategy.max_unavailable
    assert spec["shutdown"]["properties"]["preStopSleepSeconds"]["default"] == shutdown.pre_stop_sleep_seconds
    assert spec["shutdown"]["properties"]["drainSeconds"]["default"] == shutdown.drain_seconds
    assert spec["resources"]["properties"]["shmSize"]["default"] == "1Gi" == service_of().spec.resources.shm_size


# --- the overlay in the Deployment ---------------------------------------------------------------------------


def test_the_example_overlay_reaches_the_deployment_and_rolls_the_pods():
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice-podtemplate.yaml").read_text())
    example["metadata"]["namespace"] = "ml"
    service = parse_service(example)
    template = builders.deployment(service)["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert template["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    server = next(c for c in template["spec"]["containers"] if c["name"] == "server")
    assert {"name": "hf-token", "mountPath": "/var/run/secrets/hf", "readOnly": True} in server["volumeMounts"]
    without = dict(example, spec={k: v for k, v in example["spec"].items() if k != "podTemplate"})
    assert builders.deployment(parse_service(without))["spec"]["template"] != template


# --- ReplicaFailure ------------------------------------------------------------------------------------------


def deployment_with(*conditions: dict, ready: int = 1) -> dict:
    return {"metadata": {"generation": 3},
            "status": {"observedGeneration": 3, "replicas": ready, "readyReplicas": ready, "updatedReplicas": ready,
                       "availableReplicas": ready, "conditions": list(conditions)}}


QUOTA = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
         "message": 'pods "chat-7d9-x" is forbidden: exceeded quota: gpu-quota, requested: pods=1, limited: pods=1'}


def test_replica_failure_is_why_the_service_is_not_ready():
    rollout = rollout_of(deployment_with(QUOTA), desired=2)
    status, reason, message = ready_condition(rollout, pods=())
    assert (status, reason) == ("False", "ReplicaFailure")
    assert message.startswith("1/2 server pods ready; FailedCreate: pods") and "exceeded quota: gpu-quota" in message


def test_a_cleared_replica_failure_says_nothing():
    cleared = {**QUOTA, "status": "False"}
    assert rollout_of(deployment_with(cleared), desired=2).replica_failure is None
    # The Deployment controller may create the missing pod now: it is on its way, not failing.
    assert ready_condition(rollout_of(deployment_with(cleared), desired=2), pods=())[1] == "PodsStarting"


def test_replica_failure_outranks_pod_problems():
    pending = {"metadata": {"name": "chat-1"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes"}]}}
    rollout = Rollout(desired=2, replicas=1, ready=1, updated=1, available=1, current=True, deadline_exceeded=False,
                      replica_failure="FailedCreate: admission webhook denied the request")
    assert ready_condition(rollout, pods=(pending,))[1] == "ReplicaFailure"
