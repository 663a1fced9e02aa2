"""A plain token's SSE chunk comes from a template (responses.TextChunkTemplate): it must be the very bytes the
pydantic models give, for any text, either shaper and any choice index."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metronome.server.api.protocol import ChatChunkChoice, CompletionChoice, DeltaMessage, Usage
from metronome.server.api.responses import ChatShaper, CompletionShaper, Tally, TextChunkTemplate, sse
from metronome.server.engine.outputs import TokenEvent, TokenLogprobs


def event(text: str, logprobs: TokenLogprobs | None = None) -> TokenEvent:
    return TokenEvent("r", 7, text, 3, time.monotonic(), False, None, 10, 4, logprobs)


def through_models(shaper, index: int, text: str) -> str:
    if isinstance(shaper, CompletionShaper):
        return sse(shaper._chunk([CompletionChoice(index=index, text=text, logprobs=None, finish_reason=None)]))
    return sse(shaper._chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=None)]))


# Every code point but the surrogates, which a UTF-8 response could not carry either way.
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@pytest.mark.parametrize("shaper_class", [CompletionShaper, ChatShaper])
@given(text=texts, index=st.integers(0, 3))
def test_a_templated_chunk_is_the_models_chunk(shaper_class, text, index):
    shaper = shaper_class("model-\"name\"")
    [chunk] = shaper.event_chunks(index, event(text), Tally())
    assert chunk == through_models(shaper, index, text)
    assert json.loads(chunk.removeprefix("data: "))["choices"][0]["index"] == index


@pytest.mark.parametrize("shaper_class", [CompletionShaper, ChatShaper])
def test_chunks_with_logprobs_or_usage_still_come_from_the_models(shaper_class):
    shaper = shaper_class("m")
    [with_usage] = shaper.event_chunks(0, event("a"), Tally(), Usage.of(10, 4))
    assert json.loads(with_usage.removeprefix("data: "))["usage"]["completion_tokens"] == 4
    [with_logprobs] = shaper.event_chunks(0, event("a", TokenLogprobs(-0.5)), Tally())
    assert json.loads(with_logprobs.removeprefix("data: "))["choices"][0]["logprobs"] is not None


def test_a_template_needs_its_text_exactly_once():
    with pytest.raises(ValueError, match="exactly once"):
        TextChunkTemplate(lambda text: "data: {}\n\n")
    with pytest.raises(ValueError, match="exactly once"):
        TextChunkTemplate(lambda text: json.dumps([text, text]))
