"""Starting and stopping the cluster's processes by pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"


@dataclass
class ProcessRecord:
    """What the state file remembers about one started process."""

    name: str
    pid: int
    argv: list[str]
    log: str
    start_ticks: int  # the kernel's start time of `pid`: tells our process from a later one with a reused pid

    def to_json(self) -> dict:
        return {"name": self.name, "pid": self.pid, "argv": self.argv, "log": self.log,
                "start_ticks": self.start_ticks}

    @classmethod
    def from_json(cls, data: dict) -> ProcessRecord:
        return cls(name=data["name"], pid=int(data["pid"]), argv=list(data["argv"]), log=data["log"],
                   start_ticks=int(data["start_ticks"]))


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3, the state, comes first)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_start_ticks(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22 of stat: starttime


def is_running(record: ProcessRecord) -> bool:
    """True when `record.pid` is alive (not a zombie) and is the very process we started."""
    fields = _stat_fields(record.pid)
    if fields is None or fields[0] == "Z":
        return False
    return int(fields[19]) == record.start_ticks


def start_process(name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> ProcessRecord:
    """Starts `argv` in its own session (so it outlives `cluster.py up`), output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, close_fds=True)
    # The start time is fixed at fork, so reading it now is safe even if the child already exited (zombie).
    start_ticks = process_start_ticks(proc.pid)
    return ProcessRecord(name=name, pid=proc.pid, argv=argv, log=str(log_path), start_ticks=start_ticks or -1)


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

