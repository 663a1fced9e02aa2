"""The operator as a local process (`python -m metronome.operator`, i.e. `metronome operator`).

Under kwok the chart's operator Pod is Running on paper only; the real operator runs here, with a kubeconfig of
the chart's ServiceAccount (so the chart's RBAC is what it gets) and the Prometheus URL of the local Prometheus.
Stopped by its pid: SIGTERM (kopf shuts down cleanly), then SIGKILL.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from standin.lifetime import die_with_parent
from standin.loopback import free_port

ROOT = Path(__file__).resolve().parents[2]


class OperatorStartError(RuntimeError):
    pass


@dataclass
class OperatorProcess:
    kubeconfig: Path
    log_path: Path
    prometheus_url: str | None = None
    status_interval_s: float = 2.0
    extra_args: tuple[str, ...] = ()
    health_port: int = 0
    process: subprocess.Popen | None = field(default=None, repr=False)

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "metronome.operator", "--all-namespaces", "--standalone",
                "--health-host", "127.0.0.1", "--health-port", str(self.health_port),
                "--status-interval", f"{self.status_interval_s:g}"]
        if self.prometheus_url:
            argv += ["--prometheus-url", self.prometheus_url]
        return argv + list(self.extra_args)

    def start(self, timeout_s: float = 90.0) -> None:
        if self.process is not None:
            raise OperatorStartError("the operator is already running")
        self.health_port = self.health_port or free_port("127.0.0.1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                code = self.process.poll()
                self.stop()
                raise OperatorStartError(f"the operator did not become healthy (exit {code}); log "
                                         f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health_port}/healthz"
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
