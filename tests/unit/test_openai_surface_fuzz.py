"""Property-based bodies for the newer OpenAI fields (tools, response_format, logit_bias, n, logprobs): whatever
arrives, no 5xx, and every rejection carries a message."""
from __future__ import annotations

import json

import pytest
from api_helpers import TINY, build_server_parts
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

scalars = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(-3, 3) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                              max_size=3),
                      max_leaves=8)


def mostly(valid, other):
    """The valid strategy 4 times in 5 (one_of would drop repeated branches, so draw the branch index)."""
    return st.integers(0, 4).flatmap(lambda i: valid if i else other)


schemas = st.one_of(
    values,
    st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "array", "nonsense"])},
                          optional={"properties": st.dictionaries(st.text(min_size=1, max_size=5),
                                                                  st.fixed_dictionaries({"type": st.sampled_from(
                                                                      ["string", "boolean", "integer", "x"])}),
                                                                  max_size=3),
                                    "required": st.lists(st.text(max_size=5), max_size=2),
                                    "maxLength": st.integers(-1, 5), "enum": st.lists(scalars, max_size=3)}))
tool = st.fixed_dictionaries({"type": st.sampled_from(["function", "function", "other"]),
                              "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "", "bad name"])},
                                                                optional={"parameters": schemas,
                                                                          "description": st.text(max_size=5)})})
fields = {
    "response_format": mostly(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"name": st.text(max_size=4), "schema": schemas,
                                                                     "strict": st.booleans()})}), values),
    "tools": mostly(st.lists(tool, max_size=3), values),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), values,
                             st.fixed_dictionaries({"type": st.just("function"),
                                                    "function": st.fixed_dictionaries({"name": st.sampled_from(
                                                        ["f", "g", "h"])})})),
    "logit_bias": mostly(st.dictionaries(st.sampled_from(["5", "70", "-1", "x", "99999999999"]),
                                         st.floats(-200, 200) | st.integers(-101, 101), max_size=3), values),
    "n": mostly(st.integers(1, 3), st.integers(-1, 0) | values),
    "logprobs": mostly(st.booleans(), st.integers(-1, 25) | values),
    "top_logprobs": mostly(st.integers(0, 20), st.integers(-1, 25) | values),
    "min_p": mostly(st.floats(0, 1), st.floats(-1, 2) | values),
    "repetition_penalty": mostly(st.floats(0.01, 3), st.floats(-1, 0.01) | values),
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 6),
}
bodies = st.fixed_dictionaries({"model": st.just(TINY), "messages": st.just([{"role": "user", "content": "hi"}])},
                               optional=fields)


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=2048)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies)
def test_newer_fields_never_5xx(client, body):
    response = client.post("/v1/chat/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"].strip() and error["type"] == "invalid_request_error", response.text
    elif body.get("stream"):
        assert response.text.endswith("data: [DONE]\n\n") and '"type":"server_error"' not in response.text
    else:
        assert response.json()["choices"], response.text
