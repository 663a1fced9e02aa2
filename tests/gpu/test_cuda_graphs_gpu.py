"""CUDA graphs on the GPU: decode steps that replay captured graphs give the eager engine's greedy output.

Run on the GPU machine only: `pytest -q -s tests/gpu/test_cuda_graphs_gpu.py` (never part of CI).
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(cuda_graphs: bool, dtype: str = "float32", max_num_seqs: int = 16) -> EngineCore:
    config = EngineConfig(model="random:tiny", device="cuda", dtype=dtype, attention_backend="triton",
                          block_size=16, num_kv_blocks=2048, seed=11, cuda_graphs=cuda_graphs)
    return EngineCore.from_config(config, SchedulerConfig(chunk_size=512, max_num_seqs=max_num_seqs,
                                                          queue_policy="fcfs"))


def _run(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]):
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    tokens = {rid: [] for rid in ids}
    graph_steps = decode_steps = 0
    while engine.has_unfinished():
        events, stats = engine.step()
        if stats.num_tokens and not stats.num_prefill_tokens:
            decode_steps += 1
            graph_steps += stats.cuda_graph
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    return [tokens[rid] for rid in ids], graph_steps, decode_steps


@pytest.mark.parametrize("long_context", [False, True])
def test_graph_decode_matches_eager_greedy(long_context):
    """Staggered lengths shrink the decode batch through padded sizes; long contexts (> 1024 tokens) make small
    batches use kv splits, so the split-class graphs are exercised too."""
    rng = random.Random(long_context)
    lo, hi = (1100, 1900) if long_context else (1, 300)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(11)]
    max_tokens = [4 + 3 * i for i in range(11)]
    eager = _engine(cuda_graphs=False)
    assert eager.execution_mode.startswith("eager")
    expected, eager_graph_steps, _ = _run(eager, prompts, max_tokens)
    assert eager_graph_steps == 0
    del eager
    start = time.perf_counter()
    graphed = _engine(cuda_graphs=True)
    print(f"\nengine with graphs built in {time.perf_counter() - start:.1f} s: {graphed.execution_mode}")
    assert graphed.execution_mode == "cuda_graphs"
    print(f"{len(graphed.runner.graphs.graphs)} graphs, capture {graphed.runner.graph_capture_s:.2f} s")
    outputs, graph_steps, decode_steps = _run(graphed, prompts, max_tokens)
    same = sum(a == b for a, b in zip(outputs, expected))
    print(f"{same}/{len(prompts)} outputs identical to eager; {graph_steps}/{decode_steps} decode steps replayed")
    assert graph_steps == decode_steps > 0
    assert same >= len(prompts) - 1  # fp32 both ways; padded matmul shapes may move one near-tie


def test_graph_decode_is_faster_than_eager_and_reports_it():
    """Printed, not asserted as a number: the decode step time of a tiny bf16 model, graph vs eager (launch-bound,
    so this is the launch overhead the graphs remove)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(200)] for _ in range(32)]
    times = {}
    for graphs in (False, True):
        engine = _engine(cuda_graphs=graphs, dtype="bfloat16", max_num_seqs=32)
        for p in prompts:
            engine.add_request(p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        durations = []
        while engine.has_unfinished():
            _, stats = engine.step()
            if stats.num_decode_tokens == 32 and not stats.num_prefill_tokens:
                durations.append(stats.duration_s)
                assert stats.cuda_graph == graphs
        durations.sort()
        times[graphs] = durations[len(durations) // 2]
    print(f"\ntiny bf16, 32 decodes: eager {times[False] * 1e3:.2f} ms/step, graphs {times[True] * 1e3:.2f} ms/step")


def _run_forwards(engine: EngineCore, prompts: list[list[int]], max_tokens: list[int]):
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
           for p, m in zip(prompts, max_tokens)]
    tokens = {rid: [] for rid in ids}
    forwards = []
    while engine.has_unfinished():
        events, stats = engine.step()
        if stats.num_tokens:
            forwards.append((stats.forward, stats.kind))
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    return [tokens[rid] for rid in ids], forwards


def test_piecewise_mixed_steps_match_eager_greedy_and_compile_nothing_after_ready():
    """Mixed steps (chunks of staggered prompts with decodes, contexts past 1024 so that small batches split)
    replay piecewise graphs; greedy output equals eager's, and no Triton kernel compiles once the engine is ready
    (start-up warmed every variant up)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(lo, lo + 700))]
               for lo in (1, 20, 300, 1100, 1500, 5, 900)]
    max_tokens = [5 + 4 * i for i in range(len(prompts))]
    eager = _engine(cuda_graphs=False)
    expected, eager_forwards = _run_forwards(eager, prompts, max_tokens)
    assert {f for f, _ in eager_forwards} == {"eager"}
    assert eager.stats().kernel_compiles_after_ready == 0, "eager start-up left a variant uncompiled"
    del eager
    graphed = _engine(cuda_graphs=True)
    assert graphed.execution_mode == "cuda_graphs", graphed.execution_mode
    outputs, forwards = _run_forwards(graphed, prompts, max_tokens)
    mixed = [f for f, kind in forwards if kind == "mixed"]
    print(f"\n{len(mixed)} mixed steps, {mixed.count('piecewise')} piecewise; "
          f"capture {graphed.runner.graph_capture_s:.1f} s")
    assert mixed and set(mixed) == {"piecewise"}
    assert {f for f, kind in forwards if kind == "decode"} == {"graph"}
    same = sum(a == b for a, b in zip(outputs, expected))
    assert same >= len(prompts) - 1, (same, len(prompts))  # fp32 both ways; padded shapes may move one near-tie
    assert graphed.stats().kernel_compiles_after_ready == 0
