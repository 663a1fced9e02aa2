"""A few hundred fuzzed agent-framework bodies (server/api/fuzz_bodies.py) in-process: tools, tool history, forced
calls, structured outputs and /v1/responses with JSON schemas at their edges. None may get a 5xx; every 4xx is
OpenAI-shaped; every 200 stream ends as its API ends one. The long soak is `metronome bench fuzz`."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from api_helpers import TINY, build_server_parts
from fastapi.testclient import TestClient

from metronome.server.api.fuzz_bodies import agent_body, stream_ended


@pytest.fixture(scope="module")
def client():
    _, _, app = build_server_parts(max_model_len=2048)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def test_agent_bodies_never_5xx(client):
    rng = random.Random(2027)
    statuses: Counter = Counter()
    for _ in range(300):
        path, body = agent_body(rng, TINY)
        response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[(path, response.status_code)] += 1
        assert response.status_code < 500, (path, json.dumps(body)[:600], response.text[:600])
        if response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"].strip() and error["type"] == "invalid_request_error", response.text
        elif body.get("stream"):
            assert stream_ended(path, response.text), response.text[-300:]
    # Both outcomes are exercised on every route: the cases are neither all refused nor all served.
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions"):
        assert statuses[(path, 200)] > 0 and statuses[(path, 400)] > 0, statuses
