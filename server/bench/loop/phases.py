"""The phased workload of `metronome bench loop`: a sequence of (workload, Poisson rate, duration) phases, e.g.
short-heavy chat → the report's long-short mix → a burst. Each phase draws its requests from load/workloads.py with
its own seed, so every run of one command (the loop, each static config) gets exactly the same requests at the
same offsets. Pure.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from metronome.server.bench.load.workloads import (
    BenchRequest,
    LongShortSpec,
    TokenSampler,
    WorkloadError,
    WorkloadSpec,
    iter_requests,
    poisson_arrivals,
)

PHASE_WORKLOADS = ("chat", "long-short")


@dataclass(frozen=True)
class Phase:
    workload: str  # "chat" | "long-short"
    rate: float  # requests per second, Poisson
    duration_s: float
    long_fraction: float | None = None  # long-short only: overrides --long-fraction for this phase
    output_len: int | None = None  # every request of this phase generates this many tokens (decode-heavy phases)

    @property
    def label(self) -> str:
        mix = f" {self.long_fraction:.0%} long" if self.long_fraction is not None else ""
        out = f" {self.output_len} out" if self.output_len is not None else ""
        return f"{self.workload}{mix}{out} {self.rate:g} req/s {self.duration_s:g} s"


PHASE_SYNTAX = "WORKLOAD:RATE:SECONDS[:LONG_FRACTION[:OUTPUT_LEN]]"


def parse_phases(text: str) -> list[Phase]:
    """'chat:2:60,long-short:1.5:60,long-short:6:20:1:1000' — PHASE_SYNTAX per phase; LONG_FRACTION may be left
    empty ('chat:8:20::500') to give an output length alone."""
    phases = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) not in (3, 4, 5) or parts[0] not in PHASE_WORKLOADS:
            raise WorkloadError(f"--phases: {item!r} is not {PHASE_SYNTAX} with WORKLOAD one "
                                f"of {', '.join(PHASE_WORKLOADS)}")
        try:
            rate, duration = float(parts[1]), float(parts[2])
            fraction = float(parts[3]) if len(parts) >= 4 and parts[3] else None
            output_len = int(parts[4]) if len(parts) == 5 else None
        except ValueError:
            raise WorkloadError(f"--phases: {item!r}: rate, seconds and long fraction must be numbers, the output "
                                f"length an integer") from None
        if not (math.isfinite(rate) and rate > 0 and math.isfinite(duration) and duration > 0):
            raise WorkloadError(f"--phases: {item!r}: rate and seconds must be positive")
        if fraction is not None and (parts[0] != "long-short" or not 0 <= fraction <= 1):
            raise WorkloadError(f"--phases: {item!r}: a long fraction in [0, 1] applies to long-short phases only")
        if output_len is not None and output_len < 1:
            raise WorkloadError(f"--phases: {item!r}: the output length must be at least 1")
        phases.append(Phase(parts[0], rate, duration, fraction, output_len))
    if not phases:
        raise WorkloadError("--phases: no phase given")
    return phases


@dataclass(frozen=True)
class Scheduled:
    """One request of the run: when it is due (seconds from the run's start) and in which phase."""

    offset_s: float
    phase: int
    request: BenchRequest


def phase_bounds(phases: list[Phase]) -> list[tuple[float, float]]:
    """(start, end) of each phase in seconds from the run's start."""
    bounds, start = [], 0.0
    for phase in phases:
        bounds.append((start, start + phase.duration_s))
        start += phase.duration_s
    return bounds


def schedule(phases: list[Phase], base: WorkloadSpec, sampler: TokenSampler, seed: int) -> Iterator[Scheduled]:
    """Every request of every phase, in time order; indices are unique across phases."""
    index = 0
    for number, (phase, (start, end)) in enumerate(zip(phases, phase_bounds(phases), strict=True)):
        spec = replace(base, name=phase.workload)
        if phase.long_fraction is not None:
            spec = replace(spec, long_short=replace(spec.long_short or LongShortSpec(),
                                                    long_fraction=phase.long_fraction))
        if phase.output_len is not None:
            spec = replace(spec, output_len_override=phase.output_len)
        phase_seed = seed * 1000 + number
        for request, offset in zip(iter_requests(spec, sampler, phase_seed), poisson_arrivals(phase.rate, phase_seed),
                                   strict=False):
            if start + offset >= end:
                break
            yield Scheduled(start + offset, number, replace(request, index=index))
            index += 1
