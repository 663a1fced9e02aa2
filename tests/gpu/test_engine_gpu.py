"""The engine on CUDA: Triton-backed greedy output equals the CPU torch reference on the same weights, and the
host side of a step (schedule + prepare + postprocess) measured on an 8B-shaped decode batch.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_engine_gpu.py` (never part of CI). Timings are
printed, not asserted.
"""
from __future__ import annotations

import copy
import random
import statistics

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.kernels import get_backend
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams
from metronome.server.models import load_model
from metronome.server.models.loader import LoadedModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_triton_engine_matches_cpu_torch_engine(block_size):
    cpu = load_model("random:tiny", dtype="float32", device="cpu", attention_backend="torch", seed=3)
    cuda_model = copy.deepcopy(cpu.model).to("cuda")
    cuda_model.set_attention_backend(get_backend("triton"))
    cuda = LoadedModel(cpu.name, cpu.config, cuda_model, cpu.tokenizer, torch.float32, torch.device("cuda"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, cpu.config.vocab_size) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for loaded in (cpu, cuda):
        config = EngineConfig(device=str(loaded.device), block_size=block_size, num_kv_blocks=8192 // block_size)
        engine = EngineCore(loaded, config, SchedulerConfig(chunk_size=37, queue_policy="fcfs"))
        outputs.append([r.token_ids for r in engine.generate(prompts, params)])
        engine.check_no_leaks()
    same = sum(a == b for a, b in zip(*outputs))
    print(f"\nblock {block_size}: {same}/{len(prompts)} prompts identical between cuda/triton and cpu/torch")
    assert same >= len(prompts) - 1  # fp32 on both; allow one near-tie divergence on random weights


def test_host_overhead_of_an_8b_decode_step():
    loaded = load_model("random:llama-3-8b", dtype="bfloat16", device="cuda", attention_backend="triton")
    config = EngineConfig(device="cuda", block_size=16, num_kv_blocks=64 * 2200 // 16 + 64)
    engine = EngineCore(loaded, config, SchedulerConfig(chunk_size=8192, max_num_seqs=64, queue_policy="fcfs"))
    rng = random.Random(1)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    for _ in range(64):
        engine.add_request([rng.randrange(3, 120000) for _ in range(2000)], params)
    while engine.stats().num_running < 64 or any(s.is_prefilling for s in engine.live_sequences()):
        engine.step()
    for _ in range(5):  # warm-up decode steps
        engine.step()
    durations, overheads = [], []
    for _ in range(40):
        _, stats = engine.step()
        assert stats.num_decode_tokens == 64
        durations.append(stats.duration_s)
        overheads.append(stats.scheduler_overhead_s)
    d, o = statistics.median(durations), statistics.median(overheads)
    print(f"\n8B bf16, 64 decodes at ~2k context: step {d * 1e3:.2f} ms, host overhead {o * 1e3:.3f} ms "
          f"({100 * o / d:.1f} %)")
    while engine.has_unfinished():
        engine.step()
    engine.check_no_leaks()
