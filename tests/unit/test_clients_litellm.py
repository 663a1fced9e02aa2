"""LiteLLM against a real `metronome serve` with the default model: a tool round trip, structured output, a
streamed forced call, and its Responses bridge. Protocol behaviour only (the model is tiny)."""
from __future__ import annotations

import json
import os

import openai
import pytest
from default_server import KEY, MODEL, Recorder, default_server, rendered_prompt, tool_call_text, tool_result_text
from pydantic import BaseModel, Field

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map at import
litellm = pytest.importorskip("litellm")

ADD = {"type": "function", "function": {"name": "add", "description": "Add two small integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}


class City(BaseModel):
    city: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def call(served, recorder):
    client = openai.OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, http_client=recorder.client())

    def completion(**kwargs):
        return litellm.completion(model=f"openai/{MODEL}", api_base=served.v1, api_key=KEY, client=client,
                                  temperature=0, **kwargs)
    return completion


def test_tool_round_trip(call, served, recorder):
    messages = [{"role": "user", "content": "What is 4 plus 5?"}]
    reply = call(messages=messages, tools=[ADD], tool_choice="required", max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    tool_call = choice.message.tool_calls[0]
    arguments = json.loads(tool_call.function.arguments)
    assert tool_call.function.name == "add" and set(arguments) == {"a", "b"}
    result = str(arguments["a"] + arguments["b"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": result}]
    final = call(messages=messages, tools=[ADD], max_tokens=8)
    assert final.choices[0].message.role == "assistant"
    prompt = rendered_prompt(served, recorder.sent("/chat/completions")[-1])
    assert tool_call_text("add", tool_call.function.arguments) in prompt and tool_result_text(result) in prompt


def test_a_cut_off_forced_call_is_a_call(call):
    reply = call(messages=[{"role": "user", "content": "Add."}], tools=[ADD],
                 tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=2)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "add"


def test_structured_output(call):
    reply = call(messages=[{"role": "user", "content": "A city, as JSON."}], response_format=City, max_tokens=60)
    assert reply.choices[0].finish_reason == "stop"
    City.model_validate_json(reply.choices[0].message.content)


def test_streamed_forced_call(call):
    chunks = list(call(messages=[{"role": "user", "content": "What is 1 plus 1?"}], tools=[ADD],
                       tool_choice="required", parallel_tool_calls=False, max_tokens=60, stream=True))
    built = litellm.stream_chunk_builder(chunks)
    (tool_call,) = built.choices[0].message.tool_calls
    assert tool_call.function.name == "add" and set(json.loads(tool_call.function.arguments)) == {"a", "b"}
    assert built.choices[0].finish_reason == "tool_calls"


def test_responses_bridge(served):
    reply = litellm.responses(model=f"openai/{MODEL}", api_base=served.v1, api_key=KEY, input="Say hi.",
                              max_output_tokens=8, temperature=0)
    assert reply.status in {"completed", "incomplete"} and reply.usage.output_tokens > 0
