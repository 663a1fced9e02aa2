"""openai-agents through its default model path (the Responses API, `client.responses.create`) against a real
`metronome serve` with the default model: an agent that calls a tool and answers in a structured output, the
same agent streamed, and a multi-turn run with several tool exchanges. Protocol behaviour only."""
from __future__ import annotations

from typing import Annotated

import pytest
from default_server import KEY, MODEL, Recorder, default_server, rendered_prompt, tool_call_text, tool_result_text
from pydantic import BaseModel, Field

agents = pytest.importorskip("agents")
from openai import AsyncOpenAI  # noqa: E402

CALLS: list[tuple[int, int]] = []


@agents.function_tool
def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two small integers."""
    CALLS.append((a, b))
    return a + b


class Answer(BaseModel):
    total: int = Field(ge=0, le=999)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def shared_recorder():
    return Recorder()


@pytest.fixture
def recorder(served, shared_recorder):
    """The agents' default client, new for each test's event loop (an async HTTP client is bound to one)."""
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=served.v1, api_key=KEY, max_retries=0,
                                                 http_client=shared_recorder.async_client()), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    return shared_recorder


def agent(**settings) -> agents.Agent:
    return agents.Agent(name="calculator", instructions="Use the add tool, then give the total.", model=MODEL,
                        tools=[add], output_type=Answer,
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=60, **settings))


def check_last_prompt(served, recorder) -> str:
    body = recorder.sent("/responses")[-1]
    calls = [item for item in body["input"] if item.get("type") == "function_call"]
    outputs = [item for item in body["input"] if item.get("type") == "function_call_output"]
    assert calls and len(calls) == len(outputs)
    prompt = rendered_prompt(served, body)
    for call, output in zip(calls, outputs):
        assert tool_call_text(call["name"], call["arguments"]) in prompt
        assert tool_result_text(output["output"]) in prompt
    return prompt


async def test_agent_calls_a_tool_then_answers(served, recorder):
    CALLS.clear()
    result = await agents.Runner.run(agent(tool_choice="required"), "What is 2 plus 3?", max_turns=4)
    assert isinstance(result.final_output, Answer) and len(CALLS) == 1
    assert all(path.endswith("/responses") for path, _ in recorder.bodies)  # the default path is Responses
    check_last_prompt(served, recorder)


async def test_streamed_run(served, recorder):
    CALLS.clear()
    run = agents.Runner.run_streamed(agent(tool_choice="required"), "What is 1 plus 1?", max_turns=4)
    kinds = [event.type async for event in run.stream_events()]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(run.final_output, Answer) and len(CALLS) == 1
    assert recorder.sent("/responses")[-1]["stream"] is True


async def test_several_tool_exchanges(served, recorder):
    """Without resetting tool_choice the agent must call a tool every turn; three calls in, it may answer."""
    CALLS.clear()
    forced = agents.Agent(name="calculator", instructions="Add numbers with the add tool.", model=MODEL,
                          tools=[add], reset_tool_choice=False, tool_use_behavior="run_llm_again",
                          model_settings=agents.ModelSettings(temperature=0, max_tokens=60, tool_choice="required",
                                                              parallel_tool_calls=False))
    with pytest.raises(agents.MaxTurnsExceeded):
        await agents.Runner.run(forced, "Add 1 and 2, then 3 and 4, then 5 and 6.", max_turns=3)
    assert len(CALLS) == 3
    prompt = check_last_prompt(served, recorder)
    assert prompt.count("<tool_response>\n") == 2  # the third call's result would go to a fourth turn
