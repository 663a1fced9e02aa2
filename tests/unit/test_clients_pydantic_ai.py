"""pydantic-ai against a real `metronome serve` with the default model: an agent whose structured output is a
tool (so every turn is a forced call), with a function tool and a retry, streamed too. Protocol behaviour only:
every turn's calls parse and fit their schemas, and each call and its result reach the next turn's prompt."""
from __future__ import annotations

from typing import Annotated

import pytest
from default_server import KEY, MODEL, Recorder, default_server, rendered_prompt, tool_call_text, tool_result_text
from pydantic import BaseModel, Field

pydantic_ai = pytest.importorskip("pydantic_ai")
from openai import AsyncOpenAI  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel  # noqa: E402
from pydantic_ai.providers.openai import OpenAIProvider  # noqa: E402


class Answer(BaseModel):
    total: int = Field(ge=0, le=999)


def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two small integers."""
    return a + b


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


def make_agent(served, recorder, model_class=OpenAIChatModel, tools=(), retry_once: bool = True):
    client = AsyncOpenAI(base_url=served.v1, api_key=KEY, max_retries=0, http_client=recorder.async_client())
    model = model_class(MODEL, provider=OpenAIProvider(openai_client=client))
    agent = pydantic_ai.Agent(model, output_type=Answer, tools=list(tools), retries=3,
                              model_settings={"temperature": 0, "max_tokens": 60})
    seen = {"validated": 0}

    @agent.output_validator
    def once_more(output: Answer) -> Answer:
        """The first answer is sent back, so that the run has a tool exchange (a retry is one)."""
        seen["validated"] += 1
        if retry_once and seen["validated"] == 1:
            raise pydantic_ai.ModelRetry("Check the total once more.")
        return output

    return agent


def check_history(served, body: dict, exchanges: int = 1) -> None:
    """Every assistant call in the conversation and every tool result are in the rendered prompt."""
    prompt = rendered_prompt(served, body)
    calls = [c for m in body["messages"] if m["role"] == "assistant" for c in m.get("tool_calls") or []]
    results = [m for m in body["messages"] if m["role"] == "tool"]
    assert len(calls) >= exchanges and len(results) == len(calls)
    for call in calls:
        assert tool_call_text(call["function"]["name"], call["function"]["arguments"]) in prompt
    for result in results:
        assert tool_result_text(result["content"]) in prompt


async def test_structured_output_with_a_retry(served, recorder):
    """The output is a tool (final_result): every turn is a forced call; the retry's message is its result."""
    result = await make_agent(served, recorder).run("Give a total between 1 and 10.")
    assert isinstance(result.output, Answer)
    bodies = recorder.sent("/chat/completions")
    assert len(bodies) == 2 and all(body["tool_choice"] == "required" for body in bodies)
    check_history(served, bodies[-1])


async def test_several_tool_exchanges(served, recorder):
    """A function tool next to the output tool: the model may call `add` again and again; three requests in,
    the run is stopped, and the last request carried every call so far and every result."""
    before = len(recorder.sent("/chat/completions"))
    agent = make_agent(served, recorder, tools=[add], retry_once=False)
    try:
        result = await agent.run("What is 2 plus 3?", usage_limits=pydantic_ai.UsageLimits(request_limit=3))
        assert isinstance(result.output, Answer)
    except pydantic_ai.UsageLimitExceeded:
        pass
    bodies = recorder.sent("/chat/completions")[before:]
    assert len(bodies) >= 2
    check_history(served, bodies[-1], exchanges=len(bodies) - 1)


async def test_streamed_run(served, recorder):
    before = len(recorder.sent("/chat/completions"))
    async with make_agent(served, recorder, retry_once=False).run_stream("Give a total.") as run:
        output = await run.get_output()
    assert isinstance(output, Answer)
    assert all(body.get("stream") for body in recorder.sent("/chat/completions")[before:])


async def test_responses_model(served, recorder):
    result = await make_agent(served, recorder, OpenAIResponsesModel).run("Give a total.")
    assert isinstance(result.output, Answer) and len(recorder.sent("/responses")) == 2
