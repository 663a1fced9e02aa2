"""API keys: `Authorization: Bearer <key>` on every route except the probes and the scrape.

Keys come from `--api-key` (repeatable), the environment variable METRONOME_API_KEY, and `--api-key-file` (one
key per line: a mounted Kubernetes Secret), all of them valid at once. /health, /ready and /metrics stay open
so that kubelet probes and Prometheus need no secret; /version says nothing about the model. A plain ASGI
middleware, so streamed responses pass through untouched.
"""
from __future__ import annotations

import hmac
import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from metronome.server.api.http_errors import error_response

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
ENV_VAR = "METRONOME_API_KEY"


def resolve_keys(flag_keys: list[str] | None, key_file: str | None, environ=os.environ) -> tuple[str, ...]:
    """Every configured key; ValueError naming the flag when one is empty or the file cannot be read."""
    keys = list(flag_keys or [])
    if any(not k.strip() for k in keys):
        raise ValueError("--api-key must not be empty")
    if environ.get(ENV_VAR, "").strip():
        keys.append(environ[ENV_VAR])
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {key_file}: {exc.strerror or exc}") from None
        found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise ValueError(f"--api-key-file {key_file} holds no key")
        keys.extend(found)
    return tuple(k.strip() for k in keys)


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    def allowed(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip().encode()
        # compare with every key, always: the time taken says nothing about which key came close
        return any([hmac.compare_digest(given, key) for key in self.keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if self.allowed(header):
            await self.app(scope, receive, send)
            return
        message = ("Incorrect API key provided." if header else
                   "Missing API key: send it as 'Authorization: Bearer <key>'.")
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
