"""What agent frameworks send, in-process on random:tiny: edge JSON schemas, forced calls that follow closed tool
schemas, vLLM's fields under --strict-openai, text-only content, and a 500 that leaves the connection usable."""
from __future__ import annotations

import json

import httpx
import pytest
from api_helpers import TINY, ServerThread, build_engine, build_server_parts
from fastapi.testclient import TestClient

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=2048)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT, "max_tokens": 40, **body})


def schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_boolean_schemas(client):
    assert chat(client, **schema_format(True)).status_code == 200
    refused = chat(client, **schema_format(False))
    assert refused.status_code == 400 and "`false`" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"enum": [1, "a", None, True, {"k": [1]}, [1, 2]]},
    {"enum": [f"v{i}" for i in range(20000)]},
    {"type": "object", "properties": {"x": True, "y": False}},
])
def test_edge_schemas_are_applied_or_refused_never_a_5xx(client, schema):
    reply = chat(client, seed=1, temperature=1.0, **schema_format(schema))
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        assert reply.json()["error"]["param"] == "response_format" and reply.json()["error"]["message"]


def test_a_mixed_enum_is_applied(client):
    values = [1, "a", None, True, {"k": [1]}]
    for seed in range(4):
        reply = chat(client, seed=seed, temperature=1.0, **schema_format({"enum": values}))
        assert json.loads(reply.json()["choices"][0]["message"]["content"]) in values


def test_too_deep_is_a_400(client):
    for body in (schema_format(deep(300)), {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": deep(300)}}], "tool_choice": "required"}):
        reply = chat(client, **body)
        assert reply.status_code == 400 and "recursion" in reply.json()["error"]["message"], reply.text
    for depth in (900, 3000, 50_000):  # past Python's recursion limit somewhere between reading and checking
        nested = "[" * depth + "]" * depth
        reply = client.post("/v1/chat/completions", content=f'{{"model": "{TINY}", "messages": {json.dumps(CHAT)}, '
                            f'"max_tokens": 1, "metadata": {nested}}}', headers={"content-type": "application/json"})
        assert reply.status_code in (200, 400), reply.text


def test_forced_calls_take_no_keys_the_schema_does_not_list(client):
    """Unset additionalProperties is false for a forced call: random weights would otherwise add keys."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "where": {"type": "object", "properties": {"lat": {"type": "integer"}}}},
        "required": ["city"]}}}
    complete = 0
    for seed in range(8):
        reply = chat(client, tools=[tool], tool_choice="required", parallel_tool_calls=False, seed=seed,
                     temperature=1.0, max_tokens=60).json()
        choice = reply["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None and call["function"]["name"] == "get_weather"
        if choice["finish_reason"] == "tool_calls":
            complete += 1
            arguments = json.loads(call["function"]["arguments"])
            assert set(arguments) <= {"city", "where"} and "city" in arguments
            assert set(arguments.get("where", {})) <= {"lat"}
        else:
            assert choice["finish_reason"] == "length"
    assert complete > 0


def test_a_cut_off_forced_call_is_still_a_call(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    for stream in (False, True):
        reply = chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}},
                     max_tokens=4, stream=stream)
        if stream:
            events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
            calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
            finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
            assert not any(e["choices"][0]["delta"].get("content") for e in events)
        else:
            message = reply.json()["choices"][0]["message"]
            calls, finish = message["tool_calls"], [reply.json()["choices"][0]["finish_reason"]]
            assert message["content"] is None
        assert finish == ["length"] and [c["function"]["name"] for c in calls] == ["f"]
        assert calls[0]["function"]["arguments"].startswith('{"')


def test_forced_call_wins_over_response_format(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    reply = chat(client, tools=[tool], tool_choice="required", **schema_format({"type": "object"})).json()
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


@pytest.mark.parametrize("body, param", [
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
])
def test_vllm_field_mistakes_are_400s_naming_the_field(client, body, param):
    reply = chat(client, **body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_vllm_fields_apply_on_completions(client):
    reply = client.post("/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 8,
                                                 "guided_choice": ["left", "right"]})
    assert reply.json()["choices"][0]["text"] in {"left", "right"}


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "f"}}])
def test_non_text_parts_are_one_short_400(client, part):
    reply = chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, part]}])
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "messages[0].content[1]"
    assert error["message"] == (f"messages[0].content[1] is a part of type {part['type']!r}, but this model takes "
                                "text only")


def test_strict_openai_refuses_vllm_fields_by_name():
    from metronome.contract.config import SchedulerConfig
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    metrics = ServerMetrics(TINY)
    engine = build_engine(observers=[metrics])
    app = create_app(engine, build_state(engine, metrics, TINY, SchedulerConfig()), strict_openai=True)
    with TestClient(app) as strict:
        for field, value in [("guided_json", {}), ("guided_choice", ["a"]), ("structured_outputs", {"regex": "a"}),
                             ("chat_template_kwargs", {"enable_thinking": False})]:
            reply = strict.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT, "max_tokens": 1,
                                                              field: value})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == field
            assert "--strict-openai" in reply.json()["error"]["message"]
        assert strict.post("/v1/chat/completions", json={"model": TINY, "messages": CHAT, "max_tokens": 1}).is_success


def test_a_500_keeps_the_connection_usable():
    """An unexpected error is a whole 500 response; the client's pooled connection carries the next request."""
    _, _, app = build_server_parts()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    with ServerThread(app) as server, httpx.Client(limits=httpx.Limits(max_connections=1)) as pooled:
        failed = pooled.get(server.url + "/boom")
        first = failed.extensions["network_stream"].get_extra_info("client_addr")
        assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error: RuntimeError: a bug"
        assert failed.headers.get("connection") != "close"
        served = pooled.post(server.url + "/v1/completions", json={"model": TINY, "prompt": "x", "max_tokens": 1})
        assert served.status_code == 200
        assert served.extensions["network_stream"].get_extra_info("client_addr") == first  # the same connection
