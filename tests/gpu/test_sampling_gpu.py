"""Sampling additions on CUDA: grammar masks (pinned buffer, non-blocking copy) equal the CPU ones, constrained
output parses, and penalties/logprobs match the CPU sampler on the same logits.

Run on the GPU machine only: `pytest -q tests/gpu/test_sampling_gpu.py` (never part of CI).
"""
from __future__ import annotations

import json

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampler import Sampler
from metronome.server.engine.sampling import Grammar, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def cores():
    def core(device: str) -> EngineCore:
        config = EngineConfig(model="random:tiny", device=device, dtype="float32", num_kv_blocks=128,
                              cuda_graphs=False)
        return EngineCore.from_config(config, SchedulerConfig())
    return core("cpu"), core("cuda")


def test_masks_on_cuda_equal_the_cpu_masks(cores):
    cpu, cuda = cores
    grammars = [Grammar("json_schema", json.dumps(SCHEMA)), Grammar("regex", r"[a-c]+x"), Grammar("json_object")]
    for count in (1, 7):  # one by one, and through llguidance's executor
        cpu_m = [cpu.grammars.matcher(grammars[i % 3]) for i in range(count)]
        cuda_m = [cuda.grammars.matcher(grammars[i % 3]) for i in range(count)]
        _, expected = cpu.grammars.mask(list(range(count)), cpu_m)
        rows, allowed = cuda.grammars.mask(list(range(count)), cuda_m)
        assert allowed.is_cuda and rows.tolist() == list(range(count))
        assert torch.equal(allowed.cpu(), expected)


def test_constrained_generation_on_cuda_parses(cores):
    _, cuda = cores
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, grammar=grammar) for s in range(8)]
    for result in cuda.generate([f"p{i}" for i in range(8)], params):
        value = json.loads(result.text)
        assert result.finish_reason == "stop" and set(value) == {"ok", "n"} and 0 <= value["n"] <= 9


def test_penalties_and_logprobs_match_the_cpu_sampler():
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, logprobs=5),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias=((7, 4.0),)),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0)]
    histories = [([1, 2, 3, 3, 9], 2), ([4, 5, 6], 1), None, None]
    cpu = Sampler(torch.device("cpu")).sample(logits, params, [None] * 4, histories)
    cuda = Sampler(torch.device("cuda")).sample(logits.cuda(), params, [None] * 4, histories)
    assert cpu.tokens == cuda.tokens
    for a, b in zip(cpu.logprobs, cuda.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
