"""The official `openai` client against a real uvicorn server: completions and chat, streaming and not."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from api_helpers import TINY, ServerThread, build_server_parts


@pytest.fixture(scope="module")
def server():
    engine, _, app = build_server_parts()
    with ServerThread(app) as running:
        running.tokenizer = engine.tokenizer
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completion_returns_text_and_usage(client, server):
    prompt = "The quick brown fox"
    reply = client.completions.create(model=TINY, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.model == TINY
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    assert reply.usage.completion_tokens == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_token_id_prompt_counts_exactly(client):
    reply = client.completions.create(model=TINY, prompt=[5, 6, 7, 8, 9], max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 3


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=TINY, prompt="Once upon a time", max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_truncates_and_reports_stop(client):
    kwargs = dict(model=TINY, prompt="abc", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = next((full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop, f"greedy output too short to pick a stop string from: {full!r}"
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[:full.index(stop)]


def test_chat_whole_and_streamed(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    whole = client.chat.completions.create(model=TINY, messages=messages, max_completion_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 10

    stream = client.chat.completions.create(model=TINY, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing_ends_with_done(server):
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["usage"] == {"prompt_tokens": payloads[-1]["usage"]["prompt_tokens"],
                                     "completion_tokens": 5,
                                     "total_tokens": payloads[-1]["usage"]["prompt_tokens"] + 5}
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert len({p["id"] for p in payloads}) == 1


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [TINY]


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt=["one", ""]), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(max_tokens=100_000), None),  # longer than the context: the engine's check
    (dict(prompt=[10**7]), None),  # token id outside the vocabulary
    (dict(extra_body={"best_of": 3}), "best_of"),
])
def test_bad_requests_are_400_with_a_message(client, kwargs, param):
    request = dict(model=TINY, prompt="hello", max_tokens=4)
    request.update(kwargs)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param and param in error["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in caught.value.body["message"]


def test_health_ready_and_config(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    config = httpx.get(server.url + "/v1/config").json()
    assert config["generation"] == 0 and config["config_file"] is None and config["last_reload_error"] is None
    assert config["scheduler"]["chunk_size"] == config["engine_scheduler"]["chunk_size"]


def test_vanishing_temperature_is_greedy(client):
    kwargs = dict(model=TINY, prompt="same every time", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    assert client.completions.create(temperature=1e-300, **kwargs).choices[0].text == greedy
