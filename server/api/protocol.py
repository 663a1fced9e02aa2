"""OpenAI-shaped request and response types for /v1/completions and /v1/chat/completions.

Requests are validated here (shape, ranges, unsupported options) so that a bad body becomes a 400 naming the
field; the engine then validates what depends on the model (prompt length, token ids). Unknown fields are
kept aside (`unknown_fields`): the app logs each once and ignores it, as vLLM does, because LiteLLM, LangChain
and agent SDKs send fields of newer API versions; `metronome serve --strict-openai` refuses them with a 400.
Numbers must be finite (Python's JSON reader accepts NaN and Infinity), token ids must be integers (not
booleans) below 2**31, and every string must be encodable as UTF-8 (JSON may carry lone surrogate escapes).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.forced_calls import ForcedCall
from metronome.server.api.structured_outputs import VLLM_FIELDS, guided_grammar, structured_outputs_grammar
from metronome.server.engine.sampling import MAX_TOP_LOGPROBS, Grammar

TOKEN_ID_LIMIT = 1 << 31  # no vocabulary is this large; beyond it ids would overflow int32 tensors
MAX_CHOICES = 128  # n, or prompts x n for a batch of completions (OpenAI's bound for n)
NULL_MEANS_DEFAULT = frozenset({"n", "stream", "echo", "logprobs", "ignore_eos", "add_generation_prompt"})


class _Request(BaseModel):
    # allow_inf_nan=False: NaN/Infinity get "Input should be a finite number", not a confusing range error.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        """Dotted paths of the fields this server does not know, in this body and the objects it holds."""
        return list(_unknown(self, ""))

    def check_text(self) -> None:
        """Every string in the request must be encodable as UTF-8; raise InvalidRequestError naming the field."""
        found = unencodable_text(self)
        if found is not None:
            path, position, char = found
            raise InvalidRequestError(
                f"{path} is not valid Unicode: character {position} is a lone surrogate ({ascii(char)}), "
                "which cannot be encoded as UTF-8", param=path)


def unencodable_text(value: Any, path: str = "body") -> tuple[str, int, str] | None:
    """(field path, character index, character) of the first string that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start, value[exc.start]
        return None
    for where, item in _children(value, path):
        found = unencodable_text(item, where)
        if found is not None:
            return found
    return None


def _unknown(value: Any, path: str):
    if isinstance(value, BaseModel):
        prefix = f"{path}." if path else ""
        for name in value.model_extra or {}:
            yield prefix + name
        for name in type(value).model_fields:
            yield from _unknown(getattr(value, name), prefix + name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, BaseModel):
                yield from _unknown(item, f"{path}[{index}]")


def _children(value: Any, path: str):
    """(path, value) of what a request value holds; a dict's key comes before its value, so that a path is
    only built from keys already found encodable."""
    prefix = "" if path == "body" else f"{path}."
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield prefix + name, getattr(value, name)
        for name, item in (value.model_extra or {}).items():  # unknown fields: their names and text too
            yield f"{prefix}<key>", name
            yield prefix + name, item
    elif isinstance(value, dict):
        for key, item in value.items():
            yield f"{prefix}<key>", key
            yield f"{prefix}{key}", item
    elif isinstance(value, (list, tuple)) and value and not isinstance(value[0], int):  # ids: nothing to check
        for index, item in enumerate(value):
            yield f"{path}[{index}]", item


def check_token_ids(ids: list, where: str) -> list[int]:
    """Token ids are plain integers in [0, 2**31): JSON true/false and 1.0 are not token ids."""
    if not ids:
        raise ValueError(f"{where} must not be empty")
    for index, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise ValueError(f"{where}[{index}] must be an integer token id, got {_json_name(token)}")
        if not 0 <= token < TOKEN_ID_LIMIT:
            raise ValueError(f"{where}[{index}] must be a token id in [0, {TOKEN_ID_LIMIT}), got {token}")
    return ids


def _json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Extension (vLLM): usage in every chunk.")


class JsonSchemaFormat(_Request):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> Grammar | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Grammar("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                      param="response_format.json_schema")
        return Grammar("json_schema", json.dumps(self.json_schema.schema_))


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=512)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Extension: 0 or -1 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension.")
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0, description="Extension.")
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=1024, description="Extension.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    response_format: ResponseFormat | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's structured outputs (structured_outputs.py); refused under --strict-openai.
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """JSON null for a field with a non-null default means that default: clients (LangChain, LiteLLM, the
        `openai` client given None) send `"n": null` or `"stream": null` for options they leave unset."""
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_MEANS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in NULL_MEANS_DEFAULT)}
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > 16:
            raise ValueError("at most 16 stop sequences are supported")
        if any(item == "" for item in items):
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, value: Any) -> Any:
        if isinstance(value, list) and value:
            check_token_ids(value, "stop_token_ids")
        return value

    def check_supported(self) -> None:
        """Reject options this server does not implement, and text UTF-8 cannot carry. A method, not a pydantic
        validator, so that the error keeps its typed `param` instead of becoming a generic validation error."""
        self.check_text()
        self.logit_bias_items()

    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); keys are token ids written as strings (OpenAI's form)."""
        items = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                                          param="logit_bias")
            items.append((int(key), float(bias)))
        return tuple(items)

    def grammar(self) -> Grammar | None:
        return self.constraint()[0]

    def constraint(self) -> tuple[Grammar | None, str]:
        """The output's grammar (None: free text) and the field that set it: response_format or one of vLLM's
        structured-output fields, at most one of them."""
        found: list[tuple[Grammar, str]] = []
        if self.response_format is not None:
            grammar = self.response_format.grammar()
            if grammar is not None:
                found.append((grammar, "response_format"))
        guided = guided_grammar({name: getattr(self, name) for name in
                                 ("guided_json", "guided_regex", "guided_choice", "guided_grammar")})
        if guided is not None:
            found.append(guided)
        if self.structured_outputs is not None:
            grammar = structured_outputs_grammar(self.structured_outputs)
            if grammar is not None:
                found.append((grammar, "structured_outputs"))
        if len(found) > 1:
            raise InvalidRequestError(f"only one structured output constraint may be given, got {found[0][1]} and "
                                      f"{found[1][1]}", param=found[1][1])
        return found[0] if found else (None, "response_format")

    def vllm_fields(self) -> list[str]:
        """vLLM's extension fields that this request sets (--strict-openai refuses them)."""
        return [name for name in VLLM_FIELDS if getattr(self, name, None) is not None]

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, value: Any) -> Any:
        """A string, a list of strings, or token ids (a list, or a list of lists): checked before pydantic's
        union, whose lax mode would read `[true, false]` as the ids [1, 0] and bury the reason under one error
        per union member."""
        if isinstance(value, str) or not isinstance(value, list) or not value:
            return value  # the union reports other types; an empty list is refused by single_prompt
        if all(isinstance(item, str) for item in value):
            return value
        if isinstance(value[0], list):
            for index, item in enumerate(value):
                if not isinstance(item, list):
                    raise ValueError(f"prompt[{index}] must be a list of token ids like prompt[0], got "
                                     f"{_json_name(item)}")
                check_token_ids(item, f"prompt[{index}]")
            return value
        return check_token_ids(value, "prompt")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, self.n):
            raise InvalidRequestError(f"best_of must equal n ({self.n}): choosing the best of several candidates "
                                      "is not supported", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported (prompt logprobs are not computed)",
                                      param="echo")
        prompts = self.prompts()  # reject empty lists up front
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"{len(prompts)} prompts x n={self.n} is more than {MAX_CHOICES} choices",
                                      param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompts to run, each a string or a list of token ids (a batch is a list of either)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if len(prompt) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(item, int) for item in prompt):  # ids checked by _check_prompt_shape
            return [list(prompt)]  # type: ignore[list-item]
        for index, item in enumerate(prompt):
            if len(item) == 0:
                raise InvalidRequestError(f"prompt[{index}] must not be empty", param="prompt")
        return list(prompt)  # type: ignore[arg-type]


TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})


class ContentPart(_Request):
    """One part of a message's content. The model reads text only: parts of other kinds (image_url, input_audio,
    file, ...) are refused by `check_text_only` with one short message, not a validation dump."""

    type: str = Field(..., max_length=64)
    text: str | None = None
    refusal: str | None = None  # an assistant's refusal part

    def plain(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""

    def check_text_only(self, where: str) -> None:
        if self.type not in TEXT_PART_TYPES:
            raise InvalidRequestError(f"{where} is a part of type {self.type!r}, but this model takes text only",
                                      param=where)
        if not isinstance(self.refusal if self.type == "refusal" else self.text, str):
            raise InvalidRequestError(f"{where} of type {self.type!r} needs its text", param=where)


class FunctionCall(_Request):
    name: str = Field(..., max_length=256)
    arguments: str = ""  # JSON text


class ToolCallIn(_Request):
    """A tool call of an earlier assistant message, sent back by the client."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.plain() for part in self.content)

    def check_text_only(self, where: str) -> None:
        for index, part in enumerate(self.content if isinstance(self.content, list) else []):
            part.check_text_only(f"{where}.content[{index}]")

    def template_dict(self) -> dict:
        """The message as chat templates read it (Hugging Face's convention: tool call arguments as objects)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


class FunctionDefinition(_Request):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_dict(self) -> dict:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = Field(True, description="Extension: end the prompt with the assistant header.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extension (vLLM): template variables.")

    def check_supported(self) -> None:
        for index, message in enumerate(self.messages):
            message.check_text_only(f"messages[{index}]")
        super().check_supported()
        check_template_kwargs(self.chat_template_kwargs)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.n > MAX_CHOICES:
            raise InvalidRequestError(f"n must be at most {MAX_CHOICES}", param="n")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names():
            raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                                      param="tool_choice")
        self.constraint()  # one at most; a forced tool call overrides it (the output is calls, not text)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict]:
        """Messages as plain dicts for tokenizer.apply_chat_template (content parts joined into text)."""
        return [message.template_dict() for message in self.messages]

    def tool_names(self) -> set[str]:
        return {tool.function.name for tool in self.tools or []}

    def active_tools(self) -> list[dict]:
        """The tools the model is shown and whose calls are parsed back (none with tool_choice "none")."""
        return [] if self.tool_choice == "none" else [tool.as_dict() for tool in self.tools or []]

    def forced_tool(self) -> str | None:
        """"*" when tool_choice is "required", the function's name when it names one, else None."""
        if not self.tools:
            return None
        if self.tool_choice == "required":
            return "*"
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def forced_call(self, tools: list[dict]) -> ForcedCall | None:
        """How a forced tool call is constrained and read back (forced_calls.py), or None when none is forced."""
        forced = self.forced_tool()
        if forced is None:
            return None
        return ForcedCall(tools, None if forced == "*" else forced, parallel=self.parallel_tool_calls is not False)

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# What apply_chat_template takes itself: chat_template_kwargs may not set these.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs may not set {key!r}", param=f"chat_template_kwargs.{key}")


class TokenizeRequest(_Request):
    """/tokenize (vLLM's shape): a prompt as /v1/completions tokenizes it, or messages as chat renders them."""

    model: str | None = Field(None, max_length=512)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _one_input(cls, value, info):
        if value is not None and info.data.get("prompt") is not None:
            raise ValueError("send either prompt or messages, not both")
        return value


class DetokenizeRequest(_Request):
    model: str | None = Field(None, max_length=512)
    tokens: list[int] = Field(..., max_length=1 << 20)

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any) -> Any:
        if isinstance(value, list) and value:
            check_token_ids(value, "tokens")
        return value


# ---------------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionLogprobs(BaseModel):
    """The legacy completions form: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "metronome"
    root: str | None = None  # the model as loaded (its Hugging Face id, file or preset)
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_unix() -> int:
    return int(time.time())
