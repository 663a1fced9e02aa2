"""The bench loop's fleet drains a server it scales away (random:tiny on CPU, two real `metronome serve` processes):
the server leaves the routes at once, so the next requests go to the one that stays, and gets SIGTERM while a
request it took still streams — which then finishes whole, the server exiting only after it."""
from __future__ import annotations

import asyncio
import json
import time

from metronome.contract.config import SchedulerConfig, ServerConfigFile
from metronome.server.bench.load.clients import HttpClient
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.workloads import BenchRequest
from metronome.server.bench.loop import fleet as fleet_module
from metronome.server.bench.loop.fleet import ServerFleet
from metronome.server.bench.loop.routes import Routes

TOKENS = 3000  # long enough to outlast the route grace below on any machine


def test_a_drained_server_leaves_the_routes_first_and_finishes_what_it_streams(tmp_path, monkeypatch):
    monkeypatch.setattr(fleet_module, "ROUTE_GRACE_S", 0.2)
    asyncio.run(drain(tmp_path))


async def drain(tmp_path) -> None:
    fleet = ServerFleet(tmp_path, ("--model", "random:tiny", "--device", "cpu"), {}, 300.0, progress=lambda m: None)
    try:
        await fleet.start(2, config())
        first, second = fleet.live
        routes = Routes(fleet.routes_path)
        assert routes.urls() == [first.base_url, second.base_url]

        client = HttpClient(second.base_url, timeout_s=120)
        await client.discover()
        record = RequestRecord(index=0, kind="long", max_tokens=TOKENS, server=second.base_url)
        t0 = time.monotonic()
        streaming = asyncio.create_task(client.send(BenchRequest(0, TOKENS, "long", tuple(range(300, 340))),
                                                    record, t0))
        while not record.token_times_s:  # the stream is under way
            await asyncio.sleep(0.05)

        fleet.scale_to(1)
        scaled = time.monotonic() - t0
        assert fleet.live == [first] and fleet.draining == [second]
        assert json.loads(fleet.routes_path.read_text()) == [first.base_url]
        assert routes.urls() == [first.base_url]  # a client's next request goes to the server that stays

        await streaming
        await client.close()
        await fleet.settle()
        assert record.error is None and record.finish_reason == "length" and record.output_tokens == TOKENS
        assert record.end_s > scaled + 0.2, "SIGTERM must reach the server while the request still streams"
        (life,) = [life for life in fleet.lives if life.server is second]
        assert life.stopped is not None and life.stopped - t0 >= record.end_s  # it exited after the stream ended
        assert fleet.draining == [] and second.process.returncode == 0
    finally:
        await fleet.close()


def config() -> ServerConfigFile:
    return ServerConfigFile(generation=1, scheduler=SchedulerConfig(chunk_size=256, queue_policy="fcfs"))
