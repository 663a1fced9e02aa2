"""`metronome operator-stop`: stop the operator's replicas and remove its Lease — the chart's pre-delete hook.

`helm uninstall` deletes the release's objects one after the other without waiting: the operator's RBAC and its
ServiceAccount go while its pod is still shutting down, so the operator could not hand its Lease back, and a
reinstall waited a whole lease for a holder that no longer existed. Run before anything is deleted, this scales
the operator's Deployment to 0 and waits until its pods are gone (each releases the Lease on SIGTERM, its
permissions still in place), then deletes the Lease (nothing left behind, even from a replica that died without
releasing it). It always exits 0 once done or timed out: a hook that fails would leave the release half-removed.
"""
from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", required=True, help="the operator's namespace (the release's)")
    parser.add_argument("--deployment", required=True, help="the operator's Deployment")
    parser.add_argument("--lease-name", required=True, help="the operator's Lease (in the same namespace)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="how long to wait for the operator's pods to go (default %(default)s)")


def _selector(deployment: dict) -> str:
    labels = ((deployment.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def stop(kube, namespace: str, deployment_name: str, lease_name: str, timeout_s: float,
         poll_s: float = 1.0) -> bool:
    """Scale the operator to 0, wait for its pods to go, delete its Lease; True when every pod went in time."""
    from metronome.operator import kinds

    deployment = kube.get(kinds.DEPLOYMENT.api_version, kinds.DEPLOYMENT.kind, namespace, deployment_name)
    gone = True
    if deployment is not None:
        kube.patch(kinds.DEPLOYMENT.api_version, kinds.DEPLOYMENT.kind, namespace, deployment_name,
                   {"spec": {"replicas": 0}})
        selector = _selector(deployment)
        deadline = time.monotonic() + timeout_s
        while kube.list(kinds.POD.api_version, kinds.POD.kind, namespace, selector):
            if time.monotonic() > deadline:
                log.warning("operator pods of %s/%s still there after %.0f s; going on", namespace, deployment_name,
                            timeout_s)
                gone = False
                break
            time.sleep(poll_s)
    if kube.delete(kinds.LEASE.api_version, kinds.LEASE.kind, namespace, lease_name):
        log.info("deleted Lease %s/%s", namespace, lease_name)
    return gone


def run(args: argparse.Namespace) -> int:
    from metronome.operator import k8s

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    k8s.load_config()
    gone = stop(k8s.Kube(), args.namespace, args.deployment, args.lease_name, args.timeout)
    log.info("operator %s/%s stopped%s", args.namespace, args.deployment, "" if gone else " (not all pods went)")
    return 0
