"""A typed view of an InferenceService: the CR body (a dict, camelCase) parsed into frozen dataclasses.

The API server has already validated and defaulted the object against crds/inferenceservice.yaml; the defaults
here are the CRD's (each written once, as a dataclass field default; tests/unit/test_crd_schema.py keeps the two
equal) so that bodies built by hand parse the same way. Anything that cannot be used raises SpecError naming the
field, never a KeyError. spec.autotune becomes the tuner's own `AutotuneSpec` (operator/tuning/settings.py), the
serve flags spec.engine.extraArgs may not repeat are the contract's (metronome.contract.serve_flags).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome import __version__
from metronome.contract import serve_flags
from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig, validate_scheduler
from metronome.contract.model_source import (
    DEFAULT,
    SCHEMES,
    ModelSource,
    ModelSourceError,
    parse_model_source,
    syntax,
)
from metronome.contract.precision import KV_CACHE_DTYPES, QUANTIZATIONS
from metronome.operator.experiment.settings import ExperimentSpec, parse_experiment
from metronome.operator.pod_template import PodOverlay, PodTemplateError, parse_overlay
from metronome.operator.routing_spec import RoutingSpec, parse_routing
from metronome.operator.spec_error import SpecError
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy

GROUP = "metronome.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

# The server image of services without spec.image, unless the operator's --server-image names another (the CRD
# leaves spec.image unset rather than defaulting it, so the operator can tell "not chosen" from a choice).
DEFAULT_IMAGE = f"ghcr.io/metronome-dev/metronome-server:{__version__}"
HOST_PATH_KINDS = ("gguf", "hf-dir")  # mounted from the node, so their paths are absolute


def parse_source(text: Any) -> ModelSource:
    """spec.model.source through the shared syntax (metronome.contract.model_source), with the operator's own
    rules on top: a scheme the operator serves, and absolute node paths for what it mounts through hostPath."""
    where = "spec.model.source"
    try:
        source = parse_model_source(text)
    except ModelSourceError as exc:
        raise SpecError(f"{where}: {exc}") from exc
    scheme = SCHEMES.get(source.kind)
    if source.kind != DEFAULT and (scheme is None or not scheme.operator):
        raise SpecError(f"{where}: {text!r} is not one of {syntax('operator')}")
    if source.kind in HOST_PATH_KINDS and not source.value.startswith("/"):
        raise SpecError(f"{where}: {source.kind} needs an absolute path on the node, got {source.value!r}")
    return source


@dataclass(frozen=True)
class SecretKey:
    """One key of a Secret in the service's namespace; the kubelet resolves it, the operator never reads it."""
    name: str
    key: str


@dataclass(frozen=True)
class ModelCacheSpec:
    """spec.model.cache: where an hf:// or s3:// source is downloaded."""
    claim_name: str | None = None  # a ReadWriteMany claim shared by the replicas; None = an emptyDir per pod
    size_limit: str | None = None  # that emptyDir's sizeLimit


@dataclass(frozen=True)
class S3Spec:
    """spec.model.s3: how an s3:// source is reached."""
    endpoint: str | None = None  # an S3-compatible server (MinIO, Ceph, R2, ...); None = AWS
    region: str | None = None
    credentials_secret: str | None = None  # None = the pod's own identity (web identity, instance role) or anonymous
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    dtype: str = "auto"
    max_model_len: int | None = None
    cache: ModelCacheSpec = field(default_factory=ModelCacheSpec)
    token_secret: SecretKey | None = None  # hf:// : the Hub token (HF_TOKEN)
    hf_endpoint: str | None = None  # hf:// : a mirror (HF_ENDPOINT)
    s3: S3Spec = field(default_factory=S3Spec)
    served_names: tuple[str, ...] = ()  # more names clients may use in `model` (after the service's own)
    quantization: str | None = None  # QUANTIZATIONS: on-the-fly FP8; None = as the checkpoint is


@dataclass(frozen=True)
class Toleration:
    key: str | None = None
    operator: str | None = None
    value: str | None = None
    effect: str | None = None
    toleration_seconds: int | None = None

    def to_k8s(self) -> dict[str, Any]:
        pairs = {
            "key": self.key,
            "operator": self.operator,
            "value": self.value,
            "effect": self.effect,
            "tolerationSeconds": self.toleration_seconds,
        }
        return {k: v for k, v in pairs.items() if v is not None}


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    cpu: str = "2"
    memory: str = "8Gi"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    shm_size: str = "1Gi"  # /dev/shm: a memory-backed emptyDir of this size (counts against `memory`)


@dataclass(frozen=True)
class EngineSpec:
    block_size: int | None = None
    attention_backend: str = "auto"
    max_waiting: int | None = None
    max_request_body_bytes: int | None = None  # unset: the server's default
    max_waiting_per_client: int | None = None  # unset: the fair share
    max_running_per_client: int | None = None
    max_prompt_tokens_per_second_per_client: int | None = None  # unset: no rate limit
    prompt_token_burst_per_client: int | None = None  # unset: one second's worth
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    extra_args: tuple[str, ...] = ()  # appended to the server's command line


IntOrPercent = int | str  # a count of pods or "N%", as in a Deployment or a PodDisruptionBudget


@dataclass(frozen=True)
class StrategySpec:
    """The Deployment's rolling update. The default surges one pod and never drops below the replica count; in a
    GPU pool with no free GPU the surge pod cannot schedule, and maxSurge 0 / maxUnavailable 1 rolls instead."""

    max_surge: IntOrPercent = 1
    max_unavailable: IntOrPercent = 0


@dataclass(frozen=True)
class DisruptionSpec:
    """The PodDisruptionBudget child (voluntary evictions: drains, node upgrades, autoscaler)."""

    enabled: bool = True
    max_unavailable: IntOrPercent | None = None  # when neither is set: maxUnavailable 1
    min_available: IntOrPercent | None = None

    @property
    def budget(self) -> dict[str, IntOrPercent]:
        if self.min_available is not None:
            return {"minAvailable": self.min_available}
        return {"maxUnavailable": 1 if self.max_unavailable is None else self.max_unavailable}


@dataclass(frozen=True)
class ShutdownSpec:
    """How a pod leaves: a preStop sleep while endpoint removal reaches every kube-proxy, ingress and load
    balancer (the pod still serves), then SIGTERM, then the server's drain of in-flight streams."""

    pre_stop_sleep_seconds: int = 15
    drain_seconds: int = 30
    margin_seconds: int = 15  # no CRD field: the server's own shutdown after the drain

    @property
    def grace_period_seconds(self) -> int:
        """terminationGracePeriodSeconds: the kubelet counts the preStop hook inside it."""
        return self.pre_stop_sleep_seconds + self.drain_seconds + self.margin_seconds


@dataclass(frozen=True)
class SLOSpec:
    tbt_p99_ms: float
    ttft_p99_ms: float | None = None
    min_throughput_tokens_per_second: float | None = None


# spec.autotune's keys → AutotuneSpec fields (parse_autotune reads these; a test holds them to the CRD).
AUTOTUNE_FIELDS = {
    "mode": "mode", "policy": "policy", "intervalSeconds": "interval_seconds", "cooldownSeconds": "cooldown_seconds",
    "minChunkSize": "min_chunk", "maxChunkSize": "max_chunk", "maxStepUp": "max_step_up",
    "maxStepDown": "max_step_down", "margin": "margin", "deadbandLow": "deadband_low",
    "deadbandHigh": "deadband_high", "chunkGranularity": "chunk_granularity",
    "policySwitching": "policy_switching", "scaleReplicas": "scale_replicas", "prefillHeadroom": "prefill_headroom",
    "canary": "canary", "canaryChunkChange": "canary_chunk_change",
    "scaleDownHeadroom": "scale_down_headroom", "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
}


# Types of the AUTOTUNE_FIELDS that are not plain numbers (the others accept an int or a float).
_AUTOTUNE_KINDS = {"mode": str, "policy": str, "policy_switching": bool, "scale_replicas": bool, "canary": bool,
                   "min_chunk": int, "max_chunk": int, "chunk_granularity": int}


@dataclass(frozen=True)
class MetricsSpec:
    prometheus_url: str | None = None
    window_seconds: int = 60


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    replicas: int = 1
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    engine: EngineSpec = field(default_factory=EngineSpec)
    server: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: SLOSpec | None = None
    autotune: AutotuneSpec = field(default_factory=AutotuneSpec)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    pod_template: PodOverlay = field(default_factory=PodOverlay)
    strategy: StrategySpec = field(default_factory=StrategySpec)
    disruption: DisruptionSpec = field(default_factory=DisruptionSpec)
    shutdown: ShutdownSpec = field(default_factory=ShutdownSpec)
    api_key_secret: SecretKey | None = None  # the server's API key (METRONOME_API_KEY); None = no key
    routing: RoutingSpec = field(default_factory=RoutingSpec)
    experiment: ExperimentSpec | None = None  # spec.experiment (operator/experiment/)


@dataclass(frozen=True)
class InferenceService:
    """The parts of a CR body the operator needs: identity (for owner references) and the typed spec."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: InferenceServiceSpec

    @property
    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# --- parsing -------------------------------------------------------------------------------------------------


def _section(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}.{key}: expected an object, got {type(value).__name__}")
    return value


def _value(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, where: str) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; an integer field must not accept true/false.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise SpecError(f"{where}.{key}: expected {_kind_name(kind)}, got a boolean")
    if not isinstance(value, kind):
        raise SpecError(f"{where}.{key}: expected {_kind_name(kind)}, got {type(value).__name__}")
    return value


def _choice(data: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str | None, where: str
            ) -> str | None:
    value = _value(data, key, str, default, where)
    if value is not None and value not in choices:
        raise SpecError(f"{where}.{key}: must be one of {', '.join(choices)}, got {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults: where parse_* read a default, so that each is written once."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _quantity(data: Mapping[str, Any], key: str, default: str, where: str) -> str:
    return str(_value(data, key, (int, str), default, where))


def parse_model(data: Mapping[str, Any]) -> ModelSpec:
    where = "spec.model"
    if "source" not in data:
        raise SpecError(f"{where}.source: required")
    defaults = _defaults(ModelSpec)
    source = parse_source(data["source"])
    for key, kinds in (("cache", ("hf", "s3")), ("tokenSecret", ("hf",)), ("hfEndpoint", ("hf",)), ("s3", ("s3",))):
        if data.get(key) is not None and source.kind not in kinds:
            raise SpecError(f"{where}.{key}: only for {' and '.join(k + '://' for k in kinds)} sources")
    return ModelSpec(
        source=source,
        dtype=_value(data, "dtype", str, defaults["dtype"], where),
        max_model_len=_value(data, "maxModelLen", int, defaults["max_model_len"], where),
        cache=_parse_cache(_value(data, "cache", Mapping, {}, where), f"{where}.cache"),
        token_secret=_parse_secret_key(data.get("tokenSecret"), f"{where}.tokenSecret", "HF_TOKEN"),
        hf_endpoint=_url(data, "hfEndpoint", where),
        s3=_parse_s3(_value(data, "s3", Mapping, {}, where), f"{where}.s3"),
        served_names=_parse_served_names(data.get("servedNames"), f"{where}.servedNames"),
        quantization=_choice(data, "quantization", QUANTIZATIONS, defaults["quantization"], where),
    )


SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")  # model ids: org/name, gpt-4o, name:tag
SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # a DNS subdomain
SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _parse_served_names(data: Any, where: str) -> tuple[str, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise SpecError(f"{where}: expected a list of names, got {_kind_name(type(data))}")
    for index, name in enumerate(data):
        if not isinstance(name, str) or not SERVED_NAME.match(name) or len(name) > 256:
            raise SpecError(f"{where}[{index}]: a model name is letters, digits and ._:/@+- (up to 256), got {name!r}")
    return tuple(dict.fromkeys(data))


def _parse_api_key_secret(data: Any, where: str) -> SecretKey | None:
    secret = _parse_secret_key(data, where, "api-key")
    if secret is not None and not SECRET_NAME.match(secret.name):
        raise SpecError(f"{where}.name: not a Secret name (lowercase DNS subdomain), got {secret.name!r}")
    if secret is not None and not SECRET_KEY.match(secret.key):
        raise SpecError(f"{where}.key: a Secret key is letters, digits and -._, got {secret.key!r}")
    return secret


def _parse_cache(data: Mapping[str, Any], where: str) -> ModelCacheSpec:
    cache = ModelCacheSpec(claim_name=_value(data, "claimName", str, None, where),
                           size_limit=_value(data, "sizeLimit", str, None, where))
    if cache.claim_name and cache.size_limit:
        raise SpecError(f"{where}.sizeLimit: only for the emptyDir cache, not with claimName")
    return cache


def _parse_secret_key(data: Any, where: str, default_key: str) -> SecretKey | None:
    if data is None:
        return None
    if not isinstance(data, Mapping) or not data.get("name"):
        raise SpecError(f"{where}.name: required")
    return SecretKey(_value(data, "name", str, None, where), _value(data, "key", str, default_key, where))


def _parse_s3(data: Mapping[str, Any], where: str) -> S3Spec:
    defaults = _defaults(S3Spec)
    secret = _value(data, "credentialsSecret", Mapping, None, where)
    keys = {}
    if secret is not None:
        if not secret.get("name"):
            raise SpecError(f"{where}.credentialsSecret.name: required")
        keys = {"credentials_secret": _value(secret, "name", str, None, f"{where}.credentialsSecret"),
                "access_key_id_key": _value(secret, "accessKeyIdKey", str, defaults["access_key_id_key"],
                                            f"{where}.credentialsSecret"),
                "secret_access_key_key": _value(secret, "secretAccessKeyKey", str,
                                                defaults["secret_access_key_key"], f"{where}.credentialsSecret")}
    return S3Spec(endpoint=_url(data, "endpoint", where), region=_value(data, "region", str, None, where), **keys)


def _url(data: Mapping[str, Any], key: str, where: str) -> str | None:
    value = _value(data, key, str, None, where)
    if value is not None and not value.startswith(("http://", "https://")):
        raise SpecError(f"{where}.{key}: expected an http:// or https:// URL, got {value!r}")
    return value


def parse_resources(data: Mapping[str, Any]) -> ResourcesSpec:
    where = "spec.resources"
    node_selector = _value(data, "nodeSelector", Mapping, {}, where)
    tolerations = []
    for index, item in enumerate(_value(data, "tolerations", list, [], where)):
        item_where = f"{where}.tolerations[{index}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{item_where}: expected an object")
        tolerations.append(
            Toleration(
                key=_value(item, "key", str, None, item_where),
                operator=_value(item, "operator", str, None, item_where),
                value=_value(item, "value", str, None, item_where),
                effect=_value(item, "effect", str, None, item_where),
                toleration_seconds=_value(item, "tolerationSeconds", int, None, item_where),
            )
        )
    defaults = _defaults(ResourcesSpec)
    return ResourcesSpec(
        gpus=_value(data, "gpus", int, defaults["gpus"], where),
        cpu=_quantity(data, "cpu", defaults["cpu"], where),
        memory=_quantity(data, "memory", defaults["memory"], where),
        node_selector={str(k): str(v) for k, v in node_selector.items()},
        tolerations=tuple(tolerations),
        shm_size=_quantity(data, "shmSize", defaults["shm_size"], where),
    )


def parse_engine(data: Mapping[str, Any]) -> EngineSpec:
    where = "spec.engine"
    defaults = _defaults(EngineSpec)
    if data.get("promptTokenBurstPerClient") is not None and data.get("maxPromptTokensPerSecondPerClient") is None:
        raise SpecError(f"{where}.promptTokenBurstPerClient: needs maxPromptTokensPerSecondPerClient (the rate that "
                        "refills the burst)")
    return EngineSpec(
        block_size=_value(data, "blockSize", int, defaults["block_size"], where),
        attention_backend=_value(data, "attentionBackend", str, defaults["attention_backend"], where),
        max_waiting=_value(data, "maxWaiting", int, defaults["max_waiting"], where),
        max_request_body_bytes=_value(data, "maxRequestBodyBytes", int, defaults["max_request_body_bytes"], where),
        max_waiting_per_client=_value(data, "maxWaitingPerClient", int, defaults["max_waiting_per_client"], where),
        max_running_per_client=_value(data, "maxRunningPerClient", int, defaults["max_running_per_client"], where),
        max_prompt_tokens_per_second_per_client=_value(data, "maxPromptTokensPerSecondPerClient", int,
                                                       defaults["max_prompt_tokens_per_second_per_client"], where),
        prompt_token_burst_per_client=_value(data, "promptTokenBurstPerClient", int,
                                             defaults["prompt_token_burst_per_client"], where),
        kv_cache_dtype=_choice(data, "kvCacheDtype", KV_CACHE_DTYPES, defaults["kv_cache_dtype"], where),
        extra_args=parse_extra_args(_value(data, "extraArgs", list, [], where), f"{where}.extraArgs"),
    )


def parse_extra_args(args: list[Any], where: str) -> tuple[str, ...]:
    for index, arg in enumerate(args):
        if not isinstance(arg, str):
            raise SpecError(f"{where}[{index}]: expected a string, got {type(arg).__name__}")
        flag = arg.split("=", 1)[0]
        if flag in serve_flags.OPERATOR_OWNED:  # the operator sets these from spec fields
            raise SpecError(f"{where}[{index}]: {flag} is set by the operator from the spec; set that field instead")
    return tuple(args)


def _int_or_percent(data: Mapping[str, Any], key: str, default: IntOrPercent | None, where: str,
                    most: int | None = None) -> IntOrPercent | None:
    value = _value(data, key, (int, str), default, where)
    if value is None:
        return None
    number = value[:-1] if isinstance(value, str) and value.endswith("%") else value
    if isinstance(number, str) and not number.isdigit():
        raise SpecError(f"{where}.{key}: expected a count or a percentage such as 25%, got {value!r}")
    if int(number) < 0 or (most is not None and isinstance(value, str) and int(number) > most):
        raise SpecError(f"{where}.{key}: {value!r} is out of range")
    return value


def _is_zero(value: IntOrPercent) -> bool:
    return str(value).rstrip("%") in ("0", "")


def parse_strategy(data: Mapping[str, Any]) -> StrategySpec:
    where = "spec.strategy"
    defaults = _defaults(StrategySpec)
    strategy = StrategySpec(
        max_surge=_int_or_percent(data, "maxSurge", defaults["max_surge"], where),
        max_unavailable=_int_or_percent(data, "maxUnavailable", defaults["max_unavailable"], where, most=100),
    )
    if _is_zero(strategy.max_surge) and _is_zero(strategy.max_unavailable):
        raise SpecError(f"{where}: maxSurge and maxUnavailable may not both be 0 (the rollout could never move)")
    return strategy


def parse_disruption(data: Mapping[str, Any]) -> DisruptionSpec:
    where = "spec.disruption"
    defaults = _defaults(DisruptionSpec)
    disruption = DisruptionSpec(
        enabled=_value(data, "enabled", bool, defaults["enabled"], where),
        max_unavailable=_int_or_percent(data, "maxUnavailable", None, where, most=100),
        min_available=_int_or_percent(data, "minAvailable", None, where, most=100),
    )
    if disruption.max_unavailable is not None and disruption.min_available is not None:
        raise SpecError(f"{where}: set maxUnavailable or minAvailable, not both")
    return disruption


def parse_shutdown(data: Mapping[str, Any]) -> ShutdownSpec:
    where = "spec.shutdown"
    defaults = _defaults(ShutdownSpec)
    shutdown = ShutdownSpec(
        pre_stop_sleep_seconds=_value(data, "preStopSleepSeconds", int, defaults["pre_stop_sleep_seconds"], where),
        drain_seconds=_value(data, "drainSeconds", int, defaults["drain_seconds"], where),
    )
    for key, value in (("preStopSleepSeconds", shutdown.pre_stop_sleep_seconds),
                       ("drainSeconds", shutdown.drain_seconds)):
        if value < 0:
            raise SpecError(f"{where}.{key}: must be >= 0, got {value}")
    return shutdown


def parse_pod_template(data: Mapping[str, Any]) -> PodOverlay:
    try:
        return parse_overlay(data)
    except PodTemplateError as exc:
        raise SpecError(str(exc)) from exc


def parse_slo(data: Mapping[str, Any] | None) -> SLOSpec | None:
    if not data:
        return None
    where = "spec.slo"
    if "tbtP99Ms" not in data:
        raise SpecError(f"{where}.tbtP99Ms: required")
    return SLOSpec(
        tbt_p99_ms=float(_value(data, "tbtP99Ms", (int, float), None, where)),
        ttft_p99_ms=_optional_float(data, "ttftP99Ms", where),
        min_throughput_tokens_per_second=_optional_float(data, "minThroughputTokensPerSecond", where),
    )


def _float(data: Mapping[str, Any], key: str, default: float, where: str) -> float:
    return float(_value(data, key, (int, float), default, where))


def _optional_float(data: Mapping[str, Any], key: str, where: str) -> float | None:
    value = _value(data, key, (int, float), None, where)
    return None if value is None else float(value)


def _enum(kind: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(m.value for m in kind)
        raise SpecError(f"{where}: must be one of {allowed}, got {value!r}") from None


def parse_autotune(data: Mapping[str, Any], spec: Mapping[str, Any], slo: SLOSpec | None,
                   server: SchedulerConfig) -> AutotuneSpec:
    """spec.autotune, with the targets of `slo`, spec's replica bounds and the served queue policy."""
    where = "spec.autotune"
    defaults = _defaults(AutotuneSpec)
    values = {name: _value(data, key, _AUTOTUNE_KINDS[name], defaults[name], where) if name in _AUTOTUNE_KINDS
              else _float(data, key, defaults[name], where) for key, name in AUTOTUNE_FIELDS.items()}
    values["mode"] = _enum(AutotuneMode, values["mode"], f"{where}.mode")
    values["policy"] = _enum(TuningPolicy, values["policy"], f"{where}.policy")
    return AutotuneSpec(
        **values,
        tbt_p99_target_s=slo.tbt_p99_ms / 1000.0 if slo is not None else None,
        ttft_p99_target_s=slo.ttft_p99_ms / 1000.0 if slo is not None and slo.ttft_p99_ms is not None else None,
        min_throughput_tokens_per_s=slo.min_throughput_tokens_per_second if slo is not None else None,
        min_replicas=_value(spec, "minReplicas", int, defaults["min_replicas"], "spec"),
        max_replicas=_value(spec, "maxReplicas", int, defaults["max_replicas"], "spec"),
        base_queue_policy=QueuePolicy(server.queue_policy).value,
    )


def parse_metrics(data: Mapping[str, Any]) -> MetricsSpec:
    where = "spec.metrics"
    defaults = _defaults(MetricsSpec)
    return MetricsSpec(
        prometheus_url=_value(data, "prometheusUrl", str, defaults["prometheus_url"], where),
        window_seconds=_value(data, "windowSeconds", int, defaults["window_seconds"], where),
    )


def parse_server(data: Mapping[str, Any]) -> SchedulerConfig:
    try:
        return validate_scheduler(dict(data), source="spec.server")
    except ConfigError as exc:
        raise SpecError(str(exc)) from exc


def parse_spec(spec: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> InferenceServiceSpec:
    """`default_image`: the image when spec.image is unset (the operator's --server-image)."""
    if not isinstance(spec, Mapping):
        raise SpecError("spec: expected an object")
    where = "spec"
    defaults = _defaults(InferenceServiceSpec)
    server = parse_server(_section(spec, "server", where))
    slo = parse_slo(_section(spec, "slo", where))
    metrics = parse_metrics(_section(spec, "metrics", where))
    return InferenceServiceSpec(
        model=parse_model(_section(spec, "model", where)),
        replicas=_value(spec, "replicas", int, defaults["replicas"], where),
        resources=parse_resources(_section(spec, "resources", where)),
        image=_value(spec, "image", str, default_image, where),
        image_pull_policy=_value(spec, "imagePullPolicy", str, defaults["image_pull_policy"], where),
        engine=parse_engine(_section(spec, "engine", where)),
        server=server,
        slo=slo,
        autotune=parse_autotune(_section(spec, "autotune", where), spec, slo, server),
        metrics=metrics,
        pod_template=parse_pod_template(_section(spec, "podTemplate", where)),
        strategy=parse_strategy(_section(spec, "strategy", where)),
        disruption=parse_disruption(_section(spec, "disruption", where)),
        shutdown=parse_shutdown(_section(spec, "shutdown", where)),
        api_key_secret=_parse_api_key_secret(spec.get("apiKeySecret"), f"{where}.apiKeySecret"),
        routing=parse_routing(spec.get("routing")),
        experiment=parse_experiment(spec.get("experiment"), metrics.window_seconds),
    )


def parse_service(body: Mapping[str, Any], default_image: str = DEFAULT_IMAGE) -> InferenceService:
    """Parse a whole CR body (as kopf or the API returns it); `default_image` as in parse_spec."""
    metadata = body.get("metadata") or {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not name or not namespace:
        raise SpecError("metadata.name and metadata.namespace are required")
    return InferenceService(
        name=name,
        namespace=namespace,
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation") or 0),
        spec=parse_spec(body.get("spec") or {}, default_image),
    )
