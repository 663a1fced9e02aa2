"""Reconciliation steps, each a few API calls around the pure builders: bring the children in line with the spec,
serve a scheduler config, observe what runs, read the service's metrics from Prometheus. The runtime
(runtime.py) calls these from its workers; the control loop reuses `write_config` to actuate.

What the cluster holds is read from the cache the watches fill (cache.py), never fetched: a child is written only
when it differs from what the operator would write (drift.needs_write) — missing, changed in the spec, or edited
by someone else — so a reconcile that finds everything in place sends nothing.

Before the first write of a change the children to write are applied as a server-side dry run: what the API
server (or an admission webhook, or a quota) refuses is reported in the resource's terms (refusals.py) and
nothing of that change is written, so a refused spec never leaves half its children behind. The same refusal is
not tried again until the spec changes, a retry interval passes, or the operator restarts.

Each service's `ConfigMemory` keeps the server.yaml this process last wrote (configmap.Rendered), so reading the
ConfigMap back parses only what someone else wrote.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metronome.contract.config import ServerConfigFile, next_server_config
from metronome.operator import builders, changes, configmap, drift, inference_pool, kinds, refusals
from metronome.operator.alerts import RuleSettings
from metronome.operator.cache import ObjectCache
from metronome.operator.external_scalers import ScalerView
from metronome.operator.k8s import Kube, KubeError, namespace_terminating
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusSettings, ServiceSelector, try_observe
from metronome.operator.monitoring import MonitorSettings
from metronome.operator.spec import InferenceService
from metronome.operator.status import Observed
from metronome.operator.tuning.autotune import BAD_METRICS_SETTINGS
from metronome.operator.tuning.observation import Observation

log = logging.getLogger(__name__)

RETRY_REFUSED_S = 300.0  # a refused change is dry-run again after this long (a quota or a webhook may relent)
CONFIRM_S = 5.0  # a child written this long ago and not delivered by a watch since is looked up once


def _emit(kube: Kube, owner: Mapping[str, Any], event: changes.EventSpec | None) -> None:
    if event is not None:
        meta = owner["metadata"]
        log.info("%s/%s: %s: %s", meta.get("namespace"), meta.get("name"), event.reason, event.message)
        kube.emit_event(owner, event.type, event.reason, event.message)


@dataclass
class ConfigMemory:
    """The server.yaml this process last wrote for one service (None: nothing yet, or a restart)."""

    written: configmap.Rendered | None = None


@dataclass
class SyncMemory:
    """What the children's sync remembers of one service: the change the API server last refused (what it was,
    why, when it was tried), and the notices already given for a generation (each said once, not per reconcile)."""

    refusal: refusals.Refusal | None = None
    fingerprint: str | None = None
    tried_at: float = 0.0
    announced: set[tuple[str, int]] = field(default_factory=set)
    # (kind, name) -> (fingerprint, resourceVersion) of each child as this process last wrote it
    written: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def stale(self, cached: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
        """`desired` must be written: the child differs (drift.needs_write), unless it is exactly what this
        process wrote and nobody changed it since — a difference then is only how the API server stores it
        (a canonical form, a default), and writing it again would change nothing, at every reconcile."""
        if not drift.needs_write(cached, desired):
            return False
        if cached is None:
            return True
        key = (desired["kind"], desired["metadata"]["name"])
        stamp = desired["metadata"]["annotations"][drift.ANNOTATION_APPLIED]
        return self.written.get(key) != (stamp, (cached.get("metadata") or {}).get("resourceVersion"))

    def wrote(self, desired: Mapping[str, Any], stored: Mapping[str, Any]) -> None:
        key = (desired["kind"], desired["metadata"]["name"])
        stamp = desired["metadata"]["annotations"][drift.ANNOTATION_APPLIED]
        self.written[key] = (stamp, (stored.get("metadata") or {}).get("resourceVersion"))

    def clear(self) -> None:
        self.refusal, self.fingerprint = None, None

    def first_time(self, reason: str, generation: int) -> bool:
        if (reason, generation) in self.announced:
            return False
        self.announced = {(r, g) for r, g in self.announced if g == generation}
        self.announced.add((reason, generation))
        return True


@dataclass(frozen=True)
class Children:
    """What the children's sync works with: the API, the cache, and the operator's settings for them."""

    kube: Kube
    cache: ObjectCache
    monitor: MonitorSettings = MonitorSettings()
    rules: RuleSettings | None = None  # --slo-alerts: a PrometheusRule per service with an SLO
    crd_served: Callable[[str], bool] = lambda name: False


@dataclass(frozen=True)
class SyncOutcome:
    config: ServerConfigFile | None = None  # what the ConfigMap serves after the sync
    refusal: refusals.Refusal | None = None  # the change the API server refused (nothing of it written)
    wrote: bool = False  # children were written (to be seen again once their watch events are due)


def _cached(cache: ObjectCache, obj: Mapping[str, Any]) -> dict[str, Any] | None:
    meta = obj["metadata"]
    return cache.get(obj["kind"], meta.get("namespace"), meta["name"])


def _read_uncached_children(kube: Kube, cache: ObjectCache, service: InferenceService) -> None:
    """Right after the operator starts (a restart, a new leader) the cache may hold a service before its children:
    the watches list kind by kind. Two children are planned from what the cluster holds, and planned from that gap
    would undo it: the ConfigMap (the config the servers run would be written again as a new generation: a reload
    of every server, a ConfigCreated Event) and the Deployment (while an HPA or a ScaledObject scales it, it keeps
    the count the scaler set, read from the Deployment itself: missing, it would be written with spec.replicas).
    So either one the cache lacks is read from the API first; kept as unconfirmed, its watch event confirms it (or
    a later lookup drops it). A service's first reconcile, before it has any, costs a GET of each."""
    names = builders.child_names(service.name)
    for kind, name in ((kinds.CONFIG_MAP, names.config_map), (kinds.DEPLOYMENT, names.deployment)):
        if cache.get(kind.kind, service.namespace, name) is not None:
            continue
        live = kube.get(kind.api_version, kind.kind, service.namespace, name)
        if live is not None:
            cache.put_read(kind.kind, live)


def _verify_unconfirmed(kube: Kube, cache: ObjectCache, children: list[dict[str, Any]]) -> None:
    """Look up each child the operator wrote that no watch has delivered since (see cache.py): one deleted while
    its kind's watch was not yet running is forgotten, so that it is written again."""
    for child in children:
        meta = child["metadata"]
        if cache.unconfirmed(child["kind"], meta.get("namespace"), meta["name"], CONFIRM_S):
            if kube.get(child["apiVersion"], child["kind"], meta.get("namespace"), meta["name"]) is None:
                cache.forget(child["kind"], meta.get("namespace") or "", meta["name"])
            else:
                cache.confirm(child["kind"], meta.get("namespace"), meta["name"])


# --- the ConfigMap -------------------------------------------------------------------------------------------


def _last_generation(existing: Mapping[str, Any] | None, owner: Mapping[str, Any]) -> int:
    """The highest generation ever written (ConfigMap annotation or status), so that a rewritten server.yaml
    continues the numbering and metronome_config_generation only moves forward."""
    annotations = ((existing or {}).get("metadata") or {}).get("annotations") or {}
    written = str(annotations.get(configmap.ANNOTATION_CONFIG_GENERATION, "0"))
    in_status = (owner.get("status") or {}).get("configGeneration") or 0
    return max(int(written) if written.isdigit() else 0, int(in_status))


@dataclass(frozen=True)
class ConfigPlan:
    """What the ConfigMap should serve now, and whether that takes a write."""

    before: ServerConfigFile | None  # what it serves now (None: missing or invalid)
    config: ServerConfigFile
    why: str  # for the Event of a new generation
    invalid: str | None  # the invalid server.yaml being replaced
    rendered: configmap.Rendered
    obj: dict[str, Any]  # the ConfigMap to write (stamped)
    write: bool


def plan_config(cache: ObjectCache, service: InferenceService, owner: Mapping[str, Any],
                memory: ConfigMemory) -> ConfigPlan:
    """The ConfigMap keeps the config it serves (the autotuner may have retuned it); spec.server is served as a
    new generation when the ConfigMap is missing or invalid, or when spec.server differs from the one its config
    descends from (the annotation builders.config_map writes). A ConfigMap without that annotation (written before
    it existed) is adopted as it is."""
    existing = cache.get(kinds.CONFIG_MAP.kind, service.namespace, builders.child_names(service.name).config_map)
    current, error = configmap.safe_read_server_config(existing, memory.written)
    recorded = ((existing or {}).get("metadata") or {}).get("annotations", {}).get(configmap.ANNOTATION_SPEC_SERVER)
    if current is None:
        config = ServerConfigFile(generation=_last_generation(existing, owner) + 1, scheduler=service.spec.server)
        why = "from spec.server"
    elif recorded is not None and recorded != configmap.spec_server_digest(service.spec.server):
        config, why = next_server_config(current, service.spec.server), "spec.server changed"
    else:
        config, why = current, ""
    kept = memory.written
    rendered = kept if kept is not None and kept.config == config else configmap.render(config)
    obj = drift.stamped(builders.config_map(service, rendered))
    return ConfigPlan(before=current, config=config, why=why, invalid=error, rendered=rendered, obj=obj,
                      write=drift.needs_write(existing, obj))


def write_config(kube: Kube, service: InferenceService, owner: Mapping[str, Any], before: ServerConfigFile | None,
                 config: ServerConfigFile, why: str, memory: ConfigMemory | None = None) -> ServerConfigFile:
    """Write `config` into the ConfigMap (`before`: what it served, for the Event) and keep its rendering."""
    rendered = configmap.render(config)
    kube.apply(drift.stamped(builders.config_map(service, rendered)))
    if memory is not None:
        memory.written = rendered
    _emit(kube, owner, changes.describe_config(before, config, why))
    return config


def _write_planned_config(kube: Kube, owner: Mapping[str, Any], plan: ConfigPlan, memory: ConfigMemory) -> None:
    if plan.invalid and plan.before is None:
        _emit(kube, owner, changes.EventSpec(changes.WARNING, "InvalidConfig", f"{plan.invalid}; rewriting it"))
    kube.apply(plan.obj)
    memory.written = plan.rendered
    _emit(kube, owner, changes.describe_config(plan.before, plan.config, plan.why))


# --- the workload children -----------------------------------------------------------------------------------


def desired_children(ctx: Children, service: InferenceService, scalers: ScalerView = ScalerView()
                     ) -> tuple[list[dict[str, Any]], list[kinds.Kind]]:
    """The children to keep (stamped), and the kinds of child this service must not have (to delete)."""
    monitored = ctx.monitor.pod_monitors and ctx.crd_served(kinds.POD_MONITOR.crd)
    rules = ctx.rules if ctx.rules is not None and ctx.crd_served(kinds.PROMETHEUS_RULE.crd) else None
    children = builders.workload_children(
        service, scrape_annotations=ctx.monitor.annotate_pods(monitored), pod_monitor_labels=dict(ctx.monitor.labels),
        scrape_interval_seconds=ctx.monitor.interval_seconds, monitored=monitored, rules=rules)
    if service.spec.routing.inference_pool.enabled and ctx.crd_served(kinds.INFERENCE_POOL.crd):
        children.append(inference_pool.inference_pool(service))
    kept = {child["kind"] for child in children}
    retired = [kind for kind in (kinds.DISRUPTION_BUDGET, kinds.POD_MONITOR, kinds.PROMETHEUS_RULE,
                                 kinds.INFERENCE_POOL) if kind.kind not in kept]
    stamped = [drift.stamped(child) for child in children]
    if scalers.on_deployment:
        _keep_scaled_replicas(ctx.cache, service, stamped)
    return stamped, retired


def _keep_scaled_replicas(cache: ObjectCache, service: InferenceService, children: list[dict[str, Any]]) -> None:
    """While an HPA or a ScaledObject scales the Deployment itself, the Deployment keeps the count it set
    (spec.replicas would undo it at every write). Its fingerprint stays the one of spec.replicas, so the scaler's
    moves are no change to write."""
    live = cache.get(kinds.DEPLOYMENT.kind, service.namespace, builders.child_names(service.name).deployment)
    replicas = ((live or {}).get("spec") or {}).get("replicas")
    if not isinstance(replicas, int):
        return
    for child in children:
        if child["kind"] == kinds.DEPLOYMENT.kind:
            child["spec"] = {**child["spec"], "replicas": replicas}


def _pool_notice(ctx: Children, service: InferenceService, children: list[dict[str, Any]]) -> changes.EventSpec | None:
    """Why spec.routing.inferencePool is not served: the cluster lacks the API, or a pool of that name is someone
    else's (the picker's own Helm chart makes one): that one is never overwritten or deleted, so it is dropped
    from `children` (a pool the watch has not delivered is looked up: the watch sees only the operator's own)."""
    if not service.spec.routing.inference_pool.enabled:
        return None
    if not ctx.crd_served(kinds.INFERENCE_POOL.crd):
        return changes.EventSpec(
            changes.WARNING, "InferencePoolUnavailable",
            f"spec.routing.inferencePool is enabled but the cluster does not serve {kinds.INFERENCE_POOL.crd} "
            "(install the Gateway API Inference Extension's CRDs); no InferencePool written")
    pool = next(c for c in children if c["kind"] == kinds.INFERENCE_POOL.kind)
    existing = _cached(ctx.cache, pool) or ctx.kube.get(pool["apiVersion"], pool["kind"], service.namespace,
                                                        pool["metadata"]["name"])
    if existing is None or inference_pool.owned_by(existing, service):
        return None
    children.remove(pool)
    return changes.EventSpec(changes.WARNING, "InferencePoolConflict",
                             f"InferencePool {pool['metadata']['name']} exists and is not this InferenceService's; "
                             "left as it is")


def _refused(exc: KubeError, obj: Mapping[str, Any]) -> refusals.Refusal:
    return refusals.explain(obj["kind"], obj["metadata"]["name"], exc.status, exc.message, exc.details, obj)


def _refusal(exc: KubeError) -> bool:
    """The API server refused the object for what it is (not: it is away, or the namespace is going)."""
    return exc.status in refusals.REFUSAL_STATUSES and not namespace_terminating(exc)


def _dry_run(kube: Kube, writes: list[dict[str, Any]]) -> refusals.Refusal | None:
    """The first of `writes` the API server would refuse (validation, admission, quota), or None."""
    for obj in writes:
        try:
            kube.apply(obj, dry_run=True)
        except KubeError as exc:
            if not _refusal(exc):
                raise
            return _refused(exc, obj)
    return None


def sync_children(ctx: Children, service: InferenceService, owner: Mapping[str, Any], memory: ConfigMemory,
                  refused: SyncMemory, now: float, scalers: ScalerView = ScalerView()) -> SyncOutcome:
    """Write what differs from the spec (the ConfigMap first: the pods mount it), delete the children the spec no
    longer asks for; or, when the API server refuses the change, write nothing and say why. `scalers`: the other
    autoscalers on the service (one on the Deployment keeps its count)."""
    kube, cache = ctx.kube, ctx.cache
    _read_uncached_children(kube, cache, service)
    plan = plan_config(cache, service, owner, memory)
    children, retired = desired_children(ctx, service, scalers)
    _verify_unconfirmed(kube, cache, children)
    stale = [c for c in children if refused.stale(_cached(cache, c), c)]
    if any(c["kind"] == kinds.INFERENCE_POOL.kind for c in stale) or (
            service.spec.routing.inference_pool.enabled and not ctx.crd_served(kinds.INFERENCE_POOL.crd)):
        notice = _pool_notice(ctx, service, children)
        if notice is not None and refused.first_time(notice.reason, service.generation):
            _emit(kube, owner, notice)
        stale = [c for c in stale if c in children]
    writes = ([plan.obj] if plan.write else []) + stale
    if writes:
        fingerprint = drift.fingerprint({"writes": writes})
        if refused.fingerprint == fingerprint and now - refused.tried_at < RETRY_REFUSED_S:
            return SyncOutcome(plan.before, refused.refusal)
        refusal = _dry_run(kube, writes)
        if refusal is not None:
            fresh = refused.fingerprint != fingerprint
            refused.refusal, refused.fingerprint, refused.tried_at = refusal, fingerprint, now
            if fresh:
                _emit(kube, owner, changes.EventSpec(changes.WARNING, refusal.reason, refusal.message))
            return SyncOutcome(plan.before, refusal)
    refused.clear()
    try:
        if plan.write:
            _write_planned_config(kube, owner, plan, memory)
        for child in stale:
            before = _cached(cache, child)
            applied = kube.apply(child)
            refused.wrote(child, applied.obj)
            _emit(kube, owner, changes.describe_child(applied.created, before, applied.obj))
    except KubeError as exc:  # refused after all (a quota filled up since the dry run)
        if not _refusal(exc):
            raise
        refused.refusal, refused.fingerprint, refused.tried_at = _refused(exc, writes[0]), None, now
        return SyncOutcome(plan.before, refused.refusal)
    for kind in retired:
        name = service.name
        if cache.get(kind.kind, service.namespace, name) is not None and kube.delete(
                kind.api_version, kind.kind, service.namespace, name):
            _emit(kube, owner, changes.EventSpec(changes.NORMAL, "Deleted", f"deleted {kind.kind} {name}"))
    return SyncOutcome(plan.config, None, wrote=bool(stale) or plan.write)


# --- what runs -----------------------------------------------------------------------------------------------


def observe(cache: ObjectCache, service: InferenceService, memory: ConfigMemory | None = None,
            refusal: refusals.Refusal | None = None, scalers: ScalerView | None = None) -> Observed:
    """The Deployment, the served config and the server pods, as the watches last delivered them (and the
    scalers the runtime found, for the status)."""
    names = builders.child_names(service.name)
    deployment = cache.get(kinds.DEPLOYMENT.kind, service.namespace, names.deployment)
    existing = cache.get(kinds.CONFIG_MAP.kind, service.namespace, names.config_map)
    config, error = configmap.safe_read_server_config(existing, memory.written if memory is not None else None)
    pods = tuple(cache.owned(kinds.POD.kind, service.namespace, service.name))
    return Observed(deployment=deployment, pods=pods, served_config=config, config_error=error, refusal=refusal,
                    scalers=scalers)


def read_metrics(
    prometheus: PrometheusSettings, url: str, service: InferenceService, now: float
) -> tuple[Observation | None, MetricsUnavailable | None]:
    """One observation of the service from Prometheus at `url` (PrometheusSettings.resolve_url) over its
    spec.metrics window, or why there is none (never raises for Prometheus' sake: a sick Prometheus costs one
    interval, not the status refresh)."""
    try:
        window = prometheus.window(service.spec.metrics.window_seconds)
        source = prometheus.source_for(url)
    except ValueError as exc:  # a URL that is not http(s)://, a window shorter than its sub-window
        return None, MetricsUnavailable(BAD_METRICS_SETTINGS, str(exc))
    except MetricsUnavailable as exc:  # an unreadable token file
        return None, exc
    try:
        return try_observe(source, ServiceSelector(service.namespace, service.name), window, now)
    finally:
        source.close()
