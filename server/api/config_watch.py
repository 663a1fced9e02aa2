"""Live reload of the `--config` file.

Kubernetes updates a mounted ConfigMap by writing a new timestamped directory and atomically renaming a `..data`
symlink over the old one; `server.yaml` is itself a symlink through `..data`. An inotify watch on the file sees
none of that, so the watcher polls: every `interval_s` it resolves the symlink chain afresh, reads the text and
acts only when the text differs from what it last saw. A new valid file is merged over the command-line
scheduler values and handed to the engine (applied at the next step boundary); an invalid one keeps the last good
config, is logged once, counted, and shown on /v1/config. Invalid includes an empty or partial file (the schema
requires `generation` and `scheduler`) and a generation lower than the one last applied from the same file: each
file's generations only move forward. Nothing in here raises out of the poll loop.

With `VariantFiles` (`--candidate-config` and `--pod-labels`, metronome.contract.variant) each poll first decides
which file to serve: the candidate config while the pod's labels file says `metronome.dev/variant=candidate` and
that config exists, else the `--config` file. A pod that turns back into a control serves the control's file
again, whose generation may be lower than the candidate's it served meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from metronome.contract import variant
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
    variant: str = variant.CONTROL  # which file of VariantFiles is served (control = the --config file)

    def as_json(self) -> dict:
        return {
            "generation": self.generation,
            "scheduler": self.scheduler.snake_dict(),
            "config_file": self.config_file,
            "resolved_path": self.resolved_path,
            "last_reload_error": self.last_reload_error,
            "last_reload_time": self.last_reload_time,
            "variant": self.variant,
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


@dataclass(frozen=True)
class VariantFiles:
    """Which config file a server pod serves now: `candidate` while `pod_labels` (the kubelet's downward-API
    projection of the pod's labels) names the pod a candidate and that file exists, else `control`. An unreadable
    labels file reads as no labels: the control config is always the safe side."""

    control: str
    candidate: str
    pod_labels: str

    def choose(self) -> tuple[str, str]:
        """(variant, path of the file to serve)."""
        try:
            labels = variant.parse_labels(Path(self.pod_labels).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            labels = {}
        if variant.variant_of(labels) == variant.CANDIDATE and os.path.isfile(self.candidate):
            return variant.CANDIDATE, self.candidate
        return variant.CONTROL, self.control


def variant_files(config: str | None, candidate: str | None, pod_labels: str | None) -> VariantFiles | None:
    """`--config`, `--candidate-config` and `--pod-labels` as a VariantFiles (None without the last two); ValueError
    naming the flag when only some are given."""
    if candidate is None and pod_labels is None:
        return None
    if candidate is None or pod_labels is None or config is None:
        raise ValueError("--candidate-config and --pod-labels go together, and with --config")
    return VariantFiles(config, candidate, pod_labels)


@dataclass
class ConfigWatcher:
    """Polls `path` by content and applies changes through `apply(scheduler_config)`.

    `on_applied(scheduler, generation)` and `on_error()` let the caller update metrics. `variants`: serve a
    candidate config while the pod is labelled a candidate (VariantFiles; `path` is then its control file).
    """

    path: str
    base: SchedulerConfig
    status: ConfigStatus
    apply: Callable[[SchedulerConfig], None]
    on_applied: Callable[[SchedulerConfig, int], None] = lambda scheduler, generation: None
    on_error: Callable[[], None] = lambda: None
    interval_s: float = 0.5
    variants: VariantFiles | None = None
    _last_seen: tuple[str, str] | None = field(default=None, init=False)  # (path, text) of the last poll
    _applied: dict[str, int] = field(default_factory=dict, init=False)  # path -> generation last applied from it

    def choose(self) -> tuple[str, str]:
        """(variant, path) of the file to serve now."""
        return self.variants.choose() if self.variants is not None else (variant.CONTROL, self.path)

    def load_initial(self) -> SchedulerConfig:
        """Load at start-up; an invalid file here raises ConfigError (the caller refuses to start)."""
        served, path = self.choose()
        resolved, text, parsed, scheduler = load_config(path, self.base)
        self.apply(scheduler)
        self._last_seen = (path, text)
        self._record_success(path, served, resolved, parsed.generation, scheduler)
        return scheduler

    def poll_once(self) -> bool:
        """Check the file once; return True when a new config was applied."""
        served, path = self.choose()
        try:
            resolved, text = read_config(path)
        except ConfigError as exc:
            return self._record_error((path, f"unreadable:{exc}"), str(exc))
        if (path, text) == self._last_seen:
            return False
        try:
            parsed = parse_server_config(text, source=path)
            check_not_older(parsed.generation, self._applied.get(path, 0), path)
            scheduler = effective_scheduler(self.base, parsed, path)
            self.apply(scheduler)
        except (ConfigError, ValueError) as exc:  # the engine may refuse a combination the schema allows
            return self._record_error((path, text), str(exc))
        self._last_seen = (path, text)
        self._record_success(path, served, resolved, parsed.generation, scheduler)
        log.info("config %s (%s): applied generation %d: %s", path, served, parsed.generation,
                 scheduler.snake_dict())
        return True

    async def run(self) -> None:
        """Poll until cancelled. Any unexpected error is logged and the loop goes on."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll_once()
            except Exception:  # a watcher bug must not take the server down
                log.exception("config %s: unexpected error while reloading", self.path)

    def _record_success(self, path: str, served: str, resolved: str, generation: int,
                        scheduler: SchedulerConfig) -> None:
        self._applied[path] = generation
        self.status.variant = served
        self.status.generation = generation
        self.status.scheduler = scheduler
        self.status.resolved_path = resolved
        self.status.last_reload_error = None
        self.status.last_reload_time = time.time()
        self.on_applied(scheduler, generation)

    def _record_error(self, seen: tuple[str, str], message: str) -> bool:
        if seen == self._last_seen:
            return False  # the same bad state as last poll: reported once already
        self._last_seen = seen
        self.status.last_reload_error = message
        log.error("config reload failed, keeping generation %d: %s", self.status.generation, message)
        self.on_error()
        return False
