"""`metronome operator`: run the InferenceService operator (kopf underneath).

configure() is argparse only; kopf and the Kubernetes client are imported in run(), so `metronome --help` stays
instant and the operator image needs no torch.

With --leader-elect the process first waits for the Lease (operator/leader.py) and runs kopf only while it
holds it; losing it stops kopf and exits with status 1, so the pod restarts as a candidate (as the
kube-controller-manager does). kopf itself always runs standalone: kopf peering is not used (see
docs/operator.md, "Operator replicas").
"""
from __future__ import annotations

import argparse
import os
import socket
import uuid
from pathlib import Path

from metronome.operator import monitoring
from metronome.operator.alerts import RuleSettings
from metronome.operator.leader import LeaseTimes
from metronome.operator.metrics_source import PrometheusSettings
from metronome.operator.monitoring import MonitorSettings
from metronome.operator.options import (
    DEFAULT_HEALTH_PORT,
    DEFAULT_LEASE_NAME,
    DEFAULT_STATUS_INTERVAL_SECONDS,
    LeaderElection,
    OperatorOptions,
)
from metronome.operator.spec import DEFAULT_IMAGE

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOST_LEADERSHIP_EXIT = 1


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], metavar="NS",
        help="watch this namespace (repeat for several); default: all namespaces",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument(
        "--health-port", type=int, default=DEFAULT_HEALTH_PORT,
        help="port of the liveness endpoint GET /healthz (0 = none; default %(default)s)",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="address the liveness endpoint binds to")
    parser.add_argument(
        "--metrics-port", type=int, default=0,
        help="port of the operator's own GET /metrics (the loop's decisions, the SLO targets; 0 = none, the "
        "default)",
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address the metrics endpoint binds to")
    parser.add_argument(
        "--status-interval", type=float, default=DEFAULT_STATUS_INTERVAL_SECONDS, metavar="SECONDS",
        help="how often the control loop looks for services whose Prometheus reading is due; children's "
        "changes refresh status at once (default %(default)s)",
    )
    parser.add_argument(
        "--server-image", default=os.environ.get("METRONOME_SERVER_IMAGE") or DEFAULT_IMAGE, metavar="IMAGE",
        help="server image of InferenceServices without spec.image; changing it rolls their pods "
        f"(default: $METRONOME_SERVER_IMAGE, else {DEFAULT_IMAGE})",
    )
    _prometheus_flags(parser.add_argument_group("Prometheus"))
    _monitor_flags(parser.add_argument_group("monitors"))
    _leader_flags(parser.add_argument_group("replicas (leader election)"))


def _prometheus_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--prometheus-url", default=os.environ.get("METRONOME_PROMETHEUS_URL"),
        help="Prometheus base URL for services without spec.metrics.prometheusUrl "
        "(default: $METRONOME_PROMETHEUS_URL)",
    )
    group.add_argument(
        "--allow-prometheus-url", action="append", default=[], metavar="URL",
        help="a URL spec.metrics.prometheusUrl may name (repeat for several); default: none but --prometheus-url",
    )
    group.add_argument("--prometheus-bearer-token-file", metavar="FILE",
                       help="send 'Authorization: Bearer <file content>' (re-read at every reading)")
    group.add_argument("--prometheus-ca-file", metavar="FILE", help="CA bundle that verifies Prometheus' TLS")
    group.add_argument("--prometheus-insecure-skip-verify", action="store_true",
                       help="do not verify Prometheus' TLS certificate (opt-in; never the default)")
    group.add_argument(
        "--scrape-interval", type=float, default=None, metavar="SECONDS",
        help="how often Prometheus scrapes the servers: every PromQL range spans at least 4 of it, and the "
        "PodMonitors the operator writes use it (default: picked per service from spec.metrics.windowSeconds)",
    )


def _monitor_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--monitor-kind", choices=monitoring.KINDS, default=monitoring.POD_MONITOR,
        help="PodMonitor: one per service where the cluster serves that API; none: no monitor (a "
        "ServiceMonitor of the chart or pod annotations are what Prometheus scrapes by; existing "
        "PodMonitors are deleted). Default %(default)s",
    )
    group.add_argument("--monitor-label", action="append", default=[], metavar="KEY=VALUE",
                       help="label of each PodMonitor (repeat; e.g. release=kube-prometheus-stack)")
    group.add_argument(
        "--scrape-annotations", choices=monitoring.ANNOTATION_MODES, default=monitoring.AUTO,
        help="prometheus.io/* scrape annotations on the server pods: auto = only while no PodMonitor of the "
        "operator scrapes them (a Prometheus that discovers pods by annotation would scrape them twice), always, "
        "never (e.g. under a ServiceMonitor). Default %(default)s",
    )
    group.add_argument("--slo-alerts", action="store_true",
                       help="write a PrometheusRule per InferenceService with an SLO: its TBT (and TTFT, "
                       "throughput) target as alerts, where the cluster serves the PrometheusRule API")
    group.add_argument("--slo-alert-for", type=int, default=10, metavar="MINUTES",
                       help="how long an SLO is violated before its alert fires (default %(default)s)")
    group.add_argument("--slo-alert-label", action="append", default=[], metavar="KEY=VALUE",
                       help="label of each SLO PrometheusRule (repeat; e.g. release=kube-prometheus-stack)")


def _leader_flags(group: argparse._ArgumentGroup) -> None:
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--standalone", action="store_true",
                      help="act alone, without leader election (the default outside a pod; run one replica)")
    mode.add_argument("--leader-elect", action="store_true",
                      help="act only while holding a coordination.k8s.io Lease (the default in a pod, where "
                      "$POD_NAMESPACE or the service account's namespace names the Lease's namespace)")
    group.add_argument("--lease-name", default=DEFAULT_LEASE_NAME, help="the Lease's name (default %(default)s)")
    group.add_argument("--lease-namespace", default=None,
                       help="the Lease's namespace (default: $POD_NAMESPACE, else the service account's)")
    times = LeaseTimes()
    group.add_argument("--lease-duration", type=float, default=times.duration_s, metavar="SECONDS",
                       help="a silent leader is replaced after this long (default %(default)s)")
    group.add_argument("--lease-renew-deadline", type=float, default=times.renew_deadline_s, metavar="SECONDS",
                       help="a leader that could not renew for this long stops (default %(default)s)")
    group.add_argument("--lease-retry-period", type=float, default=times.retry_period_s, metavar="SECONDS",
                       help="between attempts to take or renew the Lease (default %(default)s)")


def _fail(message: str) -> SystemExit:
    return SystemExit(f"metronome operator: {message}")


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    if args.health_port < 0 or args.health_port > 65535:
        raise _fail(f"--health-port must be 0..65535, got {args.health_port}")
    if args.metrics_port < 0 or args.metrics_port > 65535:
        raise _fail(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if args.metrics_port and args.metrics_port == args.health_port and args.metrics_host == args.health_host:
        raise _fail(f"--metrics-port and --health-port are both {args.metrics_port}")
    if args.status_interval <= 0:
        raise _fail(f"--status-interval must be > 0, got {args.status_interval}")
    if not args.server_image or any(c.isspace() for c in args.server_image):
        raise _fail(f"--server-image must be an image reference without spaces, got {args.server_image!r}")
    try:
        prometheus = PrometheusSettings(
            url=args.prometheus_url or None,
            allowed_urls=tuple(args.allow_prometheus_url),
            bearer_token_file=args.prometheus_bearer_token_file,
            ca_file=args.prometheus_ca_file,
            insecure_skip_verify=args.prometheus_insecure_skip_verify,
            scrape_interval_seconds=args.scrape_interval,
        )
        monitor = MonitorSettings(kind=args.monitor_kind,
                                  labels=tuple(monitoring.parse_label(label) for label in args.monitor_label),
                                  interval_seconds=args.scrape_interval, scrape_annotations=args.scrape_annotations)
        rules = RuleSettings(labels=tuple(monitoring.parse_label(label, "--slo-alert-label")
                                          for label in args.slo_alert_label),
                             for_minutes=args.slo_alert_for) if args.slo_alerts else None
        leader = _leader_election(args) if _elects(args) else None
    except ValueError as exc:
        raise _fail(str(exc)) from exc
    return OperatorOptions(
        namespaces=tuple(dict.fromkeys(args.namespace)),
        prometheus=prometheus,
        monitor=monitor,
        log_level=args.log_level,
        health_host=args.health_host,
        health_port=args.health_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        leader_election=leader,
        status_interval_seconds=args.status_interval,
        server_image=args.server_image,
        slo_rules=rules,
    )


def _elects(args: argparse.Namespace) -> bool:
    """--leader-elect or --standalone as given; by default, leader election wherever the process runs in a pod
    (a second replica must never act alongside the first), standalone on a workstation."""
    if args.leader_elect or args.standalone:
        return args.leader_elect
    return bool(os.environ.get("POD_NAMESPACE")) or SERVICE_ACCOUNT_NAMESPACE.is_file()


def _leader_election(args: argparse.Namespace) -> LeaderElection:
    namespace = args.lease_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace and SERVICE_ACCOUNT_NAMESPACE.is_file():
        namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    if not namespace:
        raise ValueError("--leader-elect needs --lease-namespace (or $POD_NAMESPACE, or to run in a pod)")
    times = LeaseTimes(args.lease_duration, args.lease_renew_deadline, args.lease_retry_period)
    # A restarted process is a new candidate: it must not "renew" the Lease its predecessor held.
    identity = f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return LeaderElection(namespace=namespace, name=args.lease_name, identity=identity, times=times)


def _quiet_watches(record) -> bool:
    """kopf logs every watch event handled at INFO; one line per pod or Deployment status change would flood the
    log (what the reconciles do is logged by the operator itself)."""
    message = record.getMessage()
    return not (message.startswith("Handler 'watch/") and message.endswith("succeeded."))


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)

    import logging
    import threading

    import kopf

    from metronome.operator import crd_discovery, crd_removal, handlers, k8s, kinds, leader, runtime
    from metronome.operator.cache import ObjectCache
    from metronome.operator.operator_metrics import OperatorMetrics

    kopf.configure(debug=options.log_level == "DEBUG")
    logging.getLogger().setLevel(options.log_level)
    if options.log_level != "DEBUG":
        logging.getLogger("kopf.objects").addFilter(_quiet_watches)
    k8s.load_config()

    stop = threading.Event()
    lost = threading.Event()
    cache = ObjectCache()
    leadership = leader.Leadership()
    metrics = OperatorMetrics()
    service_runtime = runtime.Runtime(k8s.Kube(fence=leadership.check, cache=cache), options, cache, metrics=metrics)
    elector = None
    if options.leader_election is not None:
        election = options.leader_election
        elector = leader.LeaderElector(election.namespace, election.name, election.identity, election.times)
        leadership.elector = elector
        standby = leader.StandbyHealth(options.health_host, options.health_port) if options.health_port else None
        try:
            if not elector.acquire(stop):
                return 0
        finally:
            if standby is not None:
                standby.close()

        def on_lost() -> None:
            lost.set()
            stop.set()
            service_runtime.queue.shutdown()  # queued work is dropped; a write in flight is fenced

        elector.keep(stop, on_lost)

    metrics_server = metrics.serve(options.metrics_host, options.metrics_port) if options.metrics_port else None
    registry = kopf.OperatorRegistry()
    handlers.register(registry, options)
    crd_removal.tolerate_unserved_kinds()
    crd_discovery.watch_crds_once_served(kinds.OPTIONAL_CRDS)

    # On SIGTERM kopf runs the cleanup handlers: the runtime's workers stop (handlers.stop_runtime), then the Lease
    # is handed back at once, while the operator still has its permissions (an uninstall deletes them next), so a
    # standby or a reinstall takes over without waiting out the lease. kopf waits on the threading.Event stop flag
    # in an executor thread: set it however kopf stops (a signal too), or interpreter shutdown would wait for that
    # thread forever.
    def stand_down(**_: object) -> None:
        stop.set()
        if elector is not None and not lost.is_set():
            elector.stand_down()

    kopf.on.cleanup(registry=registry)(stand_down)
    try:
        kopf.run(
            registry=registry,
            standalone=True,
            clusterwide=options.clusterwide,
            namespaces=list(options.namespaces),
            liveness_endpoint=options.liveness_endpoint,
            memo=kopf.Memo(runtime=service_runtime),
            stop_flag=stop,
        )
    finally:
        stop.set()
        if metrics_server is not None:
            metrics_server.shutdown()
        if elector is not None and not lost.is_set():
            elector.stand_down()
    return LOST_LEADERSHIP_EXIT if lost.is_set() else 0
