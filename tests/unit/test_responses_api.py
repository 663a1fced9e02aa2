"""/v1/responses pieces: input items into chat messages, the kept conversations, and the shaper's whole and
streamed forms agreeing (random:tiny in-process for the last)."""
from __future__ import annotations

import json

import pytest
from api_helpers import TINY, build_server_parts
from fastapi.testclient import TestClient

from metronome.contract.errors import InvalidRequestError
from metronome.server.api.responses_request import ResponsesRequest, input_messages
from metronome.server.api.responses_store import ResponseStore

CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "2"}


def test_items_become_chat_messages():
    messages = input_messages([
        {"role": "user", "content": "Add"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        CALL, {**CALL, "call_id": "call_2"}, OUTPUT, {**OUTPUT, "call_id": "call_2", "output": [
            {"type": "input_text", "text": "3"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}])
    assert messages == [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "tool", "tool_call_id": "call_2", "content": "3"},
        {"role": "user", "content": "thanks"}]
    assert input_messages([CALL])[0] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]}


@pytest.mark.parametrize("items, param", [
    ([{"type": "input_image", "image_url": "x"}], "input[0]"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[0].content[0]"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
    ([{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    (["text"], "input[0]"),
])
def test_items_that_are_not_served_are_400s(items, param):
    with pytest.raises(InvalidRequestError) as caught:
        input_messages(items)
    assert caught.value.param == param


def test_the_chat_request_carries_the_options():
    request = ResponsesRequest.model_validate({
        "model": TINY, "input": "hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5,
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}},
                  {"type": "function", "name": "sub"}],
        "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "sub"}]},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}}})
    chat = request.chat_request([{"role": "user", "content": "before"}])
    assert [m.role for m in chat.messages] == ["system", "user", "user"] and chat.messages[0].content == "Be brief."
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5 and chat.tool_choice == "required"
    assert [t.function.name for t in chat.tools] == ["sub"]
    assert chat.response_format.json_schema.schema_ == {"type": "object"} and chat.response_format.json_schema.strict


def test_the_store_keeps_chains_and_drops_the_least_recently_used():
    store = ResponseStore(max_responses=3)
    store.keep("r1", None, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    store.keep("r2", "r1", [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])
    store.keep("x1", None, [])
    assert [m["content"] for m in store.conversation("r2")] == ["a", "b", "c", "d"]  # touches r1, then r2
    store.keep("x2", None, [])  # drops x1, the least recently used
    store.keep("x3", None, [])  # drops r1: r2 is kept, but its conversation is not whole
    with pytest.raises(InvalidRequestError, match="continues 'r1', which is not"):
        store.conversation("r2")
    small = ResponseStore(max_chars=10)
    small.keep("big", None, [{"role": "user", "content": "x" * 11}])
    with pytest.raises(InvalidRequestError) as caught:
        small.conversation("big")
    assert caught.value.param == "previous_response_id"


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=2048)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def events_of(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("extra", [{}, {"tools": [{"type": "function", "name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}], "tool_choice": "required"}])
def test_streamed_and_whole_responses_agree(client, extra):
    body = {"model": TINY, "input": "hi", "max_output_tokens": 12, "seed": 3, "temperature": 1.0, **extra}
    whole = client.post("/v1/responses", json=body).json()
    streamed = client.post("/v1/responses", json={**body, "stream": True})
    events = events_of(streamed.text)
    assert not streamed.text.rstrip().endswith("[DONE]")
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.incomplete" if whole["status"] == "incomplete" else "response.completed")
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(final["output"]) == strip(whole["output"]) and final["usage"] == whole["usage"]
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [item["type"] for item in whole["output"]]
    if extra:
        assert [item["type"] for item in whole["output"]] and all(i["type"] == "function_call" for i in whole["output"])
