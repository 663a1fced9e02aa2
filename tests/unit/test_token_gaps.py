"""TBT as clients get it (token_gaps.py): gaps between the times a request's tokens reach its response."""
from __future__ import annotations

import asyncio
import time

import httpx
from api_helpers import build_server_parts

from metronome.contract import metric_names as names
from metronome.server.api.token_gaps import TokenGapTimer
from metronome.server.engine.outputs import TokenEvent


def token(index: int, prompt_tokens: int = 10, token_id: int = 5) -> TokenEvent:
    return TokenEvent("r", token_id, "x", index, 0.0, False, None, prompt_tokens, index + 1)


def test_gaps_per_choice_by_lane_without_abort_events():
    now = [100.0]
    seen: list[tuple[str, float]] = []
    timer = TokenGapTimer(lambda lane, gap: seen.append((lane, round(gap, 6))), short_prompt_threshold=16,
                          clock=lambda: now[0])
    timer.on_event(0, token(0))  # a first token opens the choice's clock: no gap
    timer.on_event(1, token(0, prompt_tokens=40))
    now[0] = 100.004
    timer.on_event(0, token(1))
    now[0] = 100.010
    timer.on_event(1, token(1, prompt_tokens=40))
    timer.on_event(0, token(2, token_id=-1))  # an abort event carries no token
    now[0] = 100.011
    timer.on_event(0, token(2))
    assert seen == [("short", 0.004), ("long", 0.010), ("short", 0.007)]


def test_gaps_include_the_time_tokens_wait_for_the_event_loop():
    engine, state, app = build_server_parts()

    async def hold_up_the_loop(done: asyncio.Event) -> int:
        """Block the event loop for 30 ms every 40 ms, as other streams' and requests' work would."""
        blocks = 0
        while not done.is_set():
            time.sleep(0.03)
            blocks += 1
            await asyncio.sleep(0.01)
        return blocks

    async def main() -> tuple[float, float, int]:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                      base_url="http://t") as client:
            done = asyncio.Event()
            blocker = asyncio.create_task(hold_up_the_loop(done))
            body = {"prompt": [1, 2, 3], "max_tokens": 200, "stream": True, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            done.set()
            assert response.status_code == 200
            blocks = await blocker
        value = state.metrics.registry.get_sample_value
        labels = {"model": state.served_model_name, "lane": "short"}
        return (value(names.TIME_BETWEEN_TOKENS + "_count", labels),
                value(names.TIME_BETWEEN_TOKENS + "_bucket", {**labels, "le": "0.025"}), blocks)

    count, under_25ms, blocks = asyncio.run(main())
    assert count == 199  # 200 tokens, 199 gaps
    # The engine thread kept stepping while the loop was blocked; the tokens waited, and clients would have too.
    assert blocks >= 3 and count - under_25ms >= 2
