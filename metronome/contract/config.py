"""The server config file: the one schema shared by the engine, the server's file watcher and the operator.

Pydantic only (no torch): the operator imports it to render ConfigMaps. Field names are snake_case in the file
(`server.yaml`); the CRD spells the same fields in camelCase, which the models accept as aliases.
"""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel


class QueuePolicy(str, enum.Enum):
    FCFS = "fcfs"  # one queue, arrival order
    SPLIT = "split"  # short prompts in their own queue, admitted whole; long prompts advance chunk by chunk
    SJF = "sjf"  # shortest prompt first, aged so that nothing starves


class ConfigError(ValueError):
    """A config file or object that cannot be used; the message names the file and the field."""


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class SchedulerConfig(_Schema):
    """The reloadable scheduler knobs. Changing any of them never needs a restart."""

    chunk_size: int = Field(
        512, ge=1, le=1 << 20,
        description="fcfs, sjf: prefill tokens allowed per step, on top of one token per running decode."
    )
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Most sequences running at once.")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 22,
        description="Hard cap on tokens per step (decodes + prefill); unset = no cap beyond chunk_size.",
    )
    queue_policy: QueuePolicy = Field(QueuePolicy.SPLIT, description="fcfs | split | sjf")
    short_prompt_threshold: int = Field(
        512, ge=1, description="split: prompts of at most this many tokens go to the short queue."
    )
    short_chunk_size: int = Field(
        2048, ge=1, le=1 << 20, description="split: prefill budget per step for short prompts (admitted whole)."
    )
    long_chunk_size: int = Field(512, ge=1, le=1 << 20, description="split: prefill tokens per step for long prompts.")
    sjf_aging_seconds: float = Field(
        10.0, gt=0, description="sjf: after waiting this long a request outranks every newer one."
    )

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SchedulerConfig:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running decode needs one token per step: a smaller cap would stall decodes.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        return self

    def snake_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=False)


class ServerConfigFile(_Schema):
    """What `server.yaml` holds. `generation` is written by the operator and echoed as a metric.

    Both keys are required: a file that is empty or lacks one (half-written, or a template gone wrong) must be
    an error, not a silent reset to generation 0 and the default scheduler."""

    generation: int = Field(
        ..., ge=0, description="Bumped by the operator on every change; echoed by metronome_config_generation."
    )
    scheduler: SchedulerConfig = Field(
        ..., description="The scheduler fields to set; those left out keep the server's command-line values."
    )

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            {"generation": self.generation, "scheduler": self.scheduler.snake_dict()}, sort_keys=False
        )


def next_server_config(current: ServerConfigFile | None, scheduler: SchedulerConfig) -> ServerConfigFile:
    """The config file that serves `scheduler`: `current` if it already does, else the next generation (the first
    is 1). How the operator and `metronome bench loop` number what they write."""
    if current is None:
        return ServerConfigFile(generation=1, scheduler=scheduler)
    if current.scheduler == scheduler:
        return current
    return ServerConfigFile(generation=current.generation + 1, scheduler=scheduler)


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "missing":  # a partial file is refused, never filled in with defaults
            parts.append(f"{where} missing (a config file must set generation and scheduler)")
        else:
            parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_server_config(text: str, source: str = "<config>") -> ServerConfigFile:
    """Parse and validate config text; raise ConfigError naming the source and the offending fields."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if data is None:
        raise ConfigError(f"{source}: the file is empty; it must set generation and scheduler")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ServerConfigFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_format_validation_error(exc)}") from exc


def load_server_config(path: str | Path) -> ServerConfigFile:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    return parse_server_config(text, str(path))


def validate_scheduler(data: dict[str, Any], source: str = "scheduler") -> SchedulerConfig:
    """Validate scheduler fields given as a dict (snake_case or camelCase)."""
    try:
        return SchedulerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: {_format_validation_error(exc)}") from exc
