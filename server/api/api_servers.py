"""`metronome serve --api-servers N`: N API server processes in front of one engine process (vLLM's
--api-server-count), so that HTTP work (~42 us of CPU per streamed token in one event loop, `bench stream-cost`)
spreads over cores.

What runs where: the main process (PID 1 in a pod) launches the engine process with N channels, spawns N-1 API
workers ("spawn"), handing each its channel and the engine's ReadyInfo, and is API server 0 itself. Every API
server binds its own socket to the same host:port with SO_REUSEPORT, so the kernel spreads connections over
them, and answers every route; each response says who answered in `x-metronome-api-server`. Only server 0
watches the --config file and reconfigures the engine; the others see the applied scheduler in the engine's
stats snapshot. Metrics are prometheus_client multiprocess files in a temporary directory (metrics.py), so any
server's /metrics shows the whole server. Per-client shares and rates are per server.

Lifecycle: SIGTERM (or SIGINT) to the main process is forwarded to the workers as SIGTERM (each worker has a
process group of its own, so a terminal's Ctrl-C does not signal them twice); every server drains its own
requests (lifecycle.py); the main then waits for the workers (ProcessEngine.before_close) and only then stops
the engine. A worker that exits unexpectedly makes the main shut everything down and exit 1 (the kubelet
restarts the pod: no respawning here). A worker whose main process is gone exits by itself, as the engine does.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

log = logging.getLogger("metronome.serve")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
SERVER_HEADER = b"x-metronome-api-server"
WORKER_STOP_GRACE_S = 15.0  # beyond --drain-seconds, how long a worker may take to exit before it is killed
PARENT_POLL_S = 1.0


def check_api_servers(count: int, engine_process: str) -> None:
    """--api-servers N > 1 needs the engine in its own process: a ValueError naming both flags otherwise."""
    if count > 1 and engine_process == "off":
        raise ValueError(f"--api-servers {count} needs the engine in its own process: use --engine-process on or "
                         "auto, not off")


def prepare_metrics_dir() -> str:
    """A fresh PROMETHEUS_MULTIPROC_DIR for this server (inherited by the spawned workers); it must be set before
    prometheus_client is imported, which picks its value store once."""
    if "prometheus_client" in sys.modules:
        raise RuntimeError("prometheus_client was imported before the multiprocess metrics directory was set")
    path = tempfile.mkdtemp(prefix="metronome-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket on host:port that other processes of this user may bind too (SO_REUSEPORT: the kernel spreads
    new connections over the listening sockets). uvicorn listens on it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"--host/--port: cannot bind {host}:{port}: {exc.strerror or exc}") from None
    return sock


class ServerHeader:
    """ASGI middleware: `x-metronome-api-server: <index>` on every HTTP response."""

    def __init__(self, app, index: int):
        self.app = app
        self.header = (SERVER_HEADER, str(index).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        return await self.app(scope, receive, send_with_header)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its API server (pickled to the spawned process)."""

    args: argparse.Namespace  # the serve flags, without callables
    names: tuple[str, ...]  # served model name first, then aliases
    initial: object  # SchedulerConfig the engine started with
    info: object  # the engine's ReadyInfo (tokenizer included)
    parent: int  # the main process's PID


def build_server(args, engine, state, names, index: int, device_type: str):
    """API server `index`: the app `serve` builds, the server header, a draining uvicorn server."""
    import uvicorn

    from metronome.server.api.app import create_app
    from metronome.server.api.client_share import ShareFlags
    from metronome.server.api.lifecycle import make_draining_server
    from metronome.server.engine.serving_process import shorten_gil_switch

    app = create_app(engine, state, max_body_bytes=args.max_request_body_bytes,
                     tokenizer_workers=args.tokenizer_workers, strict_openai=args.strict_openai,
                     api_keys=args.api_keys, aliases=tuple(names[1:]), tool_call_parser=args.tool_call_parser,
                     shares=ShareFlags(args.max_waiting_per_client, args.max_running_per_client),
                     rates=args.rates)
    app.add_middleware(ServerHeader, index=index)  # added last: outermost, so every response carries it
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                            timeout_graceful_shutdown=max(args.drain_seconds, 1.0))
    shorten_gil_switch(device_type)  # the reader thread hands tokens to a busy event loop
    return make_draining_server(config, state.lifecycle, args.drain_seconds, engine.abort)


# ------------------------------------------------------------------------------------------ the main process


class Fleet:
    """The main process's view of its API workers: forwards signals, notices unexpected exits, waits for them."""

    def __init__(self, workers: list, drain_seconds: float):
        self.workers = workers
        self.drain_seconds = drain_seconds
        self.stopping = False
        self.failed = False
        self._lock = threading.Lock()

    def forward(self, sig: int) -> None:
        """Signal every live worker (the first signal drains them, a second makes them exit at once)."""
        with self._lock:
            self.stopping = True
            for worker in self.workers:
                if worker.is_alive():
                    try:
                        os.kill(worker.pid, sig)
                    except ProcessLookupError:
                        pass

    def watch(self) -> None:
        """Thread: an exit before shutdown began is a failure: log it and shut the main down (drain, exit 1)."""
        from prometheus_client.multiprocess import mark_process_dead

        pending = {worker.sentinel: worker for worker in self.workers}
        while pending:
            for sentinel in wait(list(pending), timeout=PARENT_POLL_S):
                worker = pending.pop(sentinel)
                worker.join()
                mark_process_dead(worker.pid)
                if not self.stopping:
                    log.error("API server %s (PID %d) exited with code %s: shutting the server down",
                              worker.name, worker.pid, worker.exitcode)
                    self.failed = True
                    os.kill(os.getpid(), signal.SIGTERM)  # the main's own drain, which forwards it to the others

    def wait_all(self) -> None:
        """Before the engine stops: let every worker drain and exit; kill those that overstay."""
        if not self.stopping:
            self.forward(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_seconds + WORKER_STOP_GRACE_S
        for worker in self.workers:
            worker.join(max(deadline - time.monotonic(), 0.0))
            if worker.is_alive():
                log.warning("API server %s (PID %d) did not exit: killing it", worker.name, worker.pid)
                worker.kill()
                worker.join()


def serve_many(args: argparse.Namespace, engine_config, base, initial, metrics_dir: str) -> int:
    """The main process of `serve --api-servers N` (N > 1); removes `metrics_dir` at exit."""
    try:
        return _serve_main(args, engine_config, base, initial)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve_main(args, engine_config, base, initial) -> int:
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.serve_cli import _build_engine, _http_stack, _stall_loggers
    from metronome.server.api.state import build_state
    from metronome.server.engine.serving_process import freeze_startup_heap

    count = args.api_servers
    sock = bind_socket(args.host, args.port)  # before the model loads: a taken port fails fast
    engine, device_type = _build_engine(args.engine_process, engine_config, initial, clients=count)
    names = tuple(args.served_model_name or [engine.model_name])
    spec = WorkerSpec(_picklable(args), names, initial, engine.info, os.getpid())
    context = multiprocessing.get_context("spawn")
    workers = []
    for index, (commands, replies) in enumerate(engine.spare_channels, start=1):
        # Daemonic: should the main die, multiprocessing's exit hook still takes them down (they watch it too).
        worker = context.Process(target=worker_main, name=f"metronome-api-{index}", daemon=True,
                                 args=(spec, index, commands, replies))
        worker.start()
        workers.append(worker)
        commands.close()  # the worker's now: its exit must read as EOF in the engine
        replies.close()
    engine.spare_channels = []
    fleet = Fleet(workers, args.drain_seconds)
    engine.before_close = fleet.wait_all

    metrics = ServerMetrics(names[0], multiprocess=True, primary=True)
    engine.observers = [metrics, *_stall_loggers(device_type)]
    state = build_state(engine, metrics, names[0], base, config_file=args.config,
                        poll_interval_s=args.config_poll_seconds, candidate_config=args.candidate_config,
                        pod_labels=args.pod_labels)
    server = build_server(args, engine, state, names, 0, device_type)
    drain_on_signal = server.handle_exit

    def handle_exit(sig: int, frame) -> None:  # uvicorn installs it for SIGTERM and SIGINT
        fleet.forward(signal.SIGTERM)
        drain_on_signal(sig, frame)

    server.handle_exit = handle_exit
    threading.Thread(target=fleet.watch, name="metronome-api-workers", daemon=True).start()
    log.info("serving %s (API key %s%s)", ", ".join(dict.fromkeys([*names, engine.model_name])),
             "required" if args.api_keys else "not required", ", strict OpenAI fields" if args.strict_openai else "")
    log.info("%d API servers on %s:%d (PIDs %s); HTTP: %s on %s", count, args.host, args.port,
             ", ".join(str(pid) for pid in [os.getpid(), *(worker.pid for worker in workers)]), *_http_stack())
    log.info("start-up heap frozen: %d objects the garbage collector no longer walks", freeze_startup_heap())
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()  # normally done by the app's lifespan; this covers a start-up failure
        fleet.wait_all()
    return 1 if fleet.failed else 0


def _picklable(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(**{key: value for key, value in vars(args).items() if not callable(value)})


# ------------------------------------------------------------------------------------------ a worker process


def worker_main(spec: WorkerSpec, index: int, commands, replies) -> None:
    """An API worker's entry point (multiprocessing "spawn"): PROMETHEUS_MULTIPROC_DIR is inherited."""
    args = spec.args
    # A process group of its own: a terminal's Ctrl-C reaches only the main process, which forwards one SIGTERM
    # (a second signal would make this server exit without draining).
    os.setpgid(0, 0)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api {index}]: %(message)s")
    threading.Thread(target=_exit_without_parent, args=(spec.parent,), name="metronome-parent-watch",
                     daemon=True).start()
    from metronome.server.api.config_watch import ConfigStatus
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import ServerState
    from metronome.server.engine.engine_process import ProcessEngine
    from metronome.server.engine.serving_process import freeze_startup_heap

    engine = ProcessEngine.attach(spec.info, commands, replies)
    metrics = ServerMetrics(spec.names[0], multiprocess=True, primary=False)
    engine.observers = [metrics]  # only rejections reach it: StepStats go to server 0
    # No watcher and no config gauges here (server 0 sets them); /v1/config's `engine_scheduler` is the engine's.
    state = ServerState(served_model_name=spec.names[0], metrics=metrics,
                        config=ConfigStatus(config_file=args.config, generation=0, scheduler=spec.initial))
    sock = bind_socket(args.host, args.port)
    server = build_server(args, engine, state, spec.names, index, spec.info.device_type)
    freeze_startup_heap()
    server.run(sockets=[sock])


def _exit_without_parent(parent: int) -> None:
    """Thread: the main process was killed (no SIGTERM came): exit rather than serve on as an orphan."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(1)
