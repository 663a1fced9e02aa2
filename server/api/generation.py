"""Running one request through the AsyncEngine and answering it, whole or as Server-Sent Events.

Errors the engine raises before the first token (invalid prompt, overload) propagate to the exception
handlers, so they become 400/429 before any byte of a stream is sent. The engine stream is always closed when
the response ends for any reason — finished, client gone, server cancelled — which aborts the request in the
engine and frees its KV blocks. A client that leaves while its request still waits for a first token, or
during a non-streamed generation, is noticed by watching the ASGI channel for `http.disconnect`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, Awaitable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from metronome.server.api.lifecycle import Lifecycle
from metronome.server.api.responses import DONE, Tally, sse

log = logging.getLogger("metronome.api")


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body generator however the response ends.

    Starlette stops iterating on a client disconnect but leaves closing the generator to garbage collection;
    closing it here makes the engine abort (and free KV blocks) right away.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


async def run_request(engine, lifecycle: Lifecycle, request: Request, prompt, params, shaper, stream: bool,
                      include_usage: bool):
    request_id = shaper.id
    lifecycle.begin(request_id)
    events = engine.generate(prompt, params, request_id=request_id)
    try:
        first = await unless_disconnected(request, events.__anext__())
    except BaseException as exc:
        await _close(events, lifecycle, request_id)
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=499)  # nobody is listening; the status only shows in access logs
        raise
    if stream:
        body = _stream(events, first, shaper, include_usage, lifecycle, request_id)
        return SSEResponse(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        tally = await unless_disconnected(request, _collect(events, first))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await _close(events, lifecycle, request_id)
    return JSONResponse(shaper.whole(tally))


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


async def _collect(events, first) -> Tally:
    tally = Tally()
    event = first
    while event is not None:
        tally.add(event)
        if event.finished:
            break
        event = await _next_or_none(events)
    return tally


async def _stream(events, first, shaper, include_usage: bool, lifecycle: Lifecycle,
                  request_id: str) -> AsyncIterator[str]:
    tally = Tally()
    try:
        for chunk in shaper.opening_chunks():
            yield chunk
        event = first
        while event is not None:
            tally.add(event)
            # One chunk per token, even while a multi-byte character is incomplete (empty text): clients and
            # `metronome bench` time every token from its own chunk.
            if event.text or not event.finished:
                yield shaper.text_chunk(event.text)
            if event.finished:
                break
            event = await _next_or_none(events)
        yield shaper.final_chunk(tally.finish_reason)
        if include_usage:
            yield shaper.usage_chunk(tally.usage())
        yield DONE
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band, the status is already sent
        log.exception("stream %s failed", request_id)
        yield sse({"error": {"message": f"generation failed: {type(exc).__name__}: {exc}", "type": "server_error",
                             "param": None, "code": None}})
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):
            await _close(events, lifecycle, request_id)


async def _next_or_none(events):
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _close(events, lifecycle: Lifecycle, request_id: str) -> None:
    try:
        await events.aclose()
    finally:
        lifecycle.end(request_id)
