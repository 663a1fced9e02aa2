"""Pure builders: an InferenceService → the objects that serve it (Deployment, Service, ConfigMap, PodMonitor,
PodDisruptionBudget; its SLO PrometheusRule is alerts.py's, the InferencePool inference_pool.py's).
What server.yaml holds is configmap.py's, which generation comes next metronome.contract.config's.

No API calls here. Two rules shape the output:
- The pod template depends only on what needs a restart (model, image, resources, engine flags). The scheduler
  settings live in the ConfigMap, which the servers reload; nothing derived from them (no hash, no generation)
  enters the template, so a `spec.server` change never rolls the pods.
- Every object carries an owner reference to the InferenceService, so deleting it garbage-collects them.
"""
from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metronome.contract import serve_flags as flag
from metronome.contract.config import ServerConfigFile
from metronome.contract.metric_names import PICKER_ENGINE_TYPE, PICKER_ENGINE_TYPE_LABEL_KEYS
from metronome.operator import model_fetch
from metronome.operator.alerts import RuleSettings, prometheus_rule
from metronome.operator.configmap import (
    ANNOTATION_CONFIG_GENERATION,
    ANNOTATION_SPEC_SERVER,
    CONFIG_DIR,
    CONFIG_KEY,
    CONFIG_PATH,
    Rendered,
    render,
    spec_server_digest,
)
from metronome.operator.metrics_source import QueryWindow, podmonitor_relabelings
from metronome.operator.pod_template import merge as merge_overlay
from metronome.operator.spec import InferenceService, InferenceServiceSpec

SERVER_PORT = 8000
MODEL_DIR = "/models"
SERVER_CONTAINER = "server"
RUN_AS_USER = 1000
GPU_RESOURCE = "nvidia.com/gpu"

LABEL_SERVICE = "metronome.dev/inferenceservice"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
MANAGED_BY = "metronome-operator"

PODMONITOR_API_VERSION = "monitoring.coreos.com/v1"
PODMONITOR_CRD = "podmonitors.monitoring.coreos.com"


@dataclass(frozen=True)
class ChildNames:
    deployment: str
    service: str
    config_map: str
    pod_monitor: str
    disruption_budget: str
    prometheus_rule: str


def child_names(name: str) -> ChildNames:
    return ChildNames(deployment=name, service=name, config_map=f"{name}-config", pod_monitor=name,
                      disruption_budget=name, prometheus_rule=name)


def selector_labels(name: str) -> dict[str, str]:
    """Immutable once the Deployment exists: never add to these."""
    return {LABEL_NAME: "metronome-server", LABEL_SERVICE: name}


def labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: "server",
        LABEL_PART_OF: "metronome",
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def pod_labels(name: str) -> dict[str, str]:
    """The server pods' labels: the children's, and the engine type an endpoint picker reads their metrics by
    (vLLM's names: the server exports them, metric_names.PICKER_ALIASES)."""
    return {**labels(name), **{key: PICKER_ENGINE_TYPE for key in PICKER_ENGINE_TYPE_LABEL_KEYS}}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def _metadata(service: InferenceService, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": service.namespace,
        "labels": labels(service.name),
        "ownerReferences": [service.owner_reference],
        **extra,
    }


# --- the ConfigMap (its content: configmap.py) ----------------------------------------------------------


def config_map(service: InferenceService, config: ServerConfigFile | Rendered) -> dict[str, Any]:
    """The ConfigMap serving `config` (or a rendering of it the caller keeps)."""
    rendered = config if isinstance(config, Rendered) else render(config)
    names = child_names(service.name)
    # Which spec.server this config descends from: a different one in the spec is a change to serve.
    annotations = {ANNOTATION_CONFIG_GENERATION: str(rendered.config.generation),
                   ANNOTATION_SPEC_SERVER: spec_server_digest(service.spec.server)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(service, names.config_map, annotations=annotations),
        "data": {CONFIG_KEY: rendered.text},
    }


# --- the server pod ------------------------------------------------------------------------------------------


def model_argument_and_volume(spec: InferenceServiceSpec) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """What to pass as --model, the `model` volume and its mount."""
    source = spec.model.source
    mount = {"name": "model", "mountPath": MODEL_DIR, "readOnly": True}
    if source.kind == "gguf":
        file_name = posixpath.basename(source.value)
        volume = {"name": "model", "hostPath": {"path": source.value, "type": "File"}}
        path = f"{MODEL_DIR}/{file_name}"
        return path, volume, {**mount, "mountPath": path}
    if source.kind == "hf-dir":
        return MODEL_DIR, {"name": "model", "hostPath": {"path": source.value, "type": "Directory"}}, mount
    if model_fetch.is_remote(spec.model):  # downloaded by the init container into the cache volume
        return source.value, model_fetch.cache_volume(spec.model), mount
    if source.kind == "pvc":
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True}}
        path = posixpath.join(MODEL_DIR, source.value) if source.value else MODEL_DIR
        return path, volume, mount
    # default (the GGUF inside the image) / random:<preset>: nothing to mount; a writable scratch folder instead.
    scratch = {"name": "model", "emptyDir": {}}
    argument = "default" if source.kind == "default" else f"random:{source.value}"
    return argument, scratch, {**mount, "readOnly": False}


def server_args(service: InferenceService) -> list[str]:
    """`metronome serve` flags (named in metronome.contract.serve_flags; a unit test parses them with the server's
    own parser, server/api/serve_cli.py). Clients and metrics name the model after the InferenceService."""
    spec = service.spec
    model_argument, _, _ = model_argument_and_volume(spec)
    aliases = [name for name in spec.model.served_names if name != service.name]  # spec.model.servedNames
    args = ["serve", flag.MODEL, model_argument, flag.SERVED_MODEL_NAME, service.name, *aliases]
    args += [flag.CONFIG, CONFIG_PATH, flag.HOST, "0.0.0.0", flag.PORT, str(SERVER_PORT)]
    args += [flag.DEVICE, "cuda" if spec.resources.gpus > 0 else "cpu", flag.DTYPE, spec.model.dtype]
    engine = spec.engine
    optional = ((flag.MAX_MODEL_LEN, spec.model.max_model_len), (flag.BLOCK_SIZE, engine.block_size),
                (flag.ATTENTION_BACKEND, None if engine.attention_backend == "auto" else engine.attention_backend),
                (flag.QUANTIZATION, spec.model.quantization),
                (flag.KV_CACHE_DTYPE, None if engine.kv_cache_dtype == "auto" else engine.kv_cache_dtype),
                (flag.MAX_WAITING, engine.max_waiting), (flag.MAX_REQUEST_BODY_BYTES, engine.max_request_body_bytes),
                (flag.MAX_WAITING_PER_CLIENT, engine.max_waiting_per_client),
                (flag.MAX_RUNNING_PER_CLIENT, engine.max_running_per_client),
                (flag.MAX_PROMPT_TOKENS_PER_SECOND_PER_CLIENT, engine.max_prompt_tokens_per_second_per_client),
                (flag.PROMPT_TOKEN_BURST_PER_CLIENT, engine.prompt_token_burst_per_client))
    for option, value in optional:
        if value is not None:
            args += [option, str(value)]
    if spec.resources.gpus > 1:  # one tensor-parallel rank per GPU of the pod
        args += [flag.TENSOR_PARALLEL_SIZE, str(spec.resources.gpus)]
    args += [flag.DRAIN_SECONDS, str(spec.shutdown.drain_seconds)]
    return args + list(spec.engine.extra_args)


def _resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, str] = {"cpu": res.cpu, "memory": res.memory}
    limits: dict[str, str] = {"memory": res.memory}
    if res.gpus > 0:
        # Extended resources are set as limits; the request defaults to the same number.
        limits[GPU_RESOURCE] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


SCRAPE_ANNOTATIONS = {"prometheus.io/scrape": "true", "prometheus.io/port": str(SERVER_PORT),
                      "prometheus.io/path": "/metrics"}


def pod_template(service: InferenceService, scrape_annotations: bool = True) -> dict[str, Any]:
    """The server pod. `scrape_annotations`: the prometheus.io/* annotations an annotation-discovering Prometheus
    scrapes by (--scrape-annotations; off while a monitor scrapes the pods, which would count every pod twice)."""
    spec = service.spec
    names = child_names(service.name)
    _, model_volume, model_mount = model_argument_and_volume(spec)
    volumes = [
        {"name": "config", "configMap": {"name": names.config_map, "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]}},
        model_volume,
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        model_mount,
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    # The container runtime's /dev/shm is 64 MiB; NCCL between tensor-parallel ranks and torch's IPC need more. In
    # memory, bounded: what it holds counts against the container's memory limit.
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": SERVER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["metronome"],
        "args": server_args(service),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        # A crash says why in the pod's status (and so in Ready): the end of the log when no message was written.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": [
            # The root filesystem is read-only: every cache goes to /tmp.
            {"name": "HOME", "value": "/tmp"},
            {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
            {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"},
            {"name": "TRITON_CACHE_DIR", "value": "/tmp/.cache/triton"},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            # spec.apiKeySecret: the kubelet resolves the key; the operator never reads the Secret
            *([{"name": "METRONOME_API_KEY", "valueFrom": {"secretKeyRef": {
                "name": spec.api_key_secret.name, "key": spec.api_key_secret.key}}}] if spec.api_key_secret else []),
        ],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        # Loading weights can take minutes: liveness starts only once the startup probe has passed.
        "startupProbe": _http_probe("/health", period=10, failures=180),
        "livenessProbe": _http_probe("/health", period=10, failures=3),
        "readinessProbe": _http_probe("/ready", period=5, failures=3),
        **_lifecycle(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,  # the server never talks to the API
        "enableServiceLinks": False,
        # preStop sleep, then SIGTERM and the server's drain (--drain-seconds), then its own shutdown.
        "terminationGracePeriodSeconds": spec.shutdown.grace_period_seconds,
    }
    if model_fetch.is_remote(spec.model):
        container["env"].append(model_fetch.server_cache_env(MODEL_DIR))
        pod_spec["initContainers"] = [model_fetch.fetch_init_container(spec.model, container, MODEL_DIR)]
    if spec.resources.node_selector:
        pod_spec["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.resources.tolerations:
        pod_spec["tolerations"] = [t.to_k8s() for t in spec.resources.tolerations]
    metadata: dict[str, Any] = {"labels": pod_labels(service.name)}
    if scrape_annotations:
        metadata["annotations"] = dict(SCRAPE_ANNOTATIONS)
    built = {"metadata": metadata, "spec": pod_spec}
    return merge_overlay(built, spec.pod_template, selector_labels(service.name))


def _lifecycle(spec: InferenceServiceSpec) -> dict[str, Any]:
    """A terminating pod leaves the Service's endpoints at once, but kube-proxy, ingresses and cloud load balancers
    learn it only seconds later: keep serving that long before SIGTERM (the kubelet's own sleep action, so the
    image needs no `sleep` binary; Kubernetes >= 1.30)."""
    seconds = spec.shutdown.pre_stop_sleep_seconds
    return {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}} if seconds > 0 else {}


def deployment(service: InferenceService, scrape_annotations: bool = True) -> dict[str, Any]:
    names = child_names(service.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(service, names.deployment),
        "spec": {
            "replicas": service.spec.replicas,
            "selector": {"matchLabels": selector_labels(service.name)},
            # spec.strategy; by default one new pod comes up before an old one goes (maxSurge 1, maxUnavailable 0).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {
                "maxSurge": service.spec.strategy.max_surge,
                "maxUnavailable": service.spec.strategy.max_unavailable,
            }},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            "template": pod_template(service, scrape_annotations),
        },
    }


def kube_service(service: InferenceService) -> dict[str, Any]:
    names = child_names(service.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(service, names.service),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(service.name),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(service: InferenceService) -> dict[str, Any]:
    """How many server pods voluntary evictions (drains, upgrades, the cluster autoscaler) may take at once.
    Pods that are not ready (still loading, crash-looping) may always be evicted, so a broken rollout never
    blocks a node drain."""
    names = child_names(service.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(service, names.disruption_budget),
        "spec": {
            "selector": {"matchLabels": selector_labels(service.name)},
            **service.spec.disruption.budget,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def scrape_interval_seconds(window_seconds: float) -> int:
    """A scrape interval that gives every rate() of the metrics source (operator/metrics_source.py) enough samples:
    four per sub-window of the step fit, so 3 s for the default 60 s window, 1 s for short test windows, and
    never slower than Prometheus' customary 15 s."""
    sub_window = QueryWindow.for_window(window_seconds).sub_window_seconds
    return int(max(1, min(15, sub_window // 4)))


def pod_monitor(service: InferenceService, extra_labels: Mapping[str, str] | None = None,
                interval_seconds: float | None = None) -> dict[str, Any]:
    """prometheus-operator's PodMonitor: scrapes the server pods; their series carry the server's own `model`
    label, and namespace/pod, as the metrics source selects them. `extra_labels` (--monitor-label) are what a
    Prometheus selects monitors by; `interval_seconds` (--scrape-interval) overrides the window's own pick."""
    names = child_names(service.name)
    window = service.spec.metrics.window_seconds
    interval = int(interval_seconds) if interval_seconds else scrape_interval_seconds(window)
    metadata = _metadata(service, names.pod_monitor)
    metadata["labels"] = {**dict(extra_labels or {}), **metadata["labels"]}
    endpoint = {
        "port": "http",
        "path": "/metrics",
        "interval": f"{interval}s",
        "scrapeTimeout": f"{interval}s",
        "relabelings": podmonitor_relabelings(),
    }
    return {
        "apiVersion": PODMONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {"selector": {"matchLabels": selector_labels(service.name)}, "podMetricsEndpoints": [endpoint]},
    }


def workload_children(service: InferenceService, *, scrape_annotations: bool = True,
                      pod_monitor_labels: Mapping[str, str] | None = None,
                      scrape_interval_seconds: float | None = None, monitored: bool = False,
                      rules: RuleSettings | None = None) -> list[dict[str, Any]]:
    """Every child except the ConfigMap, whose content depends on what is served now (see next_server_config).
    `monitored`: write a PodMonitor (the cluster serves the kind and --monitor-kind asks for it); `rules`: write
    the SLO PrometheusRule (the cluster serves the kind and --slo-alerts asks for it)."""
    children = [deployment(service, scrape_annotations), kube_service(service)]
    if service.spec.disruption.enabled:
        children.append(pod_disruption_budget(service))
    if monitored:
        children.append(pod_monitor(service, pod_monitor_labels, scrape_interval_seconds))
    if rules is not None:
        rule = prometheus_rule(service, rules, _metadata(service, child_names(service.name).prometheus_rule))
        if rule is not None:
            children.append(rule)
    return children
