"""Chat messages → prompt token ids through the model's own chat template."""
from __future__ import annotations

from metronome.contract.errors import InvalidRequestError


def render_chat_prompt(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
    """The tokenizer renders its template and tokenizes without adding special tokens again. A template that
    rejects the conversation (jinja's raise_exception, e.g. roles out of order) is the client's error."""
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2.TemplateError and friends, raised by the model's own template
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
