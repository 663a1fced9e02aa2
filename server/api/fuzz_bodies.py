"""Fuzzed bodies of the kind agent frameworks send: tools, tool history, forced calls, structured outputs (OpenAI's
and vLLM's fields) and the Responses API, with JSON schemas at their edges.

`metronome bench fuzz` mixes these into its soak (server/bench/fuzz_soak.py) and tests/unit/test_api_fuzz_agents.py
runs a few hundred in-process. Every body is well-formed JSON; whatever it holds, the server must answer below
500. Schemas come from `edge_schema`: boolean schemas, `$ref` cycles, enums of mixed types and of thousands of
values, nesting hundreds deep, unsatisfiable and unimplemented keywords, formats and patterns that do not parse,
and random mutations of valid ones; they are placed wherever a schema goes (response_format, tool parameters,
guided_json, structured_outputs, text.format, Responses tools).
"""
from __future__ import annotations

import json
import random
from typing import Any

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1.5, 2**64, "", "x", "\ud800", [], {}, [None], {"a": 1}]
TYPES = ["object", "string", "integer", "number", "boolean", "array", "null", "nonsense"]


def nested(depth: int, leaf: Any = None) -> dict:
    schema: Any = {"type": "string"} if leaf is None else leaf
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def valid_schema(rng: random.Random) -> dict:
    return rng.choice([
        {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "b": {"enum": ["x", "y"]}}, "required": ["a"],
         "additionalProperties": False},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
         "additionalProperties": {"type": "integer"}},
        {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
        {"type": "object"},
        {},
    ])


def edge_schema(rng: random.Random) -> Any:
    """One schema, valid or not, from the edges of JSON Schema."""
    kind = rng.randrange(24)
    if kind == 0:
        return rng.choice([True, False])
    if kind == 1:
        return rng.choice([{"$ref": "#"}, {"type": "object", "properties": {"self": {"$ref": "#"}}},
                           {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                           {"definitions": {"n": {"type": "object",
                                                  "properties": {"next": {"$ref": "#/definitions/n"}}}},
                            "$ref": "#/definitions/n"}])
    if kind == 2:
        return {"enum": [1, "a", None, True, 2.5, {"k": [1]}, [1, "b"], False][: rng.randrange(0, 9)]}
    if kind == 3:
        return {"enum": [f"value-{i}" for i in range(rng.choice([100, 2000, 20000]))]}
    if kind == 4:
        return nested(rng.choice([8, 64, 200, 400]))
    if kind == 5:
        depth = rng.choice([50, 300])
        schema: Any = {"type": "integer"}
        for _ in range(depth):
            schema = {"type": "array", "items": schema}
        return schema
    if kind == 6:
        return rng.choice([{"type": "integer", "minimum": 5, "maximum": 1}, {"anyOf": []}, {"allOf": [
            {"type": "string"}, {"type": "integer"}]}, {"type": "string", "minLength": 3, "maxLength": 1},
            {"type": "object", "required": ["missing"], "properties": {}, "additionalProperties": False}])
    if kind == 7:
        return rng.choice([{"not": {"type": "string"}}, {"if": {"type": "string"}, "then": {"maxLength": 2}},
                           {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
                           {"type": "string", "contentEncoding": "base64"}])
    if kind == 8:
        return rng.choice([{"type": "string", "format": "email"}, {"type": "string", "format": "no-such-format"},
                           {"type": "string", "pattern": "(("}, {"type": "string", "pattern": "a{1000}{1000}"},
                           {"type": "string", "pattern": "^[a-z]{2,4}$"}])
    if kind == 9:
        return rng.choice([{"$ref": "http://127.0.0.1:9/x.json"}, {"$ref": "#/nope"}, {"$ref": 5},
                           {"$ref": "#/$defs/%25"}])
    if kind == 10:
        return {"type": rng.sample(TYPES, rng.randrange(0, 4))}
    if kind == 11:
        return {"type": rng.choice(TYPES), "properties": {"\ud800" if rng.random() < 0.2 else "é": {"type": "string"}}}
    if kind == 12:
        return {"const": rng.choice(ODD_VALUES[1:])}
    if kind == 13:
        return {"type": "number", "multipleOf": rng.choice([0, -1, 0.1, 1e-300])}
    if kind == 14:
        return {"type": "object", "properties": {"x": {"type": "array", "items": False}, "y": True, "z": False}}
    if kind == 15:
        return {"type": "object", "patternProperties": {rng.choice(["^a", "((", ".*"]): {"type": "string"}}}
    if kind == 16:
        return {"type": "string", "minLength": rng.choice([10**5, 10**9]), "maxLength": 10**9}
    if kind == 17:
        return {"type": "array", "minItems": rng.choice([-1, 10**6]), "items": {"type": "integer"}}
    if kind == 18:
        return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(rng.choice([50, 1500]))}}
    if kind == 19:
        return rng.choice(ODD_VALUES)
    if kind == 20:
        return {"$schema": "https://json-schema.org/draft/2020-12/schema", **valid_schema(rng)}
    return mutated(rng, valid_schema(rng))


def mutated(rng: random.Random, schema: dict) -> Any:
    """`schema` with one key somewhere set to an odd value."""
    node = schema
    while isinstance(node, dict) and node and rng.random() < 0.6:
        child = node[rng.choice(list(node))]
        if not isinstance(child, dict):
            break
        node = child
    if isinstance(node, dict):
        node[rng.choice(["type", "properties", "required", "items", "enum", "additionalProperties", "minimum",
                         "anyOf", "$ref", "format", "pattern"])] = rng.choice([*ODD_VALUES, {"type": "x"}])
    return schema


def tool(rng: random.Random, name: str) -> dict:
    function: dict[str, Any] = {"name": name, "description": rng.choice(["", "does things", "\ud800"])}
    roll = rng.random()
    if roll < 0.5:
        function["parameters"] = valid_schema(rng)
    elif roll < 0.9:
        function["parameters"] = edge_schema(rng)
    if rng.random() < 0.3:
        function["strict"] = rng.choice([True, False, None])
    return {"type": rng.choice(["function"] * 9 + ["code_interpreter"]), "function": function}


def tool_history(rng: random.Random, names: list[str]) -> list[dict]:
    """An earlier turn: the assistant's calls and the tools' results, sometimes malformed."""
    call_id = rng.choice(["call_1", "", "x" * 300])
    arguments = rng.choice(['{"city": "Oslo"}', "not json", "", "{}", json.dumps({"a": [1] * 5})])
    assistant: dict[str, Any] = {"role": "assistant", "content": rng.choice([None, "", "Let me check."]),
                                 "tool_calls": [{"id": call_id, "type": "function",
                                                 "function": {"name": rng.choice(names + ["unknown"]),
                                                              "arguments": arguments}}]}
    if rng.random() < 0.1:
        assistant["tool_calls"] = rng.choice(ODD_VALUES)
    result = {"role": "tool", "tool_call_id": call_id, "content": rng.choice(["18C", "", [{"type": "text", "text":
                                                                                          "ok"}]])}
    if rng.random() < 0.1:
        result["content"] = rng.choice(ODD_VALUES)
    return [assistant, result]


def content(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.7:
        return rng.choice(["What is the weather?", "hi", "Add 2 and 3."])
    if roll < 0.85:
        return [{"type": "text", "text": "look"}, {"type": rng.choice(["image_url", "input_audio", "file", "video"]),
                                                    "image_url": {"url": "data:,"}}]
    return rng.choice(ODD_VALUES)


def tool_choice(rng: random.Random, names: list[str]) -> Any:
    return rng.choice(["auto", "none", "required", "required", {"type": "function", "function": {"name": names[0]}},
                       {"type": "function", "function": {"name": "missing"}}, {"type": "function"}, *ODD_VALUES[:4]])


def structured_fields(rng: random.Random) -> dict:
    """One or two of the structured-output fields (two conflict: a 400)."""
    options = [
        lambda: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": edge_schema(rng),
                                                                            "strict": rng.choice([True, False])}}},
        lambda: {"response_format": {"type": rng.choice(["json_object", "text", "structural_tag", "xml"])}},
        lambda: {"guided_json": rng.choice([edge_schema(rng), json.dumps(valid_schema(rng)), "{not json"])},
        lambda: {"guided_choice": rng.choice([["yes", "no"], [], ["", "a"], ["a\"b", "é"], [1, 2], "yes"])},
        lambda: {"guided_regex": rng.choice(["[0-9]{2}", "((", "", "a*", "\\p{L}+"])},
        lambda: {"guided_grammar": rng.choice(['root ::= "a" | "b"', 'start: "x"+', "root ::= ", "start:", "%%%"])},
        lambda: {"structured_outputs": rng.choice([{"json": edge_schema(rng)}, {"choice": ["a", "b"]},
                                                   {"regex": "[ab]"}, {"grammar": 'start: "z"'},
                                                   {"json_object": True}, {"structural_tag": {}},
                                                   {"json": valid_schema(rng), "regex": "a"},
                                                   {"json": valid_schema(rng), "disable_additional_properties": True},
                                                   {}])},
        lambda: {"chat_template_kwargs": rng.choice([{"enable_thinking": False}, {"tokenize": True},
                                                     {"messages": []}, {"1bad": 1}, {"x": edge_schema(rng)}])},
    ]
    body: dict = {}
    for _ in range(rng.choice([1, 1, 1, 2])):
        body.update(rng.choice(options)())
    return body


def chat_body(rng: random.Random, model: str | None) -> dict:
    names = ["get_weather", "add", "f.g-h"][: rng.randrange(1, 4)]
    messages: list[dict] = [{"role": "user", "content": content(rng)}]
    if rng.random() < 0.4:
        messages += tool_history(rng, names)
    body: dict[str, Any] = {"messages": messages, "max_tokens": rng.randrange(1, 12), "stream": rng.random() < 0.4}
    if rng.random() < 0.7:
        body["tools"] = [tool(rng, name) for name in names]
        body["tool_choice"] = tool_choice(rng, names)
        if rng.random() < 0.5:
            body["parallel_tool_calls"] = rng.choice([True, False, None])
    if rng.random() < 0.5:
        body.update(structured_fields(rng))
    if model is not None:
        body["model"] = model
    return body


def completion_body(rng: random.Random, model: str | None) -> dict:
    body = {"prompt": rng.choice(["Hello", "JSON:", [5, 6, 7]]), "max_tokens": rng.randrange(1, 12),
            "stream": rng.random() < 0.4, **structured_fields(rng)}
    body.pop("chat_template_kwargs", None)
    if model is not None:
        body["model"] = model
    return body


def responses_tool(rng: random.Random, name: str) -> Any:
    roll = rng.random()
    if roll < 0.8:
        return {"type": "function", "name": name, "parameters": rng.choice([valid_schema(rng), edge_schema(rng)]),
                "strict": rng.choice([True, False])}
    if roll < 0.9:
        return {"type": rng.choice(["web_search_preview", "file_search", "mcp", "custom"])}
    return rng.choice(ODD_VALUES)


def responses_item(rng: random.Random) -> Any:
    return rng.choice([
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "message", "role": rng.choice(["user", "assistant", "system", "developer", "robot"]),
         "content": [{"type": rng.choice(["input_text", "output_text", "input_image", "refusal"]), "text": "x"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": 5, "name": None},
        {"type": "function_call_output", "call_id": "call_1", "output": rng.choice(["18C", [{"type": "input_text",
                                                                                             "text": "ok"}], 7])},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": rng.choice(["item_reference", "web_search_call", "computer_call"]), "id": "x"},
        *ODD_VALUES[:6],
    ])


def responses_body(rng: random.Random, model: str | None) -> dict:
    names = ["get_weather", "add"]
    body: dict[str, Any] = {"input": rng.choice(["hi", [responses_item(rng) for _ in range(rng.randrange(0, 5))]]),
                            "max_output_tokens": rng.randrange(1, 12), "stream": rng.random() < 0.4}
    if rng.random() < 0.6:
        body["tools"] = [responses_tool(rng, name) for name in names]
        body["tool_choice"] = rng.choice(["auto", "required", "none", {"type": "function", "name": "add"},
                                          {"type": "allowed_tools", "mode": "required",
                                           "tools": [{"type": "function", "name": "add"}]},
                                          {"type": "web_search_preview"}, {"type": "function"}])
    if rng.random() < 0.4:
        body["text"] = {"format": rng.choice([{"type": "json_schema", "name": "x", "schema": edge_schema(rng)},
                                              {"type": "json_object"}, {"type": "text"}, {"type": "yaml"},
                                              {"type": "json_schema"}, None])}
    if rng.random() < 0.3:
        body.update(rng.choice([{"instructions": "Be brief."}, {"previous_response_id": "resp_unknown"},
                                {"background": True}, {"store": False}, {"reasoning": {"effort": "low"}},
                                {"include": ["reasoning.encrypted_content"]}, {"truncation": "auto"},
                                {"prompt": {"id": "p"}}, {"conversation": "c"}, {"top_logprobs": 2}]))
    if model is not None:
        body["model"] = model
    return body


def agent_body(rng: random.Random, model: str | None) -> tuple[str, dict]:
    """(route, body): a fuzzed agent-framework request."""
    roll = rng.random()
    if roll < 0.5:
        return "/v1/chat/completions", chat_body(rng, model)
    if roll < 0.8:
        return "/v1/responses", responses_body(rng, model)
    return "/v1/completions", completion_body(rng, model)


RESPONSES_TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def stream_ended(path: str, text: str) -> bool:
    """Whether a 200 event stream of `path` ended as its API ends one: `data: [DONE]` for chat and completions,
    a terminal `response.*` event for /v1/responses."""
    if path != "/v1/responses":
        return text.endswith("data: [DONE]\n\n")
    events = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
    return bool(events) and events[-1] in RESPONSES_TERMINAL
