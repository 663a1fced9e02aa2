"""Property-based fuzz of request bodies: whatever arrives, no 5xx, and every rejection carries a message."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api_helpers import TINY, build_server_parts

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
small_ints = st.integers(-3, 12)
token_ids = st.lists(st.integers(-2, 600), max_size=6)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot", ""]),
     "content": st.none() | st.text(max_size=20) | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2)}),
    max_size=3)

# Each field draws mostly plausible values, sometimes anything at all.
common_fields = {
    "model": st.sampled_from([TINY, "other-model", ""]) | json_values,
    "max_tokens": small_ints | json_values,
    "temperature": st.floats(-1, 3, allow_nan=True) | json_values,
    "top_p": st.floats(-0.5, 1.5, allow_nan=True) | json_values,
    "top_k": small_ints | json_values,
    "seed": st.integers(-5, 2**64) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stop_token_ids": token_ids | json_values,
    "ignore_eos": st.booleans() | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "logprobs": st.none() | st.booleans() | small_ints | json_values,
    "user": st.text(max_size=5) | json_values,
    "unknown_field": json_values,
}


def body_strategy(main_fields: dict) -> st.SearchStrategy[dict]:
    fields = {**common_fields, **main_fields}
    return st.fixed_dictionaries({}, optional=fields)


completion_bodies = body_strategy({"prompt": st.text(max_size=30) | token_ids | st.lists(token_ids, max_size=2)
                                   | st.lists(st.text(max_size=5), max_size=2) | json_values,
                                   "echo": st.booleans(), "best_of": small_ints})
chat_bodies = body_strategy({"messages": messages | json_values,
                             "max_completion_tokens": small_ints | json_values})


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=96)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def check_reply(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), response.text
        assert error["type"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text
    else:
        assert response.json()["choices"], response.text


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=completion_bodies)
def test_completion_bodies(client, body):
    check_reply(client.post("/v1/completions", json=body))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=chat_bodies)
def test_chat_bodies(client, body):
    check_reply(client.post("/v1/chat/completions", json=body))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_payloads(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check_reply(client.post(path, content=raw, headers={"content-type": "application/json"}))
