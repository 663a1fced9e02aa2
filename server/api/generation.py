"""Running one request through the AsyncEngine and answering it, whole or as Server-Sent Events.

Errors the engine raises before the first token (invalid prompt, overload) propagate to the exception
handlers, so they become 400/429 before any byte of a stream is sent. The engine stream is always closed when
the response ends for any reason — finished, client gone, server cancelled — which aborts the request in the
engine and frees its KV blocks. A client that leaves while its request still waits for a first token, or
during a non-streamed generation, is noticed by watching the ASGI channel for `http.disconnect`.

A request with several choices (n > 1, batched prompts) is one engine request per choice; their events are
merged as they come, and every one of them is closed with the response.

The client's share (client_share.py) is held from admission to the end of the response: each choice counts as
waiting until the first events arrive, then as running, and is released wherever the engine streams are closed.
The client's prompt-token charge (client_rate.py) is refunded when the engine refuses the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from metronome.server.api.client_share import ClientHold
from metronome.server.api.lifecycle import Lifecycle
from metronome.server.api.responses import Tally, total_usage
from metronome.server.api.token_gaps import TokenGapTimer
from metronome.server.engine.sampling import SamplingParams

log = logging.getLogger("metronome.api")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends.

    Starlette stops iterating on a client disconnect but leaves closing the generator to garbage collection;
    closing it here makes the engine abort (and free KV blocks) right away.
    """

    media_type = "text/event-stream"

    def __init__(self, *args, on_close: Callable[[], Awaitable[None]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]
                if self.on_close is not None:  # the body may never have started: its finally never ran
                    await self.on_close()


@dataclass(frozen=True)
class Job:
    """One choice of a response: a prompt (token ids) and its sampling params."""

    prompt: list[int]
    params: SamplingParams
    prompt_index: int = 0  # which of the request's prompts (usage counts each once)


async def run_request(engine, lifecycle: Lifecycle, request: Request, jobs: list[Job], shaper, stream: bool,
                      include_usage: bool, continuous_usage: bool = False, hold: ClientHold | None = None,
                      refund: Callable[[], None] | None = None, *, gaps: TokenGapTimer):
    """`hold`: the client's share for these jobs, released here however the request ends; `refund`: called when
    the engine refuses a job (its first event is an error), as the request was never served; `gaps`: times the
    tokens as they reach the response (token_gaps.py)."""
    ids = [shaper.id] if len(jobs) == 1 else [f"{shaper.id}-{i}" for i in range(len(jobs))]
    for request_id in ids:
        lifecycle.begin(request_id)
    streams = [engine.generate(job.prompt, job.params, request_id=rid) for job, rid in zip(jobs, ids)]
    try:
        # Each stream's first event: validation and overload errors surface here, before any byte is sent.
        firsts = await unless_disconnected(request, asyncio.gather(*(s.__anext__() for s in streams),
                                                                   return_exceptions=True))
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            if refund is not None:
                refund()
            raise failed
    except BaseException as exc:
        await _close_all(streams, lifecycle, ids, hold)
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)  # nobody is listening; the status only shows in access logs
        raise
    if hold is not None:
        for job in range(len(jobs)):
            hold.first_token(job)
    tallies = [Tally(prompt_index=job.prompt_index) for job in jobs]
    events = _merged(streams, firsts, gaps.on_event)
    if stream:
        body = _stream(events, tallies, shaper, include_usage, continuous_usage, lifecycle, streams, ids, hold)
        return SSEResponse(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                           on_close=lambda: _close_all(streams, lifecycle, ids, hold))
    try:
        await unless_disconnected(request, _collect(events, tallies))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await _close_all(streams, lifecycle, ids, hold)
    return JSONResponse(shaper.whole(tallies))


async def _merged(streams, firsts, on_event: Callable[[int, object], None]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, event) from every stream, each stream's events in order, until all have finished;
    `on_event` sees each event as it is handed on."""
    if len(streams) == 1:  # the common case: no task per token
        on_event(0, firsts[0])
        yield 0, firsts[0]
        if not firsts[0].finished:
            async for event in streams[0]:
                on_event(0, event)
                yield 0, event
        return
    pending: dict[asyncio.Future, int] = {}
    for index, first in enumerate(firsts):
        on_event(index, first)
        yield index, first
        if not first.finished:
            pending[asyncio.ensure_future(streams[index].__anext__())] = index
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    event = task.result()
                except StopAsyncIteration:
                    continue
                on_event(index, event)
                yield index, event
                if not event.finished:
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(BaseException):
                await task


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`, unless the client disconnects first: then cancel it and raise ClientDisconnected.

    The request body has been read by now, so the next ASGI message can only be `http.disconnect`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await task
        raise ClientDisconnected()
    return task.result()


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(events, tallies: list[Tally]) -> None:
    async for index, event in events:
        tallies[index].add(event)


async def _stream(events, tallies: list[Tally], shaper, include_usage: bool, continuous_usage: bool,
                  lifecycle: Lifecycle, streams, ids: list[str], hold: ClientHold | None) -> AsyncIterator[str]:
    try:
        for chunk in shaper.opening_chunks(list(range(len(tallies)))):
            yield chunk
        async for index, event in events:
            tally = tallies[index]
            tally.add(event)
            # One chunk per token, even while a multi-byte character is incomplete (empty text): clients and
            # `metronome bench` time every token from its own chunk.
            if event.text or not event.finished:
                for chunk in shaper.event_chunks(index, event, tally, tally.usage() if continuous_usage else None):
                    yield chunk
            if event.finished:
                for chunk in shaper.final_chunks(index, tally):
                    yield chunk
        if include_usage:
            yield shaper.usage_chunk(total_usage(tallies))
        for chunk in shaper.closing_chunks():
            yield chunk
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band, the status is already sent
        log.exception("stream %s failed", shaper.id)
        for chunk in shaper.error_chunks(f"generation failed: {type(exc).__name__}: {exc}"):
            yield chunk
        for chunk in shaper.closing_chunks():
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await events.aclose()
            await _close_all(streams, lifecycle, ids, hold)


async def _close_all(streams, lifecycle: Lifecycle, ids: list[str], hold: ClientHold | None = None) -> None:
    """Close every engine stream (aborting what still runs) and release the client's share; idempotent."""
    try:
        for events, request_id in zip(streams, ids):
            try:
                await events.aclose()
            finally:
                lifecycle.end(request_id)
    finally:
        if hold is not None:
            hold.release()
