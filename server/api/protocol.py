"""OpenAI-shaped request and response types for /v1/completions and /v1/chat/completions.

Requests are validated here (shape, ranges, unsupported options) so that a bad body becomes a 400 naming the
field; the engine then validates what depends on the model (prompt length, token ids). Unknown fields are
rejected rather than silently ignored: a client that asks for `logit_bias` should learn it had no effect.
Options that OpenAI clients commonly send with their no-op default (`n=1`, `echo=false`, zero penalties) pass.
Numbers must be finite (Python's JSON reader accepts NaN and Infinity), token ids must be integers (not
booleans) below 2**31, and every string must be encodable as UTF-8 (JSON may carry lone surrogate escapes).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from metronome.contract.errors import InvalidRequestError

TOKEN_ID_LIMIT = 1 << 31  # no vocabulary is this large; beyond it ids would overflow int32 tensors


class _Request(BaseModel):
    # allow_inf_nan=False: NaN/Infinity get "Input should be a finite number", not a confusing range error.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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


def _children(value: Any, path: str):
    """(path, value) of what a request value holds; a dict's key comes before its value, so that a path is
    only built from keys already found encodable."""
    prefix = "" if path == "body" else f"{path}."
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield prefix + name, getattr(value, name)
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


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=512)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Extension: 0 or -1 = off.")
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=1024, description="Extension.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past the end-of-sequence token.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, description="Only 1 is supported.")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored

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
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if self.presence_penalty != 0.0:
            raise InvalidRequestError("presence_penalty is not supported (only 0)", param="presence_penalty")
        if self.frequency_penalty != 0.0:
            raise InvalidRequestError("frequency_penalty is not supported (only 0)", param="frequency_penalty")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
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
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if self.logprobs not in (None, 0):
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        self.single_prompt()  # reject batches and empty lists up front

    def single_prompt(self) -> str | list[int]:
        """The one prompt to run: a string or a list of token ids. Batches of prompts are rejected."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if len(prompt) == 0:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(item, int) for item in prompt):  # ids checked by _check_prompt_shape
            return list(prompt)  # type: ignore[arg-type]
        if len(prompt) > 1:
            raise InvalidRequestError(
                "batched prompts are not supported: send one prompt (a string or a list of token ids) per request",
                param="prompt",
            )
        return self._unwrap_single(prompt[0])

    @staticmethod
    def _unwrap_single(item: Any) -> str | list[int]:
        if isinstance(item, list) and not item:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return item


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = Field(True, description="Extension: end the prompt with the assistant header.")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as plain dicts for tokenizer.apply_chat_template (content parts joined into text)."""
        return [{"role": message.role, "content": message.text()} for message in self.messages]


# ---------------------------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
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
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_unix() -> int:
    return int(time.time())
