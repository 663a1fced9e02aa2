"""Time between tokens as the API hands them to the client: the TBT the SLO is about.

The engine knows when it emitted a token; a client sees it later, after the token crossed the process boundary
(engine_process.py), waited its turn on the event loop behind every other stream's tokens and requests, and was
written to the socket. On the H200 at ~5,500 tokens/s the clients' TBT p99 was 2.5-8.4 ms above the engine's (with
a 22 ms target), so a controller steering on the engine's gaps held a chunk whose streams missed the SLO. The gaps
are taken when each event reaches the response: a streamed chunk is written right after (the response task pulls
the next event only once the last one is sent), so this is the write time.
"""
from __future__ import annotations

import time
from collections.abc import Callable

ObserveGap = Callable[[str, float], None]  # (prompt lane, seconds): ServerMetrics.observe_token_gap


class TokenGapTimer:
    """The gaps between consecutive tokens of each choice of one request, by the request's prompt lane."""

    def __init__(self, observe: ObserveGap, short_prompt_threshold: int, clock: Callable[[], float] = time.monotonic):
        self._observe = observe
        self._threshold = short_prompt_threshold
        self._clock = clock
        self._last: dict[int, float] = {}

    def on_event(self, index: int, event) -> None:
        """Called as choice `index`'s event reaches the response; token-less (abort) events are not tokens."""
        if event.token_id < 0:
            return
        now = self._clock()
        last = self._last.get(index)
        self._last[index] = now
        if last is not None:
            # metric_names.LANES, as the engine assigns them (engine.py _emit)
            lane = "short" if event.prompt_tokens <= self._threshold else "long"
            self._observe(lane, now - last)
