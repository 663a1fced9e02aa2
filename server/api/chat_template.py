"""Chat messages → prompt token ids through the model's own chat template (tools included)."""
from __future__ import annotations

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.tools import template_knows_tools, with_tools_in_system


def render_chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None) -> list[int]:
    """The tokenizer renders its template and tokenizes without adding special tokens again. A template that
    rejects the conversation (jinja's raise_exception, e.g. roles out of order) is the client's error.
    `tools` go to a template that reads them; other templates get them described in the system message
    (tools.py)."""
    if tools and not template_knows_tools(tokenizer.chat_template_source()):
        messages, tools = with_tools_in_system(messages, tools), None
    try:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **({"tools": tools} if tools else {})))
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2.TemplateError and friends, raised by the model's own template
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
