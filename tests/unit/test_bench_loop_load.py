"""The loop benchmark's load, sent from this process or dealt over client processes: every scheduled request once,
on time, its tokens stamped on the run's clock, the records back in schedule order (a small streaming server on
127.0.0.1 stands in for `metronome serve`)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from metronome.server.bench.load.clients import BenchClientError
from metronome.server.bench.load.workloads import BenchRequest
from metronome.server.bench.loop.load import ClientPool, Load, LoadTarget, deal
from metronome.server.bench.loop.phases import Scheduled

TOKEN_GAP_S = 0.01


class StreamingHandler(BaseHTTPRequestHandler):
    """/v1/completions streams max_tokens one-token chunks TOKEN_GAP_S apart, then usage and [DONE]."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for _ in range(body["max_tokens"]):
            time.sleep(TOKEN_GAP_S)
            self._event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        self._event({"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                              "prompt_tokens": len(body["prompt"])}})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    def _event(self, obj) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture()
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StreamingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def schedule(count: int, spacing_s: float) -> list[Scheduled]:
    return [Scheduled(offset_s=0.05 + i * spacing_s, phase=0,
                      request=BenchRequest(index=i, max_tokens=3 + i % 4, kind="short", prompt_token_ids=(1, 2, 3)))
            for i in range(count)]


def test_dealing_is_round_robin_and_keeps_every_request_once():
    requests = schedule(7, 0.1)
    shares = deal(requests, 3)
    assert [[item.request.index for item in share] for share in shares] == [[0, 3, 6], [1, 4], [2, 5]]
    assert deal(requests, 1) == [requests]


@pytest.mark.parametrize("processes", [1, 2])
def test_every_request_is_sent_on_time_and_recorded_in_schedule_order(server_url, processes):
    requests = schedule(12, 0.03)
    target = LoadTarget(base_urls=(server_url,), model="m", request_timeout_s=30, drain_timeout_s=30)
    pool = ClientPool(processes) if processes > 1 else None
    try:
        load = Load(target, pool)
        t0 = time.monotonic()
        records = asyncio.run(load.send(requests, t0))
    finally:
        if pool is not None:
            pool.close()
    assert [r.index for r in records] == list(range(12))
    for record, item in zip(records, requests, strict=True):
        assert record.ok, record.error
        assert record.output_tokens == len(record.token_times_s) == item.request.max_tokens
        # never early (an event loop's timer may fire within its clock's resolution, ~1 ms), on the caller's t0
        assert record.sent_s >= item.offset_s - 0.005
        assert record.sent_s < record.token_times_s[0] <= record.token_times_s[-1] <= record.end_s
        # the server spaces tokens TOKEN_GAP_S apart: the stamps are the arrivals, not the end of the stream
        assert record.token_times_s[-1] - record.token_times_s[0] >= TOKEN_GAP_S * (item.request.max_tokens - 1) * 0.8


def test_requests_to_an_unreachable_server_are_error_records_not_lost_ones():
    target = LoadTarget(base_urls=("http://127.0.0.1:1",), model="m", request_timeout_s=5, drain_timeout_s=5)
    records = asyncio.run(Load(target).send(schedule(2, 0.01), time.monotonic()))
    assert [r.index for r in records] == [0, 1]
    assert all(r.error and not r.ok for r in records)


def test_a_client_process_that_dies_mid_run_fails_the_run_with_a_clear_error(server_url):
    target = LoadTarget(base_urls=(server_url,), model="m", request_timeout_s=30, drain_timeout_s=30)
    pool = ClientPool(2)

    async def run_and_kill():
        sending = asyncio.create_task(Load(target, pool).send(schedule(8, 0.4), time.monotonic()))
        await asyncio.sleep(0.6)
        for pid in pool.pids:
            os.kill(pid, signal.SIGKILL)
        return await sending

    try:
        with pytest.raises(BenchClientError, match="a client process died during the run"):
            asyncio.run(run_and_kill())
    finally:
        pool.close()
