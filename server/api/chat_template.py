"""Chat messages → prompt token ids through the model's own chat template (tools and their history included)."""
from __future__ import annotations

from typing import Any

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.tool_prompt import history_as_text, template_knows_tools, with_tools_in_system


def render_chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The tokenizer renders its template and tokenizes without adding special tokens again. A template that
    rejects the conversation (jinja's raise_exception, e.g. roles out of order) is the client's error.
    `tools` and the conversation's tool calls and results go to a template that reads them; for other templates
    they are written as text (tool_prompt.py). `template_kwargs`: more variables for the template (vLLM's
    chat_template_kwargs, e.g. enable_thinking); a template that does not use one ignores it."""
    if not template_knows_tools(tokenizer.chat_template_source()):
        messages = history_as_text(messages)
        if tools:
            messages, tools = with_tools_in_system(messages, tools), None
    try:
        hf = getattr(tokenizer, "hf_tokenizer", None)
        if template_kwargs and hf is not None and getattr(hf, "chat_template", None):
            text = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                          **({"tools": tools} if tools else {}), **template_kwargs)
            return tokenizer.encode(text, add_special_tokens=False)
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  **({"tools": tools} if tools else {})))
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2.TemplateError and friends, raised by the model's own template
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
