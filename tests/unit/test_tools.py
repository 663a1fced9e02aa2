"""Tool calls: into the prompt (template or system message), out of the text (Qwen2/Hermes and Llama-3 JSON)."""
from __future__ import annotations

import json

import pytest

from metronome.server.api.chat_template import render_chat_prompt
from metronome.server.api.tool_prompt import tools_system_prompt
from metronome.server.api.tools import ToolStream, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "number"}, "b": {"type": "number"}}}}}]


def calls_of(text: str, fmt: str = "auto"):
    content, calls = parse_tool_calls(text, TOOLS, fmt)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_qwen2_calls_with_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = calls_of(text)
    assert content == "Let me look."
    assert calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert calls_of(text, "qwen2") == (content, calls)


def test_qwen2_unknown_function_and_broken_json_stay_text():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert calls_of(text) == (text, [])
    broken = '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
    assert calls_of(broken, "qwen2") == (broken, [])


def test_qwen2_arguments_written_as_a_string():
    content, calls = calls_of('<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>')
    assert content is None and calls == [("add", {"a": 3})]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '  {"name": "get_weather", "arguments": {"city": "Oslo"}}\n',
])
def test_llama3_json_calls(text):
    assert calls_of(text) == (None, [("get_weather", {"city": "Oslo"})])
    assert calls_of(text, "llama3") == (None, [("get_weather", {"city": "Oslo"})])


def test_llama3_several_calls_joined_by_semicolons():
    text = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    assert calls_of(text, "llama3")[1] == [("add", {"a": 1}), ("add", {"a": 2})]


def test_plain_text_and_json_that_is_no_call_stay_content():
    assert calls_of("The weather is fine.") == ("The weather is fine.", [])
    assert calls_of('{"city": "Paris"}') == ('{"city": "Paris"}', [])
    assert calls_of('{"name": "add", "parameters": {}} and more') == ('{"name": "add", "parameters": {}} and more', [])


def stream_pieces(text: str, fmt: str = "auto", size: int = 3):
    stream = ToolStream(TOOLS, fmt)
    emitted = [stream.push(text[i:i + size]) for i in range(0, len(text), size)]
    rest, calls = stream.finish()
    return "".join(emitted), rest, calls


@pytest.mark.parametrize("text", [
    "Sunny and warm, no tools needed.",
    'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call> done',
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '{"not": "a call"}',
    "a < b and <tool",
])
def test_streamed_content_equals_the_whole_parse(text):
    streamed, rest, calls = stream_pieces(text)
    content, whole_calls = parse_tool_calls(text, TOOLS)
    assert streamed + rest == (content or "")
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_stream_passes_plain_text_on_at_once_and_holds_a_call():
    stream = ToolStream(TOOLS)
    assert stream.push("Hello") == "Hello"
    assert stream.push(" <tool_") == " "  # may be a marker forming
    assert stream.push('call>{"name": "add", "arguments": {}}') == ""
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["add"]


class TemplateTokenizer:
    """Renders like a Hugging Face tokenizer; records what the template was given."""

    def __init__(self, template: str | None):
        self.template = template
        self.seen: dict = {}

    def chat_template_source(self):
        return self.template

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        self.seen = {"messages": messages, "tools": tools}
        return [len(messages)]


def test_a_template_that_reads_tools_gets_them():
    tokenizer = TemplateTokenizer("{% if tools %}{{ tools | tojson }}{% endif %}...")
    render_chat_prompt(tokenizer, [{"role": "user", "content": "hi"}], True, TOOLS)
    assert tokenizer.seen["tools"] == TOOLS and tokenizer.seen["messages"] == [{"role": "user", "content": "hi"}]


def test_other_templates_get_the_tools_in_the_system_message():
    tokenizer = TemplateTokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    render_chat_prompt(tokenizer, messages, True, TOOLS)
    seen = tokenizer.seen["messages"]
    assert tokenizer.seen["tools"] is None and len(seen) == 2
    assert seen[0]["content"].startswith("Be brief.\n\n") and tools_system_prompt(TOOLS) in seen[0]["content"]
    render_chat_prompt(tokenizer, messages[1:], True, TOOLS)
    assert tokenizer.seen["messages"][0] == {"role": "system", "content": tools_system_prompt(TOOLS)}


def test_real_template_renders_tool_calls_and_results():
    """SmolLM2's own tokenizer with a tool-aware template in the Qwen2 style: the assistant's earlier call and the
    tool's answer reach the prompt."""
    from metronome.server.models.loader import load_model

    tokenizer = load_model(None).tokenizer
    template = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
                "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    tokenizer.hf_tokenizer.chat_template, original = template, tokenizer.hf_tokenizer.chat_template
    try:
        messages = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "content": "18C", "tool_call_id": "c1"}]
        text = tokenizer.decode(render_chat_prompt(tokenizer, messages, True, TOOLS), skip_special_tokens=False)
    finally:
        tokenizer.hf_tokenizer.chat_template = original
    assert text.startswith("<tools>get_weatheradd</tools>")
    assert '<tool_call>get_weather {"city": "Paris"}</tool_call>' in text and "<|im_start|>tool\n18C" in text
