"""The last line of defence: an unexpected error becomes a complete 500 on a connection that stays usable.

Starlette's own handler for uncaught exceptions (ServerErrorMiddleware) sends its 500 and then raises the
exception again, so that the server logs it; uvicorn answers an exception from the app by closing the
connection, without a `Connection: close` header. A client's pooled keep-alive connection then dies under its
next request ("Server disconnected"). Caught here instead, the error is logged once, the 500 is a whole
response, and the app returns normally, so the connection carries the next request.

Only a response that has already started (a stream whose body failed after its status line) is left to uvicorn:
its body cannot be completed, so closing the connection is the only honest end.
"""
from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from metronome.server.api.http_errors import error_response

log = logging.getLogger("metronome.api")


class ErrorBoundary:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await error_response(500, f"internal error: {type(exc).__name__}: {exc}")(scope, receive, send)
