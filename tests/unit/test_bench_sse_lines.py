"""The bench clients split an event stream at LF only: the server writes JSON with raw U+2028/U+0085 inside
strings (ensure_ascii off), which httpx's aiter_lines would cut in two ("bad SSE payload" on a random model)."""
from __future__ import annotations

import asyncio
import json

import httpx

from metronome.server.bench.load.clients import sse_lines


def _lines_of(body: bytes, piece: int) -> list[str]:
    async def go() -> list[str]:
        async def stream():
            for i in range(0, len(body), piece):  # chunk boundaries inside lines and inside UTF-8 characters
                yield body[i:i + piece]

        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream()))
        async with httpx.AsyncClient(transport=transport) as http, http.stream("GET", "http://test/") as response:
            return [line async for line in sse_lines(response)]

    return asyncio.run(go())


def test_separators_inside_json_strings_stay_in_their_line():
    texts = ["a\u2028b", "c\x85d", "e\x1cf\u2029", "ü"]
    body = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\r\n\r\n" for t in texts)
    body += "data: [DONE]\n\n"
    for piece in (1, 3, 7, len(body)):
        lines = [line for line in _lines_of(body.encode(), piece) if line]
        assert [json.loads(line[len("data: "):])["text"] for line in lines[:-1]] == texts
        assert lines[-1] == "data: [DONE]"
