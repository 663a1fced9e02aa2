"""`metronome serve` as a child process on 127.0.0.1, for benchmarks that need a real server to push against."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

from metronome.contract.errors import MetronomeError
from metronome.server.bench.processes import free_port, log_tail, terminate


@contextlib.contextmanager
def local_server(serve_args: list[str], ready_timeout_s: float = 300.0) -> Iterator[str]:
    """Start `metronome serve <serve_args> --host 127.0.0.1 --port <free>`; yield its URL once /ready says 200;
    stop it (SIGTERM, then SIGKILL) on exit. Its log goes to a temporary file, quoted if it fails to start."""
    with local_server_process(serve_args, ready_timeout_s) as (url, _):
        yield url


@contextlib.contextmanager
def local_server_process(serve_args: list[str],
                         ready_timeout_s: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """local_server, yielding the serve process too (for benchmarks that read its CPU time)."""
    port = free_port()
    command = [sys.executable, "-m", "metronome.cli", "serve", *serve_args, "--host", "127.0.0.1",
               "--port", str(port), "--log-level", "warning"]
    log = tempfile.NamedTemporaryFile("w+", prefix="metronome-serve-", suffix=".log", delete=False)
    # PYTHONSAFEPATH: from a checkout, `-m` would let its top-level folders hide installed packages (tp_launch.py)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONSAFEPATH": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise MetronomeError(f"metronome serve exited with {process.returncode}: {log_tail(log.name, 20)}")
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise MetronomeError(f"metronome serve not ready after {ready_timeout_s:.0f}s: "
                                     f"{log_tail(log.name, 20)}")
            time.sleep(0.2)
        yield url, process
    finally:
        terminate(process, grace_s=60)
        log.close()
        os.unlink(log.name)
