"""Token events into Responses API objects: the whole `response`, or its stream of typed events.

A response's output is an assistant message (one `output_text` part) when the model wrote text, then one
`function_call` item per tool call, in the order OpenAI sends them. Streamed, the events are the ones the
`openai` client parses (each an SSE `event:` line and a `data:` object with a `sequence_number`):

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added
    response.output_text.delta ...                 text as it is generated (tool-call markup held back)
    response.output_text.done, response.content_part.done, response.output_item.done
    per call: response.output_item.added (function_call), response.function_call_arguments.delta,
              response.function_call_arguments.done, response.output_item.done
    response.completed, or response.incomplete when max_output_tokens cut the output

with no `[DONE]` line after it. A response cut off by max_output_tokens has status "incomplete" and
`incomplete_details.reason` "max_output_tokens"; a forced call cut off is still a function_call item, with the
arguments written so far. Tool calls are read as on the chat route (tools.py, forced_calls.py).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from metronome.server.api.forced_calls import ForcedCall
from metronome.server.api.protocol import now_unix
from metronome.server.api.responses import Tally, TokenText, total_usage
from metronome.server.api.tools import ToolCall, ToolStream, parse_tool_calls

# Response fields that repeat the request, with OpenAI's values when the request leaves them out.
ECHO_DEFAULTS = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
                 "previous_response_id": None, "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}},
                 "tool_choice": "auto", "tools": [], "top_p": 1.0, "truncation": "disabled", "user": None}

Done = Callable[[dict, dict], None]  # (the response, its output as one assistant chat message)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShaper:
    """One response (one engine request). `echo`: the request's values of ECHO_DEFAULTS' fields; `on_done`
    sees the finished response and its output as a chat message (responses_store.py keeps it)."""

    def __init__(self, model: str, echo: dict, token_text: TokenText | None = None, tools: list[dict] | None = None,
                 tool_format: str = "auto", forced: ForcedCall | None = None, parallel_tool_calls: bool = True,
                 on_done: Done | None = None):
        self.id = new_item_id("resp")
        self.model = model
        self.created = float(now_unix())
        self.echo = {key: echo.get(key, default) if echo.get(key) is not None else default
                     for key, default in ECHO_DEFAULTS.items()}
        self.tools = tools or []
        self.tool_format = tool_format
        self.forced = forced
        self.parallel = parallel_tool_calls
        self.on_done = on_done
        self.token_text = token_text
        self._sequence = 0
        self._message_id = new_item_id("msg")
        self._opened = False  # the message item has been announced
        self._streamed: list[str] = []
        self._tool_stream = ToolStream(self.tools, tool_format) if self.tools and forced is None else None

    # ------------------------------------------------------------------------------------------ whole

    def whole(self, tallies: list[Tally]) -> dict:
        tally = tallies[0]
        content, calls = self._outcome(tally.text)
        return self._finish(tally, content, calls)

    def _outcome(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.forced is not None:
            return "", self.forced.calls(text)
        if not self.tools:
            return text, []
        content, calls = parse_tool_calls(text, self.tools, self.tool_format)
        return content or "", calls if self.parallel else calls[:1]

    def _finish(self, tally: Tally, content: str, calls: list[ToolCall]) -> dict:
        status = "incomplete" if tally.finish_reason == "length" else "completed"
        output = ([self._message_item(content, status)] if content else []) + [_call_item(c) for c in calls]
        if status == "incomplete" and calls and self.forced is not None:
            output[-1]["status"] = "incomplete"  # the forced call that max_output_tokens cut off
        response = self._response(status, output, tally)
        if self.on_done is not None:
            message: dict = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            self.on_done(response, message)
        return response

    def _response(self, status: str, output: list[dict], tally: Tally | None = None) -> dict:
        usage = None
        if tally is not None:
            totals = total_usage([tally])
            usage = {"input_tokens": totals.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                     "output_tokens": totals.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": totals.total_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": output, "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
                "usage": usage, **self.echo}

    def _message_item(self, text: str, status: str) -> dict:
        return {"id": self._message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text)]}

    # ------------------------------------------------------------------------------------------ streamed

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening_chunks(self, indices: list[int]) -> list[str]:
        started = self._response("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def event_chunks(self, index: int, event, tally: Tally, usage=None) -> list[str]:
        text = event.text
        if self.forced is not None:
            text = ""  # the output is the calls' JSON, announced as calls when it ends
        elif self._tool_stream is not None:
            text = self._tool_stream.push(text)
        return self._text_events(text)

    def _text_events(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if not self._opened:
            self._opened = True
            events.append(self._event("response.output_item.added", output_index=0,
                                      item={**self._message_item("", "in_progress"), "content": []}))
            events.append(self._event("response.content_part.added", item_id=self._message_id, output_index=0,
                                      content_index=0, part=_text_part("")))
        self._streamed.append(text)
        events.append(self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                  content_index=0, delta=text, logprobs=[]))
        return events

    def final_chunks(self, index: int, tally: Tally) -> list[str]:
        if self.forced is not None:
            rest, calls = "", self.forced.calls(tally.text)
        elif self._tool_stream is not None:
            rest, calls = self._tool_stream.finish()
            calls = calls if self.parallel else calls[:1]
        else:
            rest, calls = "", []
        events = self._text_events(rest)
        content = "".join(self._streamed)
        response = self._finish(tally, content, calls)
        items = response["output"]
        if self._opened:
            message = items[0]
            events += [self._event("response.output_text.done", item_id=self._message_id, output_index=0,
                                   content_index=0, text=content, logprobs=[]),
                       self._event("response.content_part.done", item_id=self._message_id, output_index=0,
                                   content_index=0, part=_text_part(content)),
                       self._event("response.output_item.done", output_index=0, item=message)]
        first_call = 1 if self._opened else 0
        for offset, item in enumerate(items[first_call:]):
            where = first_call + offset
            events += [self._event("response.output_item.added", output_index=where,
                                   item={**item, "arguments": "", "status": "in_progress"}),
                       self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=where,
                                   delta=item["arguments"]),
                       self._event("response.function_call_arguments.done", item_id=item["id"], output_index=where,
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=where, item=item)]
        terminal = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        events.append(self._event(terminal, response=response))
        return events

    def usage_chunk(self, usage) -> str:
        return ""  # usage is part of the final response event

    def error_chunks(self, message: str) -> list[str]:
        return [self._event("error", code="server_error", message=message, param=None),
                self._event("response.failed", response={**self._response("failed", []),
                                                         "error": {"code": "server_error", "message": message}})]

    def closing_chunks(self) -> list[str]:
        return []  # the Responses stream ends with its terminal event, without [DONE]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall) -> dict:
    return {"id": new_item_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
            "name": call.name, "arguments": call.arguments}
