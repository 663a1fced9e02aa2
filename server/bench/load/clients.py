"""Benchmark clients: send one request, stamp every token with time.monotonic().

Both fill a RequestRecord (times relative to the run's t0). `HttpClient` speaks the OpenAI completions protocol
with streaming SSE (prompt as token ids, ignore_eos, greedy); `EngineClient` calls AsyncEngine.generate in the
same process and uses each TokenEvent's own emission time, so it measures the engine without HTTP.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from metronome.contract.errors import MetronomeError
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.workloads import BenchRequest

if TYPE_CHECKING:  # the engine (torch) stays out of module import time
    from metronome.server.engine.async_engine import AsyncEngine


class BenchClientError(MetronomeError):
    """The target cannot be used at all (unreachable server, no model): the run stops with this message."""


class Client(Protocol):
    async def send(self, request: BenchRequest, record: RequestRecord, t0: float) -> None: ...


def _prompt_of(request: BenchRequest) -> list[int] | str:
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    assert request.prompt_text is not None
    return request.prompt_text


async def sse_lines(response) -> AsyncIterator[str]:
    """The lines of an event stream, split at LF (CRLF) only, as SSE defines them. httpx's aiter_lines also splits
    at U+2028, U+0085 and other separators that JSON carries raw inside strings (the server writes UTF-8 with
    ensure_ascii off), which cut a random model's chunks in two."""
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


class HttpClient:
    """Streams /v1/completions from a Metronome (or any OpenAI-compatible, vLLM-style) server."""

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600.0, max_connections: int = 4096):
        import httpx

        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.model = model
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)

    async def close(self) -> None:
        await self._http.aclose()

    async def get_json(self, path: str) -> Any:
        import httpx

        try:
            resp = await self._http.get(path)
        except httpx.HTTPError as exc:
            raise BenchClientError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        if resp.status_code != 200:
            raise BenchClientError(f"GET {self.base_url}{path} returned HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError as exc:
            raise BenchClientError(f"GET {self.base_url}{path} did not return JSON") from exc

    async def discover(self) -> dict[str, Any]:
        """Ask the server which model it serves; fill self.model if unset. Returns the model card."""
        data = await self.get_json("/v1/models")
        cards = data.get("data") if isinstance(data, dict) else None
        if not cards:
            raise BenchClientError(f"{self.base_url}/v1/models lists no model")
        card = next((c for c in cards if c.get("id") == self.model), cards[0])
        if self.model is None:
            self.model = card.get("id")
        return card

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": _prompt_of(request),
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, request: BenchRequest, record: RequestRecord, t0: float) -> None:
        import httpx

        chunk_texts: list[str] = []
        usage_tokens: int | None = None
        record.sent_s = time.monotonic() - t0
        try:
            async with self._http.stream("POST", "/v1/completions", json=self._body(request)) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode(errors="replace")
                    record.error = f"http {resp.status_code}: {_error_message(body)}"
                    return
                async for line in sse_lines(resp):
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        break
                    now = time.monotonic() - t0
                    obj = json.loads(payload)
                    if obj.get("error"):
                        record.error = f"stream error: {_error_message(json.dumps(obj))}"
                        return
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens", usage_tokens)
                        record.prompt_tokens = obj["usage"].get("prompt_tokens", record.prompt_tokens)
                    for choice in obj.get("choices") or []:
                        record.token_times_s.append(now)
                        chunk_texts.append(choice.get("text") or "")
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
        except httpx.HTTPError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            return
        except json.JSONDecodeError as exc:
            record.error = f"protocol: bad SSE payload: {exc.msg}"
            return
        # A server may close the stream with an empty chunk that only carries finish_reason; it is not a token.
        if usage_tokens is not None and len(record.token_times_s) == usage_tokens + 1 and not chunk_texts[-1]:
            record.token_times_s.pop()
        record.output_tokens = usage_tokens if usage_tokens is not None else len(record.token_times_s)
        record.end_s = time.monotonic() - t0


def _error_message(body: str) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        return str(err.get("message") or err.get("detail") or err)[:300]
    return str(err)[:300]


class EngineClient:
    """Drives an in-process AsyncEngine; TokenEvent.time is the engine's own monotonic emission stamp."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def send(self, request: BenchRequest, record: RequestRecord, t0: float) -> None:
        from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
        from metronome.server.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        record.sent_s = time.monotonic() - t0
        stream = self.engine.generate(_prompt_of(request), params)
        try:
            async for event in stream:
                if event.token_id < 0:  # an abort event carries no token
                    record.error = f"aborted: {event.finish_reason or 'abort'}"
                    return
                record.token_times_s.append(event.time - t0)
                record.output_tokens = event.completion_tokens
                if record.prompt_tokens is None:
                    record.prompt_tokens = event.prompt_tokens
                if event.finished:
                    record.finish_reason = event.finish_reason
        except InvalidRequestError as exc:
            record.error = f"invalid: {exc}"
            return
        except EngineOverloadedError as exc:
            record.error = f"overloaded: {exc}"
            return
        finally:
            await _aclose(stream)
        record.end_s = time.monotonic() - t0


async def _aclose(stream: Any) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await asyncio.shield(close())
        except (RuntimeError, asyncio.CancelledError):
            pass
