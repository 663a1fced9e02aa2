"""The real servers of `metronome bench loop`: `metronome serve` processes on 127.0.0.1, each reading its scheduler
from a config folder laid out like a mounted ConfigMap, rewritten by the `..data` swap (bench/configfile.py) — what
the kubelet does to a pod, minus the kubelet's delay.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from metronome import source_checkout
from metronome.contract.config import ServerConfigFile
from metronome.contract.errors import MetronomeError
from metronome.server.bench.configfile import atomic_configmap_write
from metronome.server.bench.processes import free_port, http_ok, log_tail, terminate

CONFIG_NAME = "server.yaml"
DRAIN_S = 30  # --drain-seconds of every server: what a stop lets the requests in flight finish in


class LoopServerError(MetronomeError):
    """A server would not start or become ready; the message carries its log's tail."""


@dataclass
class LoopServer:
    name: str  # the "pod" label of its series in the loop's observation
    folder: Path
    argv: list[str]
    port: int
    process: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.folder / "config" / CONFIG_NAME

    @property
    def log_path(self) -> Path:
        return self.folder / "server.log"

    def write_config(self, config: ServerConfigFile) -> None:
        atomic_configmap_write(self.config_path, config.to_yaml())

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            # From a checkout without an install (the GPU machine) the child finds the code through its cwd, as
            # `python -m` from the root does; not through PYTHONPATH, where the repo's `operator/` would shadow the
            # standard library's while the interpreter starts.
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env}, cwd=source_checkout() or self.folder,
                                            start_new_session=True,
                                            close_fds=True)

    def ready(self) -> bool:
        return http_ok(f"{self.base_url}/ready")

    def stop(self, grace_s: float = DRAIN_S + 15.0) -> None:
        if self.process is not None:
            terminate(self.process, grace_s)

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)


def prepare_server(index: int, work_dir: Path, config: ServerConfigFile, serve_args: Sequence[str],
                   env: dict[str, str] | None = None) -> LoopServer:
    """Server `index` (named server-<index>) on a free port of 127.0.0.1, its config folder serving `config`; not
    started yet. The drain is long: a server the loop scales away is told to stop only once its clients have moved
    on, and must finish what it still streams."""
    folder = work_dir / f"server-{index}"
    (folder / "config").mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "metronome.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--config", str(folder / "config" / CONFIG_NAME), "--config-poll-seconds", "0.25",
            "--drain-seconds", str(DRAIN_S), *serve_args]
    server = LoopServer(f"server-{index}", folder, argv, port, env=dict(env or {}))
    server.write_config(config)
    return server


def wait_ready(servers: Sequence[LoopServer], timeout_s: float) -> None:
    """Until every server answers GET /ready with 200; LoopServerError (with a log tail) when one exits or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in list(waiting):
            if server.process is not None and server.process.poll() is not None:
                raise LoopServerError(f"{server.name} exited with {server.process.returncode} before it was "
                                      f"ready ({' '.join(server.argv[3:])}); log tail:\n{server.log_tail()}")
            if server.ready():
                waiting.remove(server)
        if waiting and time.monotonic() > deadline:
            raise LoopServerError(f"{len(waiting)} server(s) not ready after {timeout_s:.0f} s; log tail of "
                                  f"{waiting[0].name}:\n{waiting[0].log_tail()}")
        time.sleep(0.5)


def start_servers(count: int, work_dir: Path, config: ServerConfigFile, serve_args: Sequence[str],
                  env: dict[str, str] | None = None, timeout_s: float = 600.0,
                  first_index: int = 0) -> list[LoopServer]:
    """`count` servers on free ports of 127.0.0.1, all on `config`, ready (GET /ready = 200) or LoopServerError."""
    servers = [prepare_server(first_index + i, work_dir, config, serve_args, env) for i in range(count)]
    try:
        for server in servers:
            server.start()
        wait_ready(servers, timeout_s)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: Sequence[LoopServer]) -> None:
    for server in servers:
        server.stop()
