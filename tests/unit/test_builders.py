"""Pure builders: spec → Deployment / Service / ConfigMap / PodMonitor, and the server.yaml generation rules
(configmap.py)."""
from __future__ import annotations

import copy

import pytest

from metronome.contract.config import QueuePolicy, ServerConfigFile, next_server_config, parse_server_config
from metronome.operator import builders, configmap
from metronome.operator.alerts import RuleSettings
from metronome.operator.changes import describe_child, describe_config
from metronome.operator.spec import SpecError, parse_service, parse_source
from metronome.operator.tuning.actuation import scheduler_for
from metronome.operator.tuning.decision import Decision


def retuned(config: ServerConfigFile, chunk_size: int, queue_policy: str | None = None) -> ServerConfigFile:
    """What the control loop serves after a decision: actuation.scheduler_for, then the next generation."""
    decision = Decision(chunk_size=chunk_size, queue_policy=queue_policy or config.scheduler.queue_policy.value,
                        replicas=1, reason="test", changed=True)
    return next_server_config(config, scheduler_for(decision, config.scheduler))


def make_body(**spec_overrides) -> dict:
    spec = {"model": {"source": "default"}, "replicas": 2, "server": {"chunkSize": 512}}
    spec.update(spec_overrides)
    return {
        "apiVersion": "metronome.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-123", "generation": 4},
        "spec": spec,
    }


def service_of(**spec_overrides):
    return parse_service(make_body(**spec_overrides))


def container_of(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- what rolls and what does not ---------------------------------------------------------------------------


def test_scheduler_changes_leave_the_pod_template_untouched():
    before = builders.deployment(service_of(server={"chunkSize": 512, "queuePolicy": "split"}))
    after = builders.deployment(
        service_of(server={"chunkSize": 128, "queuePolicy": "sjf", "maxNumSeqs": 64, "longChunkSize": 64})
    )
    assert before == after


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"source": "random:tiny"}},
        {"model": {"source": "default", "dtype": "float16"}},
        {"image": "registry.example/metronome-server:9.9"},
        {"resources": {"gpus": 2}},
        {"engine": {"blockSize": 256}},
    ],
)
def test_restart_fields_change_the_pod_template(change):
    before = builders.deployment(service_of())
    after = builders.deployment(service_of(**change))
    assert before["spec"]["template"] != after["spec"]["template"]


def test_replicas_change_the_deployment_but_not_its_template():
    two, three = builders.deployment(service_of(replicas=2)), builders.deployment(service_of(replicas=3, maxReplicas=4))
    assert (two["spec"]["replicas"], three["spec"]["replicas"]) == (2, 3)
    assert two["spec"]["template"] == three["spec"]["template"]


# --- the server pod ------------------------------------------------------------------------------------------


def test_server_command_line():
    model = {"source": "random:llama-3-8b", "dtype": "bfloat16", "maxModelLen": 8192}
    container = container_of(builders.deployment(service_of(resources={"gpus": 4}, model=model)))
    assert container["command"] == ["metronome"]
    args = container["args"]
    assert args[0] == "serve"
    pairs = dict(zip(args[1::2], args[2::2]))
    assert pairs["--model"] == "random:llama-3-8b"
    assert pairs["--served-model-name"] == "chat"
    assert pairs["--config"] == "/etc/metronome/server.yaml"
    assert pairs["--port"] == "8000"
    assert pairs["--device"] == "cuda"
    assert pairs["--dtype"] == "bfloat16"
    assert pairs["--max-model-len"] == "8192"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_default_model_and_cpu_pods_ask_for_no_gpu():
    container = container_of(builders.deployment(service_of(resources={"gpus": 0})))
    assert container["args"][container["args"].index("--model") + 1] == "default"
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"model": {"source": "pvc:weights/llama", "dtype": "float16", "maxModelLen": 4096}, "resources": {"gpus": 2},
         "engine": {"blockSize": 256, "attentionBackend": "flash_attn", "maxWaiting": 64,
                    "maxRequestBodyBytes": 1048576, "maxWaitingPerClient": 4, "maxRunningPerClient": 16,
                    "maxPromptTokensPerSecondPerClient": 5000, "promptTokenBurstPerClient": 20000}},
        {"engine": {"maxPromptTokensPerSecondPerClient": 800}},
        {"model": {"source": "gguf:/data/m.gguf"}, "resources": {"gpus": 0}},
    ],
)
def test_the_server_parser_accepts_the_command_line(spec):
    """The contract with `metronome serve`: its own argument parser takes every flag the operator writes."""
    import argparse

    from metronome.server.api import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    args = container_of(builders.deployment(service_of(**spec)))["args"]
    parsed = parser.parse_args(args[1:])
    assert parsed.config == "/etc/metronome/server.yaml" and parsed.port == 8000
    engine = spec.get("engine", {})
    assert (parsed.max_request_body_bytes, parsed.max_waiting_per_client, parsed.max_running_per_client) == (
        engine.get("maxRequestBodyBytes", parser.get_default("max_request_body_bytes")),
        engine.get("maxWaitingPerClient"), engine.get("maxRunningPerClient"))
    assert (parsed.max_prompt_tokens_per_second_per_client, parsed.prompt_token_burst_per_client) == (
        engine.get("maxPromptTokensPerSecondPerClient"), engine.get("promptTokenBurstPerClient"))


def test_probes_ports_and_prometheus_annotations():
    deployment = builders.deployment(service_of())
    container = container_of(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics"}


def test_restricted_security_context_with_writable_tmp():
    deployment = builders.deployment(service_of())
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert next(v for v in pod["volumes"] if v["name"] == tmp["name"]) == {"name": "tmp", "emptyDir": {}}


def test_config_volume_mounts_the_configmap_read_only():
    deployment = builders.deployment(service_of())
    pod = deployment["spec"]["template"]["spec"]
    config = next(v for v in pod["volumes"] if v["name"] == "config")
    assert config["configMap"]["name"] == "chat-config"
    mount = next(m for m in container_of(deployment)["volumeMounts"] if m["name"] == "config")
    assert mount == {"name": "config", "mountPath": "/etc/metronome", "readOnly": True}


@pytest.mark.parametrize(
    ("source", "volume", "mount_path", "model_arg"),
    [
        ("pvc:weights/llama-3-8b", {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}, "/models",
         "/models/llama-3-8b"),
        ("pvc:weights", {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}, "/models", "/models"),
        ("gguf:/data/smol.gguf", {"hostPath": {"path": "/data/smol.gguf", "type": "File"}}, "/models/smol.gguf",
         "/models/smol.gguf"),
        ("hf-dir:/data/llama", {"hostPath": {"path": "/data/llama", "type": "Directory"}}, "/models", "/models"),
        ("random:tiny", {"emptyDir": {}}, "/models", "random:tiny"),
    ],
)
def test_model_volume_follows_the_source(source, volume, mount_path, model_arg):
    deployment = builders.deployment(service_of(model={"source": source}))
    pod = deployment["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "model") == {"name": "model", **volume}
    container = container_of(deployment)
    assert next(m for m in container["volumeMounts"] if m["name"] == "model")["mountPath"] == mount_path
    assert container["args"][container["args"].index("--model") + 1] == model_arg


def test_multi_gpu_pods_get_shared_memory():
    pod = builders.deployment(service_of(resources={"gpus": 2, "shmSize": "16Gi"}))["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in pod["volumes"]


def test_node_selector_and_tolerations_pass_through():
    pod = builders.deployment(
        service_of(resources={"nodeSelector": {"nvidia.com/gpu.product": "H200"},
                              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    )["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H200"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


# --- every child ---------------------------------------------------------------------------------------------


def test_every_child_is_owned_by_the_inferenceservice_and_labelled():
    service = service_of()
    config = next_server_config(None, service.spec.server)
    service = service_of(slo={"tbtP99Ms": 40})
    children = [*builders.workload_children(service, monitored=True, rules=RuleSettings()),
                builders.config_map(service, config)]
    assert {c["kind"] for c in children} == {"Deployment", "Service", "PodDisruptionBudget", "PodMonitor", "ConfigMap",
                                             "PrometheusRule"}
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner == {
            "apiVersion": "metronome.dev/v1alpha1", "kind": "InferenceService", "name": "chat", "uid": "uid-123",
            "controller": True, "blockOwnerDeletion": True,
        }
        assert child["metadata"]["namespace"] == "ml"
        assert child["metadata"]["labels"]["metronome.dev/inferenceservice"] == "chat"


def test_pod_monitor_and_slo_rule_only_when_asked_for():
    kinds = [c["kind"] for c in builders.workload_children(service_of(), rules=RuleSettings())]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget"]  # no monitor; no SLO, no rule


def test_pod_monitor_labels_series_as_the_metrics_source_selects_them():
    children = builders.workload_children(service_of(metrics={"windowSeconds": 60}), monitored=True)
    monitor = children[-1]
    assert monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"] == builders.selector_labels("chat")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("http", "/metrics", "3s")
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets == {"namespace": ["__meta_kubernetes_namespace"], "pod": ["__meta_kubernetes_pod_name"]}
    # The service's series are told apart by the server's own `model` label: its --served-model-name.
    args = builders.server_args(service_of())
    assert args[args.index("--served-model-name") + 1] == "chat"


def test_pod_monitor_carries_the_monitor_labels_and_interval():
    monitor = builders.pod_monitor(service_of(), {"release": "kube-prometheus-stack"}, interval_seconds=30)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"][builders.LABEL_SERVICE] == "chat"  # ours are kept
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "30s")


@pytest.mark.parametrize("window, interval", [(10, 1), (20, 1), (60, 3), (120, 7), (600, 15)])
def test_scrape_interval_gives_each_sub_window_four_samples(window, interval):
    assert builders.scrape_interval_seconds(window) == interval
    monitor = builders.pod_monitor(service_of(metrics={"windowSeconds": window}))
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == f"{interval}s"


def test_service_and_deployment_select_the_same_pods():
    service = service_of()
    deployment = builders.deployment(service)
    kube_service = builders.kube_service(service)
    assert kube_service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert kube_service["spec"]["selector"].items() <= template_labels.items()
    assert kube_service["spec"]["ports"][0]["targetPort"] == "http"


# --- server.yaml ---------------------------------------------------------------------------------------------


def test_config_map_round_trips_through_the_server_schema():
    service = service_of(server={"chunkSize": 256, "queuePolicy": "sjf", "maxNumSeqs": 32})
    config = next_server_config(None, service.spec.server)
    cm = builders.config_map(service, config)
    parsed = parse_server_config(cm["data"]["server.yaml"])
    assert parsed == config
    assert (parsed.generation, parsed.scheduler.chunk_size, parsed.scheduler.queue_policy) == (1, 256, QueuePolicy.SJF)
    assert cm["metadata"]["annotations"]["metronome.dev/config-generation"] == "1"
    assert configmap.read_server_config(cm) == config


def test_generation_moves_only_when_the_scheduler_changes():
    first = next_server_config(None, service_of().spec.server)
    assert next_server_config(first, service_of().spec.server) is first
    second = next_server_config(first, service_of(server={"chunkSize": 256}).spec.server)
    assert second.generation == first.generation + 1
    tuned = retuned(second, 128, "fcfs")
    assert (tuned.generation, tuned.scheduler.chunk_size, tuned.scheduler.queue_policy) == (3, 128, QueuePolicy.FCFS)
    assert retuned(tuned, 128) is tuned


def test_invalid_server_yaml_in_the_configmap_is_reported_not_raised():
    cm = {"metadata": {"name": "chat-config"}, "data": {"server.yaml": "scheduler: {chunk_size: -3}"}}
    config, error = configmap.safe_read_server_config(cm)
    assert config is None and "chat-config" in error and "chunk_size" in error
    assert configmap.safe_read_server_config(None) == (None, None)


def test_events_describe_what_changed():
    first = next_server_config(None, service_of().spec.server)
    second = retuned(first, 256)
    event = describe_config(first, second, "spec.server changed")
    assert event.reason == "ConfigUpdated" and "chunkSize 512 -> 256" in event.message and "1 -> 2" in event.message
    assert describe_config(second, second, "again") is None
    before = builders.deployment(service_of())
    after = builders.deployment(service_of(image="other:1"))
    assert describe_child(False, before, after).reason == "RollingUpdate"
    scaled = builders.deployment(service_of(replicas=3, maxReplicas=4))
    assert describe_child(False, before, scaled).reason == "Scaled"
    assert describe_child(False, before, before) is None
    assert describe_child(True, None, before).reason == "Created"
    assert describe_child(False, None, after) is None  # nothing known of before: no claim
    # A status written meanwhile, a label or a fingerprint is not a change of the child.
    moved = {**before, "metadata": {**before["metadata"], "labels": {"x": "y"}}, "status": {"readyReplicas": 2}}
    assert describe_child(False, before, moved) is None


# --- parsing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source", ["", "gguf:relative.gguf", "hf-dir:models/x", "gs://bucket/model", "pvc:Bad_Claim/x", "random:"]
)
def test_bad_model_sources_raise_spec_errors(source):
    with pytest.raises(SpecError, match="spec.model.source"):
        parse_source(source)


@pytest.mark.parametrize(
    ("spec_change", "field"),
    [
        ({"replicas": "two"}, "spec.replicas"),
        ({"resources": {"gpus": True}}, "spec.resources.gpus"),
        ({"server": {"chunkSize": 0}}, "spec.server"),
        ({"server": {"queuePolicy": "lifo"}}, "spec.server"),
        ({"slo": {"ttftP99Ms": 100}}, "spec.slo.tbtP99Ms"),
        ({"autotune": "apply"}, "spec.autotune"),
    ],
)
def test_wrong_fields_raise_spec_errors_naming_them(spec_change, field):
    with pytest.raises(SpecError, match=field.replace(".", r"\.")):
        service_of(**spec_change)


def test_builders_do_not_mutate_their_input():
    body = make_body(resources={"nodeSelector": {"a": "b"}})
    snapshot = copy.deepcopy(body)
    builders.deployment(parse_service(body))
    assert body == snapshot


def test_a_deployment_never_carries_config_content():
    service = service_of(server={"chunkSize": 777})
    text = repr(builders.deployment(service))
    assert "777" not in text and "generation" not in text


def test_server_config_file_is_the_shared_schema():
    service = service_of(server={"chunkSize": 300, "shortPromptThreshold": 256, "shortChunkSize": 1024})
    config = next_server_config(None, service.spec.server)
    assert isinstance(config, ServerConfigFile)
    assert config.scheduler.short_prompt_threshold == 256
