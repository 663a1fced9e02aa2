"""Bad input is a 4xx naming the field, never a 5xx; large bodies are refused as they stream in; prompts are
tokenized off the event loop after a size check."""
from __future__ import annotations

import json
import socket
import threading

import pytest
from api_helpers import TINY, ServerThread, build_engine, metric, scrape
from fastapi.testclient import TestClient


def make_app(max_body_bytes: int = 4096, tokenizer_workers: int = 1, max_model_len: int = 256):
    from metronome.contract.config import SchedulerConfig
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    metrics = ServerMetrics(TINY)
    engine = build_engine(observers=[metrics], max_model_len=max_model_len)
    state = build_state(engine, metrics, TINY, SchedulerConfig())
    return engine, create_app(engine, state, max_body_bytes=max_body_bytes, tokenizer_workers=tokenizer_workers)


@pytest.fixture(scope="module")
def parts():
    engine, app = make_app()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield engine, client


@pytest.fixture(scope="module")
def client(parts):
    return parts[1]


def post(client, path: str, raw: str):
    return client.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/completions", '{"prompt": "a", "stop": ["\\ud83d"], "max_tokens": 2}', "stop[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages[0].content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
])
def test_lone_surrogates_are_400_naming_the_field(client, path, raw, param):
    error = error_of(post(client, path, raw), 400)
    assert error["param"] == param
    assert "lone surrogate" in error["message"] and error["type"] == "invalid_request_error"


def test_an_unknown_field_named_with_a_surrogate_is_still_a_400(client):
    error = error_of(post(client, "/v1/completions", '{"prompt": "a", "\\ud800": 1}'), 400)
    assert error["message"].strip() and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt, where", [
    ([True, False], "prompt[0]"), ([5, True], "prompt[1]"), ([5, 1.0], "prompt[1]"),
    ([[5, 6], [7, False]], "prompt[1][1]"),
    ([5, -1], "prompt[1]"), ([5, 2**40], "prompt[1]"),
])
def test_token_id_prompts_must_be_plain_integers(client, prompt, where):
    error = error_of(post(client, "/v1/completions", json.dumps({"prompt": prompt})), 400)
    assert error["param"] == "prompt" and where in error["message"]


def test_token_ids_outside_the_vocabulary_are_400(client, parts):
    engine, _ = parts
    vocab = engine.core.vocab_size
    error = error_of(post(client, "/v1/completions", json.dumps({"prompt": [5, vocab]})), 400)
    assert error["param"] == "prompt" and str(vocab) in error["message"]


def test_stop_token_ids_must_be_integers(client):
    error = error_of(post(client, "/v1/completions", json.dumps({"prompt": "a", "stop_token_ids": [False]})), 400)
    assert error["param"] == "stop_token_ids"


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_non_finite_numbers_say_so(client, field, value):
    error = error_of(post(client, "/v1/completions", f'{{"prompt": "a", "{field}": {value}}}'), 400)
    assert error["param"] == field and "finite" in error["message"]


def test_a_body_over_the_limit_is_413_with_an_openai_error(client):
    response = client.post("/v1/completions", content=b"{" + b" " * 5000 + b"}",
                           headers={"content-type": "application/json"})
    error = error_of(response, 413)
    assert error["code"] == "request_too_large" and "4096" in error["message"]
    assert response.headers["connection"] == "close"


def test_a_chunked_body_is_refused_once_it_passes_the_limit(client):
    sent = []

    def chunks():
        for _ in range(1000):  # 1000 x 1 KiB: far more than the 4 KiB limit
            sent.append(1)
            yield b" " * 1024

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert error_of(response, 413)["code"] == "request_too_large"


def test_a_body_within_the_limit_still_reaches_the_route(client):
    reply = post(client, "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 2, "ignore_eos": True}))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(parts, monkeypatch):
    engine, client = parts
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or [])
    # random:tiny's byte tokenizer: one character is at least one token, and the context is 256
    error = error_of(post(client, "/v1/completions", json.dumps({"prompt": "x" * 300})), 400)
    assert error["param"] == "prompt" and "300 characters" in error["message"]
    error = error_of(post(client, "/v1/chat/completions",
                          json.dumps({"messages": [{"role": "user", "content": "y" * 300}]})), 400)
    assert error["param"] == "messages"
    assert calls == []


def test_prompts_are_tokenized_on_a_worker_thread(parts, monkeypatch):
    engine, client = parts
    threads = []
    real_encode = engine.tokenizer.encode

    def recording_encode(text, add_special_tokens=True):
        threads.append(threading.current_thread().name)
        return real_encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", recording_encode)
    for raw in ('{"prompt": "abc", "max_tokens": 1}',
                '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'):
        path = "/v1/completions" if "prompt" in raw else "/v1/chat/completions"
        assert post(client, path, raw).status_code == 200
    assert len(threads) == 2 and all(name.startswith("metronome-tokenize") for name in threads), threads


def test_a_large_declared_body_is_refused_without_being_sent():
    """Over a real socket: a 64 MiB Content-Length gets its 413 after the headers alone (the test sends 1 KiB
    of the body and then waits), and counts as too_large."""
    _, app = make_app(max_body_bytes=1 << 20)
    with ServerThread(app) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                         + f"content-length: {64 << 20}\r\n\r\n".encode() + b"{" + b" " * 1023)
            reply = b""
            while b"\r\n\r\n" not in reply:
                data = sock.recv(65536)
                assert data, f"connection closed without a response: {reply!r}"
                reply += data
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert metric(scrape(server.url), "metronome_requests_rejected_total", reason="too_large") >= 1
