"""Who else sets a service's replica count: HorizontalPodAutoscalers (autoscaling/v2) and KEDA ScaledObjects
(keda.sh/v1alpha1, where that CRD is served) whose scaleTargetRef names the InferenceService (through its scale
subresource) or the Deployment the operator made for it. While one does, the control loop leaves replicas alone
(it still tunes the chunk and the policy), status says so (condition ReplicasManagedExternally), and a scaler on the
Deployment keeps the count it set: the operator writes the Deployment with the replicas it has, not spec.replicas.

`scalers_targeting` is pure (tests feed it objects); `find_external_scalers` lists them (I/O).
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.operator import builders
from metronome.operator.k8s import Kube, KubeError
from metronome.operator.spec import GROUP, KIND, InferenceService

HPA_API_VERSION, HPA_KIND = "autoscaling/v2", "HorizontalPodAutoscaler"
KEDA_API_VERSION, KEDA_KIND = "keda.sh/v1alpha1", "ScaledObject"
KEDA_CRD = "scaledobjects.keda.sh"
DEPLOYMENT = "Deployment"


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
    """What the API said: the scalers found, or why they could not be listed (then `scalers` is empty)."""

    scalers: tuple[ExternalScaler, ...] = ()
    error: str | None = None

    @property
    def owner(self) -> str | None:
        """Who sets the replicas, in words (None: nobody else)."""
        return ", ".join(s.describe() for s in self.scalers) or None

    @property
    def on_deployment(self) -> bool:
        return any(s.on_deployment for s in self.scalers)


def _group(api_version: str) -> str:
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def _target_kind(ref: Mapping[str, Any], service: InferenceService, default_api_version: str | None) -> str | None:
    """The kind of this service's object that a scaleTargetRef names, or None when it names something else."""
    kind = ref.get("kind") or (DEPLOYMENT if default_api_version else None)
    api_version = ref.get("apiVersion") or default_api_version or ""
    name = ref.get("name")
    if kind == KIND and _group(api_version) == GROUP and name == service.name:
        return KIND
    if kind == DEPLOYMENT and _group(api_version) == "apps" and name == builders.child_names(service.name).deployment:
        return DEPLOYMENT
    return None


def scalers_targeting(service: InferenceService, hpas: Iterable[Mapping[str, Any]],
                      scaled_objects: Iterable[Mapping[str, Any]] = ()) -> tuple[ExternalScaler, ...]:
    """The HPAs and ScaledObjects among the given whose target is this service or its Deployment (a ScaledObject's
    scaleTargetRef defaults to an apps/v1 Deployment, as KEDA reads it)."""
    found = []
    for items, kind, default in ((hpas, HPA_KIND, None), (scaled_objects, KEDA_KIND, "apps/v1")):
        for item in items:
            ref = (item.get("spec") or {}).get("scaleTargetRef") or {}
            target = _target_kind(ref, service, default) if isinstance(ref, Mapping) else None
            if target is not None:
                found.append(ExternalScaler(kind, service.namespace, (item.get("metadata") or {}).get("name", "?"),
                                            target))
    return tuple(sorted(found, key=lambda s: (s.kind, s.name)))


class _KedaInstalled:
    """Whether KEDA's CRD is served, asked at most every CRD_RECHECK_S per API client (every refresh of every service
    looks for scalers; KEDA comes and goes far less often)."""

    CRD_RECHECK_S = 60.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: weakref.WeakKeyDictionary[Kube, tuple[float, bool]] = weakref.WeakKeyDictionary()

    def __call__(self, kube: Kube) -> bool:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(kube)
        if seen is not None and now - seen[0] < self.CRD_RECHECK_S:
            return seen[1]
        installed = kube.crd_exists(KEDA_CRD)
        with self._lock:
            self._seen[kube] = (now, installed)
        return installed


keda_installed = _KedaInstalled()


def find_external_scalers(kube: Kube, service: InferenceService) -> ScalerView:
    """List the namespace's HPAs (and ScaledObjects, where KEDA's CRD is served) and keep those targeting the
    service. An API error (RBAC, an API server away) is reported, never raised: the caller then cannot tell."""
    try:
        hpas = kube.list(HPA_API_VERSION, HPA_KIND, service.namespace, "")
        scaled = kube.list(KEDA_API_VERSION, KEDA_KIND, service.namespace, "") if keda_installed(kube) else []
    except KubeError as exc:
        return ScalerView(error=f"cannot list HorizontalPodAutoscalers or ScaledObjects: HTTP {exc.status} "
                                f"{exc.reason}")
    return ScalerView(scalers_targeting(service, hpas, scaled))
