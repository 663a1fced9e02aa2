"""server.yaml, the file the servers reload, in its ConfigMap: where it is mounted, its rendering, and which config
a ConfigMap serves. Pure; builders.config_map wraps a rendering in the object and reconcile writes it.

The operator keeps what it rendered (`Rendered`): reading a ConfigMap back compares its text with the kept one and
parses only text the operator did not write itself (a hand edit, or a ConfigMap written before a restart).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import ConfigError, SchedulerConfig, ServerConfigFile, parse_server_config

CONFIG_KEY = "server.yaml"
CONFIG_DIR = "/etc/metronome"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
ANNOTATION_CONFIG_GENERATION = "metronome.dev/config-generation"
# The spec.server a ConfigMap's config descends from (a digest): the autotuner may have moved the config on since,
# but only a different spec.server in the resource is the user's change to serve.
ANNOTATION_SPEC_SERVER = "metronome.dev/spec-server"


@dataclass(frozen=True)
class Rendered:
    """A config and the server.yaml text it renders to: what the operator writes, and keeps."""

    config: ServerConfigFile
    text: str


def spec_server_digest(scheduler: SchedulerConfig) -> str:
    text = json.dumps(scheduler.snake_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render(config: ServerConfigFile) -> Rendered:
    return Rendered(config, config.to_yaml())


def read_server_config(config_map: dict[str, Any] | None, kept: Rendered | None = None) -> ServerConfigFile | None:
    """The config a ConfigMap serves; None when there is no ConfigMap or no server.yaml in it. `kept`: the
    operator's own last rendering, returned as it is when the ConfigMap still holds its text.
    Raises ConfigError when server.yaml is there but invalid (someone edited it by hand)."""
    if not config_map:
        return None
    text = (config_map.get("data") or {}).get(CONFIG_KEY)
    if text is None:
        return None
    if kept is not None and text == kept.text:
        return kept.config
    name = (config_map.get("metadata") or {}).get("name", "configmap")
    return parse_server_config(text, source=f"ConfigMap {name} key {CONFIG_KEY}")


def safe_read_server_config(config_map: dict[str, Any] | None,
                            kept: Rendered | None = None) -> tuple[ServerConfigFile | None, str | None]:
    """read_server_config, with an invalid file reported as (None, error) instead of raised."""
    try:
        return read_server_config(config_map, kept), None
    except ConfigError as exc:
        return None, str(exc)
