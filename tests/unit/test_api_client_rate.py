"""The per-client prompt-token rate over HTTP: 429 + Retry-After + an OpenAI-style error + the rejection metric,
charges of prompt tokens x engine requests, no charge for a refused request (by the rate, the share, the size
check or the engine), and the large-request rule.

The app's limiter runs on a fake clock, so which request is refused does not depend on how fast the test runs.
"""
from __future__ import annotations

import httpx
import pytest
from api_helpers import TINY, ServerThread, build_engine, metric, scrape

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.server.api.client_rate import RateFlags, level
from metronome.server.api.client_share import ShareFlags

RATE, BURST = 20, 40
MAX_WAITING = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def server():
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    scheduler = SchedulerConfig(max_num_seqs=8)
    metrics = ServerMetrics(TINY)
    engine = build_engine(max_waiting=MAX_WAITING, scheduler=scheduler, observers=[metrics])
    state = build_state(engine, metrics, TINY, scheduler)
    app = create_app(engine, state, shares=ShareFlags(), rates=RateFlags(RATE, BURST))
    running = ServerThread(app)
    running.limiter = app.state.rate_limiter
    running.ledger = app.state.client_ledger
    running.limiter.clock = running.clock = Clock()
    with running:
        yield running


def held(server, user: str) -> float:
    bucket = server.limiter.buckets.get("user:" + user)
    return BURST if bucket is None else level(bucket, RATE, BURST, server.clock.now)


def complete(url: str, user: str, tokens: int, n: int = 1, **extra) -> httpx.Response:
    body = {"prompt": [300 + i for i in range(tokens)], "max_tokens": 2, "n": n, "temperature": 0, "user": user,
            **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def rejected(url: str) -> float:
    return metric(scrape(url), names.REQUESTS_REJECTED, reason="client_rate")


def test_the_reason_exists_before_any_rejection(server):
    assert rejected(server.url) == 0


def test_over_its_rate_a_client_gets_429_naming_the_limit_and_is_not_charged(server):
    assert complete(server.url, "a", tokens=8, n=4).status_code == 200  # 32 of 40
    assert held(server, "a") == 8
    before = rejected(server.url)
    reply = complete(server.url, "a", tokens=5, n=2)  # 10 > 8: short 2 tokens = 0.1 s
    assert reply.status_code == 429, reply.text
    assert reply.headers["Retry-After"] == "1"
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "client_rate_exceeded"
    assert "'user:a'" in error["message"] and "--max-prompt-tokens-per-second-per-client 20" in error["message"]
    assert rejected(server.url) - before == 1
    assert held(server, "a") == 8  # the refused request took nothing
    assert server.ledger.loads == {}  # nor did it keep its share
    assert complete(server.url, "b", tokens=10, n=2).status_code == 200  # another client: a bucket of its own
    server.clock.now += 0.1
    assert complete(server.url, "a", tokens=5, n=2).status_code == 200
    assert held(server, "a") == pytest.approx(0)


def test_a_request_larger_than_the_burst_is_served_from_a_full_bucket_then_owed(server):
    server.clock.now += 10  # everyone full
    assert complete(server.url, "big", tokens=25, n=2).status_code == 200  # 50 > 40
    assert held(server, "big") == -10
    reply = complete(server.url, "big", tokens=1)
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "1"  # (1 + 10) / 20 = 0.55 s
    assert "10 owed" in reply.json()["error"]["message"]
    reply = complete(server.url, "big", tokens=25, n=2)
    assert reply.status_code == 429 and reply.headers["Retry-After"] == "3"  # until full: 50 / 20 = 2.5 s
    assert "larger than the burst" in reply.json()["error"]["message"]


def test_chat_is_charged_its_rendered_prompt_times_n(server):
    server.clock.now += 10
    messages = [{"role": "user", "content": "hello there, how are you"}]
    count = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=60).json()["count"]
    body = {"messages": messages, "max_tokens": 2, "n": 2, "temperature": 0, "user": "chat"}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
    assert held(server, "chat") == BURST - 2 * count  # more than the burst (a long template): owed


def test_a_request_the_engine_refuses_is_refunded(server):
    server.clock.now += 10
    reply = complete(server.url, "refused", tokens=8, max_tokens=100_000)  # past the context: the engine's 400
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert held(server, "refused") == BURST
    reply = complete(server.url, "refused", tokens=8, n=2, prompt=[300, 10**9])  # not in the vocabulary
    assert reply.status_code == 400 and held(server, "refused") == BURST


def test_a_request_refused_before_the_rate_is_never_charged(server):
    server.clock.now += 10
    other = server.ledger.admit("user:steady", 1, MAX_WAITING, 8)  # another client is active: shares apply
    try:
        assert complete(server.url, "shared", tokens=2, n=MAX_WAITING).status_code == 429  # over its share
    finally:
        other.release()
    body = {"prompt": "word " * 100_000, "max_tokens": 2, "user": "shared"}  # refused by the size check
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code == 400
    assert "user:shared" not in server.limiter.buckets  # never charged: it still has no bucket
