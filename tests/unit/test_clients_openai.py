"""The `openai` client against a real `metronome serve` with the default model: tool round trips on chat and
Responses, a multi-turn agent loop with several tool exchanges, structured outputs, streams, vLLM's fields.

The default model is tiny, so the tests check the protocol: calls come back as calls whose arguments fit the
tools' schemas, and the calls and their results are in the prompt the server renders for the next turn."""
from __future__ import annotations

import json

import openai
import pytest
from default_server import (
    KEY,
    MODEL,
    Recorder,
    default_server,
    rendered_prompt,
    tool_call_text,
    tool_result_text,
)
from pydantic import BaseModel, Field

ADD = {"type": "function", "function": {"name": "add", "description": "Add two small integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}}, "required": ["city"]}}}
TOOLS = [ADD, WEATHER]


def run_tool(name: str, arguments: dict) -> str:
    return str(arguments["a"] + arguments["b"]) if name == "add" else f"18C in {arguments['city']}"


def check_arguments(name: str, text: str) -> dict:
    """The arguments parse and fit the tool's schema exactly: no keys it does not list."""
    arguments = json.loads(text)
    if name == "add":
        assert set(arguments) == {"a", "b"} and all(0 <= arguments[k] <= 99 for k in "ab"), arguments
    else:
        assert arguments in ({"city": "Paris"}, {"city": "Oslo"}, {"city": "Rome"}), arguments
    return arguments


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def client(served, recorder):
    return openai.OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, http_client=recorder.client())


def test_chat_tool_round_trip_reaches_the_prompt(client, served, recorder):
    messages = [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = check_arguments("add", call.function.arguments)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": run_tool("add", arguments)}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    assert final.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    prompt = rendered_prompt(served, recorder.sent("/chat/completions")[-1])
    assert tool_call_text("add", call.function.arguments) in prompt
    assert tool_result_text(str(arguments["a"] + arguments["b"])) in prompt
    assert final.usage.prompt_tokens > reply.usage.prompt_tokens


def test_agent_loop_with_several_tool_exchanges(client, served, recorder):
    """A hand-written agent loop: three forced turns (one call each), then a free turn; every call and result
    so far is in each turn's prompt."""
    messages = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": "Add 1 and 2, then check the weather in Oslo and Rome."}]
    exchanged = []
    for turn in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=0, max_tokens=60, seed=turn)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        result = run_tool(call.function.name, check_arguments(call.function.name, call.function.arguments))
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
        exchanged.append((call.function.name, call.function.arguments, result))
        prompt = rendered_prompt(served, recorder.sent("/chat/completions")[-1])
        for name, arguments, earlier in exchanged[:-1]:
            assert tool_call_text(name, arguments) in prompt and tool_result_text(earlier) in prompt
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    prompt = rendered_prompt(served, recorder.sent("/chat/completions")[-1])
    assert all(tool_call_text(n, a) in prompt and tool_result_text(r) in prompt for n, a, r in exchanged)
    assert prompt.count("<tool_response>\n") == 3 and final.choices[0].message.role == "assistant"


def test_streamed_forced_calls_and_a_cut_off_call(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, stream=True,
        tool_choice="required", temperature=0, max_tokens=80, stream_options={"include_usage": True}))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"] and deltas and chunks[-1].usage.completion_tokens > 0
    for delta in deltas:
        check_arguments(delta.function.name, delta.function.arguments)
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    named = {"type": "function", "function": {"name": "get_weather"}}
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=TOOLS, tool_choice=named, temperature=0, max_tokens=3)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.tool_calls[0].function.arguments.startswith('{"')


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


def test_structured_output_through_parse(client):
    reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}],
                                          response_format=Person, temperature=0, max_tokens=60)
    assert reply.choices[0].finish_reason == "stop" and isinstance(reply.choices[0].message.parsed, Person)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON"}],
                                           max_tokens=30, temperature=0, response_format={
                                               "type": "json_schema", "json_schema": {"name": "any", "schema": True}})
    assert whole.choices[0].message.content.strip()


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["yes", "no"]}, lambda text: text in {"yes", "no"}),
    ({"guided_regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda text: isinstance(json.loads(text)["ok"], bool)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda text: text in {"red", "green"}),
    ({"guided_grammar": 'root ::= "a" | "b"'}, lambda text: text in {"a", "b"}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, lambda text: isinstance(text, str)),
])
def test_vllm_structured_output_fields_apply(client, extra, check):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer."}],
                                           max_tokens=20, temperature=0, extra_body=extra)
    assert check(reply.choices[0].message.content), reply.choices[0].message.content


def test_responses_tool_round_trip_and_previous_response_id(client, served, recorder):
    tools = [{"type": "function", **{k: v for k, v in WEATHER["function"].items()}}]
    first = client.responses.create(model=MODEL, input="Weather in Rome?", instructions="Use tools.", tools=tools,
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    assert first.status == "completed" and [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    check_arguments(call.name, call.arguments)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "25C and sunny"}
    followed = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=tools,
                                       instructions="Use tools.", temperature=0, max_output_tokens=8)
    assert followed.previous_response_id == first.id and followed.usage.input_tokens > first.usage.input_tokens
    whole = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}, output],
        instructions="Use tools.", tools=tools, temperature=0, max_output_tokens=8)
    # The kept conversation renders the same prompt (instructions are not carried over: both requests send them).
    assert whole.usage.input_tokens == followed.usage.input_tokens
    prompt = rendered_prompt(served, recorder.sent("/responses")[-1])
    assert tool_call_text(call.name, call.arguments) in prompt and tool_result_text("25C and sunny") in prompt
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, previous_response_id="resp_unknown", input="hi", max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"


def test_responses_stream_and_structured_output(client):
    events = list(client.responses.create(model=MODEL, input="Say hi.", stream=True, temperature=0,
                                          max_output_tokens=12))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] in {"response.completed", "response.incomplete"} and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and [e.sequence_number for e in events] == list(range(len(events)))
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person, temperature=0,
                                    max_output_tokens=60)
    assert isinstance(parsed.output_parsed, Person)


def test_an_image_part_is_one_short_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert caught.value.body["message"] == ("messages[0].content[1] is a part of type 'image_url', but this model "
                                            "takes text only")
