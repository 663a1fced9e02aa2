"""Pure: the InferencePool child (inference.networking.k8s.io/v1, the Gateway API Inference Extension) of an
InferenceService whose spec.routing.inferencePool is enabled.

A gateway that routes to the pool asks the pool's endpoint picker (ext_proc) which pod gets each request; the
picker finds the pods by the pool's selector (the Deployment's own selector labels), scrapes each at the pool's
target port for its queue and KV usage, and answers with the chosen pod's address. The servers export the
picker's default names (vLLM's, metronome.contract.metric_names.PICKER_ALIASES), and the pods say so with the
engine-type label under both keys pickers read it from (builders.pod_labels).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metronome.operator import builders, kinds
from metronome.operator.spec import InferenceService

API_VERSION = kinds.INFERENCE_POOL.api_version
KIND = kinds.INFERENCE_POOL.kind
CRD = kinds.INFERENCE_POOL.crd


def pool_name(service: InferenceService) -> str:
    return service.name


def inference_pool(service: InferenceService) -> dict[str, Any]:
    picker = service.spec.routing.inference_pool.endpoint_picker
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": pool_name(service),
            "namespace": service.namespace,
            "labels": builders.labels(service.name),
            "ownerReferences": [service.owner_reference],
        },
        "spec": {
            "selector": {"matchLabels": builders.selector_labels(service.name)},
            "targetPorts": [{"number": builders.SERVER_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.service_name(service.name),
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


def owned_by(pool: Mapping[str, Any] | None, service: InferenceService) -> bool:
    """Whether an existing pool is this service's child (a pool of the same name made by someone else, e.g. the
    picker's own Helm chart, is never overwritten or deleted)."""
    references = ((pool or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == service.uid and ref.get("controller") for ref in references)
