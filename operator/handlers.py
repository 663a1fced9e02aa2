"""The kopf handlers: a few lines each, calling reconcile.py (API glue) and the pure builders/status.

- create / resume / update: write or repair every child, read the metrics (a spec change or a restart reads
  at once), then status. Idempotent (server-side apply, fixed names): an operator restart re-runs `reconcile` on
  every object and creates nothing twice.
- field spec.server: serve the new scheduler settings as a new server.yaml generation (ConfigMap only; the pods
  reload it, nothing rolls).
- timer (one per InferenceService, every --status-interval): observe the children (re-creating a deleted one)
  and refresh status. The same tick runs the control loop (control_loop.tick: every
  spec.autotune.intervalSeconds it reads Prometheus, decides and acts); the handler patches what it returns
  (spec.replicas, status.lastDecision). Its per-object state (autotune.TunerMemory) lives in kopf's memo.
- delete: nothing to clean up by hand; every child has an owner reference and is garbage-collected.

Handlers are registered onto a given registry by `register` (no import-time side effects), and write status
through kopf's `patch` (never return values: kopf would store them under status.<handler>, which the structural
schema prunes).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from metronome.operator import autotune, control_loop, reconcile
from metronome.operator import status as status_mod
from metronome.operator.changes import describe_transitions
from metronome.operator.k8s import Kube
from metronome.operator.options import OperatorOptions
from metronome.operator.spec import GROUP, PLURAL, VERSION, InferenceService, SpecError, parse_service

ANNOTATION_PREFIX = "metronome.dev"
RESOURCE = (GROUP, VERSION, PLURAL)
TUNER_MEMO_KEY = "tuner"  # per-object memo: autotune.TunerMemory

log = logging.getLogger(__name__)


def configure_settings(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations under our own prefix, not in status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # We post our own Events for every change; kopf's only for warnings and errors.
    settings.posting.level = logging.WARNING
    # Re-establish watches now and then, so a silently dropped connection cannot stall the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def login(**kwargs: Any) -> Any:
    return kopf.login_via_client(**kwargs)


def _service(body: Mapping[str, Any], kube: Kube) -> InferenceService:
    try:
        return parse_service(body)
    except SpecError as exc:
        kube.emit_event(body, "Warning", "InvalidSpec", str(exc))
        raise kopf.PermanentError(str(exc)) from exc


def _write_status(
    kube: Kube, service: InferenceService, body: Mapping[str, Any], observed: status_mod.Observed, patch: kopf.Patch
) -> None:
    current = body.get("status") or {}
    previous = current.get("conditions") or []
    desired = status_mod.compute_status(service, observed, now=reconcile.utc_now(), previous_conditions=previous)
    patch.status.update(status_mod.status_patch(current, desired))
    for event in describe_transitions(previous, desired["conditions"]):
        kube.emit_event(body, event.type, event.reason, event.message)


def reconcile_service(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    service = _service(body, memo.kube)
    reconcile.sync_children(memo.kube, service, body)
    # A spec change (or a restart) reads the metrics at once: status keeps its measurements, autotune reacts.
    observed = _autotune(memo, service, body, reconcile.observe(memo.kube, service), patch)
    _write_status(memo.kube, service, body, observed, patch)


def serve_spec_server(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    service = _service(body, memo.kube)
    config = reconcile.serve_scheduler(memo.kube, service, body, service.spec.server, why="spec.server changed")
    # Record the generation at once: it is where numbering resumes if the ConfigMap is ever lost.
    patch.status.update(status_mod.served_config_fields(config))


def refresh_status(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    service = _service(body, memo.kube)
    observed = reconcile.observe(memo.kube, service)
    if observed.deployment is None or (observed.served_config is None and observed.config_error is None):
        # Someone deleted a child: put it back (no watch on children; this tick is the repair loop).
        reconcile.sync_children(memo.kube, service, body)
        observed = reconcile.observe(memo.kube, service)
    observed = _autotune(memo, service, body, observed, patch)
    _write_status(memo.kube, service, body, observed, patch)


def _autotune(
    memo: kopf.Memo, service: InferenceService, body: kopf.Body, observed: status_mod.Observed, patch: kopf.Patch
) -> status_mod.Observed:
    """control_loop.tick, and its changes to the CR through kopf's patch."""
    tuner: autotune.TunerMemory = memo.setdefault(TUNER_MEMO_KEY, autotune.TunerMemory())
    result = control_loop.tick(memo.kube, service, body, observed, tuner, memo.options.prometheus_url)
    if result.replicas is not None:
        patch.spec["replicas"] = result.replicas
    if result.last_decision is not None:
        patch.status["lastDecision"] = result.last_decision
    return result.observed


def forget(name: str, namespace: str, logger: logging.Logger, **_: Any) -> None:
    logger.info("InferenceService %s/%s deleted; its children are garbage-collected", namespace, name)


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> None:
    on = kopf.on
    on.startup(registry=registry)(configure_settings)
    on.login(registry=registry)(login)
    on.resume(*RESOURCE, registry=registry)(reconcile_service)
    on.create(*RESOURCE, registry=registry)(reconcile_service)
    on.update(*RESOURCE, registry=registry)(reconcile_service)
    on.field(*RESOURCE, field="spec.server", registry=registry)(serve_spec_server)
    on.delete(*RESOURCE, registry=registry, optional=True)(forget)
    kopf.timer(
        *RESOURCE,
        registry=registry,
        interval=options.status_interval_seconds,
        initial_delay=options.status_interval_seconds,
    )(refresh_status)
