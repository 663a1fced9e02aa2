"""Property-based fuzz of request bodies and routes: whatever arrives, no 5xx, and every rejection carries an
OpenAI-style error. Small and fast; the long soak is `metronome bench fuzz` (docs/perf/isolation.md)."""
from __future__ import annotations

import json

import pytest
from api_helpers import TINY, build_server_parts
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True)
                | st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


# Text JSON can carry but UTF-8 cannot encode: lone surrogate escapes ("\ud800").
surrogate_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4),
                           st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]), st.text(max_size=4))


def mostly(valid, *edges):
    """Usually a valid value, sometimes an edge case, sometimes any JSON at all."""
    # one_of() drops duplicate branches, so weight by drawing the branch index ourselves.
    branches = [valid] * 8 + list(edges) + [json_values]
    return st.integers(0, len(branches) - 1).flatmap(lambda i: branches[i])


token_ids = st.lists(st.integers(3, 500), min_size=1, max_size=6)
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "system", "assistant", "developer"]),
                    st.sampled_from(["tool", "robot", ""])),
     "content": mostly(st.text(max_size=20), st.none(), surrogate_text,
                       st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                       "text": st.text(max_size=10)}), max_size=2))})

# Optional fields: each present or not; when present usually valid, so that many bodies reach the engine.
common_fields = {
    "model": mostly(st.sampled_from([TINY, TINY, "other-model"])),
    "max_tokens": mostly(st.integers(1, 12), st.integers(-3, 0), st.integers(40, 10**6)),
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 3), st.sampled_from([float("nan"), 1e-300, 5e-324])),
    "top_p": mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5), st.just(float("inf"))),
    "top_k": mostly(st.integers(0, 50), st.integers(-3, -1)),
    "seed": mostly(st.integers(0, 2**32), st.integers(-5, -1), st.integers(2**63, 2**64)),
    "stop": mostly(st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
                   st.just(""), st.lists(st.text(max_size=1), min_size=17, max_size=20), surrogate_text,
                   st.lists(surrogate_text, min_size=1, max_size=2)),
    "stop_token_ids": mostly(token_ids, st.lists(st.integers(-2, 10**6), max_size=3),
                             st.lists(st.booleans(), min_size=1, max_size=2)),
    "ignore_eos": mostly(st.booleans()),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()}), st.none()),
    "n": mostly(st.just(1), st.integers(-1, 3)),
    "logprobs": mostly(st.none(), st.booleans(), st.integers(-3, 5)),
    "user": mostly(st.text(max_size=5), surrogate_text),
    "presence_penalty": mostly(st.just(0.0), st.floats(-2, 2)),
}
completion_fields = {"echo": mostly(st.just(False), st.just(True)), "best_of": mostly(st.just(1), st.integers(-3, 5)),
                     "suffix": mostly(st.none(), st.text(max_size=3))}
chat_fields = {"max_completion_tokens": mostly(st.integers(1, 12), st.integers(-3, 0))}
prompt = mostly(st.text(min_size=1, max_size=30) | token_ids, st.just(""), st.just([]),
                st.lists(token_ids, max_size=2), st.lists(st.text(max_size=5), max_size=2),
                st.lists(st.integers(-2, 10**7), max_size=4), surrogate_text, st.lists(surrogate_text, max_size=2),
                st.lists(st.booleans(), min_size=1, max_size=3), st.lists(st.floats(), min_size=1, max_size=3),
                st.lists(st.integers(2**31, 2**70), min_size=1, max_size=2))


def body_strategy(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    body = st.fixed_dictionaries(required, optional={**common_fields, **optional})
    return mostly(body, st.dictionaries(st.text(max_size=8), json_values, max_size=4))


completion_bodies = body_strategy({"prompt": prompt}, completion_fields)
chat_bodies = body_strategy({"messages": mostly(st.lists(message, min_size=1, max_size=3), st.just([]))},
                            chat_fields)


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=96)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def check_reply(response) -> None:
    event(f"status {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"].strip(), response.text
        assert error["type"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text
    else:
        assert response.json()["choices"], response.text


def post_json(client, path: str, body: dict):
    # json.dumps writes NaN/Infinity as Python's json.loads (and so the server) reads them back
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=completion_bodies)
def test_completion_bodies(client, body):
    check_reply(post_json(client, "/v1/completions", body))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=chat_bodies)
def test_chat_bodies(client, body):
    check_reply(post_json(client, "/v1/chat/completions", body))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_payloads(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check_reply(client.post(path, content=raw, headers={"content-type": "application/json"}))


ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics", "/v1/config",
          "/docs", "/openapi.json", "/nope", "/v1/completions/extra", "/%ff"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.sampled_from(ROUTES),
       raw=st.none() | st.binary(max_size=20) | json_values.map(lambda v: json.dumps(v).encode()))
def test_every_route_and_method(client, method, path, raw):
    response = client.request(method, path, content=raw, headers={"content-type": "application/json"})
    event(f"{method} {path} {response.status_code}")
    assert response.status_code < 500, response.text
    if response.status_code >= 400 and method != "HEAD":
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"].strip() and error["type"], response.text
