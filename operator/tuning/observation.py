"""What Prometheus saw of one service over one window, as plain data (built by operator/metrics_source.py or by
`metronome bench loop` from the servers' own scrapes, read by the controller), and why there is none when there is
none (`MetricsUnavailable`). No I/O here."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from metronome.contract.errors import MetronomeError


@dataclass(frozen=True)
class StepSample:
    """Mean tokens per step and mean step time of one pod's steps of one kind over one sub-window (weight = steps
    in it). `kind` is "decode" (no prefill tokens) or "mixed" (metric_names.STEP_KINDS); "" when not told apart."""

    tokens_per_step: float
    step_seconds: float
    steps: float = 1.0
    pod: str = ""
    kind: str = ""

    @property
    def mixed(self) -> bool:
        return self.kind == "mixed"


@dataclass(frozen=True)
class Observation:
    """One service over one window, as Prometheus saw it. Optional fields are None when not measured."""

    window_seconds: float
    sample_count: int  # TBT samples (token gaps) in the window, all pods together
    tbt_p99_s: float | None
    output_tokens_per_s: float = 0.0
    ttft_p99_s: float | None = None
    prompt_tokens_per_s: float | None = None
    requests_per_s: float | None = None  # finished requests per second (request_e2e count rate)
    mean_prompt_tokens: float | None = None
    long_prompt_share: float | None = None  # share of prompts in the long lane (metronome_prompts_total{lane})
    short_tbt_p99_s: float | None = None  # p99 TBT of short-prompt requests (the TBT histogram's lane="short")
    decode_batch_size: float | None = None  # mean running sequences per pod
    step_samples: tuple[StepSample, ...] = ()
    pod_generations: Mapping[str, int] = field(default_factory=dict)  # pod → its metronome_config_generation
    config_applied_at: Mapping[str, float] = field(default_factory=dict)  # pod → Unix time it applied its config
    waiting_requests: float | None = None  # mean requests waiting over the window, all pods
    waiting_growth: float | None = None  # waiting requests at the window's end minus at its start (> 0: growing)
    prefilling_requests: float | None = None  # mean admitted requests still prefilling over the window, all pods


class MetricsUnavailable(MetronomeError):
    """No usable observation. `reason` is CamelCase, ready for a condition's reason field."""

    UNREACHABLE = "PrometheusUnreachable"
    TIMEOUT = "PrometheusTimeout"
    QUERY_FAILED = "QueryFailed"
    BAD_RESPONSE = "BadResponse"
    NO_SERIES = "NoSeries"
    URL_NOT_ALLOWED = "PrometheusURLNotAllowed"
    UNAUTHORIZED = "PrometheusUnauthorized"
    CREDENTIALS = "PrometheusCredentials"
    TLS = "PrometheusTLS"

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message
