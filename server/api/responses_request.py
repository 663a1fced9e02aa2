"""`POST /v1/responses` requests, translated into the chat completion that serves them.

The Responses API describes a conversation as items: messages (`role` + text or content parts), the model's
earlier `function_call`s and the client's `function_call_output`s, after optional `instructions`. Here those
become chat messages (an assistant message with `tool_calls`, `tool` messages with `tool_call_id`), the flat
function tools become chat tools, `text.format` becomes `response_format` and `max_output_tokens` becomes
`max_completion_tokens`; the chat path then renders, constrains, generates and parses tool calls as for
/v1/chat/completions. `previous_response_id` prepends the conversation kept for that response
(responses_store.py); like OpenAI's, earlier `instructions` do not carry over.

What is not served is refused with a 400 naming the field: built-in tools (web search, file search, computer
use, MCP, code interpreter, ...), `item_reference` and other non-conversation items, `background`, stored
prompts (`prompt`), `conversation` objects, and image, audio and file inputs (the model reads text only).
Reasoning items in the input are dropped: no model served here reasons in a separate channel.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, ValidationError

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.protocol import TEXT_PART_TYPES, ChatCompletionRequest, _Request

MAX_INPUT_ITEMS = 4096
ROLES = ("user", "system", "developer", "assistant")
# Input items that carry nothing a model served here can read; dropped rather than refused.
DROPPED_ITEMS = ("reasoning",)


class ResponsesRequest(_Request):
    model: str | None = Field(None, max_length=512)
    input: str | list[Any] = Field(..., description="Text, or a list of input items.")
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    # Accepted; nothing to apply to the models served here.
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Refused when set (check_supported says why).
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # Extensions, as on the chat route.
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None

    def check_supported(self) -> None:
        self.check_text()
        if self.background:
            raise InvalidRequestError("background responses are not supported", param="background")
        if self.prompt is not None:
            raise InvalidRequestError("stored prompts are not supported; send input and instructions",
                                      param="prompt")
        if self.conversation is not None:
            raise InvalidRequestError("conversation objects are not supported; use previous_response_id or send "
                                      "the whole input", param="conversation")
        if self.top_logprobs:
            raise InvalidRequestError("top_logprobs is not supported on /v1/responses", param="top_logprobs")
        self.chat_tools()
        self.chat_tool_choice()
        self.response_format()
        input_messages(self.input)

    @property
    def keeps(self) -> bool:
        """Whether the response is kept for previous_response_id (OpenAI's `store`, true unless false)."""
        return self.store is not False

    def chat_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        return [chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(self.tools)]

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            if not isinstance(name, str):
                raise InvalidRequestError("tool_choice of type function needs a name", param="tool_choice.name")
            return {"type": "function", "function": {"name": name}}
        if kind == "allowed_tools":
            mode = choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise InvalidRequestError("tool_choice.mode must be auto or required", param="tool_choice.mode")
            return mode
        raise InvalidRequestError(f"tool_choice of type {kind!r} is not supported: only function tools are",
                                  param="tool_choice")

    def allowed_tool_names(self) -> set[str] | None:
        """The names an `allowed_tools` tool_choice keeps, else None (all)."""
        choice = self.tool_choice
        if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
            return None
        listed = choice.get("tools")
        if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
            raise InvalidRequestError("tool_choice.tools must be a list of tools", param="tool_choice.tools")
        return {t.get("name") for t in listed if t.get("type") == "function"}

    def response_format(self) -> dict | None:
        """`text.format` in chat's `response_format` shape."""
        if self.text is None or self.text.get("format") is None:
            return None
        fmt = self.text["format"]
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError("text.format.type must be text, json_object or json_schema",
                                      param="text.format")
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        if "schema" not in fmt:
            raise InvalidRequestError("text.format of type json_schema needs a schema", param="text.format.schema")
        schema = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}

    def chat_request(self, history: list[dict]) -> ChatCompletionRequest:
        """The chat completion that serves this response, after `history` (the previous response's
        conversation, if any)."""
        messages = list(history) + input_messages(self.input)
        if self.instructions:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise InvalidRequestError("input must not be empty", param="input")
        tools = self.chat_tools()
        allowed = self.allowed_tool_names()
        if tools is not None and allowed is not None:
            tools = [t for t in tools if t["function"]["name"] in allowed]
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "stream": self.stream,
            "tools": tools or None, "tool_choice": self.chat_tool_choice() if tools else None,
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "seed": self.seed, "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty, "stop": self.stop,
            "user": self.user,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as exc:  # a value that only the chat request's own checks see
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise InvalidRequestError(f"{where}: {error['msg']}", param=where) from None


def chat_tool(tool: Any, where: str) -> dict:
    """A flat Responses function tool as a chat tool; other tool types are refused."""
    if not isinstance(tool, dict):
        raise InvalidRequestError(f"{where} must be an object", param=where)
    kind = tool.get("type")
    if kind != "function":
        raise InvalidRequestError(f"{where} is a {kind!r} tool: only function tools are supported", param=where)
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def input_messages(value: str | list[Any]) -> list[dict]:
    """Input items as chat messages: a function_call joins the assistant turn before it (a model's turn is its
    text and its calls), each function_call_output is a tool message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if len(value) > MAX_INPUT_ITEMS:
        raise InvalidRequestError(f"input has {len(value)} items, more than {MAX_INPUT_ITEMS}", param="input")
    messages: list[dict] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": content})
        elif kind in DROPPED_ITEMS:
            continue
        else:
            raise InvalidRequestError(f"{where} is an item of type {kind!r}, which is not supported here "
                                      "(messages, function_call and function_call_output are)", param=where)
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(ROLES)}", param=f"{where}.role")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for index, part in enumerate(parts):
        here = f"{where}[{index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise InvalidRequestError(f"{here} must be a content part with a type", param=here)
        if part["type"] not in TEXT_PART_TYPES:
            raise InvalidRequestError(f"{here} is a part of type {part['type']!r}, but this model takes text only",
                                      param=here)
        text = part.get("refusal" if part["type"] == "refusal" else "text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{here} of type {part['type']!r} needs its text", param=here)
        texts.append(text)
    return "".join(texts)


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if isinstance(value, (dict, list)) and key == "arguments":
        return json.dumps(value, ensure_ascii=False)  # some clients send the arguments as an object
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value
