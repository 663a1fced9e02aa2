"""Sweep chunk sizes x queue policies x request rates, and recommend a configuration for a TBT SLO.

The background report recommends configurations "by A/B test" but prints no table; this produces one by
measurement. Each configuration is applied once (in-process: Engine reconfigure; against a server: the config
file rewritten the Kubernetes way, then /v1/config polled until it reports the new generation), then the same
workload (same seed, so the same requests) runs at every rate.

Recommendation rule: among all runs whose pooled TBT p99 <= SLO, the highest output throughput wins; the
runner-ups are the best runs of the other configurations, in throughput order. A configuration's capacity is
the highest rate at which it met the SLO.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig, load_server_config, validate_scheduler
from metronome.contract.errors import MetronomeError
from metronome.server.bench.configfile import atomic_configmap_write
from metronome.server.bench.load.clients import Client, HttpClient
from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.runner import LoadPattern, StopRule, run_load
from metronome.server.bench.load.stats import summarize
from metronome.server.bench.load.workloads import BenchRequest


class SweepError(MetronomeError):
    """A sweep cannot go on: a configuration was rejected or never applied."""


@dataclass(frozen=True)
class SweepConfig:
    chunk_size: int
    queue_policy: str

    @property
    def label(self) -> str:
        return f"chunk {self.chunk_size} / {self.queue_policy}"


def parse_policies(text: str) -> list[str]:
    allowed = [p.value for p in QueuePolicy]
    policies = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in policies if p not in allowed]
    if bad or not policies:
        raise SweepError(f"unknown queue polic{'ies' if len(bad) > 1 else 'y'} {bad or text!r}; "
                         f"choose from {', '.join(allowed)}")
    return policies


def grid(chunk_sizes: list[int], policies: list[str]) -> list[SweepConfig]:
    return [SweepConfig(c, p) for p in policies for c in chunk_sizes]


def swept_fields(config: SweepConfig) -> dict[str, Any]:
    """The scheduler fields one point of the sweep sets (snake_case). Under `split` the swept size is the long
    prompts' chunk (short prompts keep their own whole-prompt budget); chunk_size follows it so either reading
    holds."""
    fields: dict[str, Any] = {"chunk_size": config.chunk_size, "queue_policy": config.queue_policy}
    if config.queue_policy == QueuePolicy.SPLIT.value:
        fields["long_chunk_size"] = config.chunk_size
    return fields


def scheduler_for(base: SchedulerConfig, config: SweepConfig) -> SchedulerConfig:
    """The base scheduler with this point's fields (swept_fields)."""
    try:
        return validate_scheduler({**base.snake_dict(), **swept_fields(config)}, source=config.label)
    except ConfigError as exc:
        raise SweepError(str(exc)) from exc


# --- recommendation (pure) -----------------------------------------------------------------------------------------


@dataclass
class Choice:
    chunk_size: int
    queue_policy: str
    rate: float | None
    output_tokens_per_s: float
    tbt_p99_ms: float | None
    ttft_p99_ms: float | None
    capacity_rate: float | None  # highest rate this configuration met the SLO at


@dataclass
class Recommendation:
    slo_tbt_ms: float
    best: Choice | None
    alternatives: list[Choice] = field(default_factory=list)
    note: str = ""


def recommend(runs: list[RunEntry], slo_tbt_ms: float, alternatives: int = 2) -> Recommendation:
    by_config: dict[tuple[int, str], list[RunEntry]] = {}
    for run in runs:
        key = (run.params["chunk_size"], run.params["queue_policy"])
        by_config.setdefault(key, []).append(run)

    def meets(run: RunEntry) -> bool:
        p99 = run.summary.tbt.p99_ms
        return run.summary.num_completed > 0 and p99 is not None and p99 <= slo_tbt_ms

    choices: list[Choice] = []
    for (chunk, policy), members in by_config.items():
        passing = [r for r in members if meets(r)]
        if not passing:
            continue
        top = max(passing, key=lambda r: r.summary.output_tokens_per_s)
        rates = [r.params.get("rate") for r in passing if r.params.get("rate") is not None]
        choices.append(Choice(chunk, policy, top.params.get("rate"), top.summary.output_tokens_per_s,
                              top.summary.tbt.p99_ms, top.summary.ttft.p99_ms, max(rates) if rates else None))
    choices.sort(key=lambda c: c.output_tokens_per_s, reverse=True)
    if not choices:
        measured = [r for r in runs if r.summary.tbt.p99_ms is not None]
        note = "no configuration met the SLO"
        if measured:
            low = min(measured, key=lambda r: r.summary.tbt.p99_ms)  # type: ignore[arg-type, return-value]
            note += (f"; the lowest TBT p99 was {low.summary.tbt.p99_ms:.1f} ms ({low.label}): "
                     "try smaller chunks, lower rates, or more replicas")
        return Recommendation(slo_tbt_ms, None, [], note)
    return Recommendation(slo_tbt_ms, choices[0], choices[1:1 + alternatives])


# --- applying a configuration --------------------------------------------------------------------------------------


class ConfigTarget(Protocol):
    async def apply(self, scheduler: SchedulerConfig) -> int | None: ...  # returns the generation, if any
    async def effective(self) -> dict[str, Any]: ...


class EngineTarget:
    """An in-process AsyncEngine: reconfigure() takes effect at the next step boundary."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def apply(self, scheduler: SchedulerConfig) -> int | None:
        self.engine.reconfigure(scheduler)
        return None

    async def effective(self) -> dict[str, Any]:
        return self.engine.stats().scheduler.snake_dict()


class ServerFileTarget:
    """A running server's --config file, rewritten by a `..data` swap; waits for /v1/config to show it."""

    def __init__(self, config_file: str, client: HttpClient, timeout_s: float = 30.0, poll_s: float = 0.2):
        self.config_file = config_file
        self.client = client
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    async def _server_config(self) -> dict[str, Any]:
        data = await self.client.get_json("/v1/config")
        if not isinstance(data, dict) or "generation" not in data:
            raise SweepError(f"{self.client.base_url}/v1/config does not report a generation: {str(data)[:200]}")
        return data

    async def apply(self, scheduler: SchedulerConfig) -> int | None:
        current = await self._server_config()
        generation = int(current["generation"]) + 1
        try:
            generation = max(generation, load_server_config(self.config_file).generation + 1)
        except ConfigError:
            pass  # no readable file yet: the server's generation is the reference
        from metronome.contract.config import ServerConfigFile

        text = ServerConfigFile(generation=generation, scheduler=scheduler).to_yaml()
        atomic_configmap_write(self.config_file, text)
        deadline = time.monotonic() + self.timeout_s
        while True:
            current = await self._server_config()
            if int(current["generation"]) >= generation:
                return generation
            if time.monotonic() > deadline:
                error = current.get("last_reload_error")
                raise SweepError(f"the server did not apply generation {generation} of {self.config_file} within "
                                 f"{self.timeout_s:g} s" + (f": {error}" if error else
                                                            " (is it started with --config on this file?)"))
            await asyncio.sleep(self.poll_s)

    async def effective(self) -> dict[str, Any]:
        return (await self._server_config()).get("scheduler", {})


# --- the sweep -----------------------------------------------------------------------------------------------------


async def run_sweep(target: ConfigTarget, client: Client, base: SchedulerConfig, configs: list[SweepConfig],
                    rates: list[float], make_requests: Callable[[], Iterator[BenchRequest]], stop: StopRule,
                    seed: int, slo_tbt_ms: float | None, slo_ttft_ms: float | None = None, progress: bool = False,
                    on_run: Callable[[RunEntry], None] | None = None) -> list[RunEntry]:
    runs: list[RunEntry] = []
    for config in configs:
        scheduler = scheduler_for(base, config)
        generation = await target.apply(scheduler)
        for rate in sorted(rates):
            label = f"{config.label} @ {rate:g} req/s"
            result = await run_load(client, make_requests(), LoadPattern(rate=rate), stop, seed=seed,
                                    progress=progress, label=label)
            effective = await target.effective()
            if effective.get("chunk_size") != scheduler.chunk_size or \
                    effective.get("queue_policy") != scheduler.queue_policy.value:
                raise SweepError(f"{label}: the target ran with {effective.get('chunk_size')} / "
                                 f"{effective.get('queue_policy')}, not the configuration asked for")
            params = {"chunk_size": config.chunk_size, "queue_policy": config.queue_policy, "rate": rate,
                      "generation": generation, "scheduler": effective}
            entry = RunEntry(label, params, summarize(result.records, slo_tbt_ms, slo_ttft_ms), result.records,
                             result.started_at, result.wall_s)
            runs.append(entry)
            if on_run is not None:
                on_run(entry)
    return runs
