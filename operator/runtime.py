"""The operator at run time: the cache the watches fill, the work queue, the workers that reconcile one service at a
time, and the control loop's clock.

Level-triggered, as controllers in Kubernetes are: every watch event (an InferenceService, any of its children, one
of its pods, the CRD of an optional child kind) only puts the owner's key on the queue; a worker then reconciles
the service as a whole from the cache — write what differs from the spec, read metrics when due, write what status
now says — whatever the events were. Nothing depends on having seen a particular event, so nothing is lost when
the operator restarts, when a leader changes, or when the watch re-lists after the API server was away; and kopf's
change detection, with the progress annotations an old leader could leave behind, is not used at all.

The control loop is a clock: every --status-interval it queues the services whose Prometheus reading is due. An
idle service costs the API server nothing.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome.contract.rfc3339 import format_time
from metronome.operator import external_scalers, kinds, reconcile, startup_reads
from metronome.operator import status as status_mod
from metronome.operator.cache import LABEL_SERVICE, ObjectCache
from metronome.operator.changes import WARNING, describe_transitions
from metronome.operator.control_loop import tick
from metronome.operator.k8s import Kube, KubeError, LeadershipLost, namespace_terminating
from metronome.operator.operator_metrics import OperatorMetrics
from metronome.operator.options import OperatorOptions
from metronome.operator.spec import InferenceService, SpecError, parse_service
from metronome.operator.tuning import autotune
from metronome.operator.workqueue import WorkQueue

log = logging.getLogger(__name__)

WORKERS = 4  # services reconciled at once (never one service twice at once)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0  # a failed reconcile is retried after a doubling pause
FENCED_RETRY_S = 1.0  # a reconcile the Lease's fence stopped is tried again after this
NOT_FOUND = 404


# --- per-service state, operator-wide ------------------------------------------------------------------------


@dataclass
class ServiceState:
    uid: str
    tuner: autotune.TunerMemory = field(default_factory=autotune.TunerMemory)
    configs: reconcile.ConfigMemory = field(default_factory=reconcile.ConfigMemory)  # the server.yaml it wrote
    refused: reconcile.SyncMemory = field(default_factory=reconcile.SyncMemory)
    invalid_generation: int | None = None  # the generation whose InvalidSpec was announced
    failures: int = 0  # reconciles failed in a row (the retry back-off)


class Services:
    """Every InferenceService this operator serves: its tuner memory (when to read Prometheus next, the last
    reading), the server.yaml it last wrote, the refusal it last reported. Lost on restart, which only means an
    early first reading, one parse of each ConfigMap and one dry run."""

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
        # The spec's own changes are read at once by their reconcile; here only the interval counts.
        return [key for key, state in items if state.tuner.due(now, state.tuner.spec_generation)]

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._states.pop((namespace, name), None)


# --- the runtime ---------------------------------------------------------------------------------------------


class Runtime:
    def __init__(self, kube: Kube, options: OperatorOptions, cache: ObjectCache | None = None,
                 workers: int = WORKERS, metrics: OperatorMetrics | None = None):
        self.kube, self.options = kube, options
        self.metrics = metrics  # the operator's own series (decisions, SLO targets), when served
        self.cache = cache or ObjectCache()
        self.queue = WorkQueue()
        self.services = Services()
        self.startup_reads = startup_reads.StartupReads()  # per process: a new leader is a new process
        self._workers = workers
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        for index in range(self._workers):
            self._spawn(self._work, f"reconcile-{index}")
        self._spawn(self._clock, "control-loop")

    def _spawn(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop taking work; wait up to `grace_s` for the reconciles in flight."""
        self._stop.set()
        self.queue.shutdown()
        deadline = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # --- what the watches deliver ------------------------------------------------------------------------------

    def observe(self, kind: kinds.Kind, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """A watch event (event_type None: the initial listing): keep the object, queue its service."""
        meta = obj.get("metadata") or {}
        if kind in kinds.SCALERS:
            self._observe_scaler(kind, event_type, obj)
            return
        if event_type == "DELETED":
            self.cache.delete(kind.kind, obj)
        else:
            self.cache.put(kind.kind, obj)
        if kind is kinds.CRD:
            if meta.get("name") in kinds.OPTIONAL_CRDS:
                self.queue_all()  # a child kind appeared or went: every service gets or drops that child
            return
        if kind is kinds.INFERENCE_SERVICE:
            if event_type == "DELETED":
                self.services.forget(meta.get("namespace"), meta.get("name"))
                if self.metrics is not None:
                    self.metrics.forget(meta.get("namespace"), meta.get("name"))
                log.info("InferenceService %s/%s deleted; its children are garbage-collected",
                         meta.get("namespace"), meta.get("name"))
                return
            self.queue.add((meta.get("namespace"), meta.get("name")))
            return
        owner = (meta.get("labels") or {}).get(LABEL_SERVICE)
        if owner and meta.get("namespace"):
            self.queue.add((meta["namespace"], owner))

    def _observe_scaler(self, kind: kinds.Kind, event_type: str | None, obj: Mapping[str, Any]) -> None:
        """An HPA or a ScaledObject: queue the services it targeted before and targets now. Its status changes
        (every few seconds while it scales) move nothing here, so only a new one, a deleted one or a changed
        scaleTargetRef queues a reconcile."""
        meta = obj.get("metadata") or {}
        before = self.cache.get(kind.kind, meta.get("namespace"), meta.get("name") or "")
        if event_type == "DELETED":
            self.cache.delete(kind.kind, obj)
        else:
            self.cache.put(kind.kind, obj)
        retargeted = before is None or event_type == "DELETED" or (
            external_scalers.scale_target(kind.kind, before) != external_scalers.scale_target(kind.kind, obj))
        if not retargeted:
            return
        for key in (external_scalers.targeted_services(kind.kind, before, self.cache)
                    | external_scalers.targeted_services(kind.kind, obj, self.cache)):
            self.queue.add(key)

    def queue_all(self) -> None:
        for key in self.cache.names(kinds.INFERENCE_SERVICE.kind):
            self.queue.add(key)

    def crd_served(self, name: str) -> bool:
        """Established and not being deleted: a terminating CRD stays Established while its objects go, but the
        API server refuses new ones (and writing one would be reported as a refused spec)."""
        crd = self.cache.get(kinds.CRD.kind, None, name) or {}
        if (crd.get("metadata") or {}).get("deletionTimestamp"):
            return False
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    # --- the workers and the clock -----------------------------------------------------------------------------

    def _work(self) -> None:
        while self.process_next():
            pass

    def process_next(self, timeout_s: float | None = None) -> bool:
        """Reconcile the next queued service; False once the queue is shut down (or nothing came in time)."""
        key = self.queue.get(timeout_s)
        if key is None:
            return False
        try:
            self.reconcile(*key)
        except LeadershipLost as exc:
            # Nothing was written. Either the Lease is gone — the renew thread then shuts the queue and the
            # process down — or a renewal is late and the work resumes once it succeeds.
            log.warning("%s/%s: %s", *key, exc)
            self.queue.add_after(key, FENCED_RETRY_S)
        except Exception as exc:  # noqa: BLE001 - one service's failure must not stop the worker
            self._retry_later(key, exc)
        finally:
            self.queue.done(key)
        return True

    def _retry_later(self, key: tuple[str, str], exc: Exception) -> None:
        if isinstance(exc, KubeError) and namespace_terminating(exc):
            log.debug("%s/%s: its namespace is being deleted: %s", *key, exc)
            return  # the deletion of the resource follows; nothing to retry
        state = self.services.state(*key, uid=(self.cache.get(kinds.INFERENCE_SERVICE.kind, *key) or {})
                                    .get("metadata", {}).get("uid") or "")
        state.failures += 1
        pause = min(RETRY_FIRST_S * 2 ** (state.failures - 1), RETRY_MAX_S)
        if isinstance(exc, KubeError) or isinstance(exc, OSError) or "urllib3" in type(exc).__module__:
            log.warning("%s/%s: %s (next try in %.0f s)", *key, exc, pause)
        else:
            log.exception("%s/%s: reconcile failed (next try in %.0f s)", *key, pause)
        self.queue.add_after(key, pause)

    def _clock(self) -> None:
        while not self._stop.wait(self.options.status_interval_seconds):
            for key in self.services.due(time.time()):
                self.queue.add(key)

    # --- one reconcile -----------------------------------------------------------------------------------------

    def reconcile(self, namespace: str, name: str) -> None:
        fence = getattr(self.kube, "fence", None)
        if fence is not None:
            fence()  # a replica that may not write does not start a reconcile either
        owner = self.cache.get(kinds.INFERENCE_SERVICE.kind, namespace, name)
        if owner is None:
            self.services.forget(namespace, name)
            return
        if (owner.get("metadata") or {}).get("deletionTimestamp"):
            return
        state = self.services.state(namespace, name, owner["metadata"].get("uid") or "")
        try:
            service = parse_service(owner, self.options.server_image)
        except SpecError as exc:
            self._report_invalid(owner, state, str(exc))
            return
        state.invalid_generation = None
        awaiting_watches = startup_reads.read_before_reconcile(self.kube, self.cache, self.startup_reads, service,
                                                               self.crd_served, reconcile.CONFIRM_S)
        children = reconcile.Children(kube=self.kube, cache=self.cache, monitor=self.options.monitor,
                                      rules=self.options.slo_rules, crd_served=self.crd_served)
        scalers = external_scalers.cached_scalers(self.cache, service,
                                                  keda_served=self.crd_served(kinds.SCALED_OBJECT.crd))
        outcome = reconcile.sync_children(children, service, owner, state.configs, state.refused, time.time(),
                                          scalers)
        # Once more when what was written, or read in place of a watch's listing, should have come back through
        # the watches.
        if outcome.wrote or awaiting_watches:
            self.queue.add_after((namespace, name), reconcile.CONFIRM_S + 1.0)
        observed = reconcile.observe(self.cache, service, state.configs, outcome.refusal, scalers)
        result = tick(self.kube, service, owner, observed, state.tuner, self.options.prometheus, state.configs,
                      self.cache)
        if self.metrics is not None:
            self.metrics.after_tick(service, result.decision)
        self._write_status(service, owner, result.observed, result.last_decision, result.experiment)
        if result.replicas is not None:  # the autotuner scaled: the next reconcile scales the Deployment
            self._patch_owner(service, {"spec": {"replicas": result.replicas}})
            self.queue.add((namespace, name))
        state.failures = 0

    def _write_status(self, service: InferenceService, owner: Mapping[str, Any], observed: status_mod.Observed,
                      last_decision: dict[str, Any] | None, experiment: dict[str, Any] | None = None) -> None:
        # The owner as cached now: a write earlier in this reconcile (spec.replicas) may have moved it on.
        current = (self.cache.get(kinds.INFERENCE_SERVICE.kind, service.namespace, service.name) or owner)
        status = current.get("status") or {}
        previous = status.get("conditions") or []
        desired = status_mod.compute_status(service, observed, now=format_time(), previous_conditions=previous,
                                            applied_generation=status.get("observedGeneration"))
        patch = status_mod.status_patch(status, desired)
        if last_decision is not None:
            patch["lastDecision"] = last_decision
        if experiment is not None:
            patch["experiment"] = experiment
        if patch:
            self._patch_owner(service, {"status": patch}, subresource="status")
        for event in describe_transitions(previous, desired["conditions"]):
            self.kube.emit_event(owner, event.type, event.reason, event.message)

    def _patch_owner(self, service: InferenceService, body: Mapping[str, Any], subresource: str | None = None):
        try:
            self.kube.patch(kinds.INFERENCE_SERVICE.api_version, kinds.INFERENCE_SERVICE.kind, service.namespace,
                            service.name, body, subresource=subresource)
        except KubeError as exc:
            if exc.status != NOT_FOUND:  # deleted meanwhile: nothing to report to
                raise

    def _report_invalid(self, owner: Mapping[str, Any], state: ServiceState, message: str) -> None:
        """A spec the operator cannot use: Ready says why (once per generation, with a Warning Event); nothing
        is written, and observedGeneration stays at the generation last applied."""
        meta = owner["metadata"]
        generation = int(meta.get("generation") or 0)
        status = owner.get("status") or {}
        conditions = status_mod.invalid_spec_conditions(message, generation=generation, now=format_time(),
                                                        previous=status.get("conditions") or [])
        if conditions != status.get("conditions"):
            try:
                self.kube.patch(kinds.INFERENCE_SERVICE.api_version, kinds.INFERENCE_SERVICE.kind,
                                meta["namespace"], meta["name"], {"status": {"conditions": conditions}},
                                subresource="status")
            except KubeError as exc:
                if exc.status != NOT_FOUND:
                    raise
        if state.invalid_generation != generation:
            state.invalid_generation = generation
            log.warning("%s/%s: InvalidSpec: %s", meta["namespace"], meta["name"], message)
            self.kube.emit_event(owner, WARNING, "InvalidSpec", message)
