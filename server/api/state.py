"""Everything one server process shares between its routes, its config watcher and its signal handling."""
from __future__ import annotations

from dataclasses import dataclass, field

from metronome.server.api.config_watch import ConfigStatus, ConfigWatcher, variant_files
from metronome.server.api.lifecycle import Lifecycle
from metronome.server.api.metrics import ServerMetrics


@dataclass
class ServerState:
    served_model_name: str
    metrics: ServerMetrics
    config: ConfigStatus
    watcher: ConfigWatcher | None = None  # None when the server runs without --config
    lifecycle: Lifecycle = field(default_factory=Lifecycle)


def build_state(engine, metrics: ServerMetrics, served_model_name: str, base_scheduler,
                config_file: str | None = None, poll_interval_s: float = 0.5,
                candidate_config: str | None = None, pod_labels: str | None = None) -> ServerState:
    """Wire metrics and (with a config file) the watcher to `engine`. The file is loaded and applied now, so an
    invalid file at start-up raises ConfigError instead of serving with settings nobody asked for.
    `candidate_config` and `pod_labels` (both or neither, with `config_file`): serve the candidate config while
    the pod is labelled a candidate (config_watch.VariantFiles)."""
    status = ConfigStatus(config_file=config_file, generation=0, scheduler=base_scheduler)
    watcher = None
    if config_file:
        variants = variant_files(config_file, candidate_config, pod_labels)
        watcher = ConfigWatcher(config_file, base_scheduler, status, apply=engine.reconfigure,
                                on_applied=metrics.set_config, on_error=metrics.count_reload_error,
                                interval_s=poll_interval_s, variants=variants)
        watcher.load_initial()
    else:
        metrics.set_config(base_scheduler, 0)
    return ServerState(served_model_name=served_model_name, metrics=metrics, config=status, watcher=watcher)
