"""Background long-short load against the servers the stand-in runs, through the bench code (workloads,
HttpClient, stats), until told to stop.

Open loop: Poisson arrivals at `rate_per_server` to every server, each with its own request stream. Bounded:
at most `max_in_flight_per_server` requests in flight per server (arrivals beyond it are skipped and counted, so a
slow machine cannot pile up an unbounded backlog), every request has a timeout, and stop() cancels what is left.
Only 127.0.0.0/8 URLs are accepted.
"""
from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from metronome.server.bench.clients import HttpClient
from metronome.server.bench.inprocess import DEFAULT_HTTP_TOKEN_RANGE, sampler_for_range
from metronome.server.bench.records import RequestRecord
from metronome.server.bench.stats import gaps, percentile
from metronome.server.bench.workloads import LongShortSpec, WorkloadSpec, iter_requests, poisson_arrivals


@dataclass(frozen=True)
class LoadSpec:
    rate_per_server: float = 0.5  # requests per second, per server
    long_fraction: float = 0.2
    long_prompt_len: int = 1024
    short_prompt_len: int = 32
    output_len: int = 48
    max_in_flight_per_server: int = 8
    request_timeout_s: float = 180.0
    seed: int = 0


@dataclass
class LoadStats:
    records: list[RequestRecord] = field(default_factory=list)
    skipped: int = 0  # arrivals dropped because the server already had max_in_flight requests


def require_loopback(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    if not ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8"):
        raise ValueError(f"load may only go to 127.0.0.0/8, not {url}")
    return url


class LoadDriver:
    def __init__(self, base_urls: list[str], spec: LoadSpec = LoadSpec()):
        self.base_urls = [require_loopback(url) for url in base_urls]
        self.spec = spec
        self.stats = LoadStats()
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self.error: BaseException | None = None

    def start(self) -> "LoadDriver":
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()
        self._started.wait(30)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def now(self) -> float:
        """Seconds since the load started, on the clock of the records' token times."""
        return time.monotonic() - self._t0

    def tbt_p99_s(self, since_s: float = 0.0) -> float | None:
        """p99 of the token gaps that ended after `since_s` (load clock), every request and server together."""
        values = [b - a for r in list(self.stats.records) for a, b in zip(r.token_times_s, r.token_times_s[1:])
                  if b >= since_s]
        return percentile(values, 99)

    def completed(self, since_s: float = 0.0) -> int:
        return sum(1 for r in list(self.stats.records) if r.ok and r.end_s is not None and r.end_s >= since_s)

    def errors(self) -> list[str]:
        return [r.error for r in list(self.stats.records) if r.error]

    def token_gaps(self) -> list[float]:
        return [g for r in list(self.stats.records) for g in gaps(r.token_times_s)]

    # --- the event loop thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported through self.error
            self.error = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._t0 = time.monotonic()
        self._started.set()
        clients = [HttpClient(url, timeout_s=self.spec.request_timeout_s) for url in self.base_urls]
        try:
            for client in clients:
                await client.discover()
            senders = [asyncio.create_task(self._drive(client, index)) for index, client in enumerate(clients)]
            await self._stop.wait()
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
        finally:
            for client in clients:
                await client.close()

    async def _drive(self, client: HttpClient, index: int) -> None:
        spec = self.spec
        workload = WorkloadSpec(name="long-short", long_short=LongShortSpec(
            long_fraction=spec.long_fraction, long_prompt_len=spec.long_prompt_len,
            short_prompt_len=spec.short_prompt_len, output_len=spec.output_len))
        seed = spec.seed * 1000 + index
        requests = iter_requests(workload, sampler_for_range(*DEFAULT_HTTP_TOKEN_RANGE), seed)
        in_flight: set[asyncio.Task] = set()
        start = time.monotonic()
        try:
            for request, offset in zip(requests, poisson_arrivals(spec.rate_per_server, seed)):
                delay = start + offset - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if len(in_flight) >= spec.max_in_flight_per_server:
                    self.stats.skipped += 1
                    continue
                record = RequestRecord(index=request.index, kind=request.kind, max_tokens=request.max_tokens,
                                       prompt_tokens=request.prompt_len, scheduled_s=time.monotonic() - self._t0)
                self.stats.records.append(record)
                task = asyncio.create_task(self._send(client, request, record))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _send(self, client: HttpClient, request, record: RequestRecord) -> None:
        try:
            await asyncio.wait_for(client.send(request, record, self._t0), self.spec.request_timeout_s)
        except asyncio.TimeoutError:
            record.error = f"timeout after {self.spec.request_timeout_s:g} s"
        except asyncio.CancelledError:
            record.error = record.error or "cancelled: load stopped"
            raise
        except Exception as exc:  # noqa: BLE001 - one broken request must not end the load
            record.error = f"{type(exc).__name__}: {exc}"
