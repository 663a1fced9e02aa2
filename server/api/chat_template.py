"""Chat messages → prompt token ids through the model's own chat template."""
from __future__ import annotations

from metronome.server.errors import InvalidRequestError


def render_chat_prompt(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """Apply the tokenizer's chat template and tokenize the result without adding special tokens again
    (templates write their own BOS). A template that rejects the conversation (e.g. roles out of order) is the
    client's error, so it becomes InvalidRequestError."""
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = apply(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # jinja2.TemplateError, ValueError("no chat template"), raise_exception() in templates
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise InvalidRequestError("the chat template did not render text", param="messages")
    return encode_without_special_tokens(tokenizer, text)


def encode_without_special_tokens(tokenizer, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode takes no such option adds none
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))
