"""The operator as a local process: `metronome operator` (the venv's console script) with a given kubeconfig.

Under kwok the chart's operator Pod is Running on paper only; the real operator runs here, with a kubeconfig of the
chart's ServiceAccount (chart.py: so the chart's RBAC is what it gets) and, for the closed loop, the URL of the
local Prometheus. Each start writes a log of its own (operator-<n>.log in `log_dir`). Stopped by its pid: SIGTERM
(kopf shuts down cleanly), then SIGKILL; should the driver die first, the kernel sends it SIGTERM.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from metronome.server.bench.processes import free_port, http_ok, log_tail, terminate
from metronome_testing.checkout import ROOT
from metronome_testing.lifetime import die_with_parent


class OperatorStartError(RuntimeError):
    pass


# Every operator log of the session, so that a failing test's report can show the ones written while it ran.
SESSION_LOGS: list[Path] = []


def logs_written_since(start: float) -> list[Path]:
    return [path for path in SESSION_LOGS if path.exists() and path.stat().st_mtime >= start]


@dataclass
class OperatorProcess:
    kubeconfig: Path
    log_dir: Path
    prometheus_url: str | None = None
    status_interval_s: float = 1.0
    scope_args: tuple[str, ...] = ("--all-namespaces",)
    lifecycle_args: tuple[str, ...] = ("--standalone",)  # or --leader-elect and its Lease flags
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen | None = field(default=None, repr=False)
    health_port: int = 0  # of the running process; a free one at each start
    metrics_port: int = 0  # its own /metrics (the loop's decisions, the SLO targets); a free one at each start
    starts: int = 0
    logs: list[Path] = field(default_factory=list)  # one per start, oldest first

    @property
    def log_path(self) -> Path:
        """The log of the latest start."""
        return self.logs[-1] if self.logs else self.log_dir / f"operator-{self.starts + 1}.log"

    def argv(self) -> list[str]:
        argv = [str(Path(sys.executable).parent / "metronome"), "operator", *self.scope_args, *self.lifecycle_args,
                "--health-host", "127.0.0.1", "--health-port", str(self.health_port),
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--status-interval", f"{self.status_interval_s:g}"]
        if self.prometheus_url:
            argv += ["--prometheus-url", self.prometheus_url]
        return argv + list(self.extra_args)

    def start(self, timeout_s: float = 90.0) -> None:
        if self.process is not None:
            raise OperatorStartError("the operator is already running")
        self.health_port, self.metrics_port = free_port(), free_port()
        self.starts += 1
        self.logs.append(self.log_dir / f"operator-{self.starts}.log")
        SESSION_LOGS.append(self.log_path)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
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
        return http_ok(f"http://127.0.0.1:{self.health_port}/healthz")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process is not None:
            terminate(self.process, grace_s)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self, index: int = -1) -> str:
        return self.logs[index].read_text(errors="replace") if self.logs else ""

    def all_logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in self.logs)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)
