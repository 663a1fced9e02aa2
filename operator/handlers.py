"""What the operator registers with kopf: watches, and nothing else.

kopf is the watch machinery here (list, watch, re-list after an outage, retries, CRDs that appear later): one
`on.event` per kind — the InferenceServices, every kind of child and the server pods (selected on the server by
the operator's own label), the HPAs and KEDA ScaledObjects (which may set a service's replicas), and the CRDs of
the optional kinds — hands each event to the runtime, which keeps the object in its cache and queues the owner's
reconcile (runtime.py). No kopf change handler (create, update, resume, field), so no progress or last-handled
annotations on the resources: what was applied is read from the cluster itself (the children's fingerprints, the
ConfigMap's spec.server digest, status.observedGeneration), and a new leader trusts nothing an old one wrote about
its own progress. No timer or daemon either: kopf would put a
finalizer on every object they serve, which leaves objects stuck when the operator is gone (`helm uninstall`
with resources left); without one, nothing blocks a deletion and the garbage collector removes the children
through their owner references.
"""
from __future__ import annotations

import itertools
import logging
from typing import Any

import kopf

from metronome.operator import builders, kinds
from metronome.operator.options import OperatorOptions
from metronome.operator.runtime import Runtime

ANNOTATION_PREFIX = "metronome.dev"
# Children and pods are watched by the operator's own label, selected by the API server: other Deployments,
# ConfigMaps and pods of the namespaces served never reach the operator.
CHILD_SELECTOR = f"{builders.LABEL_MANAGED_BY}={builders.MANAGED_BY}"

log = logging.getLogger(__name__)


class RetryForever:
    """kopf's error_backoffs that never run out: 1, 1, 2, 3, 5, 8, 13 s, then every 15 s. Iterable afresh for
    each request (kopf iterates it once per request)."""

    FIRST = (1, 1, 2, 3, 5, 8, 13)
    THEN = 15

    def __iter__(self):
        return itertools.chain(self.FIRST, itertools.repeat(self.THEN))


def configure_settings(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Nothing is stored on the resources (no change handlers); should kopf ever need to, under our prefix.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # We post our own Events for every change; kopf's only for warnings and errors.
    settings.posting.level = logging.WARNING
    # Re-establish watches now and then, so a silently dropped connection cannot stall the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    for kind in kinds.WATCHED:
        settings.watching.label_selectors[kind.api_version, kind.plural] = CHILD_SELECTOR
    # Retry API errors (5xx, 429, connection refused) for as long as the API server is away: kopf's default
    # gives up after about a minute, and a watcher that gives up ends the operator. Once the API server is back,
    # the watches re-list and every object's event queues its service's reconcile.
    settings.networking.error_backoffs = RetryForever()


def login(**kwargs: Any) -> Any:
    return kopf.login_via_client(**kwargs)


def start_runtime(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.start()


def stop_runtime(memo: kopf.Memo, **_: Any) -> None:
    memo.runtime.stop()


def _watch(kind: kinds.Kind):
    def seen(event: dict, memo: kopf.Memo, **_: Any) -> None:
        runtime: Runtime = memo.runtime
        runtime.observe(kind, event.get("type"), event.get("object") or {})

    seen.__name__ = f"watch_{kind.plural}"
    return seen


def _optional_crd(name: str, **_: Any) -> bool:
    return name in kinds.OPTIONAL_CRDS


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> None:
    on = kopf.on
    on.startup(registry=registry)(configure_settings)
    on.startup(registry=registry)(start_runtime)
    on.cleanup(registry=registry)(stop_runtime)
    on.login(registry=registry)(login)
    resource = kinds.INFERENCE_SERVICE
    on.event(group=resource.group, version=resource.version, plural=resource.plural, registry=registry,
             id=f"watch/{resource.plural}")(_watch(resource))
    for kind in kinds.WATCHED:
        labels = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY}
        on.event(group=kind.group, version=kind.version, plural=kind.plural, labels=labels, registry=registry,
                 id=f"watch/{kind.plural}")(_watch(kind))
    for kind in kinds.SCALERS:  # the user's: no label to select on (kopf watches KEDA's once its CRD is served)
        on.event(group=kind.group, version=kind.version, plural=kind.plural, registry=registry,
                 id=f"watch/{kind.plural}")(_watch(kind))
    crd = kinds.CRD
    on.event(group=crd.group, version=crd.version, plural=crd.plural, when=_optional_crd, registry=registry,
             id=f"watch/{crd.plural}")(_watch(crd))
