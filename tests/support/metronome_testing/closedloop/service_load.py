"""Closed-loop load on one InferenceService spread over its servers, for the replica tests: `concurrency` clients,
each sending its next long-short request when its last one finished, every request to the ready server with the
fewest of the load's requests in flight (ties in turn), as a least-request balancer or an LLM router spreads it.
Round robin would give every server the same arrival rate, so a slower server (a new one warming up, one sharing its
core) holds more of a closed loop's clients the longer its requests take, until they pass its max_num_seqs and
queue whole: two servers ran at TTFT p99 7.7 and 19.6 s where one had carried half the load in 0.7-1.0 s.
The servers come from the stand-in: one it starts for a new pod takes load once GET /ready answers; one whose pod
was deleted leaves `standin.servers()` at once and gets no new request, while the stand-in lets it finish what it
streams (the pod's preStop sleep, then its drain).

The load can change while it runs (`set_load`: a load step up, or a drop): new clients start at once, clients
beyond the new concurrency finish their request first — nothing is cancelled before `stop()`. Only 127.0.0.0/8 is
contacted (load.require_loopback).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from metronome.server.bench.load.clients import HttpClient
from metronome.server.bench.load.inprocess import DEFAULT_HTTP_TOKEN_RANGE, sampler_for_range
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.stats import percentile, ttft
from metronome.server.bench.load.workloads import LongShortSpec, WorkloadSpec, iter_requests
from metronome.server.bench.processes import http_ok

from .load import LoadSpec, require_loopback

READY_POLL_S = 0.5


class ServiceLoad:
    def __init__(self, servers: Callable[[], list[str]], spec: LoadSpec, concurrency: int):
        """`servers()`: the base URLs of the service's servers as the stand-in runs them now (ready or not)."""
        self.servers = servers
        self.spec, self.concurrency = spec, concurrency
        self.records: list[RequestRecord] = []
        self._ready: set[str] = set()
        self._turn = 0
        self._in_flight: dict[str, int] = {}
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._generation = 0  # bumps on every set_load: the request stream and the clients' count follow it
        self.error: BaseException | None = None

    # --- control ------------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> ServiceLoad:
        self._thread = threading.Thread(target=self._run, name="service-load", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout_s) or self.error is not None:
            self.stop()
            raise RuntimeError(f"the load could not start: {self.error or 'no ready server'}")
        return self

    def set_load(self, concurrency: int, spec: LoadSpec | None = None) -> None:
        """From now on: `concurrency` clients, drawing from `spec` (the current one when None)."""
        def change() -> None:
            self.spec = spec or self.spec
            self.concurrency = concurrency
            self._generation += 1
            self._spawn_clients()

        assert self._loop is not None
        self._loop.call_soon_threadsafe(change)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(self._stop.set)
            except RuntimeError:
                pass
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # --- what it measured ---------------------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self._t0

    def gaps_since(self, since_s: float) -> list[float]:
        return [b - a for r in list(self.records) for a, b in zip(r.token_times_s, r.token_times_s[1:])
                if a >= since_s]

    def ttfts_since(self, since_s: float) -> list[float]:
        """Time to first token of the requests sent at or after `since_s` that got one."""
        return [t for r in list(self.records) if (r.sent_s or -1.0) >= since_s and (t := ttft(r)) is not None]

    def ttft_p99_s(self, since_s: float) -> float | None:
        return percentile(self.ttfts_since(since_s), 99)

    def completed(self, since_s: float = 0.0) -> int:
        return sum(1 for r in list(self.records) if r.ok and r.end_s is not None and r.end_s >= since_s)

    def errors(self) -> list[str]:
        """Every request that failed or was cut short (a drain that aborted a stream counts)."""
        return [r.error or f"finish_reason {r.finish_reason}" for r in list(self.records)
                if r.error or r.finish_reason == "abort"]

    def servers_used(self, since_s: float = 0.0) -> dict[str, int]:
        out: dict[str, int] = {}
        for record in list(self.records):
            if (record.sent_s or -1.0) >= since_s:
                out[record.server] = out.get(record.server, 0) + 1
        return out

    def drained_at(self, sent_before_s: float) -> float:
        """When the last request sent before `sent_before_s` ended (now while one still runs)."""
        ends = [record.end_s if record.end_s is not None else self.now() for record in list(self.records)
                if record.sent_s is not None and record.sent_s < sent_before_s]
        return max(ends, default=sent_before_s)

    def servers_streaming(self, since_s: float) -> dict[str, int]:
        """Each server's requests that streamed a token at or after `since_s`, whenever they were sent."""
        out: dict[str, int] = {}
        for record in list(self.records):
            if record.token_times_s and record.token_times_s[-1] >= since_s:
                out[record.server] = out.get(record.server, 0) + 1
        return out

    # --- the event loop thread ----------------------------------------------------------------------------------

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
        self._clients: dict[str, HttpClient] = {}
        self._tasks: set[asyncio.Task] = set()
        poller = asyncio.create_task(self._poll_ready())
        try:
            while not self._ready:
                await asyncio.sleep(0.1)
            probe = HttpClient(next(iter(self._ready)), timeout_s=self.spec.request_timeout_s)
            try:
                await probe.discover()
            finally:
                await probe.close()
            self._model = probe.model
            self._t0 = time.monotonic()
            self._spawn_clients()
            self._started.set()
            await self._stop.wait()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            poller.cancel()
            for client in self._clients.values():
                await client.close()

    async def _poll_ready(self) -> None:
        while True:
            urls = [require_loopback(url) for url in self.servers()]
            answers = await asyncio.gather(*(asyncio.to_thread(http_ok, f"{url}/ready", 1.0) for url in urls))
            self._ready = {url for url, ok in zip(urls, answers) if ok}
            await asyncio.sleep(READY_POLL_S)

    def _endpoint(self) -> str | None:
        """The ready server with the fewest requests in flight, among those the stand-in still runs for a pod (a
        deleted pod's leaves at once); ties in turn."""
        live = [url for url in self.servers() if url in self._ready]
        if not live:
            return None
        self._turn += 1
        fewest = min(self._in_flight.get(url, 0) for url in live)
        tied = [url for url in live if self._in_flight.get(url, 0) == fewest]
        return tied[self._turn % len(tied)]

    def _spawn_clients(self) -> None:
        spec = self.spec
        workload = WorkloadSpec(name="long-short", long_short=LongShortSpec(
            long_fraction=spec.long_fraction, long_prompt_len=spec.long_prompt_len,
            short_prompt_len=spec.short_prompt_len, output_len=spec.output_len))
        self._requests = iter_requests(workload, sampler_for_range(*DEFAULT_HTTP_TOKEN_RANGE),
                                       spec.seed * 1000 + self._generation)
        running = sum(1 for task in self._tasks if not task.done())
        for _ in range(max(0, self.concurrency - running)):
            task = asyncio.create_task(self._client())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _client(self) -> None:
        while True:
            if sum(1 for task in self._tasks if not task.done()) > self.concurrency:
                return  # the load dropped: this client leaves, its last request done
            url = self._endpoint()
            if url is None:
                await asyncio.sleep(0.2)
                continue
            request = next(self._requests)
            client = self._clients.get(url) or self._clients.setdefault(
                url, HttpClient(url, model=self._model, timeout_s=self.spec.request_timeout_s))
            record = RequestRecord(index=request.index, kind=request.kind, max_tokens=request.max_tokens,
                                   prompt_tokens=request.prompt_len, scheduled_s=self.now(), server=url)
            self.records.append(record)
            self._in_flight[url] = self._in_flight.get(url, 0) + 1
            try:
                await asyncio.wait_for(client.send(request, record, self._t0), self.spec.request_timeout_s)
            except asyncio.TimeoutError:
                record.error = f"timeout after {self.spec.request_timeout_s:g} s"
            except asyncio.CancelledError:
                record.error = record.error or "cancelled: load stopped"
                raise
            except Exception as exc:  # noqa: BLE001 - one broken request must not end the load
                record.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._in_flight[url] -= 1
            if record.error:
                await asyncio.sleep(0.5)
