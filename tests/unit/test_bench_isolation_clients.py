"""`bench isolation` sends its hostile requests as another client than the steady streams (or as the same one)."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from metronome.server.bench.robustness import isolation
from metronome.server.bench.robustness.isolation import HOSTILE_USER, STEADY_USER, IsolationConfig


def recorded_users(cfg: IsolationConfig, kind: str) -> list[str]:
    users: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        users.append(json.loads(request.content)["user"])
        return httpx.Response(429, json={"error": {"message": "over its share"}})

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await isolation.HOSTILE[kind](client, cfg, random.Random(0))

    asyncio.run(run())
    return users


@pytest.mark.parametrize("kind", isolation.HOSTILE_KINDS)
@pytest.mark.parametrize(("hostile_client", "user"), [("other", HOSTILE_USER), ("same", STEADY_USER)])
def test_every_hostile_kind_carries_the_hostile_clients_user(kind, hostile_client, user):
    cfg = IsolationConfig(url="http://127.0.0.1:1", model="m", burst=3, storm=2, big_body_mb=0.001,
                          long_prompt_tokens=10, hostile_client=hostile_client)
    users = recorded_users(cfg, kind)
    assert users and set(users) == {user}


def test_the_steady_streams_are_their_own_client():
    assert STEADY_USER != HOSTILE_USER
    bodies: list[dict] = []
    stop = asyncio.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        stop.set()
        return httpx.Response(200, text="data: [DONE]\n\n")

    async def run() -> None:
        cfg = IsolationConfig(url="http://127.0.0.1:1", model=None)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await isolation.steady_stream(client, cfg, random.Random(0), stop, [], isolation.Counter())

    asyncio.run(run())
    assert bodies and bodies[0]["user"] == STEADY_USER


def test_an_unknown_hostile_client_mode_is_refused():
    with pytest.raises(ValueError, match="hostile_client"):
        IsolationConfig(url="http://127.0.0.1:1", model=None, hostile_client="elsewhere")


def test_server_counters_read_rejections_compiles_and_long_steps_from_a_real_scrape():
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.bench.robustness.isolation import LONG_STEP_S, server_counters

    metrics = ServerMetrics("m")
    for seconds, kind in [(0.004, "decode"), (0.05, "mixed"), (LONG_STEP_S, "decode"), (0.2, "decode"),
                          (0.3, "mixed")]:
        metrics.step_duration.labels("m", kind).observe(seconds)
    metrics.on_rejected("overloaded")
    metrics.on_rejected("overloaded")
    metrics.compiles_after_ready.labels("m").inc()

    counters = server_counters(metrics.render().decode())

    assert counters["steps"] == 5 and counters["steps_over_100ms"] == 2  # 100 ms itself is not over
    assert counters["kernel_compiles_after_ready"] == 1
    assert counters["rejected:overloaded"] == 2
