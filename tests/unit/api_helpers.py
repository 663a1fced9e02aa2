"""Shared pieces of the API tests: a real uvicorn server in a thread, Kubernetes-style config dirs, scraping."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from metronome.server.bench.configfile import project
from metronome.server.bench.processes import free_port

TINY = "random:tiny"


# ------------------------------------------------------------------------------------------ Kubernetes volume


def k8s_config_dir(root: Path, text: str) -> Path:
    """Lay out a ConfigMap volume as the kubelet does; return the path of `server.yaml` (a symlink through `..data`).
    Later versions: `atomic_configmap_write(path, text)`, the kubelet's `..data` swap."""
    project(root, {"server.yaml": text})
    return root / "server.yaml"


# ------------------------------------------------------------------------------------------ engine + server


def build_engine(model: str = TINY, max_waiting: int = 1024, num_kv_blocks: int = 256, scheduler=None,
                 observers=(), max_model_len: int = 1024):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.engine.async_engine import AsyncEngine
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine import EngineCore

    config = EngineConfig(model=model, device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks,
                          max_waiting=max_waiting, max_model_len=max_model_len)
    core = EngineCore.from_config(config, scheduler or SchedulerConfig())
    return AsyncEngine(core, observers=list(observers))


def build_server_parts(model: str = TINY, max_waiting: int = 1024, scheduler=None, config_file: str | None = None,
                       num_kv_blocks: int = 256, poll_interval_s: float = 0.1, max_model_len: int = 1024):
    """(engine, state, app) wired as `metronome serve` wires them."""
    from metronome.contract.config import SchedulerConfig
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    base = scheduler or SchedulerConfig()
    metrics = ServerMetrics(model)
    engine = build_engine(model, max_waiting=max_waiting, num_kv_blocks=num_kv_blocks, scheduler=base,
                          observers=[metrics], max_model_len=max_model_len)
    state = build_state(engine, metrics, model, base, config_file=config_file, poll_interval_s=poll_interval_s)
    return engine, state, create_app(engine, state)


@dataclass
class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread."""

    app: object
    port: int = 0

    def __post_init__(self) -> None:
        import uvicorn

        self.port = self.port or free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: _ready(self.url), timeout=120, what="server ready")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# ------------------------------------------------------------------------------------------ metrics


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, frozenset(labels)): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and wanted <= set(ls)]
    if not found:
        raise AssertionError(f"no sample {name}{labels} in /metrics")
    return sum(found)
