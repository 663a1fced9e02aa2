"""A request-body size limit, enforced while the body streams in (ASGI middleware).

A body whose Content-Length is over the limit gets 413 before a byte of it is read; a body without one (chunked)
is counted as it arrives and refused as soon as it passes the limit. Either way no more than `max_bytes` of it
are ever held, so a 64 MiB upload costs neither memory nor event-loop time. A body within the limit is handed
to the app unchanged, and later `receive()` calls (the routes watch them for `http.disconnect`) go through.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metronome.server.api.http_errors import error_body
from metronome.server.api.limits import DEFAULT_MAX_BODY_BYTES


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES, on_reject=lambda reason: None):
        if max_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"the request body has {declared} bytes")
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its whole body: nobody to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(send, f"the request body has more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _refuse(self, send: Send, what: str) -> None:
        self.on_reject("too_large")
        payload = json.dumps(error_body(
            413, f"{what}; this server accepts at most {self.max_bytes} bytes (--max-request-body-bytes)",
            code="request_too_large")).encode()
        # Connection: close, since the rest of the body is never read and the connection cannot be reused.
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server rejects a malformed length before we see it
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the buffered body once, then whatever the client sends next (a disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed
