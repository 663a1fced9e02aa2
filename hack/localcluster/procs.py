"""Starting and stopping the cluster's processes by pid, and finding free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class ProcessRecord:
    """What the state file remembers about one started process."""

    name: str
    pid: int
    argv: list[str]
    log: str

    def to_json(self) -> dict:
        return {"name": self.name, "pid": self.pid, "argv": self.argv, "log": self.log}

    @classmethod
    def from_json(cls, data: dict) -> "ProcessRecord":
        return cls(name=data["name"], pid=int(data["pid"]), argv=list(data["argv"]), log=data["log"])


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def is_running(record: ProcessRecord) -> bool:
    """True when `record.pid` is alive and still runs the program we started (pids get reused)."""
    cmdline = _cmdline(record.pid)
    if not cmdline or _is_zombie(record.pid):
        return False
    return cmdline[0] == record.argv[0]


def start_process(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> ProcessRecord:
    """Starts `argv` in its own session (so it outlives `cluster.py up`), output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, close_fds=True)
    return ProcessRecord(name=name, pid=proc.pid, argv=argv, log=str(log_path))


def _reap(pid: int) -> None:
    """Collects the exit status when the process is our own child (no zombies left behind)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop_process(record: ProcessRecord, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; only if the pid still runs what we started."""
    if not is_running(record):
        _reap(record.pid)
        return
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap(record.pid)
        if not is_running(record):
            return
        time.sleep(0.1)
    if is_running(record):
        os.kill(record.pid, signal.SIGKILL)
    for _ in range(50):
        _reap(record.pid)
        if not is_running(record):
            return
        time.sleep(0.1)


def log_tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
