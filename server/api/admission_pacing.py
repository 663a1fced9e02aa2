"""Admission pacing: new HTTP requests start one at a time, with token deliveries in between (ASGI middleware).

One event loop runs every request's handling and every running stream's token writes. A wave of requests that
arrive together (a client storming the server: 32 streams at once, most refused with 429) would otherwise run
their handlers back to back in one loop iteration, ~0.3-0.6 ms of Python each, and every stream's next token,
which the engine has already handed to the loop, waits behind all of them. Here each new request waits for its
turn, and a turn comes up at most once every DELIVERY_HOPS iterations, so what became ready meanwhile runs first:
a wave can delay a token by about one request's work, not by the whole wave's.

Why DELIVERY_HOPS = 2: a token takes two loop hops to reach its socket. The engine's reader thread schedules one
handle per step (call_soon_threadsafe), which puts each event on its stream's queue; that wakes the stream's task,
which runs in the next iteration and writes the chunk. With one hop between starts, a token that arrived during
request A's work would be put in the next iteration, next to request B's start, and written only after B. With
two, it is written before B starts.

Pacing costs a request that nobody is ahead of nothing: it starts at once, in the iteration its task first runs.
Waiting requests are served first come, first served. Nothing is held once a request has started (receive and
send are passed on untouched), so a stream pays nothing per token. Every HTTP request is paced, the probes and
/metrics too: their handlers take the loop as any request's do (a scrape renders every metric), and a probe waits
only for the requests that arrived before it, as it would without pacing. A request whose client leaves while it
waits still gets its turn (the server sees the disconnect when it reads the body, at once, and answers nobody);
one whose task is cancelled while it waits leaves the queue and holds nothing. Lifespan and websocket scopes pass
straight through.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

DELIVERY_HOPS = 2  # loop iterations between two request starts: the reader thread's handle, then the stream's task


class AdmissionPacer:
    def __init__(self, app: ASGIApp, hops: int = DELIVERY_HOPS):
        if hops < 1:
            raise ValueError(f"admission pacing needs at least 1 loop iteration between starts, got {hops}")
        self.app = app
        self.hops = hops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: deque[asyncio.Future] = deque()
        self._gap = False  # a request started less than `hops` iterations ago

    @property
    def waiting(self) -> int:
        """Requests waiting for their turn now (tests read it)."""
        return sum(not turn.done() for turn in self._waiting)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._turn()
        await self.app(scope, receive, send)

    async def _turn(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first request, or a new loop (tests): the old loop's callbacks never run
            self._loop, self._waiting, self._gap = loop, deque(), False
        if not self._gap and not self._waiting:
            self._started()
            return
        turn = loop.create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):  # already popped: its turn was given and has passed
                self._waiting.remove(turn)
            raise

    def _started(self) -> None:
        self._gap = True
        self._loop.call_soon(self._tick, self.hops, self._loop)

    def _tick(self, left: int, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return
        if left > 1:
            loop.call_soon(self._tick, left - 1, loop)
            return
        self._gap = False
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled waiter's future is done: skip it
                turn.set_result(None)
                self._started()
                return
