#!/usr/bin/env python3
"""Start, stop or inspect the local Kubernetes control plane on 127.0.0.1.

    python hack/cluster.py up [--with-prometheus] [--prometheus-config FILE] [--state-dir DIR] [--no-build]
    python hack/cluster.py down [--state-dir DIR]
    python hack/cluster.py status [--state-dir DIR]

`up` builds missing tools (hack/build-tools.sh), starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok with two fake 8-GPU nodes, waits until ready, and prints `export KUBECONFIG=<path>` as
its last line. Running it again reuses the running cluster. The Python API lives in metronome_testing.localcluster
(tests/support/) and is re-exported here: LocalCluster(state_dir).up() -> ClusterInfo, .down(),
.start_prometheus(cfg), .stop_prometheus().
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from metronome_testing.localcluster import ClusterError, ClusterInfo, LocalCluster, default_state_dir

__all__ = ["ClusterError", "ClusterInfo", "LocalCluster"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--state-dir", type=Path, default=None,
                        help=f"where pki, data, logs, kubeconfig and state live (default {default_state_dir()})")
    parser.add_argument("--with-prometheus", action="store_true", help="also start Debian's prometheus")
    parser.add_argument("--prometheus-config", type=Path, default=None,
                        help="scrape config for prometheus (implies --with-prometheus; default scrapes the "
                             "API server)")
    parser.add_argument("--no-build", action="store_true", help="fail instead of building missing tools")
    parser.add_argument("--nodes", type=int, default=2, help="number of fake 8-GPU nodes (default 2)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cluster = LocalCluster(args.state_dir, node_count=args.nodes, build=not args.no_build)
    try:
        if args.action == "up":
            info = cluster.up(with_prometheus=args.with_prometheus, prometheus_config=args.prometheus_config)
            print(f"API server:  {info.api_url} (Kubernetes {info.kubernetes_version})"
                  f"{' [already running]' if info.reused else ''}")
            print(f"logs:        {info.logs_dir}")
            print(f"tools:       export PATH={info.bin_dir}:$PATH")
            if info.prometheus_url:
                print(f"prometheus:  {info.prometheus_url}")
            print(f"export KUBECONFIG={info.kubeconfig}")
        elif args.action == "down":
            cluster.down()
            print(f"stopped; logs kept in {cluster.layout.logs_dir}")
        else:
            status = cluster.status()
            print(json.dumps(status, indent=2))
            return 0 if status["up"] else 1
    except ClusterError as error:
        print(f"cluster.py {args.action}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
