"""Forced tool calls: the grammar's schema (closed objects), and calls read back whole or cut off by max_tokens."""
from __future__ import annotations

import json

from metronome.server.api.forced_calls import ForcedCall
from metronome.server.api.json_schemas import closed_objects, copy_json

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "where": {"type": "object", "properties": {
        "lat": {"type": "number"}}}}, "required": ["city"]}}}
GET_TIME = {"type": "function", "function": {"name": "get_time"}}
OPEN = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": {"type": "string"}}}}
TOOLS = [WEATHER, GET_TIME, OPEN]


def named(calls):
    return [(c.name, c.arguments) for c in calls]


def test_unset_additional_properties_is_false_at_every_level():
    schema = closed_objects(WEATHER["function"]["parameters"])
    assert schema["additionalProperties"] is False
    assert schema["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["city"]  # a string schema is no object
    assert WEATHER["function"]["parameters"].get("additionalProperties") is None  # the tool is not edited
    assert closed_objects(OPEN["function"]["parameters"])["additionalProperties"] == {"type": "string"}


def test_closing_walks_combinators_but_leaves_all_of_members_open():
    schema = {"anyOf": [{"type": "object", "properties": {"a": {}}}], "$defs": {"d": {"properties": {"x": {}}}},
              "allOf": [{"type": "object", "properties": {"b": {"type": "object"}}}],
              "items": {"type": "object"}, "unevaluatedProperties": False}
    closed = closed_objects(schema)
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert closed["allOf"][0]["properties"]["b"]["additionalProperties"] is False
    assert closed["items"]["additionalProperties"] is False and "additionalProperties" not in closed
    assert closed_objects(True) is True


def test_deep_schemas_are_walked_without_recursion():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    closed = closed_objects(deep)
    node = closed
    for _ in range(5000):
        assert node["additionalProperties"] is False
        node = node["properties"]["a"]
    assert node == {"type": "string"} and copy_json([[1], {"a": [2]}]) == [[1], {"a": [2]}]


def test_schema_shapes():
    assert ForcedCall(TOOLS, "get_time").schema() == {"type": "object", "properties": {},
                                                      "additionalProperties": False}
    one = ForcedCall(TOOLS, None, parallel=False).schema()
    assert [s["properties"]["name"]["const"] for s in one["anyOf"]] == ["get_weather", "get_time", "tag"]
    many = ForcedCall([WEATHER], None).schema()
    assert many["type"] == "array" and many["minItems"] == 1 and many["items"]["properties"]["name"] == {
        "const": "get_weather"}
    assert many["items"]["properties"]["arguments"]["additionalProperties"] is False


def test_complete_outputs():
    assert named(ForcedCall(TOOLS, "get_weather").calls('{"city":"Oslo"}')) == [("get_weather", '{"city": "Oslo"}')]
    one = ForcedCall(TOOLS, None, parallel=False).calls('{"name":"get_time","arguments":{}}')
    assert named(one) == [("get_time", "{}")]
    many = ForcedCall(TOOLS, None).calls('[{"name":"get_time","arguments":{}},{"name":"tag","arguments":{"k":"v"}}]')
    assert named(many) == [("get_time", "{}"), ("tag", '{"k": "v"}')]
    assert all(c.id.startswith("call_") for c in many) and many[0].id != many[1].id


def test_cut_off_outputs_are_still_calls():
    assert named(ForcedCall(TOOLS, "get_weather").calls('{"city":"Os')) == [("get_weather", '{"city":"Os')]
    one = ForcedCall(TOOLS, None, parallel=False)
    assert named(one.calls('{"name":"get_weather","arguments":{"city":"Os')) == [("get_weather", '{"city":"Os')]
    assert named(one.calls('{"name":"get_weather","argu')) == [("get_weather", "")]
    assert named(one.calls('{"name":"get_ti')) == [("get_time", "")]  # the name completed from the tools
    assert named(one.calls('{"na')) == [("get_weather", "")]
    many = ForcedCall(TOOLS, None)
    assert named(many.calls('[{"name":"get_time","arguments":{}},{"name":"tag","arguments":{"k":')) == [
        ("get_time", "{}"), ("tag", '{"k":')]
    assert named(many.calls("[")) == [("get_weather", "")]
    for text in ("", "[{", '[{"name":"tag"', '[{"name":"tag",'):
        (call,) = many.calls(text)
        assert call.name in {"get_weather", "tag"} and json.dumps(call.arguments)
