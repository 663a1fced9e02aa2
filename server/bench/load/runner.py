"""Drive a client with a load pattern until a stop rule, then collect the records.

Patterns: Poisson arrivals at a fixed rate (open loop: requests arrive whether or not earlier ones finished), or a
fixed number of concurrent requests (closed loop). Every run is bounded: sending stops after `num_requests` or
`duration_s`; each request gets at most `request_timeout_s`; in-flight requests get `drain_timeout_s` after the
last send and are then cancelled (recorded as errors), so a hung server cannot hang the benchmark.
"""
from __future__ import annotations

import asyncio
import datetime as _dt
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from metronome.server.bench.load.clients import Client
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.workloads import BenchRequest, WorkloadError, poisson_arrivals


@dataclass(frozen=True)
class LoadPattern:
    rate: float | None = None  # requests per second, Poisson; math.inf = all at once
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise WorkloadError("give exactly one of a request rate or a concurrency")
        if self.rate is not None and not self.rate > 0:
            raise WorkloadError(f"request rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise WorkloadError(f"concurrency must be >= 1, got {self.concurrency}")

    def label(self) -> str:
        if self.rate is not None:
            return "burst" if math.isinf(self.rate) else f"{self.rate:g} req/s"
        return f"concurrency {self.concurrency}"


@dataclass(frozen=True)
class StopRule:
    num_requests: int | None = None
    duration_s: float | None = None
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise WorkloadError("a run needs a request count or a duration (it must stop by itself)")
        if self.num_requests is not None and self.num_requests < 1:
            raise WorkloadError(f"request count must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError(f"duration must be > 0, got {self.duration_s}")
        if not (self.request_timeout_s > 0 and self.drain_timeout_s >= 0):
            raise WorkloadError("timeouts must be positive")

    def expected_requests(self, pattern: LoadPattern) -> int | None:
        """How many requests the run will send, when knowable up front (for the progress bar)."""
        if self.num_requests is not None:
            if self.duration_s is not None and pattern.rate is not None and not math.isinf(pattern.rate):
                return min(self.num_requests, max(1, round(pattern.rate * self.duration_s)))
            return self.num_requests
        if pattern.rate is not None and not math.isinf(pattern.rate):
            return max(1, round(pattern.rate * self.duration_s))  # type: ignore[operator]
        return None


@dataclass
class RunResult:
    records: list[RequestRecord]
    started_at: str  # wall clock, ISO 8601 UTC
    wall_s: float  # from the first send to the end of the drain


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, enabled: bool, label: str, total: int | None):
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=False)
            self._task = self._bar.add_task(label, total=total)

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _record_for(request: BenchRequest, scheduled_s: float) -> RequestRecord:
    return RequestRecord(index=request.index, kind=request.kind, max_tokens=request.max_tokens,
                         prompt_tokens=request.prompt_len, scheduled_s=scheduled_s)


async def _send_one(client: Client, request: BenchRequest, record: RequestRecord, t0: float, stop: StopRule,
                    progress: _Progress) -> None:
    try:
        await asyncio.wait_for(client.send(request, record, t0), stop.request_timeout_s)
    except asyncio.TimeoutError:
        record.error = f"timeout: no completion within {stop.request_timeout_s:g} s"
        record.end_s = None
    except asyncio.CancelledError:
        record.error = f"cancelled: unfinished {stop.drain_timeout_s:g} s after the last send"
        record.end_s = None
        raise
    except Exception as exc:  # a client bug or a broken connection must not kill the whole run
        record.error = f"{type(exc).__name__}: {exc}"
        record.end_s = None
    finally:
        progress.advance()


async def run_load(client: Client, requests: Iterator[BenchRequest], pattern: LoadPattern, stop: StopRule,
                   seed: int = 0, progress: bool = False, label: str = "bench") -> RunResult:
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    with _Progress(progress, f"{label} ({pattern.label()})", stop.expected_requests(pattern)) as bar:
        t0 = time.monotonic()
        if pattern.rate is not None:
            await _open_loop(client, requests, pattern.rate, stop, seed, t0, bar, records, tasks)
        else:
            await _closed_loop(client, requests, pattern.concurrency, stop, t0, bar, records, tasks)  # type: ignore[arg-type]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=stop.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall_s = time.monotonic() - t0
    return RunResult(records=records, started_at=started_at, wall_s=wall_s)


def _may_send(stop: StopRule, sent: int, offset_s: float) -> bool:
    if stop.num_requests is not None and sent >= stop.num_requests:
        return False
    return stop.duration_s is None or offset_s < stop.duration_s


async def _open_loop(client: Client, requests: Iterator[BenchRequest], rate: float, stop: StopRule, seed: int,
                     t0: float, bar: _Progress, records: list[RequestRecord], tasks: list[asyncio.Task]) -> None:
    for request, offset in zip(requests, poisson_arrivals(rate, seed)):
        if not _may_send(stop, len(records), offset):
            break
        delay = t0 + offset - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        record = _record_for(request, offset)
        records.append(record)
        tasks.append(asyncio.create_task(_send_one(client, request, record, t0, stop, bar)))


async def _closed_loop(client: Client, requests: Iterator[BenchRequest], concurrency: int, stop: StopRule,
                       t0: float, bar: _Progress, records: list[RequestRecord], tasks: list[asyncio.Task]) -> None:
    all_handed_out = asyncio.Event()

    async def worker() -> None:
        while True:
            offset = time.monotonic() - t0
            request = next(requests, None) if _may_send(stop, len(records), offset) else None
            if request is None:
                all_handed_out.set()
                return
            record = _record_for(request, offset)
            records.append(record)
            await _send_one(client, request, record, t0, stop, bar)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    tasks.extend(workers)
    # Return once sending is over (or the duration has passed); the caller's drain then bounds the in-flight tail.
    waiter = asyncio.create_task(all_handed_out.wait())
    await asyncio.wait([waiter], timeout=stop.duration_s)
    waiter.cancel()
