"""Forced tool calls (`tool_choice` "required" or a named function): the grammar, and the calls out of its text.

The output is plain JSON that a grammar compiled from the tools' schemas constrains, in one of three shapes:
- a named function: its arguments object;
- "required" without parallel calls: one call `{"name": ..., "arguments": {...}}`;
- "required" with `parallel_tool_calls` (OpenAI's default): a JSON array of one or more such calls.
The tools' parameter schemas are closed (json_schemas.closed_objects): no keys they do not list.

A call cut off by max_tokens is still a call: the text is read as far as it goes, so the client gets `tool_calls`
with the name and the arguments written so far (not valid JSON) and finish_reason "length", never the raw JSON
as content. Compact JSON (the grammar allows no free whitespace) with "name" before "arguments", as the schema
lists them, is what makes the name readable first.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from metronome.server.api.json_schemas import closed_objects
from metronome.server.api.tools import ToolCall, new_call_id


@dataclass(frozen=True)
class ForcedCall:
    tools: list[dict]  # OpenAI tool dicts ({"type": "function", "function": {...}})
    name: str | None  # the named function; None: any of the tools
    parallel: bool = True  # "required" only: an array of calls

    def schema(self) -> dict:
        if self.name is not None:
            return _parameters(self._tool(self.name))
        chosen = [tool["function"] for tool in self.tools]
        one = {"anyOf": [_call_schema(f) for f in chosen]} if len(chosen) > 1 else _call_schema(chosen[0])
        return {"type": "array", "items": one, "minItems": 1} if self.parallel else one

    def calls(self, text: str) -> list[ToolCall]:
        """The calls in the generated text, complete or cut off."""
        if self.name is not None:
            return [ToolCall(self.name, _arguments_text(text), new_call_id())]
        try:
            value = json.loads(text)
        except ValueError:
            return self._partial(text)
        values = value if isinstance(value, list) else [value]
        calls = [self._complete(item) for item in values]
        return calls if all(calls) else self._partial(text)  # type: ignore[return-value]

    def _tool(self, name: str) -> dict:
        return next(tool["function"] for tool in self.tools if tool["function"]["name"] == name)

    def _complete(self, value) -> ToolCall | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = json.dumps(value.get("arguments", {}), ensure_ascii=False)
        return ToolCall(value["name"], arguments, new_call_id())

    def _partial(self, text: str) -> list[ToolCall]:
        decoder = json.JSONDecoder()
        pos = _skip(text, 0)
        if self.parallel and text.startswith("[", pos):
            pos = _skip(text, pos + 1)
        calls = []
        while pos < len(text):
            try:
                value, end = decoder.raw_decode(text, pos)
            except ValueError:
                calls.append(self._cut_call(text[pos:]))
                break
            call = self._complete(value)
            if call is not None:
                calls.append(call)
            pos = _skip(text, end)
            if not text.startswith(",", pos):
                break
            pos = _skip(text, pos + 1)
        return calls or [self._cut_call("")]

    def _cut_call(self, text: str) -> ToolCall:
        """A call cut off inside `{"name": "...", "arguments": ...`: the name (completed from the tools when it
        was cut too) and whatever of the arguments was written."""
        decoder = json.JSONDecoder()
        name, arguments = "", ""
        head = '{"name":'
        if text.startswith(head):
            pos = _skip(text, len(head))
            try:
                name, pos = decoder.raw_decode(text, pos)
                rest = text[_skip(text, pos):]
                key = ',"arguments":'
                arguments = rest[len(key):] if rest.startswith(key) else ""
            except ValueError:
                name = text[pos + 1:] if text.startswith('"', pos) else ""
        return ToolCall(self._resolve(str(name)), arguments, new_call_id())

    def _resolve(self, prefix: str) -> str:
        names = [tool["function"]["name"] for tool in self.tools]
        if prefix in names:
            return prefix
        return next((n for n in names if n.startswith(prefix)), names[0])


def _parameters(function: dict) -> dict:
    parameters = function.get("parameters")
    return closed_objects(parameters) if parameters else {"type": "object", "properties": {},
                                                           "additionalProperties": False}


def _call_schema(function: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": _parameters(function)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _arguments_text(text: str) -> str:
    """A named function's output is its arguments; as JSON text they are passed on compact, as OpenAI's are."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos
