"""AsyncEngine: background step thread, per-request streams, early close aborts and frees KV blocks."""
from __future__ import annotations

import asyncio

import pytest
from engine_fakes import RecordingObserver, expected_greedy, fake_engine

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
from metronome.server.engine.async_engine import AsyncEngine
from metronome.server.engine.sampling import SamplingParams


async def collect(engine: AsyncEngine, prompt, params, request_id=None):
    return [event async for event in engine.generate(prompt, params, request_id)]


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        stats = engine.stats()
        if stats.num_running == 0 and sum(stats.num_waiting.values()) == 0 and not engine._commands:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


@pytest.fixture
async def engine():
    observer = RecordingObserver()
    eng = AsyncEngine(fake_engine(chunk_size=8), observers=[observer])
    eng.observer = observer
    await eng.start()
    yield eng
    await eng.shutdown()


async def test_concurrent_streams_are_exact_and_ordered(engine):
    prompts = [[1, 2, 3], list(range(30)), [9] * 17]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    results = await asyncio.gather(*(collect(engine, p, params) for p in prompts))
    for p, events in zip(prompts, results):
        assert [e.token_id for e in events] == expected_greedy(p, 10)
        assert [e.index for e in events] == list(range(10))
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert not any(e.finished for e in events[:-1])
        assert all(a.time <= b.time for a, b in zip(events, events[1:]))
    assert engine.observer.steps > 0


async def test_closing_a_stream_early_aborts_and_frees_blocks(engine):
    stream = engine.generate(list(range(50)), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
                             request_id="leaver")
    got = []
    async for event in stream:
        got.append(event)
        if len(got) == 3:
            break
    await stream.aclose()  # what the HTTP layer does on client disconnect
    await wait_idle(engine)
    await engine.shutdown()  # stop the thread so that the core can be inspected safely
    engine.core.check_no_leaks()
    assert engine.core.block_manager.num_used_blocks == 0
    assert "leaver" not in engine.core._seqs


async def test_validation_errors_raise_before_any_token(engine):
    with pytest.raises(InvalidRequestError) as info:
        await collect(engine, [1], SamplingParams(top_p=2.0))
    assert info.value.param == "top_p"
    with pytest.raises(InvalidRequestError):
        await collect(engine, "", SamplingParams())
    assert engine.observer.rejected == ["invalid", "invalid"]


async def test_overload_rejects_with_typed_error():
    core = fake_engine(max_waiting=1, max_num_seqs=1)
    eng = AsyncEngine(core)
    await eng.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        first = eng.generate([1, 2], params)
        second = eng.generate([3, 4], params)
        await first.__anext__()  # running
        await asyncio.sleep(0)
        t = asyncio.ensure_future(second.__anext__())  # queued behind max_num_seqs = 1
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloadedError):
            await collect(eng, [5], params)
        await first.aclose()
        await t
        await second.aclose()
    finally:
        await eng.shutdown()


async def test_reconfigure_is_applied_by_the_engine_thread(engine):
    engine.reconfigure(SchedulerConfig(queue_policy="sjf", chunk_size=3))
    for _ in range(200):
        if engine.stats().scheduler.chunk_size == 3:
            break
        await asyncio.sleep(0.01)
    assert engine.stats().scheduler.queue_policy.value == "sjf"
    events = await collect(engine, list(range(20)), SamplingParams(max_tokens=4, temperature=0.0))
    assert [e.token_id for e in events] == expected_greedy(list(range(20)), 4)


async def test_idle_engine_does_not_step(engine):
    await collect(engine, [1, 2], SamplingParams(max_tokens=2, temperature=0.0))
    await wait_idle(engine)
    steps = engine.observer.steps
    await asyncio.sleep(0.2)
    assert engine.observer.steps == steps
    assert engine.is_running


async def test_a_failing_step_fails_its_requests_but_not_the_engine(engine):
    real_step = engine.core.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_step()

    engine.core.step = flaky_step
    with pytest.raises(RuntimeError, match="device fell over"):
        await collect(engine, list(range(30)), SamplingParams(max_tokens=5, temperature=0.0))
    events = await collect(engine, [4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    assert [e.token_id for e in events] == expected_greedy([4, 5], 3)
    await wait_idle(engine)
    await engine.shutdown()
    engine.core.check_no_leaks()
    assert engine.core.block_manager.num_used_blocks == 0
