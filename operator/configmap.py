"""server.yaml, the file the servers reload: which config a ConfigMap serves, the next generation to write, and
the scheduler config that carries out a controller Decision. Pure; builders.config_map wraps it in the object and
reconcile.serve_scheduler writes it."""
from __future__ import annotations

from typing import Any

from metronome.contract.config import (
    ConfigError,
    QueuePolicy,
    SchedulerConfig,
    ServerConfigFile,
    parse_server_config,
    validate_scheduler,
)
from metronome.operator.decision import Decision

CONFIG_KEY = "server.yaml"
CONFIG_DIR = "/etc/metronome"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
ANNOTATION_CONFIG_GENERATION = "metronome.dev/config-generation"


def next_server_config(current: ServerConfigFile | None, scheduler: SchedulerConfig) -> ServerConfigFile:
    """The config to serve `scheduler`: the current one if it already does, else a new generation."""
    if current is None:
        return ServerConfigFile(generation=1, scheduler=scheduler)
    if current.scheduler == scheduler:
        return current
    return ServerConfigFile(generation=current.generation + 1, scheduler=scheduler)


def read_server_config(config_map: dict[str, Any] | None) -> ServerConfigFile | None:
    """The config a ConfigMap serves; None when there is no ConfigMap or no server.yaml in it.
    Raises ConfigError when server.yaml is there but invalid (someone edited it by hand)."""
    if not config_map:
        return None
    text = (config_map.get("data") or {}).get(CONFIG_KEY)
    if text is None:
        return None
    name = (config_map.get("metadata") or {}).get("name", "configmap")
    return parse_server_config(text, source=f"ConfigMap {name} key {CONFIG_KEY}")


def safe_read_server_config(config_map: dict[str, Any] | None) -> tuple[ServerConfigFile | None, str | None]:
    """read_server_config, with an invalid file reported as (None, error) instead of raised."""
    try:
        return read_server_config(config_map), None
    except ConfigError as exc:
        return None, str(exc)


def scheduler_for(decision: Decision, served: SchedulerConfig) -> SchedulerConfig:
    """The scheduler config that carries out a decision: its budget lands on the fields its policy reads
    (split: long prompts advance by the budget, short ones are admitted whole within max(budget, threshold)).
    `chunk_size` always holds the budget, so switching policy keeps it. Other fields stay as served.
    Raises ConfigError when the result is not a valid scheduler config."""
    fields = {**served.snake_dict(), "queue_policy": decision.queue_policy, "chunk_size": decision.chunk_size}
    if QueuePolicy(decision.queue_policy) is QueuePolicy.SPLIT:
        fields["long_chunk_size"] = decision.chunk_size
        fields["short_chunk_size"] = max(decision.chunk_size, served.short_prompt_threshold)
    return validate_scheduler(fields, source="the decision")
