"""A typed view of an InferenceService: the CR body (a dict, camelCase) parsed into frozen dataclasses.

The API server has already validated and defaulted the object against crds/inferenceservice.yaml; the defaults
here mirror the CRD's (a unit test keeps them equal) so that bodies built by hand parse the same way. Anything
that cannot be used raises SpecError naming the field, never a KeyError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from metronome.contract.config import ConfigError, SchedulerConfig, validate_scheduler

GROUP = "metronome.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_IMAGE = "ghcr.io/metronome-dev/metronome-server:0.1.0"
MODEL_KINDS = ("default", "random", "gguf", "hf-dir", "pvc")
_PVC_SOURCE = re.compile(r"^(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(/(?P<path>.*))?$")


class SpecError(ValueError):
    """An InferenceService body the operator cannot act on; the message names the field."""


@dataclass(frozen=True)
class ModelSource:
    """`default`, `random:<preset>`, `gguf:/file.gguf`, `hf-dir:/dir` or `pvc:<claim>[/<path>]`."""

    kind: str
    value: str = ""  # preset, absolute path, or path inside the claim
    claim: str = ""  # pvc only

    @classmethod
    def parse(cls, source: str) -> "ModelSource":
        if not isinstance(source, str) or not source:
            raise SpecError("spec.model.source: must be a non-empty string")
        if source == "default":
            return cls("default")
        kind, sep, rest = source.partition(":")
        if not sep or kind not in MODEL_KINDS or not rest:
            raise SpecError(
                f"spec.model.source: {source!r} is not one of default, random:<preset>, gguf:/path.gguf, "
                "hf-dir:/path, pvc:<claim>[/<path>]"
            )
        if kind in ("gguf", "hf-dir") and not rest.startswith("/"):
            raise SpecError(f"spec.model.source: {kind} needs an absolute path, got {rest!r}")
        if kind == "pvc":
            match = _PVC_SOURCE.match(rest)
            if not match:
                raise SpecError(f"spec.model.source: {rest!r} is not <claim>[/<path>] with a valid claim name")
            return cls("pvc", value=(match.group("path") or "").strip("/"), claim=match.group("claim"))
        return cls(kind, value=rest)


@dataclass(frozen=True)
class ModelSpec:
    source: ModelSource
    dtype: str = "auto"
    max_model_len: int | None = None


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


@dataclass(frozen=True)
class EngineSpec:
    block_size: int | None = None
    attention_backend: str = "auto"
    max_waiting: int | None = None


@dataclass(frozen=True)
class SLOSpec:
    tbt_p99_ms: float
    ttft_p99_ms: float | None = None
    min_throughput_tokens_per_second: float | None = None


@dataclass(frozen=True)
class AutotuneSpec:
    mode: str = "off"
    policy: str = "model"
    interval_seconds: int = 30
    cooldown_seconds: int = 60
    min_chunk_size: int = 64
    max_chunk_size: int = 8192
    max_step_up: float = 2.0
    max_step_down: float = 4.0
    margin: float = 0.9
    deadband_low: float = 0.7
    deadband_high: float = 0.95
    chunk_granularity: int = 64
    policy_switching: bool = True
    scale_replicas: bool = False


@dataclass(frozen=True)
class MetricsSpec:
    prometheus_url: str | None = None
    window_seconds: int = 60


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 8
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    engine: EngineSpec = field(default_factory=EngineSpec)
    server: SchedulerConfig = field(default_factory=SchedulerConfig)
    slo: SLOSpec | None = None
    autotune: AutotuneSpec = field(default_factory=AutotuneSpec)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)


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


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _quantity(data: Mapping[str, Any], key: str, default: str, where: str) -> str:
    return str(_value(data, key, (int, str), default, where))


def parse_model(data: Mapping[str, Any]) -> ModelSpec:
    where = "spec.model"
    if "source" not in data:
        raise SpecError(f"{where}.source: required")
    return ModelSpec(
        source=ModelSource.parse(data["source"]),
        dtype=_value(data, "dtype", str, "auto", where),
        max_model_len=_value(data, "maxModelLen", int, None, where),
    )


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
    return ResourcesSpec(
        gpus=_value(data, "gpus", int, 1, where),
        cpu=_quantity(data, "cpu", "2", where),
        memory=_quantity(data, "memory", "8Gi", where),
        node_selector={str(k): str(v) for k, v in node_selector.items()},
        tolerations=tuple(tolerations),
    )


def parse_engine(data: Mapping[str, Any]) -> EngineSpec:
    where = "spec.engine"
    return EngineSpec(
        block_size=_value(data, "blockSize", int, None, where),
        attention_backend=_value(data, "attentionBackend", str, "auto", where),
        max_waiting=_value(data, "maxWaiting", int, None, where),
    )


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


def parse_autotune(data: Mapping[str, Any]) -> AutotuneSpec:
    where = "spec.autotune"
    defaults = AutotuneSpec()
    return AutotuneSpec(
        mode=_value(data, "mode", str, defaults.mode, where),
        policy=_value(data, "policy", str, defaults.policy, where),
        interval_seconds=_value(data, "intervalSeconds", int, defaults.interval_seconds, where),
        cooldown_seconds=_value(data, "cooldownSeconds", int, defaults.cooldown_seconds, where),
        min_chunk_size=_value(data, "minChunkSize", int, defaults.min_chunk_size, where),
        max_chunk_size=_value(data, "maxChunkSize", int, defaults.max_chunk_size, where),
        max_step_up=_float(data, "maxStepUp", defaults.max_step_up, where),
        max_step_down=_float(data, "maxStepDown", defaults.max_step_down, where),
        margin=_float(data, "margin", defaults.margin, where),
        deadband_low=_float(data, "deadbandLow", defaults.deadband_low, where),
        deadband_high=_float(data, "deadbandHigh", defaults.deadband_high, where),
        chunk_granularity=_value(data, "chunkGranularity", int, defaults.chunk_granularity, where),
        policy_switching=_value(data, "policySwitching", bool, defaults.policy_switching, where),
        scale_replicas=_value(data, "scaleReplicas", bool, defaults.scale_replicas, where),
    )


def parse_metrics(data: Mapping[str, Any]) -> MetricsSpec:
    where = "spec.metrics"
    return MetricsSpec(
        prometheus_url=_value(data, "prometheusUrl", str, None, where),
        window_seconds=_value(data, "windowSeconds", int, 60, where),
    )


def parse_server(data: Mapping[str, Any]) -> SchedulerConfig:
    try:
        return validate_scheduler(dict(data), source="spec.server")
    except ConfigError as exc:
        raise SpecError(str(exc)) from exc


def parse_spec(spec: Mapping[str, Any]) -> InferenceServiceSpec:
    if not isinstance(spec, Mapping):
        raise SpecError("spec: expected an object")
    where = "spec"
    return InferenceServiceSpec(
        model=parse_model(_section(spec, "model", where)),
        replicas=_value(spec, "replicas", int, 1, where),
        min_replicas=_value(spec, "minReplicas", int, 1, where),
        max_replicas=_value(spec, "maxReplicas", int, 8, where),
        resources=parse_resources(_section(spec, "resources", where)),
        image=_value(spec, "image", str, DEFAULT_IMAGE, where),
        image_pull_policy=_value(spec, "imagePullPolicy", str, "IfNotPresent", where),
        engine=parse_engine(_section(spec, "engine", where)),
        server=parse_server(_section(spec, "server", where)),
        slo=parse_slo(_section(spec, "slo", where)),
        autotune=parse_autotune(_section(spec, "autotune", where)),
        metrics=parse_metrics(_section(spec, "metrics", where)),
    )


def parse_service(body: Mapping[str, Any]) -> InferenceService:
    """Parse a whole CR body (as kopf or the API returns it)."""
    metadata = body.get("metadata") or {}
    name, namespace = metadata.get("name"), metadata.get("namespace")
    if not name or not namespace:
        raise SpecError("metadata.name and metadata.namespace are required")
    return InferenceService(
        name=name,
        namespace=namespace,
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation") or 0),
        spec=parse_spec(body.get("spec") or {}),
    )
