"""Unit-test fixtures shared across modules. `default_served` is one `metronome serve` with the default model,
started by the first client-library module that asks for it and kept for the session: five modules (OpenAI,
LiteLLM, LangChain, OpenAI Agents, PydanticAI) talk to the same server instead of each loading the model again.
`one_thread` runs a module's torch math on one intra-op thread (`pytestmark = pytest.mark.usefixtures(...)`).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_served(tmp_path_factory):
    from default_server import default_server

    with default_server(tmp_path_factory.mktemp("serve")) as served:
        yield served


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine, OpenMP workers spin-waiting for a busy core make a
    2-thread matmul several times slower than a 1-thread one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
