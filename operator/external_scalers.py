"""Who else sets a service's replica count: HorizontalPodAutoscalers (autoscaling/v2) and KEDA ScaledObjects
(keda.sh/v1alpha1, where that CRD is served) whose scaleTargetRef names the InferenceService (through its scale
subresource) or the Deployment the operator made for it. While one does, the control loop leaves replicas alone
(it still tunes the chunk and the policy), status says so (condition ReplicasManagedExternally), and a scaler on the
Deployment keeps the count it set: the operator writes the Deployment with the replicas it has, not spec.replicas.

Both kinds are the user's (no operator label): the watches deliver every one of the namespaces served into the
cache, and each event queues the service its scaleTargetRef names (`targeted_services`). A reconcile reads them from
the cache (`cached_scalers`), never from the API. `scalers_targeting` is pure.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.operator import builders, kinds
from metronome.operator.cache import LABEL_SERVICE, ObjectCache
from metronome.operator.spec import GROUP, KIND, InferenceService

HPA_KIND, KEDA_KIND = kinds.HORIZONTAL_POD_AUTOSCALER.kind, kinds.SCALED_OBJECT.kind
DEPLOYMENT = kinds.DEPLOYMENT.kind


@dataclass(frozen=True)
class ExternalScaler:
    kind: str  # HorizontalPodAutoscaler or ScaledObject
    namespace: str
    name: str
    target_kind: str  # InferenceService or Deployment

    @property
    def on_deployment(self) -> bool:
        return self.target_kind == DEPLOYMENT

    def describe(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


@dataclass(frozen=True)
class ScalerView:
    """The scalers that target one service (empty: nobody but the operator or a person sets its replicas)."""

    scalers: tuple[ExternalScaler, ...] = ()

    @property
    def owner(self) -> str | None:
        """Who sets the replicas, in words (None: nobody else)."""
        return ", ".join(s.describe() for s in self.scalers) or None

    @property
    def on_deployment(self) -> bool:
        return any(s.on_deployment for s in self.scalers)


def _group(api_version: str) -> str:
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def scale_target(scaler_kind: str, obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of what a scaler's scaleTargetRef names, when that is an InferenceService or an apps/v1
    Deployment (a ScaledObject's bare name means a Deployment, as KEDA reads it); None for anything else."""
    ref = (obj.get("spec") or {}).get("scaleTargetRef")
    if not isinstance(ref, Mapping) or not ref.get("name"):
        return None
    default = "apps/v1" if scaler_kind == KEDA_KIND else None
    kind = ref.get("kind") or (DEPLOYMENT if default else None)
    group = _group(ref.get("apiVersion") or default or "")
    if (kind, group) in ((KIND, GROUP), (DEPLOYMENT, "apps")):
        return kind, ref["name"]
    return None


def scalers_targeting(service: InferenceService, hpas: Iterable[Mapping[str, Any]],
                      scaled_objects: Iterable[Mapping[str, Any]] = ()) -> tuple[ExternalScaler, ...]:
    """The HPAs and ScaledObjects among the given whose target is this service or its Deployment."""
    ours = {(KIND, service.name), (DEPLOYMENT, builders.child_names(service.name).deployment)}
    found = []
    for items, kind in ((hpas, HPA_KIND), (scaled_objects, KEDA_KIND)):
        for item in items:
            target = scale_target(kind, item)
            if target in ours:
                found.append(ExternalScaler(kind, service.namespace, (item.get("metadata") or {}).get("name", "?"),
                                            target[0]))
    return tuple(sorted(found, key=lambda s: (s.kind, s.name)))


def targeted_services(scaler_kind: str, obj: Mapping[str, Any] | None, cache: ObjectCache) -> set[tuple[str, str]]:
    """(namespace, name) of the InferenceService a scaler targets, directly or through its Deployment (one the
    operator made, found in the cache by its owner label); empty for anything else."""
    namespace = ((obj or {}).get("metadata") or {}).get("namespace")
    target = scale_target(scaler_kind, obj) if obj and namespace else None
    if target is None:
        return set()
    kind, name = target
    if kind == KIND:
        return {(namespace, name)}
    deployment = cache.get(DEPLOYMENT, namespace, name) or {}
    owner = ((deployment.get("metadata") or {}).get("labels") or {}).get(LABEL_SERVICE)
    return {(namespace, owner)} if owner and builders.child_names(owner).deployment == name else set()


def cached_scalers(cache: ObjectCache, service: InferenceService, keda_served: bool) -> ScalerView:
    """The HPAs (and ScaledObjects, while KEDA's CRD is served) of the service's namespace, as the watches last
    delivered them, that target the service."""
    hpas = cache.in_namespace(HPA_KIND, service.namespace)
    scaled = cache.in_namespace(KEDA_KIND, service.namespace) if keda_served else []
    return ScalerView(scalers_targeting(service, hpas, scaled))
