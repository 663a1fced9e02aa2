"""Overload (bounded waiting queue → 429 + Retry-After) and client disconnects (abort, KV blocks freed)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from api_helpers import ServerThread, build_server_parts, metric, scrape, wait_until

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig


@pytest.fixture(scope="module")
def server():
    # One running sequence and room for two waiting: a burst must overflow.
    engine, _, app = build_server_parts(max_waiting=2, scheduler=SchedulerConfig(max_num_seqs=1, chunk_size=64))
    with ServerThread(app) as running:
        running.engine = engine
        yield running


def idle(url: str) -> dict:
    def check():
        samples = scrape(url)
        busy = metric(samples, names.REQUESTS_RUNNING) + metric(samples, names.REQUESTS_WAITING)
        return samples if busy == 0 else None

    return wait_until(check, timeout=60, what="engine idle")


async def first_chunk_then_hold(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event,
                                release: asyncio.Event) -> dict:
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                break
        started.set()
        await release.wait()
        chunks = [line async for line in lines if line.startswith("data: ")]
    return json.loads(chunks[-2][len("data: "):])  # the usage chunk before [DONE]


def test_burst_beyond_max_waiting_gets_429_with_retry_after(server):
    long_body = {"prompt": "hold the engine", "max_tokens": 900, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            started, release = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(first_chunk_then_hold(client, server.url, long_body, started, release))
            await started.wait()  # the only running slot is taken
            burst = [client.post(server.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2})
                     for i in range(8)]
            replies = await asyncio.gather(*burst)
            release.set()
            return replies, await holder

    before = metric(scrape(server.url), names.REQUESTS_REJECTED, reason="overloaded")
    replies, holder_usage = asyncio.run(scenario())
    rejected = [r for r in replies if r.status_code == 429]
    accepted = [r for r in replies if r.status_code == 200]
    assert len(rejected) + len(accepted) == len(replies), [r.text for r in replies]
    assert len(rejected) >= len(replies) - 2 - 1  # at most max_waiting queued (+1 if the holder just finished)
    for reply in rejected:
        assert int(reply.headers["Retry-After"]) >= 1
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_error" and error["message"]
    for reply in accepted:
        assert reply.json()["usage"]["completion_tokens"] >= 1
    assert holder_usage["usage"]["completion_tokens"] == 900
    after = idle(server.url)
    assert metric(after, names.REQUESTS_REJECTED, reason="overloaded") - before == len(rejected)
    assert metric(after, names.KV_CACHE_USAGE) == 0 and metric(after, names.KV_BLOCKS_LEAKED) == 0


@pytest.fixture(scope="module")
def roomy_server():
    # Several streams running at once, so disconnects hit sequences that hold blocks mid-decode.
    engine, _, app = build_server_parts(scheduler=SchedulerConfig(max_num_seqs=4, chunk_size=16))
    with ServerThread(app) as running:
        running.engine = engine
        yield running


def test_disconnected_streams_abort_and_free_kv_blocks(roomy_server):
    server = roomy_server
    body = {"prompt": "a long answer please " * 4, "max_tokens": 900, "ignore_eos": True, "stream": True}

    async def open_and_drop(client: httpx.AsyncClient, chunks_to_read: int) -> int:
        read = 0
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    read += 1
                    if read == chunks_to_read:
                        break  # leaving the block closes the connection mid-stream
        return read

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(open_and_drop(client, 3), open_and_drop(client, 1),
                                        open_and_drop(client, 5))

    before = scrape(server.url)
    assert asyncio.run(scenario()) == [3, 1, 5]
    after = idle(server.url)
    assert metric(after, names.KV_CACHE_USAGE) == 0
    assert metric(after, names.KV_BLOCKS_LEAKED) == 0
    assert server.engine.stats().kv_blocks_leaked == 0
    # Aborted early: far fewer tokens than three full answers were generated.
    generated = metric(after, names.GENERATION_TOKENS) - metric(before, names.GENERATION_TOKENS)
    assert generated < 3 * 900


def test_clients_leaving_while_queued_are_aborted_before_they_run(server):
    """A request still waiting for its first token, streamed or not, is aborted when its client leaves."""
    long_body = {"prompt": "hold the engine", "max_tokens": 900, "ignore_eos": True, "stream": True,
                 "stream_options": {"include_usage": True}}

    async def leave_early(client: httpx.AsyncClient, stream: bool) -> str:
        body = {"prompt": "never mind", "max_tokens": 50, "ignore_eos": True, "stream": stream}
        try:
            await client.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(120, read=0.3))
        except httpx.ReadTimeout:
            return "left"
        return "answered"

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            started, release = asyncio.Event(), asyncio.Event()
            holder = asyncio.create_task(first_chunk_then_hold(client, server.url, long_body, started, release))
            await started.wait()
            outcomes = await asyncio.gather(leave_early(client, False), leave_early(client, True))
            release.set()
            return outcomes, await holder

    before = idle(server.url)
    outcomes, holder_usage = asyncio.run(scenario())
    assert outcomes == ["left", "left"]
    assert holder_usage["usage"]["completion_tokens"] == 900
    after = idle(server.url)
    # Only the holder generated anything: the two queued requests never ran.
    assert metric(after, names.GENERATION_TOKENS) - metric(before, names.GENERATION_TOKENS) == 900
    assert metric(after, names.KV_CACHE_USAGE) == 0 and metric(after, names.KV_BLOCKS_LEAKED) == 0
