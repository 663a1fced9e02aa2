"""Per-client shares over HTTP: 429 + Retry-After + an OpenAI-style error + the rejection metric, identities by
API key and `user` field, and a lone client that is not throttled.

Another client's requests in flight are taken straight from the app's ledger (as a request would take them), so
that which requests are over their share does not depend on how fast the engine runs.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from api_helpers import TINY, ServerThread, build_engine, metric, scrape, wait_until

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.server.api.client_share import ShareFlags, client_identity

MAX_WAITING = 4
KEYS = ("key-one", "key-two")


def serve(api_keys=(), shares=ShareFlags()):
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    scheduler = SchedulerConfig(max_num_seqs=8)
    metrics = ServerMetrics(TINY)
    engine = build_engine(max_waiting=MAX_WAITING, scheduler=scheduler, observers=[metrics])
    state = build_state(engine, metrics, TINY, scheduler)
    app = create_app(engine, state, api_keys=api_keys, shares=shares)
    return ServerThread(app), app.state.client_ledger


@pytest.fixture(scope="module")
def open_server():
    running, ledger = serve()
    with running:
        running.ledger = ledger
        yield running


@pytest.fixture(scope="module")
def keyed_server():
    running, ledger = serve(api_keys=KEYS, shares=ShareFlags(max_running_per_client=3))
    with running:
        running.ledger = ledger
        yield running


def complete(url: str, n: int, user: str | None = None, key: str | None = None, chat: bool = False):
    body = {"max_tokens": 2, "n": n, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hello there"
    if user is not None:
        body["user"] = user
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return httpx.post(url + path, json=body, headers=headers, timeout=120)


def rejected(url: str) -> float:
    return metric(scrape(url), names.REQUESTS_REJECTED, reason="client_share")


def test_rejection_reasons_exist_before_any_rejection(open_server):
    samples = scrape(open_server.url)
    for reason in ("overloaded", "invalid", "draining", "too_large", "client_share"):
        assert metric(samples, names.REQUESTS_REJECTED, reason=reason) >= 0


def test_a_lone_client_may_use_the_whole_waiting_queue(open_server):
    reply = complete(open_server.url, n=MAX_WAITING, user="alone")
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["choices"]) == MAX_WAITING
    assert open_server.ledger.loads == {}  # everything given back once answered


@pytest.mark.parametrize("chat", [False, True])
def test_over_its_share_a_client_gets_429_naming_the_limit(open_server, chat):
    other = open_server.ledger.admit("user:steady", 1, MAX_WAITING, 8)  # another client is active
    try:
        before = rejected(open_server.url)
        reply = complete(open_server.url, n=MAX_WAITING // 2 + 1, user="hostile", chat=chat)
        assert reply.status_code == 429, reply.text
        assert int(reply.headers["Retry-After"]) >= 1
        error = reply.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "client_share_exceeded"
        assert "'user:hostile'" in error["message"] and "--max-waiting 4 / 2" in error["message"]
        assert rejected(open_server.url) - before == 1
        assert set(open_server.ledger.loads) == {"user:steady"}  # the refused request took nothing
        # within its share (4 // 2 = 2) the same client is served
        reply = complete(open_server.url, n=MAX_WAITING // 2, user="hostile", chat=chat)
        assert reply.status_code == 200, reply.text
    finally:
        other.release()
    # alone again: the request that was refused is served
    assert complete(open_server.url, n=MAX_WAITING // 2 + 1, user="hostile", chat=chat).status_code == 200


def test_without_a_user_field_the_peer_address_is_the_client(open_server):
    other = open_server.ledger.admit("addr:127.0.0.1", 1, MAX_WAITING, 8)
    try:
        # no `user`: the same client as the one holding a request, so it is alone and may use the whole queue
        assert complete(open_server.url, n=MAX_WAITING - 1).status_code == 200
        # a `user` field makes it another client, with half of the queue
        assert complete(open_server.url, n=MAX_WAITING, user="someone-else").status_code == 429
        assert complete(open_server.url, n=MAX_WAITING // 2, user="someone-else").status_code == 200
    finally:
        other.release()


def test_api_keys_are_the_clients_and_the_user_field_does_not_override_them(keyed_server):
    url = keyed_server.url
    one = keyed_server.ledger.admit(client_identity(KEYS[0], None, None), 1, MAX_WAITING, 8)
    try:
        # the same key under another user name is still that one client, alone: no share applies
        assert complete(url, n=MAX_WAITING, user="not-key-one", key=KEYS[0]).status_code == 200
        before = rejected(url)
        reply = complete(url, n=MAX_WAITING // 2 + 1, user="anyone", key=KEYS[1])
        assert reply.status_code == 429 and "'key:" in reply.json()["error"]["message"]
        assert KEYS[1] not in reply.text  # the key is never echoed
        assert rejected(url) - before == 1
    finally:
        one.release()


def test_the_running_share_counts_running_and_waiting_requests(keyed_server):
    url = keyed_server.url
    other = keyed_server.ledger.admit(client_identity(KEYS[0], None, None), 1, MAX_WAITING, 8)
    mine = keyed_server.ledger.admit(client_identity(KEYS[1], None, None), 2, MAX_WAITING, 8)
    mine.first_token(0)
    mine.first_token(1)  # two running; --max-running-per-client 3
    try:
        reply = complete(url, n=2, key=KEYS[1])
        assert reply.status_code == 429 and "--max-running-per-client 3" in reply.json()["error"]["message"]
        assert complete(url, n=1, key=KEYS[1]).status_code == 200
    finally:
        other.release()
        mine.release()
    assert keyed_server.ledger.loads == {}


def test_streamed_requests_give_their_share_back_when_the_stream_ends(open_server):
    body = {"prompt": "hello", "max_tokens": 3, "stream": True, "user": "streamer", "n": 2}
    with httpx.stream("POST", open_server.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert open_server.ledger.loads == {}


def test_no_slot_outlives_its_request_whatever_the_clients_do(open_server):
    """Bursts from two clients at once, streams dropped after one chunk, clients that time out while waiting:
    afterwards no client holds anything (a leaked slot would throttle that client for good)."""
    url = open_server.url

    async def plain(client: httpx.AsyncClient, user: str) -> int:
        body = {"prompt": "hi", "max_tokens": 4, "user": user, "n": 2}
        return (await client.post(url + "/v1/completions", json=body)).status_code

    async def dropped(client: httpx.AsyncClient, user: str) -> int:
        body = {"prompt": "go on", "max_tokens": 200, "ignore_eos": True, "stream": True, "user": user}
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break
            return response.status_code

    async def impatient(client: httpx.AsyncClient, user: str) -> int:
        body = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True, "user": user}
        try:
            return (await client.post(url + "/v1/completions", json=body,
                                      timeout=httpx.Timeout(60, read=0.05))).status_code
        except httpx.ReadTimeout:
            return 0

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            work = [kind(client, user) for user in ("a", "b") for kind in (plain, dropped, impatient) * 4]
            return await asyncio.gather(*work)

    statuses = asyncio.run(scenario())
    assert set(statuses) <= {0, 200, 429}, statuses
    wait_until(lambda: open_server.ledger.loads == {}, timeout=60, what="every client's slots given back")
