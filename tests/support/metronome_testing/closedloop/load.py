"""Background long-short load against the servers the stand-in runs, through the bench code (workloads,
HttpClient, stats), until told to stop.

Closed loop: `concurrency_per_server` clients per server, each sending the next request of that server's
long-short stream as soon as its last one finished. The decode batch is then the concurrency on a fast machine and
a slow one alike, and the load can never outrun the servers (an open loop would pile up a backlog on a busy
2-core machine and measure queueing, not chunking). Every request has a timeout; stop() cancels what is left.
Only 127.0.0.0/8 URLs are accepted.
"""
from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from metronome.server.bench.load.clients import HttpClient
from metronome.server.bench.load.inprocess import DEFAULT_HTTP_TOKEN_RANGE, sampler_for_range
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import percentile
from metronome.server.bench.load.workloads import LongShortSpec, WorkloadSpec, iter_requests


@dataclass(frozen=True)
class LoadSpec:
    concurrency_per_server: int = 4
    long_fraction: float = 0.5
    long_prompt_len: int = 512
    short_prompt_len: int = 32
    output_len: int = 32
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass
class LoadStats:
    records: list[RequestRecord] = field(default_factory=list)


def require_loopback(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    if ipaddress.ip_address(host) not in ipaddress.ip_network("127.0.0.0/8"):
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

    def start(self, timeout_s: float = 60.0) -> LoadDriver:
        """Start sending; raises when the servers cannot be used (e.g. /v1/models does not answer)."""
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s):
            self.stop()
            raise RuntimeError(f"the load did not start within {timeout_s:g} s")
        if self.error is not None:
            self.stop()
            raise RuntimeError(f"the load could not start: {self.error}") from self.error
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:  # the loop closed in between: nothing left to stop
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def now(self) -> float:
        """Seconds since the load started, on the clock of the records' token times."""
        return time.monotonic() - self._t0

    def gaps_since(self, since_s: float) -> list[float]:
        """Token gaps (TBT) that began at or after `since_s` (load clock), every request and server together."""
        return [b - a for r in list(self.stats.records) for a, b in zip(r.token_times_s, r.token_times_s[1:])
                if a >= since_s]

    def tbt_p99_s(self, since_s: float = 0.0) -> float | None:
        return percentile(self.gaps_since(since_s), 99)

    def completed(self, since_s: float = 0.0) -> int:
        return sum(1 for r in list(self.stats.records) if r.ok and r.end_s is not None and r.end_s >= since_s)

    def errors(self) -> list[str]:
        return [r.error for r in list(self.stats.records) if r.error]

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
        clients = [HttpClient(url, timeout_s=self.spec.request_timeout_s) for url in self.base_urls]
        try:
            for client in clients:
                await client.discover()
            self._t0 = time.monotonic()
            self._started.set()
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
        requests = iter_requests(workload, sampler_for_range(*DEFAULT_HTTP_TOKEN_RANGE), spec.seed * 1000 + index)

        async def worker() -> None:
            for request in requests:  # one shared stream per server; each worker takes the next request
                record = RequestRecord(index=request.index, kind=request.kind, max_tokens=request.max_tokens,
                                       prompt_tokens=request.prompt_len, scheduled_s=time.monotonic() - self._t0)
                self.stats.records.append(record)
                await self._send(client, request, record)
                if record.error:
                    await asyncio.sleep(0.5)  # a refused or broken request: do not spin on a sick server

        workers = [asyncio.create_task(worker()) for _ in range(spec.concurrency_per_server)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

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
