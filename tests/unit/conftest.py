"""Unit-test fixtures shared across modules. `default_served` is one `metronome serve` with the default model,
started by the first client-library module that asks for it and kept for the session: five modules (OpenAI,
LiteLLM, LangChain, OpenAI Agents, PydanticAI) talk to the same server instead of each loading the model again.
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_served(tmp_path_factory):
    from default_server import default_server

    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served
