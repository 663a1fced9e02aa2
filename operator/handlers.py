"""The kopf handlers: a few lines each, calling reconcile.py (API glue) and the pure builders/status.

- create / resume / update: write or repair every child, read the metrics (a spec change or a restart reads
  at once), then status. Idempotent (server-side apply, fixed names): an operator restart re-runs `reconcile` on
  every object and creates nothing twice.
- field spec.server: serve the new scheduler settings as a new server.yaml generation (ConfigMap only; the pods
  reload it, nothing rolls).
- children (event handlers on the Deployments and ConfigMaps the operator labels as its own): any change —
  a rollout step, a pod becoming ready, a deletion, the watch re-listing after the API server was away —
  refreshes the owner's status from what the children say now, and puts a deleted child back.
- the control loop (one thread for the whole operator, `ControlLoop`): every --status-interval it refreshes the
  services whose Prometheus reading is due (spec.autotune.intervalSeconds; control_loop.tick reads, decides and
  acts). No kopf timer: kopf puts a finalizer on every object a timer serves, which leaves objects stuck when
  the operator is gone (`helm uninstall` with resources left); without one, nothing blocks a deletion and the
  garbage collector removes the children through their owner references.
- delete: nothing to clean up by hand.

Handlers are registered onto a given registry by `register` (no import-time side effects), and write the CR's
status through kopf's `patch` in the CR's own handlers, through a merge patch of the status subresource
elsewhere (never return values: kopf would store them under status.<handler>, which the structural schema
prunes).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import urllib3

from metronome.contract.rfc3339 import format_time
from metronome.operator import builders, control_loop, reconcile
from metronome.operator import status as status_mod
from metronome.operator.changes import describe_transitions
from metronome.operator.k8s import Kube, KubeError
from metronome.operator.options import OperatorOptions
from metronome.operator.spec import GROUP, PLURAL, VERSION, InferenceService, SpecError, parse_service
from metronome.operator.tuning import autotune

ANNOTATION_PREFIX = "metronome.dev"
RESOURCE = (GROUP, VERSION, PLURAL)
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
# The children whose changes refresh their owner (the same labels builders.labels puts on every child).
CHILD_LABELS = {builders.LABEL_MANAGED_BY: builders.MANAGED_BY, builders.LABEL_SERVICE: kopf.PRESENT}
CHILD_KINDS = (("apps", "v1", "deployments"), ("", "v1", "configmaps"))

log = logging.getLogger(__name__)


# --- per-service state, operator-wide ------------------------------------------------------------------------


@dataclass
class ServiceState:
    uid: str
    tuner: autotune.TunerMemory = field(default_factory=autotune.TunerMemory)
    configs: reconcile.ConfigMemory = field(default_factory=reconcile.ConfigMemory)  # the server.yaml it wrote
    # One refresh or config write at a time per service: the CR's handlers, its children's events and the loop
    # run in threads, and the loop writes the next server.yaml from the config it observed under this lock.
    # Reentrant: refresh_owner holds it from reading the owner to writing its status (so two refreshes never
    # announce the same transition), and refresh takes it again.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)


class Services:
    """Every InferenceService this operator has reconciled: its tuner memory (when to read Prometheus next, the
    last reading), the server.yaml it last wrote, and its lock. Lost on restart, which only means an early first
    reading and one parse of each ConfigMap."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], ServiceState] = {}

    def state(self, namespace: str, name: str, uid: str) -> ServiceState:
        with self._lock:
            state = self._states.get((namespace, name))
            if state is None or state.uid != uid:  # a re-created object starts afresh
                state = self._states[(namespace, name)] = ServiceState(uid)
            return state

    def due(self, now: float) -> list[tuple[str, str]]:
        """The services whose Prometheus reading is due now."""
        with self._lock:
            items = list(self._states.items())
        # The spec's own changes are read at once by the CR's handlers; here only the interval counts.
        return [key for key, state in items if state.tuner.due(now, state.tuner.spec_generation)]

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._states.pop((namespace, name), None)


# --- kopf settings -------------------------------------------------------------------------------------------


class RetryForever:
    """kopf's error_backoffs that never run out: 1, 1, 2, 3, 5, 8, 13 s, then every 15 s. Iterable afresh for
    each request (kopf iterates it once per request)."""

    FIRST = (1, 1, 2, 3, 5, 8, 13)
    THEN = 15

    def __iter__(self):
        return itertools.chain(self.FIRST, itertools.repeat(self.THEN))


def configure_settings(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Progress and the last-handled spec live in annotations under our own prefix, not in status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # We post our own Events for every change; kopf's only for warnings and errors.
    settings.posting.level = logging.WARNING
    # Re-establish watches now and then, so a silently dropped connection cannot stall the operator.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # Retry API errors (5xx, 429, connection refused) for as long as the API server is away: kopf's default
    # gives up after about a minute, and a watcher that gives up ends the operator. Once the API server is back,
    # the watches re-list and every child's event refreshes its owner from the state it is in now.
    settings.networking.error_backoffs = RetryForever()


def login(**kwargs: Any) -> Any:
    return kopf.login_via_client(**kwargs)


# --- the refresh: observe, maybe read Prometheus and act, status ---------------------------------------------


@dataclass(frozen=True)
class Refresh:
    status: dict[str, Any]  # merge patch of the CR's status
    replicas: int | None = None  # patch spec.replicas to this (the autotuner scaled)


def _service(body: Mapping[str, Any], memo: kopf.Memo) -> InferenceService:
    try:
        return parse_service(body, memo.options.server_image)
    except SpecError as exc:
        memo.kube.emit_event(body, "Warning", "InvalidSpec", str(exc))
        raise kopf.PermanentError(str(exc)) from exc


def _state(memo: kopf.Memo, body: Mapping[str, Any]) -> ServiceState:
    meta = body["metadata"]
    return memo.services.state(meta["namespace"], meta["name"], meta.get("uid") or "")


def refresh(memo: kopf.Memo, service: InferenceService, body: Mapping[str, Any], *, repair: bool) -> Refresh:
    """Status from the children as they are now (`repair`: put a deleted child back first), with the control
    loop's tick (a Prometheus reading when one is due)."""
    kube, options = memo.kube, memo.options
    state = _state(memo, body)
    with state.lock:
        observed = reconcile.observe(kube, service, state.configs)
        missing = observed.deployment is None or (observed.served_config is None and observed.config_error is None)
        if repair and missing:
            reconcile.sync_children(kube, service, body, options.monitor, state.configs)
            observed = reconcile.observe(kube, service, state.configs)
        result = control_loop.tick(kube, service, body, observed, state.tuner, options.prometheus, state.configs)
        if "metrics" in memo:
            memo.metrics.after_tick(service, result.decision)
        current = body.get("status") or {}
        previous = current.get("conditions") or []
        desired = status_mod.compute_status(service, result.observed, now=format_time(),
                                            previous_conditions=previous)
        patch = status_mod.status_patch(current, desired)
        if result.last_decision is not None:
            patch["lastDecision"] = result.last_decision
        for event in describe_transitions(previous, desired["conditions"]):
            kube.emit_event(body, event.type, event.reason, event.message)
    return Refresh(patch, result.replicas)


def _apply_to_kopf_patch(result: Refresh, patch: kopf.Patch) -> None:
    patch.status.update(result.status)
    if result.replicas is not None:
        patch.spec["replicas"] = result.replicas


def refresh_owner(memo: kopf.Memo, namespace: str, name: str) -> None:
    """Refresh one InferenceService outside its own handlers (a child changed, a reading is due): read it fresh
    and write what changed by merge patches."""
    kube: Kube = memo.kube
    owner = kube.get(API_VERSION, KIND, namespace, name)
    if owner is None:
        memo.services.forget(namespace, name)
        return
    with _state(memo, owner).lock:
        owner = kube.get(API_VERSION, KIND, namespace, name)  # as it is now, after any refresh we waited for
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        try:
            service = parse_service(owner, memo.options.server_image)
        except SpecError:
            return  # its own handler reported it (InvalidSpec) and will again on the next spec change
        result = refresh(memo, service, owner, repair=True)
        if result.replicas is not None:
            kube.patch(API_VERSION, KIND, namespace, name, {"spec": {"replicas": result.replicas}})
        if result.status:
            kube.patch(API_VERSION, KIND, namespace, name, {"status": result.status}, subresource="status")


# --- the handlers --------------------------------------------------------------------------------------------


OUTAGE_RETRY_S = 5.0  # kopf's own retry delay is 60 s: a service would stay stale a minute after an outage
UNAVAILABLE_STATUSES = frozenset({429, 500, 502, 503, 504})  # an API server starting, overloaded or going away


def retried_through_outages(handler):
    """An API server that stops answering mid-handler is a temporary error, not a bug: kopf retries the handler
    in OUTAGE_RETRY_S and logs one line instead of a traceback."""
    @functools.wraps(handler)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            raise kopf.TemporaryError(f"the API server did not answer: {exc}", delay=OUTAGE_RETRY_S) from exc
        except KubeError as exc:
            if exc.status not in UNAVAILABLE_STATUSES:
                raise
            raise kopf.TemporaryError(f"the API server is unavailable: {exc}", delay=OUTAGE_RETRY_S) from exc
    return wrapped



@retried_through_outages
def reconcile_service(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    service = _service(body, memo)
    state = _state(memo, body)
    with state.lock:
        reconcile.sync_children(memo.kube, service, body, memo.options.monitor, state.configs)
        # A spec change (or a restart) reads the metrics at once: status keeps its measurements, autotune reacts.
        _apply_to_kopf_patch(refresh(memo, service, body, repair=False), patch)


@retried_through_outages
def serve_spec_server(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    service = _service(body, memo)
    state = _state(memo, body)
    with state.lock:
        config = reconcile.serve_scheduler(memo.kube, service, body, service.spec.server, why="spec.server changed",
                                           memory=state.configs)
    # Record the generation at once: it is where numbering resumes if the ConfigMap is ever lost.
    patch.status.update(status_mod.served_config_fields(config))


def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """An owned Deployment or ConfigMap changed (or went): refresh its InferenceService."""
    meta = body.get("metadata") or {}
    name = (meta.get("labels") or {}).get(builders.LABEL_SERVICE)
    if not (name and meta.get("namespace")):
        return
    try:
        refresh_owner(memo, meta["namespace"], name)
    except (KubeError, urllib3.exceptions.HTTPError) as exc:
        # The API server went away between the event and the refresh. Its watch re-lists when it is back, and the
        # control loop refreshes every service on its own clock: one line, not a traceback per event.
        log.warning("refresh of %s/%s after a child change failed: %s", meta["namespace"], name, exc)


def forget(name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    memo.services.forget(namespace, name)
    if "metrics" in memo:
        memo.metrics.forget(namespace, name)
    logger.info("InferenceService %s/%s deleted; its children are garbage-collected", namespace, name)


# --- the control loop ----------------------------------------------------------------------------------------


class ControlLoop:
    """One thread for the operator: every `interval_s` it refreshes the services whose reading is due. A
    failure costs that service one pass, never the loop."""

    MAX_BACKOFF_S = 60.0

    def __init__(self, memo: kopf.Memo, interval_s: float):
        self.memo, self.interval_s = memo, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        # A service whose refresh failed (the API server away) is retried after a doubling pause, not every pass.
        self._failures: dict[tuple[str, str], tuple[int, float]] = {}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.run_once(time.monotonic())

    def run_once(self, now: float) -> None:
        """One pass: refresh every due service that is not pausing after a failure."""
        for key in self.memo.services.due(time.time()):
            if self._stop.is_set():
                return
            failures, retry_at = self._failures.get(key, (0, 0.0))
            if now < retry_at:
                continue
            try:
                refresh_owner(self.memo, *key)
                self._failures.pop(key, None)
            except Exception as exc:  # noqa: BLE001 - an API hiccup costs this service a pause, not the loop
                pause = min(self.interval_s * 2 ** failures, self.MAX_BACKOFF_S)
                self._failures[key] = (failures + 1, now + pause)
                log.warning("control loop: %s/%s: %s (next try in %.0f s)", *key, exc, pause)


def start_control_loop(memo: kopf.Memo, **_: Any) -> None:
    memo.control_loop = ControlLoop(memo, memo.options.status_interval_seconds)
    memo.control_loop.start()


def stop_control_loop(memo: kopf.Memo, **_: Any) -> None:
    loop = getattr(memo, "control_loop", None)
    if loop is not None:
        loop.stop()


def register(registry: kopf.OperatorRegistry, options: OperatorOptions) -> None:
    on = kopf.on
    on.startup(registry=registry)(configure_settings)
    on.startup(registry=registry)(start_control_loop)
    on.cleanup(registry=registry)(stop_control_loop)
    on.login(registry=registry)(login)
    on.resume(*RESOURCE, registry=registry)(reconcile_service)
    on.create(*RESOURCE, registry=registry)(reconcile_service)
    on.update(*RESOURCE, registry=registry)(reconcile_service)
    on.field(*RESOURCE, field="spec.server", registry=registry)(serve_spec_server)
    on.delete(*RESOURCE, registry=registry, optional=True)(forget)
    for group, version, plural in CHILD_KINDS:
        on.event(group=group, version=version, plural=plural, labels=CHILD_LABELS, registry=registry,
                 id=f"child_changed/{plural}")(child_changed)
