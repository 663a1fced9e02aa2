"""The results file: one JSON document per command (config, environment, runs with summaries and raw records)."""
from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metronome.contract.errors import MetronomeError
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import RunSummary

SCHEMA = "metronome-bench/1"


class ResultsError(MetronomeError):
    """The results file cannot be written."""


@dataclass
class RunEntry:
    """One measured run: what was asked (params), what came out (summary), and every request (records)."""

    label: str
    params: dict[str, Any]
    summary: RunSummary
    records: list[RequestRecord] = field(default_factory=list)
    started_at: str = ""
    wall_s: float = 0.0

    def to_dict(self, include_records: bool = True) -> dict[str, Any]:
        data = {"label": self.label, "params": self.params, "summary": self.summary.to_dict(),
                "started_at": self.started_at, "wall_s": round(self.wall_s, 4)}
        if include_records:
            data["records"] = [r.to_dict() for r in self.records]
        return data


def environment(device: str | None = None, torch_version: str | None = None) -> dict[str, Any]:
    """Where and when: host, Python, platform, torch and device (when known), UTC date, the command line."""
    from metronome import __version__

    env = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "metronome": __version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["metronome", *sys.argv[1:]]) if sys.argv and "metronome" in sys.argv[0]
        else shlex.join(sys.argv),
    }
    if "torch" in sys.modules or torch_version is not None:
        import torch

        env["torch"] = torch_version or torch.__version__
        if device is None:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if device is not None:
        env["device"] = device
    return env


def _clean(obj: Any) -> Any:
    """JSON has no NaN/inf: write them as null (numbers that could not be measured)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, document: dict[str, Any]) -> Path:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_clean({"schema": SCHEMA, **document}), indent=1, allow_nan=False) + "\n")
    except OSError as exc:
        raise ResultsError(f"cannot write results {path}: {exc.strerror or exc}") from exc
    return path
