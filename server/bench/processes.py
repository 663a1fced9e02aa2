"""The local processes the benchmarks start (the test harness starts its own with the same helpers): a free
loopback port for one, a probe of its HTTP endpoint, a stop by its pid the way the kubelet stops a container
(SIGTERM, the grace period, then SIGKILL), and the tail of its log for an error message."""
from __future__ import annotations

import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

# Loopback endpoints are asked directly, whatever proxy the environment names.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on at `host` right now (the kernel's pick: a process that binds it later may
    still lose a race for it, which shows as a server that fails to start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when a plain-HTTP endpoint (a server's /ready, the operator's /healthz, etcd's /readyz) answers 200."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def terminate(process: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; returns the exit code (a process that already exited keeps it)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=max(grace_s, 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    return process.returncode


def log_tail(path: str | Path, lines: int = 25) -> str:
    """The last `lines` lines of a log, or "(no log)" when it cannot be read."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
