"""Live reload of the `--config` file.

Kubernetes updates a mounted ConfigMap by writing a new timestamped directory and atomically renaming a `..data`
symlink over the old one; `server.yaml` is itself a symlink through `..data`. An inotify watch on the file sees
none of that, so the watcher polls: every `interval_s` it resolves the symlink chain afresh, reads the text and
acts only when the text differs from what it last saw. A new valid file is merged over the command-line
scheduler values and handed to the engine (applied at the next step boundary); an invalid one keeps the last good
config, is logged once, counted, and shown on /v1/config. Invalid includes an empty or partial file (the schema
requires `generation` and `scheduler`) and a generation lower than the applied one: the generation the server
reports never goes backwards. Nothing in here raises out of the poll loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.contract.config import (
    ConfigError,
    SchedulerConfig,
    ServerConfigFile,
    parse_server_config,
    validate_scheduler,
)

log = logging.getLogger("metronome.config")


@dataclass
class ConfigStatus:
    """What /v1/config reports: the applied config and the outcome of the last reload attempt."""

    config_file: str | None
    generation: int
    scheduler: SchedulerConfig
    last_reload_error: str | None = None
    last_reload_time: float | None = None  # unix time of the last successful apply
    resolved_path: str | None = None

    def as_json(self) -> dict:
        return {
            "generation": self.generation,
            "scheduler": self.scheduler.snake_dict(),
            "config_file": self.config_file,
            "resolved_path": self.resolved_path,
            "last_reload_error": self.last_reload_error,
            "last_reload_time": self.last_reload_time,
        }


def effective_scheduler(base: SchedulerConfig, file_config: ServerConfigFile, source: str) -> SchedulerConfig:
    """The command-line values with every scheduler field that the file sets explicitly laid over them.

    A field removed from the file falls back to its command-line value. The merge is re-validated, so
    cross-field rules hold for the combination, not only for each side.
    """
    overrides = file_config.scheduler.model_dump(mode="json", include=file_config.scheduler.model_fields_set)
    return validate_scheduler({**base.snake_dict(), **overrides}, source=f"{source}: scheduler")


def check_not_older(new: int, applied: int, source: str) -> None:
    """A generation below the applied one is a stale or mistaken write; taking it would make the operator
    count this pod as rolled back."""
    if new < applied:
        raise ConfigError(f"{source}: generation {new} is older than the applied generation {applied}; "
                          "the generation never goes backwards")


def read_config(path: str) -> tuple[str, str]:
    """(resolved path, text). Resolving each time follows a `..data` symlink that was swapped since last poll."""
    resolved = os.path.realpath(path)
    try:
        with open(resolved, encoding="utf-8") as handle:
            return resolved, handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from exc


def load_config(path: str, base: SchedulerConfig) -> tuple[str, str, ServerConfigFile, SchedulerConfig]:
    """Read, parse and merge; raise ConfigError naming the file and field."""
    resolved, text = read_config(path)
    parsed = parse_server_config(text, source=path)
    return resolved, text, parsed, effective_scheduler(base, parsed, path)


@dataclass
class ConfigWatcher:
    """Polls `path` by content and applies changes through `apply(scheduler_config)`.

    `on_applied(scheduler, generation)` and `on_error()` let the caller update metrics.
    """

    path: str
    base: SchedulerConfig
    status: ConfigStatus
    apply: Callable[[SchedulerConfig], None]
    on_applied: Callable[[SchedulerConfig, int], None] = lambda scheduler, generation: None
    on_error: Callable[[], None] = lambda: None
    interval_s: float = 0.5
    _last_seen: str | None = field(default=None, init=False)

    def load_initial(self) -> SchedulerConfig:
        """Load at start-up; an invalid file here raises ConfigError (the caller refuses to start)."""
        resolved, text, parsed, scheduler = load_config(self.path, self.base)
        self.apply(scheduler)
        self._last_seen = text
        self._record_success(resolved, parsed.generation, scheduler)
        return scheduler

    def poll_once(self) -> bool:
        """Check the file once; return True when a new config was applied."""
        try:
            resolved, text = read_config(self.path)
        except ConfigError as exc:
            return self._record_error(f"unreadable:{exc}", str(exc))
        if text == self._last_seen:
            return False
        try:
            parsed = parse_server_config(text, source=self.path)
            check_not_older(parsed.generation, self.status.generation, self.path)
            scheduler = effective_scheduler(self.base, parsed, self.path)
            self.apply(scheduler)
        except (ConfigError, ValueError) as exc:  # the engine may refuse a combination the schema allows
            return self._record_error(text, str(exc))
        self._last_seen = text
        self._record_success(resolved, parsed.generation, scheduler)
        log.info("config %s: applied generation %d: %s", self.path, parsed.generation, scheduler.snake_dict())
        return True

    async def run(self) -> None:
        """Poll until cancelled. Any unexpected error is logged and the loop goes on."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll_once()
            except Exception:  # a watcher bug must not take the server down
                log.exception("config %s: unexpected error while reloading", self.path)

    def _record_success(self, resolved: str, generation: int, scheduler: SchedulerConfig) -> None:
        self.status.generation = generation
        self.status.scheduler = scheduler
        self.status.resolved_path = resolved
        self.status.last_reload_error = None
        self.status.last_reload_time = time.time()
        self.on_applied(scheduler, generation)

    def _record_error(self, seen: str, message: str) -> bool:
        if seen == self._last_seen:
            return False  # the same bad state as last poll: reported once already
        self._last_seen = seen
        self.status.last_reload_error = message
        log.error("config reload failed, keeping generation %d: %s", self.status.generation, message)
        self.on_error()
        return False
