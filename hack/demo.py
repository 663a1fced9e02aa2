#!/usr/bin/env python3
"""`make demo`: Metronome's closed loop on this machine, from nothing to a retuned service.

    python hack/demo.py [--duration SECONDS] [--slo-ms MS] [--concurrency N] [--config-delay LOW-HIGH] [--state-dir DIR]

1. the local control plane (metronome_testing.localcluster: etcd, kube-apiserver, controller-manager, scheduler,
   kwok GPU nodes);
2. the chart, installed with helm. Its operator Pod is Running on a kwok node on paper only, so the real operator
   runs here as a process, with the chart's ServiceAccount token (the chart's RBAC is what it gets);
3. the kubelet stand-in (metronome_testing.standin): a real `metronome serve` on 127.0.0.x for each Running server
   pod, its config folder kept in sync with the pod's ConfigMap by the `..data` swap, each change landing after a
   kubelet-like delay (--config-delay, default 5-15 s; a real node takes 30-90 s), printed as `[kubelet]` lines;
4. Debian's Prometheus scraping those servers every second (file_sd targets written by the stand-in);
5. examples/inferenceservice.yaml, then a merge patch that fits it to this CPU machine (fcfs from chunk 512, a
   short tuning interval and window, autotune off until a target is known) — printed before it is applied;
6. long-short load against the servers (server/bench); after 20 s of it, a TBT target that chunk 512 violates,
   chosen from those 20 s (metronome_testing.closedloop.slo; or --slo-ms), and autotune on;
7. `kubectl get inferenceservices` every few seconds, so CHUNK, TBT-P99 and SLO visibly change as the operator
   retunes.
--duration counts from the start of the load; 0 runs until Ctrl-C. Either way everything started here is stopped by
its pid at the end (servers, operator, Prometheus, control plane) and the exit code is 0 when the run went as planned.
Only 127.0.0.0/8 is contacted.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from metronome_testing.chart import install_chart, service_account_kubeconfig
from metronome_testing.checkout import EXAMPLE, ROOT
from metronome_testing.closedloop import LoadDriver, LoadSpec
from metronome_testing.closedloop.slo import CalibrationError, choose_tbt_target
from metronome_testing.localcluster import ClusterError, KubeTools, LocalCluster, default_cache_dir
from metronome_testing.operator_process import OperatorProcess
from metronome_testing.standin import DelayRange, KubeletStandIn, StandInOptions, scrape_config

NAME = "smollm2"  # metadata.name in the example
NAMESPACE = "demo"
RELEASE, RELEASE_NAMESPACE = "metronome", "metronome-system"
SERVER_ARGS = ("--kv-cache-memory-gb", "0.5", "--drain-seconds", "2", "--log-level", "warning")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=0.0,
                        help="seconds of load and tuning after the servers are up; 0 = until Ctrl-C (default)")
    parser.add_argument("--slo-ms", type=int, default=None,
                        help="p99 TBT target (default: chosen from 20 s of load at chunk 512, as docs/e2e.md explains)")
    parser.add_argument("--concurrency", type=int, default=LoadSpec.concurrency_per_server,
                        help="concurrent requests per server (default %(default)s)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between table prints")
    parser.add_argument("--config-delay", type=_delay_range, default=DEMO_CONFIG_DELAY,
                        help="seconds from a ConfigMap write to the servers' config folders, LOW-HIGH or one number "
                             "(default 5-15; a real kubelet: 30-90)")
    parser.add_argument("--state-dir", type=Path, default=default_cache_dir() / "clusters" / "demo",
                        help="the demo cluster's folder (logs are kept there)")
    return parser


# The CPU adaptation of the example (docs/e2e.md has the measurements behind these numbers): fcfs, so the
# prefill budget can go below split's 512-token floor; steps of 0.1-1 s, so a short interval and window.
INITIAL_CHUNK, FLOOR_CHUNK = 512, 32
CALIBRATION_S = 20.0
FALLBACK_SLO_MS = 1000
CPU_PATCH = {"spec": {
    "server": {"chunkSize": INITIAL_CHUNK, "queuePolicy": "fcfs", "maxNumSeqs": 16},
    "autotune": {"mode": "off", "policy": "model", "intervalSeconds": 5, "cooldownSeconds": 10,
                 "minChunkSize": FLOOR_CHUNK, "maxChunkSize": 1024, "chunkGranularity": 32, "deadbandLow": 0.3,
                 "policySwitching": False},
    "metrics": {"windowSeconds": 20},
}}


DEMO_CONFIG_DELAY = DelayRange(5.0, 15.0)  # short enough that a few minutes show several retunes


def _delay_range(text: str) -> DelayRange:
    try:
        return DelayRange.parse(text, "--config-delay")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Stop:
    """Ctrl-C / SIGTERM → a flag the main loop checks; a second Ctrl-C is ignored while cleaning up."""

    def __init__(self) -> None:
        self.event = threading.Event()
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        if not self.event.is_set():
            print(f"\n[demo] {signal.Signals(signum).name}: stopping and cleaning up", flush=True)
        self.event.set()

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration < 0:
        print("demo: --duration must be >= 0", file=sys.stderr)
        return 2
    stop = Stop()
    cluster = LocalCluster(args.state_dir)
    started: list = []  # what to stop, newest first
    try:
        return run(args, stop, cluster, started)
    except (ClusterError, RuntimeError, OSError, ValueError) as exc:
        if stop.event.is_set():  # Ctrl-C interrupted a kubectl/helm call: a requested stop, not a failure
            return 0
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        say("cleaning up")
        for item in reversed(started):
            try:
                item.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the rest
                print(f"demo: stopping {type(item).__name__} failed: {exc}", file=sys.stderr)
        cluster.down()
        say(f"everything stopped; logs in {args.state_dir / 'logs'} and {args.state_dir / 'standin'}")


def run(args, stop: Stop, cluster: LocalCluster, started: list) -> int:
    say("starting the local control plane (a first run builds the Go tools: many minutes)")
    info = cluster.up()
    kube = KubeTools(kubeconfig=info.kubeconfig, bin_dir=info.bin_dir, api_url=info.api_url, logs_dir=info.logs_dir)
    say(f"Kubernetes {info.kubernetes_version} at {info.api_url}; export KUBECONFIG={info.kubeconfig}")
    if stop.event.is_set():
        return 0

    work = args.state_dir / "demo"
    standin = KubeletStandIn(info.kubeconfig, StandInOptions(work_dir=args.state_dir / "standin",
                                                             extra_args=SERVER_ARGS, config_delay=args.config_delay))
    standin.start()
    started.append(standin)
    say(f"kubelet stand-in: ConfigMap changes reach the servers {args.config_delay.describe()} after they are seen")
    config = work / "prometheus.yml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(scrape_config(standin.options.targets_path, 1.0))
    prometheus_url = cluster.start_prometheus(config)
    say(f"Prometheus at {prometheus_url}, scraping the stand-in's servers every second")

    say("helm install of charts/metronome")
    service_account = install_chart(kube, RELEASE, RELEASE_NAMESPACE).service_account
    kubeconfig = service_account_kubeconfig(kube, RELEASE_NAMESPACE, service_account, work / "operator.kubeconfig")
    operator = OperatorProcess(kubeconfig=kubeconfig, log_dir=args.state_dir / "logs",
                               prometheus_url=prometheus_url, status_interval_s=2.0)
    operator.start()
    started.append(operator)
    say(f"operator running as ServiceAccount {RELEASE_NAMESPACE}/{service_account} (log {operator.log_path})")

    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    kube.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
    say(f"applied {EXAMPLE.relative_to(ROOT)}; fitting it to this CPU machine with:\n  {json.dumps(CPU_PATCH)}")
    _patch(kube, CPU_PATCH)

    replicas = int(kube.kubectl("get", "inferenceservices.metronome.dev", NAME, "-n", NAMESPACE,
                                "-o", "jsonpath={.spec.replicas}").stdout or 1)
    say(f"waiting for {replicas} servers (the stand-in loads the model once per pod)")
    deadline = time.monotonic() + 600
    while not stop.event.is_set() and len(standin.ready_servers(NAMESPACE)) < replicas:
        if time.monotonic() > deadline:
            standin.wait_for_servers(replicas, NAMESPACE, timeout_s=1)  # raises, with the servers' logs
        stop.wait(2)
    if stop.event.is_set():
        return 0

    spec = LoadSpec(concurrency_per_server=args.concurrency)
    load = _start_load(standin, spec)
    started.append(load)
    say(f"long-short load: {spec.concurrency_per_server} concurrent requests per server, {spec.long_fraction:.0%} "
        f"of prompts {spec.long_prompt_len} tokens, the rest {spec.short_prompt_len}; {spec.output_len} output "
        "tokens each")
    end = time.monotonic() + args.duration if args.duration else None
    slo_ms = args.slo_ms
    if slo_ms is not None:
        _enable_autotune(kube, slo_ms)
    else:
        say(f"measuring {CALIBRATION_S:g} s at chunk {INITIAL_CHUNK} to choose a TBT target")
    servers = {s.base_url for s in standin.servers(NAMESPACE)}
    shown: set = set()  # config updates already printed as applied
    while not stop.event.is_set():
        table = kube.kubectl("get", "inferenceservices.metronome.dev", "-n", NAMESPACE, check=False)
        p99 = load.tbt_p99_s(since_s=max(0.0, load.now() - 20))
        client = f"client-side p99 TBT (last 20 s): {p99 * 1e3:.0f} ms" if p99 else "client-side p99 TBT: -"
        print(f"\n{time.strftime('%H:%M:%S')}  {client}; completed {load.completed()}, "
              f"errors {len(load.errors())}\n{table.stdout.rstrip() or table.stderr.rstrip()}", flush=True)
        _print_config_updates(standin, shown)
        gaps = load.gaps_since(0.0)
        if slo_ms is None and load.now() >= CALIBRATION_S and len(gaps) >= 100:
            slo_ms = _calibrated_slo_ms(gaps)
            _enable_autotune(kube, slo_ms)
        now_servers = {s.base_url for s in standin.servers(NAMESPACE)}
        if now_servers != servers and len(standin.ready_servers(NAMESPACE)) == len(now_servers):
            servers = now_servers  # replicas changed: drive the new set
            started.remove(load)
            load.stop()
            load = _start_load(standin, spec)
            started.append(load)
        if end is not None and time.monotonic() >= end:
            break
        stop.wait(args.interval if end is None else max(0.0, min(args.interval, end - time.monotonic())))
    final = kube.kubectl("get", "inferenceservices.metronome.dev", NAME, "-n", NAMESPACE,
                         "-o", "jsonpath={.status.slo} {.status.chunkSize} {.status.tbtP99Ms}", check=False).stdout
    say(f"final: SLO, CHUNK, TBT-P99 = {final} (target {slo_ms} ms)")
    return 0


def _print_config_updates(standin: KubeletStandIn, shown: set) -> None:
    """The kubelet's lag, made visible: ConfigMap changes still waiting for a pod's sync, and the ones just applied."""
    pending, applied = standin.config_updates()
    now = time.monotonic()
    for update in applied:
        if (update.volume, update.seen_at) not in shown:
            shown.add((update.volume, update.seen_at))
            print(f"[kubelet] {_pod_name(update.volume)}: {update.summary} applied {update.delay_s:.1f} s after the "
                  "ConfigMap change was seen", flush=True)
    for update in pending:
        print(f"[kubelet] {_pod_name(update.volume)}: {update.summary} waiting for the pod's sync "
              f"(seen {now - update.seen_at:.0f} s ago, applies in {max(0.0, update.due_at - now):.0f} s)", flush=True)


def _pod_name(volume: str) -> str:
    return volume.split(" ", 1)[0].split("/")[1]  # "<namespace>/<pod>/<uid> <mount>"


def _patch(kube: KubeTools, patch: dict) -> None:
    kube.kubectl("patch", "inferenceservices.metronome.dev", NAME, "-n", NAMESPACE, "--type=merge",
                 "-p", json.dumps(patch))


def _calibrated_slo_ms(gaps: list[float]) -> int:
    from metronome.server.bench.load.stats import percentile

    try:
        calibration = choose_tbt_target(percentile(gaps, 50), percentile(gaps, 99), INITIAL_CHUNK, FLOOR_CHUNK)
    except CalibrationError as exc:
        say(f"{exc}; using {FALLBACK_SLO_MS} ms")
        return FALLBACK_SLO_MS
    say(f"{len(gaps)} token gaps {calibration.describe()}")
    return round(calibration.target_s * 1000)


def _enable_autotune(kube: KubeTools, slo_ms: int) -> None:
    say(f"SLO p99 TBT {slo_ms} ms, autotune on (mode apply, policy model)")
    _patch(kube, {"spec": {"slo": {"tbtP99Ms": slo_ms}, "autotune": {"mode": "apply"}}})


def _start_load(standin: KubeletStandIn, spec: LoadSpec) -> LoadDriver:
    urls = [s.base_url for s in standin.ready_servers(NAMESPACE)]
    return LoadDriver(urls, spec).start()


if __name__ == "__main__":
    sys.exit(main())
