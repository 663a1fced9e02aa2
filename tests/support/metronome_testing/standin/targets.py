"""Prometheus file_sd targets for the servers the stand-in runs, and a scrape config that reads them.

Each target carries the label contract of metronome.operator.metrics_source (`namespace`, `service` from the
pod label app.kubernetes.io/instance, `pod`), the same labels `POD_RELABELING` derives from Kubernetes service
discovery in a real cluster. Prometheus re-reads the file when it changes (it watches the folder), so the file
is replaced atomically.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from metronome.operator.metrics_source import POD_RELABELING

# The series labels the contract asks for, in POD_RELABELING's order: namespace, pod; `service` is extra
# (the operator matches the server's own `model` label; this one is for people reading the series).
NAMESPACE_LABEL, POD_LABEL = (target for _, target in POD_RELABELING)
SERVICE_LABEL = "service"
SCRAPE_JOB = "metronome-servers"


@dataclass(frozen=True)
class Target:
    address: str  # host:port on 127.0.0.0/8
    namespace: str
    service: str
    pod: str


def file_sd_groups(targets: Iterable[Target]) -> list[dict]:
    """The file_sd JSON document: one group per server, sorted so that equal sets give equal files."""
    return [{"targets": [t.address],
             "labels": {NAMESPACE_LABEL: t.namespace, SERVICE_LABEL: t.service, POD_LABEL: t.pod}}
            for t in sorted(targets, key=lambda t: (t.namespace, t.pod, t.address))]


def write_file_sd(path: Path, targets: Iterable[Target]) -> bool:
    """Write the targets file when its content changes (atomic rename); returns whether it was written."""
    text = json.dumps(file_sd_groups(targets), indent=2) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
    return True


def scrape_config(targets_file: Path, interval_seconds: float = 1.0) -> str:
    """A Prometheus config that scrapes every target of `targets_file` each `interval_seconds`."""
    if not 0 < interval_seconds <= 60:
        raise ValueError(f"scrape interval must be within (0, 60] s, got {interval_seconds}")
    interval = f"{int(interval_seconds * 1000)}ms"
    return f"""global:
  scrape_interval: {interval}
  scrape_timeout: {interval}
  evaluation_interval: {interval}
scrape_configs:
- job_name: {SCRAPE_JOB}
  metrics_path: /metrics
  file_sd_configs:
  - files: [{json.dumps(str(targets_file))}]
    refresh_interval: 5s
"""
