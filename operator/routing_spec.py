"""spec.routing: how a gateway reaches the service's pods beyond its plain Service. Today one way: an InferencePool
(inference.networking.k8s.io/v1, the Gateway API Inference Extension) whose endpoint picker chooses a pod per
request from each pod's queue and KV usage. Parsed from the CR body like the rest of spec.py (defaults = the
CRD's, written once here; SpecError names the field). The child itself is inference_pool.py's.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome.operator.spec_error import SpecError

# A Service name (the picker is reached through its Service): a DNS-1035 label.
SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
FAILURE_MODES = ("FailClose", "FailOpen")  # the InferencePool API's endpointPickerRef.failureMode
# Appended to the InferenceService's name when endpointPicker.name is unset: what the picker's own Helm chart
# (the Gateway API Inference Extension's `inferencepool` chart) names its Service for a release of that name.
PICKER_SUFFIX = "-epp"


@dataclass(frozen=True)
class EndpointPickerSpec:
    """spec.routing.inferencePool.endpointPicker: the picker's Service, its ext_proc port (the picker's default
    gRPC port), and what a gateway does when the picker does not answer."""

    name: str | None = None  # None: "<InferenceService name>-epp"
    port: int = 9002
    failure_mode: str = "FailClose"

    def service_name(self, service: str) -> str:
        return self.name or f"{service}{PICKER_SUFFIX}"


@dataclass(frozen=True)
class InferencePoolSpec:
    enabled: bool = False
    endpoint_picker: EndpointPickerSpec = field(default_factory=EndpointPickerSpec)


@dataclass(frozen=True)
class RoutingSpec:
    inference_pool: InferencePoolSpec = field(default_factory=InferencePoolSpec)


def _object(data: Any, where: str) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: expected an object, got {type(data).__name__}")
    return data


def _typed(data: Mapping[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SpecError(f"{where}.{key}: expected {'an integer' if kind is int else kind.__name__}, "
                        f"got {type(value).__name__}")
    return value


def parse_endpoint_picker(data: Mapping[str, Any], where: str) -> EndpointPickerSpec:
    default = EndpointPickerSpec()
    picker = EndpointPickerSpec(
        name=_typed(data, "name", str, default.name, where),
        port=_typed(data, "port", int, default.port, where),
        failure_mode=_typed(data, "failureMode", str, default.failure_mode, where),
    )
    if picker.name is not None and (len(picker.name) > 63 or not SERVICE_NAME.match(picker.name)):
        raise SpecError(f"{where}.name: a Service name is a DNS-1035 label (lower case letters, digits and '-', "
                        f"starting with a letter, at most 63), got {picker.name!r}")
    if not 1 <= picker.port <= 65535:
        raise SpecError(f"{where}.port: must be within 1..65535, got {picker.port}")
    if picker.failure_mode not in FAILURE_MODES:
        raise SpecError(f"{where}.failureMode: must be one of {', '.join(FAILURE_MODES)}, got {picker.failure_mode!r}")
    return picker


def parse_routing(data: Any) -> RoutingSpec:
    where = "spec.routing"
    routing = _object(data, where)
    pool = _object(routing.get("inferencePool"), f"{where}.inferencePool")
    return RoutingSpec(inference_pool=InferencePoolSpec(
        enabled=_typed(pool, "enabled", bool, InferencePoolSpec().enabled, f"{where}.inferencePool"),
        endpoint_picker=parse_endpoint_picker(_object(pool.get("endpointPicker"),
                                                      f"{where}.inferencePool.endpointPicker"),
                                              f"{where}.inferencePool.endpointPicker"),
    ))
