"""The official `openai` client, and LiteLLM/LangChain-style raw bodies, against a real `metronome serve` process
(random:tiny on CPU, 127.0.0.1) started with an API key and two served names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from api_helpers import TINY, ServerThread, build_engine, wait_until

from metronome.server.bench.processes import free_port

KEY = "sk-test-metronome"
NAMES = ["tiny-chat", "tiny-alias"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [str(Path(sys.executable).with_name("metronome")), "serve", "--model", TINY, "--device", "cpu",
           "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "4096", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", *NAMES, "--api-key", KEY, "--log-level", "info"]
    env = {k: v for k, v in os.environ.items() if k != "METRONOME_API_KEY"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url) or process.poll() is not None, timeout=180, what="metronome serve ready")
        assert process.poll() is None, log_path.read_text()
        yield url, log_path
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


# ------------------------------------------------------------------------------------------ names, keys, errors


def test_start_up_logs_say_what_was_loaded(served):
    log = served[1].read_text()
    assert "model random:tiny loaded in" in log and "float32 on cpu" in log
    assert ("KV cache 256 blocks x 16 tokens = 4096 tokens (float32); "
            "max concurrency 1.00 requests of 4096 tokens") in log
    assert "execution eager" in log and "API key required" in log


def test_every_name_answers_and_responses_carry_the_first(client):
    assert [m.id for m in client.models.list().data] == [*NAMES, TINY]
    assert client.models.retrieve(NAMES[1]).id == NAMES[1] and client.models.retrieve(TINY).id == TINY
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    for name in [*NAMES, TINY]:
        reply = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert reply.model == NAMES[0]


def test_the_api_key_guards_v1_but_not_probes_or_metrics(served):
    url = served[0]
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path
    anonymous = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        anonymous.models.list()
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["code"] == "invalid_api_key"
    missing = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    assert missing.status_code == 401 and "Missing API key" in missing.json()["error"]["message"]
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_unknown_model_is_openai_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)
    body = caught.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "model_not_found" and body["param"] == "model"


def test_tokenize_detokenize_version(served):
    url, headers = served[0], {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(url + "/tokenize", json={"prompt": "héllo", "return_token_strs": True}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] == 4096
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()["prompt"]
    assert text == "héllo"
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}, headers=headers).json()
    reply = openai.OpenAI(base_url=url + "/v1", api_key=KEY).chat.completions.create(
        model=NAMES[0], messages=CHAT, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    bad = httpx.post(url + "/detokenize", json={"tokens": [10**6]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    from metronome import __version__

    assert httpx.get(url + "/version").json() == {"version": __version__}


# ------------------------------------------------------------------------------------------ n, batches, logprobs


def test_n_choices_are_seeded_and_counted(client):
    kwargs = dict(model=NAMES[0], prompt="Once", max_tokens=6, n=3, seed=11, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # seeds seed, seed + 1, seed + 2
    assert first.usage.completion_tokens == 18 and first.usage.prompt_tokens == len("Once") + 1


def test_batched_prompts_times_n(client):
    reply = client.completions.create(model=NAMES[0], prompt=["ab", "cde"], n=2, max_tokens=3,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert reply.usage.prompt_tokens == 3 + 4 and reply.usage.completion_tokens == 12  # each prompt counted once
    ids = client.completions.create(model=NAMES[0], prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_completion_logprobs_and_echo(client):
    reply = client.completions.create(model=NAMES[0], prompt="The", max_tokens=5, logprobs=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # greedy: the chosen token is the most likely one, so its text is among the top ones
    assert all(len(top) <= 3 and token in top for top, token in zip(lp.top_logprobs, lp.tokens))
    assert lp.text_offset[0] == 0 and all(v <= 0 for v in lp.token_logprobs)
    echoed = client.completions.create(model=NAMES[0], prompt="The", max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "The" + reply.choices[0].text


def test_chat_logprobs_streamed_and_whole(client):
    kwargs = dict(model=NAMES[0], messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.bytes is not None for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4) for t in content)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_streamed_n_chat_with_usage(client):
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=3, n=2, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_penalties_and_bias_steer_greedy_output(client, served):
    kwargs = dict(model=NAMES[0], prompt="zz", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs).choices[0].text
    token = httpx.post(served[0] + "/tokenize", json={"prompt": "Q"}, headers={"Authorization": f"Bearer {KEY}"}
                       ).json()["tokens"][-1]
    biased = client.completions.create(logit_bias={str(token): 100}, **kwargs).choices[0].text
    assert biased == "Q" * 6 != plain
    penalised = client.completions.create(logit_bias={str(token): 100}, presence_penalty=2.0,
                                          **{**kwargs, "extra_body": {"ignore_eos": True, "repetition_penalty": 50.0}})
    assert penalised.choices[0].text.count("Q") < 6


# ------------------------------------------------------------------------------------------ structured output, tools


def test_response_format_json_schema(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=NAMES[0], messages=CHAT, max_tokens=120, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        value = json.loads(reply.choices[0].message.content)
        assert reply.choices[0].finish_reason == "stop" and set(value) == {"name", "age", "tags"}
        assert len(value["name"]) <= 10 and 0 <= value["age"] <= 120 and set(value["tags"]) <= {"a", "b"}


def test_response_format_json_object_streamed(client):
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=200, temperature=0,
                                                 response_format={"type": "json_object"}, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.startswith("{")
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)


def test_a_bad_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}})
    assert caught.value.body["param"] == "response_format"


def test_named_tool_choice_returns_a_call(client):
    reply = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in {"C", "F"}


def test_required_tool_choice_streamed(client):
    """One call without parallel calls; with them (OpenAI's default) one or more, the last maybe cut off."""
    kwargs = dict(model=NAMES[0], messages=[{"role": "user", "content": "1 + 2?"}], tools=[WEATHER, ADD],
                  tool_choice="required", max_tokens=100, stream=True, seed=5)
    chunks = list(client.chat.completions.create(parallel_tool_calls=False, **kwargs))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name in {"get_weather", "add"}
    json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kwargs))
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    finish = chunks[-1].choices[0].finish_reason
    assert [c.index for c in calls] == list(range(len(calls))) and calls and finish in {"tool_calls", "length"}
    assert all(c.function.name in {"get_weather", "add"} for c in calls)
    for call in calls if finish == "tool_calls" else calls[:-1]:
        json.loads(call.function.arguments)
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)


def test_a_tool_conversation_round_trips(client):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}]
    reply = client.chat.completions.create(model=NAMES[0], messages=messages, tools=[WEATHER], tool_choice="auto",
                                           max_tokens=5, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason in {"length", "tool_calls"}


# ------------------------------------------------------------------------------------------ clients with extra fields


def test_litellm_style_body_with_extra_fields(served):
    """Fields of newer API versions and of proxies are accepted and ignored (and logged once)."""
    body = {"model": NAMES[1], "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}],
            "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "metadata": {"trace": "t1"}, "store": False, "parallel_tool_calls": False, "service_tier": "auto",
            "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
            "litellm_session_id": "abc", "reasoning_effort": "low", "ignore_eos": True}
    with httpx.stream("POST", served[0] + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    token_chunks = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content") is not None
                    and e["choices"][0]["delta"].get("role") is None]
    assert [e["usage"]["completion_tokens"] for e in token_chunks] == [1, 2, 3]  # continuous usage
    assert events[-1]["usage"]["completion_tokens"] == 3
    log = served[1].read_text()
    assert "ignoring unknown field(s)" in log and "litellm_session_id" in log and "messages[0].cache_control" in log


def test_langchain_style_structured_output(client):
    """with_structured_output(method="json_schema") sends a strict json_schema and parallel_tool_calls."""
    reply = client.chat.completions.create(
        model=NAMES[0], messages=CHAT, max_tokens=120, parallel_tool_calls=False, n=2, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "strict": True, "schema": SCHEMA}})
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert set(json.loads(choice.message.content)) == {"name", "age", "tags"}


def test_strict_mode_keeps_the_400s():
    from metronome.contract.config import SchedulerConfig
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    metrics = ServerMetrics(TINY)
    engine = build_engine(observers=[metrics])
    app = create_app(engine, build_state(engine, metrics, TINY, SchedulerConfig()), strict_openai=True)
    with ServerThread(app) as server:
        strict = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            strict.completions.create(model=TINY, prompt="x", max_tokens=1, extra_body={"frobnicate": True})
        assert caught.value.body["param"] == "frobnicate" and "strict" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            strict.chat.completions.create(model=TINY, max_tokens=1, messages=[
                {"role": "user", "content": "x", "cache_control": {}}])
        assert caught.value.body["param"] == "messages[0].cache_control"
        assert strict.completions.create(model=TINY, prompt="x", max_tokens=1, n=2).choices[1].index == 1


def test_api_keys_from_flags_env_and_file(tmp_path):
    from metronome.server.api.auth import resolve_keys

    key_file = tmp_path / "keys"
    key_file.write_text("# keys\nk-file-1\n\nk-file-2\n")
    assert resolve_keys(["k-flag"], str(key_file), {"METRONOME_API_KEY": "k-env"}) == \
        ("k-flag", "k-env", "k-file-1", "k-file-2")
    assert resolve_keys(None, None, {}) == ()
    with pytest.raises(ValueError, match="--api-key-file"):
        resolve_keys(None, str(tmp_path / "missing"), {})
    with pytest.raises(ValueError, match="--api-key"):
        resolve_keys([" "], None, {})


def test_nulls_mean_defaults(client):
    """LangChain and LiteLLM send unset options as null."""
    reply = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=2, n=None, stream=None,
                                           temperature=None, top_p=None, presence_penalty=None, logprobs=None,
                                           frequency_penalty=None, logit_bias=None, seed=None, stop=None)
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    plain = client.completions.create(model=NAMES[0], prompt="x", max_tokens=2, echo=None, n=None, logprobs=None)
    assert len(plain.choices) == 1
