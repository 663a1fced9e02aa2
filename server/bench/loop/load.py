"""The loop benchmark's load: every scheduled request sent on time and every token stamped as it arrives, in this
process or spread over client processes, to a fixed set of servers or to the live ones a routes file lists
(routes.py: the servers a replica-aware run starts and stops).

One Python process reading ~5,500 streamed tokens/s (the H200's mix at 45 req/s) is busy enough that a token can
wait in its socket for the event loop: on the H200 the clients' TBT p99 ran 7-12 ms over the one the server timed
at its write. That error falls on goodput, which is judged from the clients' records, and
not on what the controller steers by. With `client_processes` > 1 the requests are dealt round-robin to that many
spawned processes, each with its own event loop and connections; all stamp time.monotonic() (CLOCK_MONOTONIC, one
clock for every process on the machine) relative to the same t0, so their records merge as if one client took them.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from metronome.server.bench.load.clients import BenchClientError, HttpClient
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.loop.phases import Scheduled
from metronome.server.bench.loop.routes import Routes
from metronome.server.engine.serving_process import GIL_SWITCH_INTERVAL_S


@dataclass(frozen=True)
class LoadTarget:
    """Where and how a share of the load is sent: plain data, so it crosses to a client process."""

    base_urls: tuple[str, ...]  # request k of a share goes to base_urls[k % len]
    model: str
    request_timeout_s: float
    drain_timeout_s: float  # after the last request is sent, in-flight ones get this long
    routes_path: str | None = None  # set: request k goes to the k-th of the live URLs this file lists (routes.py)


def deal(requests: Sequence[Scheduled], shares: int) -> list[list[Scheduled]]:
    """Round-robin: share i gets requests i, i + shares, ... — every share sees every phase at 1/shares the rate."""
    return [list(requests[i::shares]) for i in range(shares)]


async def send_scheduled(requests: Sequence[Scheduled], target: LoadTarget, t0: float) -> list[RequestRecord]:
    """Send each request at t0 + its offset, stream it to the end (or the drain's), and return one record per
    request in schedule order."""
    clients: dict[str, HttpClient] = {}
    routes = Routes(target.routes_path) if target.routes_path else None

    def client_for(number: int) -> HttpClient:
        urls = (routes.urls() if routes is not None else None) or target.base_urls
        url = urls[number % len(urls)]
        if url not in clients:
            clients[url] = HttpClient(url, model=target.model, timeout_s=target.request_timeout_s)
        return clients[url]

    records: list[RequestRecord] = []
    tasks = []
    try:
        for number, item in enumerate(requests):
            delay = t0 + item.offset_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            request = item.request
            client = client_for(number)
            record = RequestRecord(index=request.index, kind=request.kind, max_tokens=request.max_tokens,
                                   prompt_tokens=request.prompt_len, scheduled_s=item.offset_s,
                                   server=client.base_url)
            records.append(record)
            tasks.append(asyncio.create_task(_send(client, request, record, t0, target.request_timeout_s)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=target.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for client in clients.values():
            await client.close()
    return records


async def _send(client: HttpClient, request, record: RequestRecord, t0: float, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(client.send(request, record, t0), timeout_s)
    except asyncio.TimeoutError:
        record.error, record.end_s = f"timeout: no completion within {timeout_s:g} s", None
    except asyncio.CancelledError:
        record.error, record.end_s = "cancelled: unfinished when the drain ended", None
        raise
    except Exception as exc:  # noqa: BLE001 - one broken request must not end the run
        record.error, record.end_s = f"{type(exc).__name__}: {exc}", None


def run_client_loop(work):
    """Run a client's coroutine as the clients should be run: on uvloop where installed, and with a short GIL
    switch interval so another thread (the scrapes' parser) cannot hold a token's timestamp back by 5 ms."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    return uvloop.run(work)


def _share_main(requests: list[Scheduled], target: LoadTarget, t0: float) -> list[RequestRecord]:
    return run_client_loop(send_scheduled(requests, target, t0))


def _warm() -> None:
    """Each client process's start: what a share will import, so the first request of a run is not late by it."""
    import httpx  # noqa: F401


def _ready() -> int:
    time.sleep(0.2)  # long enough that the first calls land on different processes
    return os.getpid()


class ClientPool:
    """`processes` spawned client processes, started (and their imports done) before a run's clock starts."""

    def __init__(self, processes: int):
        import multiprocessing

        self.processes = processes
        # spawn, not fork: the parent runs an event loop and threads, which a forked child would inherit half-made
        self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_warm)
        # one submit per process, made before any returns, starts every process (an executor spawns on demand)
        self.pids = {future.result(timeout=120) for future in [self._pool.submit(_ready) for _ in range(processes)]}

    async def send(self, requests: Sequence[Scheduled], target: LoadTarget, t0: float) -> list[RequestRecord]:
        """Every request, dealt over the processes; the records merged in schedule order."""
        loop = asyncio.get_running_loop()
        shares = [loop.run_in_executor(self._pool, _share_main, share, target, t0)
                  for share in deal(requests, self.processes) if share]
        try:
            merged = [record for records in await asyncio.gather(*shares) for record in records]
        except BrokenProcessPool as exc:  # killed (OOM, a signal): the run's records are incomplete, so no run
            raise BenchClientError(f"a client process died during the run: {exc}") from exc
        return sorted(merged, key=lambda r: (r.scheduled_s, r.index))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class Load:
    """The load of every run on one set of servers: sent from this process, or dealt over a client pool."""

    def __init__(self, target: LoadTarget, pool: ClientPool | None = None):
        self.target = target
        self.pool = pool

    async def send(self, requests: Sequence[Scheduled], t0: float) -> list[RequestRecord]:
        if self.pool is None:
            return await send_scheduled(requests, self.target, t0)
        return await self.pool.send(requests, self.target, t0)
