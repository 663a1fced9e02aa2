"""The InferencePool child on the API server, around the pure builder (inference_pool.py): written when
spec.routing.inferencePool is enabled and the cluster serves the InferencePool API, deleted when the spec turns
it off. A pool of the same name that this service does not own is left alone and reported.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from metronome.operator import changes, inference_pool
from metronome.operator.k8s import Kube
from metronome.operator.spec import InferenceService

log = logging.getLogger(__name__)


def _event(kube: Kube, owner: Mapping[str, Any], event: changes.EventSpec | None) -> None:
    if event is not None:
        log.info("%s: %s: %s", (owner.get("metadata") or {}).get("name"), event.reason, event.message)
        kube.emit_event(owner, event.type, event.reason, event.message)


def sync_inference_pool(kube: Kube, service: InferenceService, owner: Mapping[str, Any]) -> None:
    enabled = service.spec.routing.inference_pool.enabled
    name = inference_pool.pool_name(service)
    if not kube.crd_exists(inference_pool.CRD):
        if enabled:
            _event(kube, owner, changes.EventSpec(
                changes.WARNING, "InferencePoolUnavailable",
                f"spec.routing.inferencePool is enabled but the cluster does not serve {inference_pool.CRD} "
                "(install the Gateway API Inference Extension's CRDs); no InferencePool written"))
        return
    existing = kube.get(inference_pool.API_VERSION, inference_pool.KIND, service.namespace, name)
    if existing is not None and not inference_pool.owned_by(existing, service):
        if enabled:
            _event(kube, owner, changes.EventSpec(
                changes.WARNING, "InferencePoolConflict",
                f"InferencePool {name} exists and is not this InferenceService's; left as it is"))
        return
    if enabled:
        applied = kube.apply(inference_pool.inference_pool(service))
        _event(kube, owner, changes.describe_child(applied.action.value, applied.before, applied.after))
    elif existing is not None and kube.delete(inference_pool.API_VERSION, inference_pool.KIND, service.namespace,
                                              name):
        _event(kube, owner, changes.EventSpec(changes.NORMAL, "Deleted", f"deleted InferencePool {name}"))
