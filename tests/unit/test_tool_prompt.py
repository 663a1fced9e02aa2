"""Tool-call history in the prompt, per chat-template family: SmolLM2's (no tool support: the calls and results
written as text in the format the tools' system message asks for) and a Qwen2.5/Qwen3-style tool template (the
template's own fields), written into a tokenizer config as a model folder ships it."""
from __future__ import annotations

import json

import pytest

from metronome.server.api.chat_template import render_chat_prompt
from metronome.server.api.protocol import ChatCompletionRequest
from metronome.server.api.tool_prompt import history_as_text, tools_system_prompt

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "4C"}]},
    {"role": "assistant", "content": "Paris 18C, Oslo 4C.", "tool_calls": []},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "25C"},
]

# A template in the style of Qwen2.5/Qwen3's: tools in the system turn, calls from `tool_calls`, results from
# `tool` messages grouped into one user turn, and the `enable_thinking` switch of Qwen3's.
QWEN_STYLE = (  # Hugging Face renders with trim_blocks: a newline right after a tag is written as {{ '\n' }}
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}"
    "{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' }}{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}{{ '\\n<tool_call>\\n' }}{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")


def template_messages(messages: list[dict]) -> list[dict]:
    """As the chat route hands them to the template."""
    return ChatCompletionRequest(messages=messages).template_messages()


@pytest.fixture(scope="module")
def smollm2():
    from metronome.server.models.loader import _GGUFSource, parse_model_spec

    source = _GGUFSource(parse_model_spec(None))
    return source.tokenizer(source.config())


@pytest.fixture(scope="module")
def qwen_style(smollm2, tmp_path_factory):
    """SmolLM2's vocabulary in a model folder whose tokenizer_config.json carries the Qwen-style template."""
    from metronome.server.models.tokenizer import load_hf_tokenizer

    folder = tmp_path_factory.mktemp("qwen-style")
    smollm2.hf_tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_STYLE}))
    return load_hf_tokenizer(folder, "qwen-style", smollm2.eos_token_ids, smollm2.bos_token_id)


def rendered(tokenizer, messages, tools=None, **kwargs) -> str:
    ids = render_chat_prompt(tokenizer, template_messages(messages), True, tools, kwargs or None)
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_smollm2_template_gets_calls_and_results_as_text(smollm2):
    assert "tools" not in smollm2.chat_template_source()
    text = rendered(smollm2, CONVERSATION, [WEATHER])
    assert text == (
        f"<|im_start|>system\n{tools_system_prompt([WEATHER])}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n4C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18C, Oslo 4C.<|im_end|>\n"
        "<|im_start|>user\nAnd Rome?<|im_end|>\n"
        '<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n25C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    system = tools_system_prompt([WEATHER])
    assert "<tool_call>" in system and "<tool_response></tool_response>" in system


def test_smollm2_template_gets_the_history_without_tools_too(smollm2):
    """tool_choice "none" (or tools dropped by the client) still shows the model its earlier calls."""
    text = rendered(smollm2, CONVERSATION[:3])
    assert "# Tools" not in text and '"arguments": {"city": "Paris"}' in text and "<tool_response>\n18C\n" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_qwen_style_template_gets_its_own_fields(qwen_style):
    text = rendered(qwen_style, CONVERSATION, [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(WEATHER))
    assert ('<|im_start|>assistant\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            "<|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n4C\n</tool_response>"
            "<|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n25C\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert "You may call one or more functions" not in text  # the template's own tool prompt, not ours


def test_chat_template_kwargs_reach_the_template(qwen_style, smollm2):
    messages = [{"role": "user", "content": "hi"}]
    no_thinking = rendered(qwen_style, messages, enable_thinking=False)
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert rendered(qwen_style, messages).endswith("<|im_start|>assistant\n")
    assert rendered(smollm2, messages, enable_thinking=False) == rendered(smollm2, messages)  # unused: ignored


def test_history_as_text_keeps_unparsable_arguments_as_written():
    (assistant,) = history_as_text([{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}]}])
    assert assistant == {"role": "assistant",
                         "content": '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'}
