"""One `metronome serve` process playing one pod: started in its own session (a Ctrl-C in the terminal reaches
the driver, not the servers), output to a log file, stopped by its pid like the kubelet stops a container:
SIGTERM, the grace period, then SIGKILL. Should the driver die first, the kernel sends it SIGTERM (lifetime.py)."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from metronome.server.bench.processes import http_ok, log_tail, terminate
from metronome_testing.lifetime import die_with_parent


@dataclass
class ServerProcess:
    argv: list[str]
    address: str
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None
    started_at: float = 0.0

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}"

    @property
    def target(self) -> str:
        return f"{self.address}:{self.port}"

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {time.strftime('%H:%M:%S')} starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env}, start_new_session=True, close_fds=True,
                                            preexec_fn=die_with_parent)
        self.started_at = time.monotonic()

    def exit_code(self) -> int | None:
        """None while it runs (or before it started)."""
        return None if self.process is None else self.process.poll()

    def is_ready(self, timeout_s: float = 2.0) -> bool:
        """Running, and GET /ready on its loopback address answers 200."""
        return self.process is not None and self.exit_code() is None and http_ok(f"{self.base_url}/ready", timeout_s)

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code."""
        return None if self.process is None else terminate(self.process, grace_s)

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)
