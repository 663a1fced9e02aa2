"""Tool calling: tool calls out of the generated text (tool_prompt.py puts tools and their history in).

Two formats:
- Qwen2 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, text around them is
  the message content;
- Llama 3.x JSON: the whole message is a JSON object `{"name": ..., "parameters": {...}}` (or "arguments"),
  optionally after `<|python_tag|>`, several joined by `;`.
Only names among the request's tools count as calls; anything else stays text. `tool_choice` "required" or a
named function is forced with a grammar instead (forced_calls.py).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from metronome.server.api.tool_prompt import TOOL_CALL_CLOSE as QWEN_CLOSE
from metronome.server.api.tool_prompt import TOOL_CALL_OPEN as QWEN_OPEN

PYTHON_TAG = "<|python_tag|>"
FORMATS = ("auto", "qwen2", "llama3")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from(obj: object, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _json_objects(text: str) -> list | None:
    """`text` as one or more JSON values (joined by `;` or whitespace), else None."""
    decoder = json.JSONDecoder()
    values, pos, text = [], 0, text.strip()
    while pos < len(text):
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return values or None


def parse_qwen2(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(QWEN_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(QWEN_CLOSE, start)
        body = text[start + len(QWEN_OPEN): end if end >= 0 else len(text)]
        values = _json_objects(body)
        call = _call_from(values[0], names) if values and len(values) == 1 else None
        if call is None:  # not a call we can read: leave it in the text
            content.append(text[pos: end + len(QWEN_CLOSE) if end >= 0 else len(text)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        if end < 0:
            break
        pos = end + len(QWEN_CLOSE)
    joined = "".join(content).strip() if calls else "".join(content)
    return (joined or None), calls


def parse_llama3(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    values = _json_objects(body) if body.startswith("{") else None
    calls = [_call_from(v, names) for v in values or []]
    if not calls or any(c is None for c in calls):
        return text, []
    return None, calls  # type: ignore[return-value]


def parse_tool_calls(text: str, tools: list[dict], fmt: str = "auto") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished message."""
    names = {t["function"]["name"] for t in tools}
    if fmt in ("auto", "qwen2") and QWEN_OPEN in text:
        content, calls = parse_qwen2(text, names)
        if calls or fmt == "qwen2":
            return content, calls
    if fmt in ("auto", "llama3"):
        return parse_llama3(text, names)
    return text, []


class ToolStream:
    """Streaming with tools: text that can no longer be part of a tool call is passed on at once; from a
    possible call's start on, the text is held and parsed when the message ends."""

    def __init__(self, tools: list[dict], fmt: str = "auto"):
        self.tools = tools
        self.fmt = fmt
        self.text = ""
        self.emitted = 0

    def push(self, delta: str) -> str:
        self.text += delta
        safe = self._safe_end()
        out = self.text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out

    def _safe_end(self) -> int:
        text = self.text
        stripped = text.lstrip()
        if self.fmt in ("auto", "llama3") and (not stripped or stripped[0] == "{" or
                                                PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)])):
            if self.emitted == 0:
                return 0  # the message may be one JSON call: hold it all
        if self.fmt == "llama3":
            return len(text)
        found = text.find(QWEN_OPEN)
        if found >= 0:
            return found
        for keep in range(min(len(QWEN_OPEN) - 1, len(text)), 0, -1):  # a marker may be forming at the end
            if QWEN_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet passed on, calls)."""
        content, calls = parse_tool_calls(self.text, self.tools, self.fmt)
        content = content or ""
        done = self.text[:self.emitted]
        rest = content[len(done):] if content.startswith(done) else ""
        return rest, calls
