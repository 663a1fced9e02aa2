"""Turning token events into OpenAI bodies: whole responses and SSE chunks, for completions and chat.

Pure functions of (request id, model, events so far); the route glue lives in generation.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from metronome.server.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
    new_id,
    now_unix,
)

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


@dataclass
class Tally:
    """Accumulates the events of one request."""

    texts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None

    def add(self, event) -> None:
        if event.text:
            self.texts.append(event.text)
        self.prompt_tokens = event.prompt_tokens
        # An abort event carries no token; never let it lower the count.
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.finished:
            self.finish_reason = event.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens)


class CompletionShaper:
    """`text_completion` objects."""

    id_prefix = "cmpl"

    def __init__(self, model: str):
        self.id = new_id(self.id_prefix)
        self.model = model
        self.created = now_unix()

    def opening_chunks(self) -> list[str]:
        return []

    def text_chunk(self, text: str) -> str:
        return sse(self._chunk([CompletionChoice(text=text, finish_reason=None)]))

    def final_chunk(self, finish_reason: str | None) -> str:
        return sse(self._chunk([CompletionChoice(text="", finish_reason=finish_reason)]))

    def usage_chunk(self, usage: Usage) -> str:
        return sse(self._chunk([], usage))

    def whole(self, tally: Tally) -> dict:
        return CompletionResponse(id=self.id, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=tally.text, finish_reason=tally.finish_reason)],
                                  usage=tally.usage()).model_dump()

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
        body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return body.model_dump(exclude_none=False)


class ChatShaper:
    """`chat.completion` and `chat.completion.chunk` objects."""

    id_prefix = "chatcmpl"

    def __init__(self, model: str):
        self.id = new_id(self.id_prefix)
        self.model = model
        self.created = now_unix()

    def opening_chunks(self) -> list[str]:
        return [sse(self._chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))]))]

    def text_chunk(self, text: str) -> str:
        return sse(self._chunk([ChatChunkChoice(delta=DeltaMessage(content=text))]))

    def final_chunk(self, finish_reason: str | None) -> str:
        return sse(self._chunk([ChatChunkChoice(delta=DeltaMessage(), finish_reason=finish_reason)]))

    def usage_chunk(self, usage: Usage) -> str:
        return sse(self._chunk([], usage))

    def whole(self, tally: Tally) -> dict:
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[ChatChoice(message=AssistantMessage(content=tally.text), finish_reason=tally.finish_reason)],
            usage=tally.usage(),
        ).model_dump()

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        data = body.model_dump()
        for choice in data["choices"]:  # OpenAI omits unset delta fields
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return data
