"""Async scheduling on the GPU: launching step n+1 before reading step n's tokens (which then reach n+1's CUDA
graph inputs on the device) gives the synchronous engine's output, greedy and seeded; and how much decode wall
time the overlap saves (printed, not asserted: speed goes into `metronome bench engine`).

Run on the GPU machine only: `pytest -q -s tests/gpu/test_async_gpu.py` (never part of CI).
"""
from __future__ import annotations

import random
import statistics
import time
import warnings

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    """One engine (graphs captured once); each test switches async scheduling on and off on it. No prefix
    caching, so a second run of the same prompts computes exactly what the first did."""
    config = EngineConfig(model="random:tiny", device="cuda", dtype="float32", attention_backend="triton",
                          block_size=16, num_kv_blocks=2048, seed=11, enable_prefix_caching=False,
                          async_scheduling="on")
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=512, max_num_seqs=16, queue_policy="fcfs"))
    assert core.execution_mode == "cuda_graphs", core.execution_mode
    assert core.async_scheduling
    return core


def _run(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams], lookahead: bool):
    engine.async_scheduling = lookahead
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    forwards: set[str] = set()
    in_flight = 0
    while engine.has_unfinished():
        events, stats = engine.step()
        in_flight += engine.in_flight
        if stats.num_tokens:
            forwards.add(stats.forward)
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert (in_flight > 0) == lookahead
    return [tokens[rid] for rid in ids], forwards


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 300))] for _ in range(11)]


def test_async_greedy_equals_synchronous_through_decode_and_piecewise_graphs(engine):
    """Staggered lengths: the decode batch shrinks through padded graph sizes, and the 512-token chunks carry
    decodes (piecewise graphs), so tokens in flight are gathered into both kinds of static inputs."""
    prompts = _prompts(1)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(11)]
    expected, sync_forwards = _run(engine, prompts, params, lookahead=False)
    got, forwards = _run(engine, prompts, params, lookahead=True)
    assert got == expected
    assert {"graph", "piecewise"} <= forwards and {"graph", "piecewise"} <= sync_forwards


def test_async_seeded_sampling_equals_synchronous(engine):
    prompts = _prompts(2)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.9, top_k=50 if i % 2 else 0,
                             top_p=0.9 if i % 3 else 1.0, min_p=0.05 if i % 4 == 0 else 0.0, seed=100 + i,
                             ignore_eos=True) for i in range(11)]
    expected, _ = _run(engine, prompts, params, lookahead=False)
    got, _ = _run(engine, prompts, params, lookahead=True)
    assert got == expected


def test_a_stop_token_ends_the_request_at_the_same_token(engine):
    """The stopped request's row in the step in flight is dropped; its output ends at the stop token."""
    prompts = _prompts(3)
    plain = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True) for _ in prompts]
    reference, _ = _run(engine, prompts, plain, lookahead=False)
    stops = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(out[5],))
             for out in reference]
    expected, _ = _run(engine, prompts, stops, lookahead=False)
    got, _ = _run(engine, prompts, stops, lookahead=True)
    assert got == expected
    for out, want in zip(got, reference):
        assert out == want[:want.index(want[5]) + 1]


def _host_syncs(core: EngineCore) -> list[str]:
    """Where one step() makes a synchronizing CUDA call (torch's sync debug mode), as file:line."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            core.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{w.filename.rsplit('/', 1)[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def test_decode_step_wall_with_and_without_async_scheduling():
    """Interleaved on one engine (host speed drifts): decode steps at batch 1 and 64, 512-token contexts."""
    config = EngineConfig(model="random:smollm2-360m", device="cuda", dtype="bfloat16", block_size=16,
                          num_kv_blocks=4096, seed=3, enable_prefix_caching=False)
    core = EngineCore.from_config(config, SchedulerConfig(chunk_size=2048, max_num_seqs=64, queue_policy="fcfs"))
    rng = random.Random(0)
    for batch in (1, 64):
        for _ in range(batch):
            core.add_request([rng.randrange(3, 40_000) for _ in range(512)],
                             SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        while any(s.is_prefilling for s in core.live_sequences()) or core.scheduler.num_waiting:
            core.step()
        walls: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(4):
            for lookahead in (False, True):
                core.async_scheduling = lookahead
                for _ in range(3):
                    core.step()  # switch over (the first step of a run reads nothing)
                for _ in range(20):
                    t0 = time.perf_counter()
                    _, stats = core.step()
                    walls[lookahead].append(time.perf_counter() - t0)
                    assert stats.num_tokens == batch and stats.cuda_graph
        off, on = (statistics.median(walls[m]) * 1000 for m in (False, True))
        print(f"\ndecode batch {batch}: {off:.2f} ms/step synchronous, {on:.2f} ms/step async "
              f"({off / on:.2f}x) [{core.execution_mode}]")
        print(f"host syncs in one async decode step (only the read of the step before should wait): "
              f"{_host_syncs(core)}")
        for seq in core.live_sequences():
            core.abort(seq.request_id)
        while core.has_unfinished():
            core.step()
        core.check_no_leaks()
