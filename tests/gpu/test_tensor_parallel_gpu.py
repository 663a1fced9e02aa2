"""Tensor parallelism over NCCL on one host (needs >= 2 GPUs; never in CI):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        pytest -q -s tests/gpu/test_tensor_parallel_gpu.py

1. fp32, Triton: TP=2 greedy tokens equal TP=1's on a random Qwen2-0.5B (14 query / 2 KV heads, qkv biases,
   tied embeddings), allowing one near-tie divergence over the prompts as the single-GPU test does.
2. Llama-3-8B (random weights), TP=2, in bf16 and with FP8 weights and KV cache, and Qwen3-30B-A3B in FP8: a mixed
   chunked-prefill + decode run finishes every request without leaking KV blocks, each rank caches half the KV
   heads, and the workers exit 0 on close. Step times are
   printed, not asserted (figures belong in docs/perf/tp.md via `metronome bench engine`).
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs of one host")]

# NVLink multicast (NVLS) stays off on the shared machines; the workers inherit these.
for _name in ("NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 600))] for _ in range(count)]


def test_tp2_fp32_greedy_matches_tp1():
    prompts = _prompts(150000, 12, 0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for tp in (1, 2):
        config = EngineConfig(model="random:qwen2-0.5b", dtype="float32", device="cuda", attention_backend="triton",
                              num_kv_blocks=2048, tensor_parallel_size=tp, cuda_graphs=False)
        core = EngineCore.from_config(config, SchedulerConfig(chunk_size=97))
        try:
            outputs.append([r.token_ids for r in core.generate(prompts, params)])
            core.check_no_leaks()
        finally:
            core.close()
    same = sum(a == b for a, b in zip(*outputs))
    print(f"\nTP=2 vs TP=1 (fp32): {same}/{len(prompts)} prompts identical")
    assert same >= len(prompts) - 1


@pytest.mark.parametrize(("model", "kv_heads", "fp8"), [("llama-3-8b", 8, False), ("llama-3-8b", 8, True),
                                                     ("qwen3-30b-a3b", 4, True)],
                         ids=["llama-3-8b-bf16", "llama-3-8b-fp8-weights-and-cache", "qwen3-30b-a3b-fp8"])
def test_tp2_serves_a_mixed_batch(model, kv_heads, fp8):
    precision = dict(quantization="fp8", kv_cache_dtype="fp8") if fp8 else {}
    config = EngineConfig(model=f"random:{model}", dtype="bfloat16", device="cuda", attention_backend="triton",
                          tensor_parallel_size=2, **precision)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=512, max_num_seqs=64))
    try:
        assert core.runner.kv_caches[0][0].shape[2] == kv_heads // 2
        assert core.runner.kv_caches[0][0].dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for prompt in _prompts(128000, 32, 1):
            core.add_request(prompt, params)
        steps, start, done = 0, time.perf_counter(), 0
        while core.has_unfinished():
            events, _ = core.step()
            steps += 1
            done += sum(e.finished for e in events)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        print(f"\nTP=2 {model} {'FP8' if fp8 else 'bf16'}: 32 requests, {steps} steps in {elapsed:.2f} s "
              f"({1000 * elapsed / steps:.1f} ms/step)")
        assert done == 32
        core.check_no_leaks()
    finally:
        core.close()
    assert [p.returncode for p in core.workers.procs] == [0]
