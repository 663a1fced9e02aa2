"""The state file: which processes a cluster runs (by pid), on which ports, and for whom."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ClusterError
from .procs import ProcessRecord


@dataclass
class ClusterState:
    api_url: str = ""
    ports: dict[str, int] = field(default_factory=dict)
    processes: list[ProcessRecord] = field(default_factory=list)  # control plane, in start order
    prometheus: ProcessRecord | None = None
    prometheus_url: str | None = None
    prometheus_config: str | None = None
    kubernetes_version: str = ""
    owner_pid: int = 0  # the process that ran `up` (lets a test session reap clusters of dead sessions)

    def to_json(self) -> dict:
        return {
            "api_url": self.api_url,
            "ports": self.ports,
            "processes": [record.to_json() for record in self.processes],
            "prometheus": self.prometheus.to_json() if self.prometheus else None,
            "prometheus_url": self.prometheus_url,
            "prometheus_config": self.prometheus_config,
            "kubernetes_version": self.kubernetes_version,
            "owner_pid": self.owner_pid,
        }

    @classmethod
    def from_json(cls, data: dict) -> ClusterState:
        prometheus = data.get("prometheus")
        return cls(
            api_url=data.get("api_url", ""),
            ports={key: int(value) for key, value in data.get("ports", {}).items()},
            processes=[ProcessRecord.from_json(item) for item in data.get("processes", [])],
            prometheus=ProcessRecord.from_json(prometheus) if prometheus else None,
            prometheus_url=data.get("prometheus_url"),
            prometheus_config=data.get("prometheus_config"),
            kubernetes_version=data.get("kubernetes_version", ""),
            owner_pid=int(data.get("owner_pid", 0)),
        )


def load_state(path: Path) -> ClusterState | None:
    if not path.exists():
        return None
    try:
        return ClusterState.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as error:
        raise ClusterError(f"unreadable cluster state file {path}: {error} (remove it after stopping the "
                           f"processes it names)") from error


def save_state(path: Path, state: ClusterState) -> None:
    """Written atomically, so a crash never leaves half a state file (and so unknown pids)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp.{os.getpid()}")
    tmp.write_text(json.dumps(state.to_json(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
