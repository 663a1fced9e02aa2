"""`metronome operator`: run the InferenceService operator (kopf underneath).

configure() is argparse only; kopf and the Kubernetes client are imported in run(), so `metronome --help` stays
instant and the operator image needs no torch.
"""
from __future__ import annotations

import argparse
import os

from metronome.operator.options import DEFAULT_HEALTH_PORT, DEFAULT_STATUS_INTERVAL_SECONDS, OperatorOptions

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", "-n", action="append", default=[], metavar="NS",
        help="watch this namespace (repeat for several); default: all namespaces",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    parser.add_argument(
        "--prometheus-url", default=os.environ.get("METRONOME_PROMETHEUS_URL"),
        help="Prometheus base URL for services without spec.metrics.prometheusUrl "
        "(default: $METRONOME_PROMETHEUS_URL)",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)
    parser.add_argument(
        "--health-port", type=int, default=DEFAULT_HEALTH_PORT,
        help="port of the liveness endpoint GET /healthz (0 = none; default %(default)s)",
    )
    parser.add_argument("--health-host", default="0.0.0.0", help="address the liveness endpoint binds to")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument(
        "--standalone", action="store_true", default=True,
        help="run without kopf peering (one operator replica; the default)",
    )
    peering.add_argument(
        "--peering", metavar="NAME", default=None,
        help="coordinate with other operator replicas through kopf's ClusterKopfPeering NAME "
        "(needs kopf's peering CRDs)",
    )
    parser.add_argument(
        "--status-interval", type=float, default=DEFAULT_STATUS_INTERVAL_SECONDS, metavar="SECONDS",
        help="how often each InferenceService's status is refreshed (default %(default)s)",
    )


def options_from_args(args: argparse.Namespace) -> OperatorOptions:
    if args.health_port < 0 or args.health_port > 65535:
        raise SystemExit(f"metronome operator: --health-port must be 0..65535, got {args.health_port}")
    if args.status_interval <= 0:
        raise SystemExit(f"metronome operator: --status-interval must be > 0, got {args.status_interval}")
    return OperatorOptions(
        namespaces=tuple(dict.fromkeys(args.namespace)),
        prometheus_url=args.prometheus_url,
        log_level=args.log_level,
        health_host=args.health_host,
        health_port=args.health_port,
        peering=args.peering,
        status_interval_seconds=args.status_interval,
    )


def _quiet_status_refresh(record) -> bool:
    """kopf logs every timer run at INFO; a status refresh every few seconds per service would flood the log."""
    return not record.getMessage().startswith("Timer 'refresh_status' succeeded")


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)

    import logging

    import kopf

    from metronome.operator import handlers, k8s

    kopf.configure(debug=options.log_level == "DEBUG")
    logging.getLogger().setLevel(options.log_level)
    if options.log_level != "DEBUG":
        logging.getLogger("kopf.objects").addFilter(_quiet_status_refresh)
    k8s.load_config()

    registry = kopf.OperatorRegistry()
    handlers.register(registry, options)
    kopf.run(
        registry=registry,
        standalone=options.peering is None,
        peering_name=options.peering,
        clusterwide=options.clusterwide,
        namespaces=list(options.namespaces),
        liveness_endpoint=options.liveness_endpoint,
        memo=kopf.Memo(kube=k8s.Kube(), options=options),
    )
    return 0
