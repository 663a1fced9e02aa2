"""What a new operator (a restart, a new leader) reads from the API before it trusts its cache.

kopf's watches list kind by kind, and each listed object reaches the cache through its own handler task, so a
service can be reconciled before the listing of its pods, of its namespace's HPAs and ScaledObjects, or of the
optional kinds' CRDs is in. Planned from that gap, a reconcile undoes what it cannot see: with no HPA or
ScaledObject in view the Deployment is written with spec.replicas (resetting the count the scaler chose); with no
pods, Ready names no pod's problem (a flip of its reason, Events both ways); with no PodMonitor CRD, the pods get
scrape annotations (a rollout). The kopf stream's LISTED bookmark does not say the handlers have filled the cache.

So the first reconcile of each service reads these from the API, once per operator start each: the service's
pods (a LIST by its label), the HPAs and ScaledObjects of its namespace (a LIST of each, shared by the services
of that namespace), the optional CRDs (a GET of each, for the whole operator). What is read goes into the cache as
unconfirmed (cache.py): its watch's event confirms it. An object deleted after this read but before its watch
listed would never be reported gone, so one still unconfirmed after `for_s` is listed again: gone, it is
forgotten. In steady state nothing is unconfirmed and nothing is read.

The ConfigMap and the Deployment, which the reconcile plans from by name, are read where it plans
(reconcile._read_uncached_children).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from metronome.operator import builders, kinds
from metronome.operator.cache import ObjectCache
from metronome.operator.k8s import Kube
from metronome.operator.spec import InferenceService

OPTIONAL_CRDS = "optional CRDs"  # what StartupReads records once the optional kinds' CRDs have been read


@dataclass(frozen=True)
class Listing:
    """One LIST that stands in for a watch's initial listing: `kind` in `namespace`, the pods of `service` (by the
    labels the pod watch selects on and the cache indexes by) or every object of the namespace."""

    kind: kinds.Kind
    namespace: str
    service: str | None = None

    @property
    def label_selector(self) -> str | None:
        if self.service is None:
            return None
        return f"{builders.LABEL_MANAGED_BY}={builders.MANAGED_BY},{builders.LABEL_SERVICE}={self.service}"

    def cached(self, cache: ObjectCache) -> list[dict[str, Any]]:
        if self.service is None:
            return cache.in_namespace(self.kind.kind, self.namespace)
        return cache.owned(self.kind.kind, self.namespace, self.service)


def listings_for(service: InferenceService, keda_served: bool) -> tuple[Listing, ...]:
    """What a reconcile of `service` reads from the cache by kind rather than by name: its pods (status, the
    experiment's slices) and the other autoscalers of its namespace (who sets the replicas)."""
    scalers = (kinds.HORIZONTAL_POD_AUTOSCALER, *((kinds.SCALED_OBJECT,) if keda_served else ()))
    return (Listing(kinds.POD, service.namespace, service.name),
            *(Listing(kind, service.namespace) for kind in scalers))


def _typed(kind: kinds.Kind, item: Mapping[str, Any]) -> dict[str, Any]:
    """A list's item as a watch delivers it: with its apiVersion and kind."""
    return {"apiVersion": kind.api_version, "kind": kind.kind, **item}


def _name(obj: Mapping[str, Any]) -> str:
    return (obj.get("metadata") or {}).get("name") or ""


def read_listing(kube: Kube, cache: ObjectCache, listing: Listing) -> None:
    for item in kube.list(listing.kind.api_version, listing.kind.kind, listing.namespace, listing.label_selector):
        cache.put_read(listing.kind.kind, _typed(listing.kind, item))


def unconfirmed(cache: ObjectCache, listing: Listing, for_s: float) -> list[str]:
    """Names of the listing's cached objects read (or written) at least `for_s` ago that no watch has delivered."""
    return [name for name in map(_name, listing.cached(cache))
            if cache.unconfirmed(listing.kind.kind, listing.namespace, name, for_s)]


def recheck_listing(kube: Kube, cache: ObjectCache, listing: Listing, names: list[str]) -> None:
    """List again what `names` were read from: one gone is forgotten (its deletion came before its watch listed,
    so no event will report it); one still there is kept as unconfirmed, to be looked at again."""
    live = {_name(item): item for item in kube.list(listing.kind.api_version, listing.kind.kind,
                                                      listing.namespace, listing.label_selector)}
    for name in names:
        if name in live:
            cache.put_read(listing.kind.kind, _typed(listing.kind, live[name]))
        else:
            cache.forget(listing.kind.kind, listing.namespace, name)


def read_optional_crds(kube: Kube, cache: ObjectCache) -> None:
    """The CRDs of the optional kinds the cache lacks: whether a PodMonitor, a PrometheusRule or an InferencePool
    is written, and whether ScaledObjects count, depends on them."""
    crd = kinds.CRD
    for name in kinds.OPTIONAL_CRDS:
        if cache.get(crd.kind, None, name) is None:
            live = kube.get(crd.api_version, crd.kind, None, name)
            if live is not None:
                cache.put_read(crd.kind, live)


class StartupReads:
    """What this process has read in place of its watches' initial listings: each at most once (a failed read is
    tried again by the reconcile's retry). Shared by the workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[Hashable] = set()

    def done(self, what: Hashable) -> bool:
        with self._lock:
            return what in self._done

    def mark(self, what: Hashable) -> None:
        with self._lock:
            self._done.add(what)


def read_before_reconcile(kube: Kube, cache: ObjectCache, reads: StartupReads, service: InferenceService,
                          crd_served: Callable[[str], bool], for_s: float) -> bool:
    """Fill the cache's gaps for a reconcile of `service` (see the module's docstring). True while something read
    awaits its watch's event: the service should be reconciled again after `for_s`, to look again."""
    if not reads.done(OPTIONAL_CRDS):
        read_optional_crds(kube, cache)
        reads.mark(OPTIONAL_CRDS)
    awaiting = False
    for listing in listings_for(service, keda_served=crd_served(kinds.SCALED_OBJECT.crd)):
        if not reads.done(listing):
            read_listing(kube, cache, listing)
            reads.mark(listing)
        elif stale := unconfirmed(cache, listing, for_s):
            recheck_listing(kube, cache, listing, stale)
        awaiting = awaiting or bool(unconfirmed(cache, listing, 0.0))
    return awaiting
