"""langchain-openai's ChatOpenAI against a real `metronome serve` with the default model: a tool round trip,
structured output (json_schema and function calling), a streamed forced call, and the Responses API path
(`use_responses_api=True`). Protocol behaviour only (the model is tiny)."""
from __future__ import annotations

from typing import Annotated

import pytest
from default_server import KEY, MODEL, Recorder, default_server, rendered_prompt, tool_call_text, tool_result_text
from pydantic import BaseModel, Field

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402


@tool
def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two small integers."""
    return a + b


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=10)
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def chat(served, recorder):
    def make(**kwargs):
        return langchain_openai.ChatOpenAI(model=MODEL, base_url=served.v1, api_key=KEY, temperature=0,
                                           max_retries=0, http_client=recorder.client(), **kwargs)
    return make


def test_tool_round_trip(chat, served, recorder):
    llm = chat(max_tokens=60).bind_tools([add], tool_choice="add")
    question = HumanMessage("What is 6 plus 7?")
    reply = llm.invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"} and reply.content == ""
    result = add.invoke(call["args"])
    final = chat(max_tokens=8).bind_tools([add]).invoke([question, reply, ToolMessage(str(result),
                                                                                      tool_call_id=call["id"])])
    assert final.type == "ai"
    body = recorder.sent("/chat/completions")[-1]
    prompt = rendered_prompt(served, body)
    sent_call = body["messages"][1]["tool_calls"][0]["function"]
    assert tool_call_text("add", sent_call["arguments"]) in prompt and tool_result_text(str(result)) in prompt


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(chat, method):
    pet = chat(max_tokens=60).with_structured_output(Pet, method=method).invoke("Invent a pet.")
    assert isinstance(pet, Pet)


def test_streamed_forced_call(chat):
    llm = chat(max_tokens=60).bind_tools([add], tool_choice="required", parallel_tool_calls=False)
    chunks = list(llm.stream("What is 2 plus 2?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    (call,) = merged.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}


def test_responses_api_round_trip(chat, served, recorder):
    llm = chat(max_tokens=60, use_responses_api=True)
    question = HumanMessage("What is 3 plus 4?")
    reply = llm.bind_tools([add], tool_choice="add").invoke([question])
    (call,) = reply.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    result = add.invoke(call["args"])
    final = chat(max_tokens=8, use_responses_api=True).bind_tools([add]).invoke(
        [question, reply, ToolMessage(str(result), tool_call_id=call["id"])])
    assert final.type == "ai"
    body = recorder.sent("/responses")[-1]
    (sent_call,) = [item for item in body["input"] if item.get("type") == "function_call"]
    prompt = rendered_prompt(served, body)
    assert tool_call_text("add", sent_call["arguments"]) in prompt and tool_result_text(str(result)) in prompt
    streamed = list(llm.stream("Say hi."))
    assert any(chunk.content for chunk in streamed)
