"""KubeletStandIn: runs a real `metronome serve` process for every server Pod that kwok reports Running.

kwok plays the kubelet's bookkeeping (nodes, pod phases) but runs nothing. This harness plays the part that runs
containers, for server pods only: it watches the Pods of InferenceService Deployments through the API server, and
for each Running one it
- projects the pod's config volume (a ConfigMap, or a projected volume of ConfigMaps and the pod's own labels
  through the downward API) into a local folder and keeps it in sync by the `..data` swap
  (metronome.server.bench.configfile), a change of a ConfigMap or of the pod's labels landing after a kubelet-like
  delay (propagation.py: 30-90 s by default, `config_delay` or $METRONOME_STANDIN_CONFIG_DELAY to change it),
- starts `metronome serve` with the pod's own args on its own loopback address 127.0.0.x and a free port
  (podspec.py maps host/port/device and mount paths), restarting it with back-off if it dies,
- lists it in a Prometheus file_sd targets file with the labels namespace/service/pod (targets.py), and writes
  its address on the Pod (annotation `metronome.dev/standin-address`) for Kubernetes service discovery,
and stops the process when the pod is deleted as a kubelet would: the server leaves `servers()` and the targets
file at once (the endpoints' removal), keeps serving through the pod's preStop sleep (at most
`max_pre_stop_seconds`), then gets SIGTERM (its drain), the grace period and SIGKILL. It only ever talks to the API
server and to 127.0.0.0/8; pod IPs are never read.

With `pod_network` it also plays the pod network, for clients that go by pod IP (an InferencePool's endpoint
picker): each server listens on its pod's container port at a loopback address of its own, and that address is
written into the Pod's status.podIP/podIPs as a CNI plugin and the kubelet would. kwok gives a Running pod a fake
10.x IP first; until the stand-in has replaced it, a reader of pod IPs must wait (never contact a 10.x address).

    standin = KubeletStandIn(kubeconfig, StandInOptions(work_dir=...))
    standin.start(); ...; standin.wait_for_servers(2, namespace="ns"); ...; standin.stop()
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metronome.server.bench.configfile import current_files, project
from metronome.server.bench.processes import free_port, http_ok, log_tail

from .loopback import AddressPool, port_is_free
from .podspec import SERVER_POD_SELECTOR, LocalMounts, PodSpecError, ServerPod, is_running, local_argv, server_pod
from .propagation import ConfigUpdate, DelayRange, Propagation
from .server_process import ServerProcess
from .targets import Target, write_file_sd

log = logging.getLogger("standin")

# host:port of the server the stand-in runs for a Pod, written on the Pod: Prometheus' kubernetes_sd_configs
# relabels `__address__` from it (tests/e2e/test_kubernetes_sd.py); pods without it are dropped.
ADDRESS_ANNOTATION = "metronome.dev/standin-address"

# One core per server: two servers and the control plane share a small machine.
DEFAULT_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}


class StandInError(RuntimeError):
    """The stand-in cannot do what was asked (no console script, servers not ready in time, ...)."""


def venv_metronome() -> list[str]:
    """The `metronome` console script of the running interpreter's venv."""
    script = Path(sys.executable).parent / "metronome"
    if not os.access(script, os.X_OK):
        raise StandInError(f"no `metronome` console script next to {sys.executable} (run `make venv`)")
    return [str(script)]


@dataclass(frozen=True)
class StandInOptions:
    work_dir: Path
    targets_file: Path | None = None  # default: <work_dir>/targets.json
    namespaces: tuple[str, ...] = ()  # empty = every namespace
    device: str = "cpu"
    extra_args: tuple[str, ...] = ()  # appended to every server's args (e.g. a KV budget, a short drain)
    env: tuple[tuple[str, str], ...] = tuple(DEFAULT_ENV.items())
    program: tuple[str, ...] = ()  # default: the venv's `metronome`
    first_address: str = "127.0.0.2"
    last_address: str = "127.0.0.254"
    resync_seconds: float = 0.5
    max_grace_seconds: float = 10.0  # a pod may ask for 60 s; a local stop should not take that long
    max_pre_stop_seconds: float = 5.0  # the pod's preStop sleep, at most this long here
    max_restart_backoff_seconds: float = 30.0
    config_delay: DelayRange | None = None  # None: $METRONOME_STANDIN_CONFIG_DELAY, else the kubelet's 30-90 s
    seed: int | None = None  # of the delays' random source (None: unseeded)
    pod_network: bool = False  # listen on the pod's container port, and write the address as the pod's IP

    @property
    def targets_path(self) -> Path:
        return self.targets_file or self.work_dir / "targets.json"


@dataclass(frozen=True)
class ServerInfo:
    """A server the stand-in runs, as tests and the demo see it."""

    namespace: str
    pod: str
    service: str
    address: str
    port: int
    config_dirs: tuple[Path, ...]
    log_path: Path
    restarts: int
    pid: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}"


@dataclass
class _Running:
    pod: ServerPod
    server: ServerProcess
    config_dirs: dict[str, Path]  # mount path → local folder
    grace_s: float
    restarts: int = 0
    restart_at: float | None = None


@dataclass
class _State:
    running: dict[str, _Running] = field(default_factory=dict)  # pod key → server
    problems: dict[str, str] = field(default_factory=dict)  # pod key → why it cannot be played


class KubeletStandIn:
    def __init__(self, kubeconfig: Path | str, options: StandInOptions):
        self.kubeconfig = Path(kubeconfig)
        self.options = options
        self._program = list(options.program) or venv_metronome()
        self._addresses = AddressPool(options.first_address, options.last_address)
        self._state = _State()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._retiring: list[threading.Thread] = []  # servers of deleted pods on their way out
        self._api: Any = None
        self._watch: Any = None
        self.config_delay = options.config_delay or DelayRange.from_env()
        self._propagation = Propagation(self.config_delay, random.Random(options.seed))
        self.last_error: str | None = None

    # --- public API ------------------------------------------------------------------------------------------

    def start(self) -> KubeletStandIn:
        import kubernetes

        if self._threads:
            raise StandInError("the stand-in is already started")
        self.options.work_dir.mkdir(parents=True, exist_ok=True)
        write_file_sd(self.options.targets_path, [])
        self._api = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        self._stopping.clear()
        self._threads = [threading.Thread(target=self._loop, name="standin-sync", daemon=True),
                         threading.Thread(target=self._watch_pods, name="standin-watch", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop syncing, then every server (in parallel), and empty the targets file."""
        self._stopping.set()
        self._wake.set()
        if self._watch is not None:
            self._watch.stop()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads = []
        for thread in self._retiring:
            thread.join(timeout=60)
        self._retiring = []
        with self._lock:
            running = list(self._state.running.items())
            self._state.running.clear()
        stoppers = [threading.Thread(target=self._stop_server, args=(key, entry)) for key, entry in running]
        for stopper in stoppers:
            stopper.start()
        for stopper in stoppers:
            stopper.join()
        write_file_sd(self.options.targets_path, [])
        if self._api is not None:
            self._api.close()
            self._api = None

    def __enter__(self) -> KubeletStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def servers(self, namespace: str | None = None, service: str | None = None) -> list[ServerInfo]:
        with self._lock:
            entries = list(self._state.running.values())
        out = [ServerInfo(namespace=e.pod.namespace, pod=e.pod.name, service=e.pod.service,
                          address=e.server.address, port=e.server.port,
                          config_dirs=tuple(e.config_dirs.values()), log_path=e.server.log_path, restarts=e.restarts,
                          pid=e.server.process.pid if e.server.process else None)
               for e in entries
               if (namespace is None or e.pod.namespace == namespace) and (service is None or e.pod.service == service)]
        return sorted(out, key=lambda s: (s.namespace, s.pod))

    def problems(self) -> dict[str, str]:
        """Pods that cannot be played here, with the reason (pod key → message)."""
        with self._lock:
            return dict(self._state.problems)

    def config_updates(self) -> tuple[list[ConfigUpdate], list[ConfigUpdate]]:
        """(pending, applied): ConfigMap changes waiting out the kubelet delay, and the last ones projected."""
        with self._lock:
            return self._propagation.pending(), self._propagation.history()

    def ready_servers(self, namespace: str | None = None, service: str | None = None) -> list[ServerInfo]:
        """The servers of the selection that answer /ready now."""
        return [s for s in self.servers(namespace, service) if self._ready(s)]

    def wait_for_servers(self, count: int, namespace: str | None = None, service: str | None = None,
                         timeout_s: float = 300.0) -> list[ServerInfo]:
        """Block until `count` servers of the selection answer /ready; fail with their logs otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            servers = self.servers(namespace, service)
            ready = [s for s in servers if self._ready(s)]
            if len(ready) >= count and len(ready) == len(servers):
                return ready
            if time.monotonic() > deadline or self._stopping.is_set():
                details = "\n".join(f"--- {s.pod} ({s.log_path}, restarts {s.restarts}):\n{log_tail(s.log_path, 15)}"
                                    for s in servers)
                raise StandInError(f"{len(ready)}/{count} servers ready after {timeout_s:.0f} s "
                                   f"(problems: {self.problems() or 'none'}; last error: {self.last_error})\n"
                                   f"{details}")
            time.sleep(0.5)

    # --- the loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sync_once()
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - an API hiccup must not end the loop
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("stand-in sync failed: %s", self.last_error)
            self._wake.wait(self.options.resync_seconds)
            self._wake.clear()

    def _watch_pods(self) -> None:
        """Wakes the loop on every pod event (the loop itself lists, so a dropped watch only costs latency)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self._api)
        while not self._stopping.is_set():
            self._watch = kubernetes.watch.Watch()
            try:
                if len(self.options.namespaces) == 1:
                    stream = self._watch.stream(core.list_namespaced_pod, self.options.namespaces[0],
                                                label_selector=SERVER_POD_SELECTOR, timeout_seconds=30)
                else:
                    stream = self._watch.stream(core.list_pod_for_all_namespaces, label_selector=SERVER_POD_SELECTOR,
                                                timeout_seconds=30)
                for _ in stream:
                    self._wake.set()
                    if self._stopping.is_set():
                        break
            except Exception:  # noqa: BLE001 - re-watch after a pause; the loop still lists on its own
                self._stopping.wait(1.0)

    def sync_once(self) -> None:
        """One level-triggered pass: pods → processes, ConfigMaps → folders, processes → targets file."""
        pods = self._list_pods()
        wanted: dict[str, ServerPod] = {}
        annotations: dict[str, dict[str, str]] = {}
        pod_ips: dict[str, str | None] = {}
        problems: dict[str, str] = {}
        for raw in pods:
            if not is_running(raw):
                continue
            try:
                pod = server_pod(raw)
            except PodSpecError as exc:
                meta = raw.get("metadata") or {}
                problems[f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid')}"] = str(exc)
                continue
            wanted[pod.key] = pod
            annotations[pod.key] = (raw.get("metadata") or {}).get("annotations") or {}
            pod_ips[pod.key] = (raw.get("status") or {}).get("podIP")
        with self._lock:
            gone = [key for key in self._state.running if key not in wanted]
            stopping = [(key, self._state.running.pop(key)) for key in gone]
        for key, entry in stopping:
            self._retire(key, entry)
        config_maps: dict[tuple[str, str], dict[str, str] | None] = {}
        for key, pod in wanted.items():
            try:
                self._sync_pod(key, pod, config_maps)
            except (PodSpecError, ValueError, OSError) as exc:
                problems[key] = str(exc)
        with self._lock:
            self._state.problems = problems
            targets = [Target(e.server.target, e.pod.namespace, e.pod.service, e.pod.name)
                       for e in self._state.running.values()]
            unannounced = [(e.pod, e.server.target) for key, e in self._state.running.items()
                           if annotations.get(key, {}).get(ADDRESS_ANNOTATION) != e.server.target]
            unaddressed = [(e.pod, e.server.address) for key, e in self._state.running.items()
                           if self.options.pod_network and pod_ips.get(key) != e.server.address]
        write_file_sd(self.options.targets_path, targets)
        for pod, target in unannounced:
            self._announce(pod, target)
        for pod, address in unaddressed:
            self._set_pod_ip(pod, address)

    def _set_pod_ip(self, pod: ServerPod, address: str) -> None:
        """pod_network: the server's loopback address becomes the Pod's IP (status.podIP and podIPs)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self._api)
        try:
            # A merge patch replaces podIPs whole (a strategic one would add to kwok's 10.x entry).
            core.patch_namespaced_pod_status(pod.name, pod.namespace,
                                             {"status": {"podIP": address, "podIPs": [{"ip": address}]}},
                                             _content_type="application/merge-patch+json", _request_timeout=10)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile has no IP to set
                raise

    def _announce(self, pod: ServerPod, target: str) -> None:
        """Write the server's loopback address on its Pod (ADDRESS_ANNOTATION), where a Prometheus with
        Kubernetes service discovery reads it instead of the pod IP (which must never be contacted)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(self._api)
        try:
            core.patch_namespaced_pod(pod.name, pod.namespace,
                                      {"metadata": {"annotations": {ADDRESS_ANNOTATION: target}}}, _request_timeout=10)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:  # a pod deleted meanwhile has nothing to announce
                raise

    # --- one pod ---------------------------------------------------------------------------------------------

    def _sync_pod(self, key: str, pod: ServerPod, cache: dict) -> None:
        with self._lock:
            entry = self._state.running.get(key)
        pod_dir = self._pod_dir(pod)
        config_dirs = entry.config_dirs if entry else {
            mount: pod_dir / "volumes" / volume.volume for mount, volume in pod.config_maps}
        ready_to_run = True
        for mount, volume in pod.config_maps:
            data = {source.config_map: self._config_map_data(pod.namespace, source.config_map, cache)
                    for source in volume.sources}
            if any(data[source.config_map] is None and not source.optional for source in volume.sources):
                ready_to_run = False  # the kubelet holds the container until the ConfigMap exists
                continue
            files = volume.files(data, dict(pod.labels), dict(pod.annotations))
            folder = config_dirs[mount]
            with self._lock:
                due = self._propagation.ready(f"{key} {mount}", files, current_files(folder))
            if due and project(folder, files):
                log.info("%s: %s synced from ConfigMap %s", key, mount, volume.config_map)
        if entry is None:
            if ready_to_run:
                self._start_server(key, pod, pod_dir, config_dirs)
            return
        code = entry.server.exit_code()
        if code is None:
            return
        now = time.monotonic()
        if entry.restart_at is None:  # just died: schedule a restart, like restartPolicy Always
            delay = min(2.0 ** entry.restarts, self.options.max_restart_backoff_seconds)
            entry.restart_at = now + delay
            log.warning("%s: server exited with %s; restarting in %.0f s. Log tail:\n%s", key, code, delay,
                        entry.server.log_tail())
        elif now >= entry.restart_at:
            entry.restarts += 1
            entry.restart_at = None
            entry.server.start()  # same address and port: clients and Prometheus targets stay valid

    def _start_server(self, key: str, pod: ServerPod, pod_dir: Path, config_dirs: dict[str, Path]) -> None:
        fixed = pod.container_port if self.options.pod_network else None
        if self.options.pod_network and fixed is None:
            raise PodSpecError(f"pod {pod.namespace}/{pod.name}: pod_network needs a containerPort on the server "
                               "container")
        address = self._addresses.take(lambda a: port_is_free(a, fixed)) if fixed else self._addresses.take()
        try:
            port = fixed or free_port(address)
            argv = self._argv(pod, address, port, pod_dir, config_dirs)
        except BaseException:
            self._addresses.give_back(address)
            raise
        env = {**dict(self.options.env), **dict(pod.env), "POD_NAME": pod.name, "POD_NAMESPACE": pod.namespace}
        for name in ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):
            env.pop(name, None)  # the image points caches at its /tmp; here the user's own caches serve
        server = ServerProcess(argv=argv, address=address, port=port, env=env,
                               log_path=self.options.work_dir / "logs" / f"{pod.namespace}_{pod.name}.log")
        server.start()
        grace = min(pod.grace_seconds, self.options.max_grace_seconds)
        with self._lock:
            self._state.running[key] = _Running(pod=pod, server=server, config_dirs=config_dirs, grace_s=grace)
        log.info("%s: started %s on %s (pid %s)", key, " ".join(argv[1:3]), server.target, server.process.pid)

    def _argv(self, pod: ServerPod, address: str, port: int, pod_dir: Path, config_dirs: dict[str, Path]) -> list[str]:
        mounts = [(mount, str(path)) for mount, path in config_dirs.items()]
        mounts += list(pod.host_paths)
        for index, mount in enumerate(pod.scratch_mounts):
            scratch = pod_dir / "volumes" / f"scratch-{index}"
            scratch.mkdir(parents=True, exist_ok=True)
            mounts.append((mount, str(scratch)))
        return local_argv(pod, self._program, address, port, self.options.device, LocalMounts(tuple(mounts)),
                          self.options.extra_args)

    def _retire(self, key: str, entry: _Running) -> None:
        """A deleted pod's server, already out of `servers()` and the targets: its preStop sleep, then the stop,
        in a thread of its own (the sync goes on meanwhile)."""
        def run() -> None:
            self._stopping.wait(min(entry.pod.pre_stop_seconds, self.options.max_pre_stop_seconds))
            self._stop_server(key, entry)

        self._retiring = [t for t in self._retiring if t.is_alive()]
        thread = threading.Thread(target=run, name=f"standin-retire-{entry.pod.name}", daemon=True)
        self._retiring.append(thread)
        thread.start()

    def _stop_server(self, key: str, entry: _Running) -> None:
        with self._lock:
            self._propagation.forget(f"{key} ")
        code = entry.server.stop(entry.grace_s)
        self._addresses.give_back(entry.server.address)
        shutil.rmtree(self._pod_dir(entry.pod), ignore_errors=True)
        log.info("%s: server stopped (exit %s)", key, code)

    def _pod_dir(self, pod: ServerPod) -> Path:
        return self.options.work_dir / "pods" / f"{pod.namespace}_{pod.name}_{pod.uid[:8]}"

    @staticmethod
    def _ready(server: ServerInfo) -> bool:
        return http_ok(f"{server.base_url}/ready")

    # --- API reads -------------------------------------------------------------------------------------------

    def _list_pods(self) -> list[dict]:
        import kubernetes

        core = kubernetes.client.CoreV1Api(self._api)
        if self.options.namespaces:
            items = []
            for namespace in self.options.namespaces:
                items += core.list_namespaced_pod(namespace, label_selector=SERVER_POD_SELECTOR,
                                                  _request_timeout=10).items
        else:
            items = core.list_pod_for_all_namespaces(label_selector=SERVER_POD_SELECTOR, _request_timeout=10).items
        return [self._api.sanitize_for_serialization(pod) for pod in items]

    def _config_map_data(self, namespace: str, name: str, cache: dict) -> dict[str, str] | None:
        import kubernetes

        if (namespace, name) not in cache:
            core = kubernetes.client.CoreV1Api(self._api)
            try:
                config_map = core.read_namespaced_config_map(name, namespace, _request_timeout=10)
                cache[(namespace, name)] = dict(config_map.data or {})
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
                cache[(namespace, name)] = None
        return cache[(namespace, name)]
