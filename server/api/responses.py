"""Turning token events into OpenAI bodies: whole responses and SSE chunks, for completions and chat.

A response has one or more choices (n, batched prompts); each choice is one engine request with its own
`Tally`. The shapers are pure functions of (request id, model, events so far); the route glue lives in
generation.py.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from metronome.server.api.forced_calls import ForcedCall
from metronome.server.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    new_id,
    now_unix,
)
from metronome.server.api.tools import ToolCall, ToolStream, parse_tool_calls

DONE = "data: [DONE]\n\n"

TokenText = Callable[[int], str]  # a token id's own text (for logprobs)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _json_text(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# Stands for a choice's text while a chunk template is rendered (no model text contains a NUL-framed marker).
_TEXT_MARK = "\x00metronome-text\x00"


class TextChunkTemplate:
    """The SSE chunk of one plain token (no logprobs, no usage) for one choice index, as a prefix and suffix
    around the JSON-encoded text. Rendered once through the pydantic models with a marker for the text, so a
    token costs one json.dumps of its text instead of building and dumping the models (a stream of every running
    request's tokens every step is the API process' largest load: -22 % of its CPU per token with these,
    docs/perf/isolation.md).
    The chunk is byte-for-byte the one the models give."""

    def __init__(self, render: Callable[[str], str]):
        mark = _json_text(_TEXT_MARK)
        whole = render(_TEXT_MARK)
        if whole.count(mark) != 1:
            raise ValueError("a chunk template needs its text exactly once")
        self.prefix, self.suffix = whole.split(mark)

    def chunk(self, text: str) -> str:
        return f"{self.prefix}{_json_text(text)}{self.suffix}"


@dataclass
class Tally:
    """Accumulates the events of one choice."""

    prompt_index: int = 0  # which prompt of the request this choice answers (usage counts each prompt once)
    texts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token id, TokenLogprobs) per token, when asked for

    def add(self, event) -> None:
        if event.text:
            self.texts.append(event.text)
        self.prompt_tokens = event.prompt_tokens
        # An abort event carries no token; never let it lower the count.
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)
        if event.logprobs is not None:
            self.logprobs.append((event.token_id, event.logprobs))
        if event.finished:
            self.finish_reason = event.finish_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens)


def total_usage(tallies: list[Tally]) -> Usage:
    prompts = {t.prompt_index: t.prompt_tokens for t in tallies}
    return Usage.of(sum(prompts.values()), sum(t.completion_tokens for t in tallies))


class _Shaper:
    id_prefix = "x"

    def __init__(self, model: str, token_text: TokenText | None = None):
        self.id = new_id(self.id_prefix)
        self.model = model
        self.created = now_unix()
        self.token_text = token_text or str
        self._templates: dict[int, TextChunkTemplate] = {}

    def _text_chunk(self, index: int, text: str) -> str:
        """A plain token's chunk for choice `index`, through its template (see TextChunkTemplate)."""
        template = self._templates.get(index)
        if template is None:
            template = self._templates[index] = TextChunkTemplate(lambda t: self._render_text(index, t))
        return template.chunk(text)

    def _render_text(self, index: int, text: str) -> str:
        """The chunk of a plain token through the models (the templates' source of truth)."""
        raise NotImplementedError

    def opening_chunks(self, indices: list[int]) -> list[str]:
        return []

    def usage_chunk(self, usage: Usage) -> str:
        return sse(self._chunk([], usage))

    def error_chunks(self, message: str) -> list[str]:
        """What tells the client in-band that generation failed after the status line was sent."""
        return [sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})]

    def closing_chunks(self) -> list[str]:
        return [DONE]

    def _chunk(self, choices: list, usage: Usage | None = None) -> dict:
        raise NotImplementedError


class CompletionShaper(_Shaper):
    """`text_completion` objects. `echo[i]`: the prompt text that choice i starts with (echo=true)."""

    id_prefix = "cmpl"

    def __init__(self, model: str, token_text: TokenText | None = None, echo: list[str] | None = None):
        super().__init__(model, token_text)
        self.echo = echo
        self._offsets: dict[int, int] = {}

    def opening_chunks(self, indices: list[int]) -> list[str]:
        if not self.echo:
            return []
        return [sse(self._chunk([CompletionChoice(index=i, text=self.echo[i], finish_reason=None)]))
                for i in indices]

    def event_chunks(self, index: int, event, tally: Tally, usage: Usage | None = None) -> list[str]:
        if event.logprobs is None and usage is None:
            return [self._text_chunk(index, event.text)]
        logprobs = None
        if event.logprobs is not None:
            logprobs = self._logprobs([(event.token_id, event.logprobs)], self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + len(logprobs.tokens[0])
        return [sse(self._chunk([CompletionChoice(index=index, text=event.text, logprobs=logprobs,
                                                  finish_reason=None)], usage))]

    def _render_text(self, index: int, text: str) -> str:
        return sse(self._chunk([CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)]))

    def final_chunks(self, index: int, tally: Tally) -> list[str]:
        return [sse(self._chunk([CompletionChoice(index=index, text="", finish_reason=tally.finish_reason)]))]

    def whole(self, tallies: list[Tally]) -> dict:
        choices = []
        for index, tally in enumerate(tallies):
            prefix = self.echo[index] if self.echo else ""
            logprobs = self._logprobs(tally.logprobs, len(prefix)) if tally.logprobs else None
            choices.append(CompletionChoice(index=index, text=prefix + tally.text, logprobs=logprobs,
                                            finish_reason=tally.finish_reason))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=total_usage(tallies)).model_dump()

    def _logprobs(self, entries, offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for token, lp in entries:
            text = self.token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> dict:
        body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        return body.model_dump(exclude_none=False)


class ChatShaper(_Shaper):
    """`chat.completion` and `chat.completion.chunk` objects. With `tools`, tool calls in the text are parsed
    into `tool_calls` (format `tool_format`, see tools.py); `forced`: the output is the JSON of forced calls
    (tool_choice "required" or a named function, constrained by a grammar; forced_calls.py)."""

    id_prefix = "chatcmpl"

    def __init__(self, model: str, token_text: TokenText | None = None, tools: list[dict] | None = None,
                 tool_format: str = "auto", forced: ForcedCall | None = None, parallel_tool_calls: bool = True):
        super().__init__(model, token_text)
        self.tools = tools or []
        self.tool_format = tool_format
        self.forced = forced
        self.parallel = parallel_tool_calls
        self._streams: dict[int, ToolStream] = {}

    def opening_chunks(self, indices: list[int]) -> list[str]:
        return [sse(self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
                for i in indices]

    def event_chunks(self, index: int, event, tally: Tally, usage: Usage | None = None) -> list[str]:
        text = event.text
        if self.forced is not None:
            text = ""  # the whole output is the calls, sent when they are complete (or cut off)
        elif self.tools:
            text = self._streams.setdefault(index, ToolStream(self.tools, self.tool_format)).push(text)
        if event.logprobs is None and usage is None:
            return [self._text_chunk(index, text)]
        logprobs = self._logprobs([(event.token_id, event.logprobs)]) if event.logprobs is not None else None
        return [sse(self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text),
                                                 logprobs=logprobs)], usage))]

    def _render_text(self, index: int, text: str) -> str:
        return sse(self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=None)]))

    def final_chunks(self, index: int, tally: Tally) -> list[str]:
        chunks = []
        if self.forced or self.tools:
            if self.forced is not None:
                rest, calls = "", self.forced.calls(tally.text)
            else:
                rest, calls = self._streams.setdefault(index, ToolStream(self.tools, self.tool_format)).finish()
                calls = calls if self.parallel else calls[:1]
            if rest:
                chunks.append(sse(self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=rest))])))
            if calls:
                delta = DeltaMessage(tool_calls=[c.as_openai(i) for i, c in enumerate(calls)])
                chunks.append(sse(self._chunk([ChatChunkChoice(index=index, delta=delta)])))
                chunks.append(sse(self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(),
                                                               finish_reason=_reason(tally, calls))])))
                return chunks
        chunks.append(sse(self._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(),
                                                       finish_reason=tally.finish_reason)])))
        return chunks

    def whole(self, tallies: list[Tally]) -> dict:
        choices = []
        for index, tally in enumerate(tallies):
            content, calls = self._message(tally.text)
            message = AssistantMessage(content=content,
                                       tool_calls=[c.as_openai() for c in calls] if calls else None)
            logprobs = self._logprobs(tally.logprobs) if tally.logprobs else None
            choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                      finish_reason=_reason(tally, calls)))
        body = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=total_usage(tallies)).model_dump()
        for choice in body["choices"]:  # OpenAI leaves tool_calls out of a plain message
            if choice["message"]["tool_calls"] is None:
                del choice["message"]["tool_calls"]
        return body

    def _message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.forced is not None:
            return None, self.forced.calls(text)
        if not self.tools:
            return text, []
        content, calls = parse_tool_calls(text, self.tools, self.tool_format)
        return content, calls if self.parallel else calls[:1]

    def _logprobs(self, entries) -> ChatLogprobs:
        content = []
        for token, lp in entries:
            text = self.token_text(token)
            top = [TopLogprob(token=self.token_text(t), logprob=v, bytes=list(self.token_text(t).encode()))
                   for t, v in lp.top]
            content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
        return ChatLogprobs(content=content)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> dict:
        body = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)
        data = body.model_dump()
        for choice in data["choices"]:  # OpenAI omits unset delta fields
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return data


def _reason(tally: Tally, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and tally.finish_reason == "stop" else tally.finish_reason
