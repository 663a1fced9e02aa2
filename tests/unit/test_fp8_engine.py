"""An FP8 model through the engine on the CPU: per-token activation scales make a token's output independent of
the batch it is computed in, so the greedy output is the same at any chunk size and concurrent or alone; the
start-up summary says how the weights are stored."""
from __future__ import annotations

import random

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40, 17, 63)]


def _generate(chunk: int, prompts: list[list[int]], together: bool = True) -> list[list[int]]:
    engine = EngineCore.from_config(
        EngineConfig(model="random:tiny", device="cpu", dtype="float32", attention_backend="torch", seed=8,
                     num_kv_blocks=128, quantization="fp8"),
        SchedulerConfig(chunk_size=chunk, queue_policy="fcfs"))
    assert "fp8 e4m3 (online)" in engine.startup_summary()
    outputs = []
    for batch in ([prompts] if together else [[p] for p in prompts]):
        ids = [engine.add_request(p, GREEDY) for p in batch]
        tokens = {rid: [] for rid in ids}
        while engine.has_unfinished():
            events, _ = engine.step()
            for event in events:
                if event.token_id >= 0:
                    tokens[event.request_id].append(event.token_id)
        outputs += [tokens[rid] for rid in ids]
    return outputs


def test_fp8_greedy_output_does_not_depend_on_chunking_or_batching(prompts):
    torch.manual_seed(0)
    reference = _generate(1 << 20, prompts)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in reference)
    for chunk in (7, 32):
        assert _generate(chunk, prompts) == reference, chunk
    assert _generate(1 << 20, prompts, together=False) == reference
