"""ProcessEngine: the engine core in a spawned process, behind AsyncEngine's interface. Real child processes and
pipes; the in-process AsyncEngine over the same config is the reference for tokens and error messages."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from api_helpers import TINY, ServerThread, metric, scrape, wait_until
from engine_fakes import RecordingObserver

from metronome.contract import metric_names as mn
from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineOverloadedError, InvalidRequestError, ModelNotFoundError
from metronome.server.bench.processes import free_port
from metronome.server.engine.async_engine import AsyncEngine
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.engine_process import ProcessEngine, engine_process_mode, streams_first
from metronome.server.engine.outputs import TokenEvent
from metronome.server.engine.sampling import Grammar, SamplingParams

in_module_loop = pytest.mark.asyncio(loop_scope="module")  # the loop the shared engines were started on

CONFIG = EngineConfig(model=TINY, device="cpu", dtype="float32", num_kv_blocks=24, max_model_len=512, max_waiting=2)
ONE_AT_A_TIME = SchedulerConfig(max_num_seqs=1)  # later requests wait: the queue bound is reachable
LONG = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)



@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engines():
    """(the process engine, the in-process reference), both started; one engine process for the module."""
    process = ProcessEngine.launch(CONFIG, ONE_AT_A_TIME, observers=[RecordingObserver()])
    reference = AsyncEngine(EngineCore.from_config(CONFIG, ONE_AT_A_TIME), observers=[RecordingObserver()])
    await process.start()
    await reference.start()
    yield process, reference
    await reference.shutdown()
    await process.shutdown()


async def collect(engine, prompt, params, request_id=None):
    return [event async for event in engine.generate(prompt, params, request_id)]


async def settled(engine, predicate, what: str):
    for _ in range(1000):
        if predicate(engine.stats()):
            return engine.stats()
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine stats never showed {what}: {engine.stats()}")


def idle(stats) -> bool:
    return stats.num_running == 0 and sum(stats.num_waiting.values()) == 0 and stats.kv_blocks_free == \
        stats.kv_blocks_total


@in_module_loop
async def test_a_greedy_stream_is_the_in_process_engines(engines):
    process, reference = engines
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = await collect(process, "the same prompt", params)
    want = await collect(reference, "the same prompt", params)
    fields = [(e.token_id, e.text, e.index, e.finished, e.finish_reason, e.prompt_tokens, e.completion_tokens)
              for e in want]
    assert [(e.token_id, e.text, e.index, e.finished, e.finish_reason, e.prompt_tokens, e.completion_tokens)
            for e in got] == fields
    assert process.observers[0].steps > 0
    assert process.tokenizer.decode(process.tokenizer.encode("héllo")) == "héllo"  # the tokenizer came over


@in_module_loop
async def test_leaving_a_stream_early_frees_the_request_in_the_engine_process(engines):
    process, _ = engines
    stream = process.generate(list(range(3, 60)), LONG, request_id="leaver")
    got = [await stream.__anext__() for _ in range(3)]
    assert [e.index for e in got] == [0, 1, 2]
    assert process.stats().num_running == 1
    await stream.aclose()
    stats = await settled(process, idle, "no requests and every KV block free")
    assert stats.kv_blocks_leaked == 0
    assert "leaver" not in process._streams


@in_module_loop
async def test_reconfigure_reaches_the_next_stats(engines):
    process, _ = engines
    process.reconfigure(SchedulerConfig(max_num_seqs=1, chunk_size=3))
    await settled(process, lambda s: s.scheduler.chunk_size == 3, "chunk_size 3")
    events = await collect(process, list(range(3, 20)), SamplingParams(max_tokens=2, temperature=0.0))
    assert events[-1].finished
    process.reconfigure(ONE_AT_A_TIME)
    await settled(process, lambda s: s.scheduler.chunk_size == ONE_AT_A_TIME.chunk_size, "the chunk size back")


BAD_REQUESTS = [
    ([5, 6], SamplingParams(top_p=2.0)),
    ("", SamplingParams()),
    ([5, 99999], SamplingParams()),
    ([True, 5], SamplingParams()),
    (list(range(3, 600)), SamplingParams(max_tokens=1)),
    ([5, 6], SamplingParams(max_tokens=511)),  # past the context
    ([5, 6], SamplingParams(max_tokens=500)),  # within the context, past the KV cache (24 blocks)
    ([5, 6], SamplingParams(grammar=Grammar("json_schema", "{not json"))),
    ([5, 6], SamplingParams(logit_bias=((99999, 1.0),))),
]


@pytest.mark.parametrize(("prompt", "params"), BAD_REQUESTS)
@in_module_loop
async def test_invalid_requests_raise_before_any_event_as_in_process(engines, prompt, params):
    process, reference = engines
    rejected = len(process.observers[0].rejected)
    with pytest.raises(InvalidRequestError) as want:
        await collect(reference, prompt, params)
    with pytest.raises(InvalidRequestError) as got:
        await anext(aiter(process.generate(prompt, params)))
    assert (str(got.value), got.value.param) == (str(want.value), want.value.param)
    assert process.observers[0].rejected[rejected:] == ["invalid"]


@in_module_loop
async def test_tensor_parallel_runs_from_the_engine_process(engines):
    _, reference = engines
    engine = ProcessEngine.launch(dataclasses.replace(CONFIG, tensor_parallel_size=2), ONE_AT_A_TIME)
    await engine.start()
    try:
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(engine.pid)], capture_output=True,
                                                      text=True).stdout.split()]
        assert len(workers) == 1  # rank 1, started by the engine process
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = [e.token_id for e in await collect(engine, [5, 6, 7, 8], params)]
        assert got == [e.token_id for e in await collect(reference, [5, 6, 7, 8], params)]
    finally:
        await engine.shutdown()
    assert engine._process.exitcode == 0
    wait_until(lambda: not any(_alive(pid) for pid in workers), timeout=30, what="the rank-1 worker to exit")


@in_module_loop
async def test_overload_raises_the_in_process_engines_error(engines):
    messages = []
    for engine in engines:
        running = engine.generate([3, 4], LONG)
        await running.__anext__()  # running: max_num_seqs 1, so the next two wait
        waiting = [engine.generate([5, i], LONG) for i in (6, 7)]
        firsts = [asyncio.ensure_future(w.__anext__()) for w in waiting]
        await asyncio.sleep(0)  # both adds are sent (the process engine counts them until acknowledged)
        if engine is engines[1]:  # the in-process engine counts them once its thread has queued them
            await settled(engine, lambda s: sum(s.num_waiting.values()) == 2, "two waiting")
        with pytest.raises(EngineOverloadedError) as caught:
            await collect(engine, [8], LONG)
        messages.append(str(caught.value))
        assert engine.observers[0].rejected[-1] == "overloaded"
        await running.aclose()
        for first, stream in zip(firsts, waiting):
            await first
            await stream.aclose()
        await settled(engine, idle, "idle again")
    assert messages[0] == messages[1] == "engine overloaded: 2 requests waiting (max_waiting 2); retry later"


def test_a_killed_engine_process_fails_open_streams_and_health():
    engine, app = serve_with_process_engine()
    with ServerThread(app) as server:
        body = {"model": TINY, "prompt": "hi", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming
            os.kill(engine.pid, signal.SIGKILL)
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert "the engine process exited with code -9" in error["message"]
        assert not engine.is_running
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_stopped"
        refused = httpx.post(server.url + "/v1/completions", json={"model": TINY, "prompt": "hi"})
        assert refused.status_code == 503 and "exited with code -9" in refused.json()["error"]["message"]
    assert not engine._process.is_alive()


def test_a_bad_model_fails_in_the_parent_with_the_engines_error():
    bad = EngineConfig(model="random:no-such-preset", device="cpu")
    with pytest.raises(ModelNotFoundError) as want:
        EngineCore.from_config(bad)
    with pytest.raises(type(want.value)) as got:
        ProcessEngine.launch(bad)
    assert str(got.value) == str(want.value)


def test_auto_runs_the_engine_in_a_process_on_cuda_only():
    assert engine_process_mode("auto", "cuda") == (True, "auto: cuda")
    assert engine_process_mode("auto", "cpu") == (False, "auto: cpu")
    assert engine_process_mode("on", "cpu") == (True, "on")
    assert engine_process_mode("off", "cuda") == (False, "off")
    with pytest.raises(InvalidRequestError, match="one of auto, on, off"):
        engine_process_mode("sometimes", "cpu")


ORPHAN = textwrap.dedent("""
    import sys
    from metronome.server.engine.config import EngineConfig
    from metronome.server.engine.engine_process import ProcessEngine
    if __name__ == "__main__":
        engine = ProcessEngine.launch(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=16))
        print(engine.pid, flush=True)
        sys.stdin.read()  # until killed
""")


def test_an_api_process_killed_hard_leaves_no_engine_process(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN)
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd())
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        wait_until(lambda: not _alive(child), timeout=30, what=f"engine process {child} to exit")
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def serve_with_process_engine():
    """(engine, app) as `metronome serve --engine-process on` wires them."""
    from metronome.server.api.app import create_app
    from metronome.server.api.metrics import ServerMetrics
    from metronome.server.api.state import build_state

    metrics = ServerMetrics(TINY)
    engine = ProcessEngine.launch(CONFIG, observers=[metrics])
    return engine, create_app(engine, build_state(engine, metrics, TINY, SchedulerConfig()))


def test_the_app_streams_through_an_engine_process():
    engine, app = serve_with_process_engine()
    with ServerThread(app) as server:
        body = {"model": TINY, "prompt": "hi", "max_tokens": 5, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
        assert finishes == [None] * 5 + ["length"]  # one chunk per token, then the finish
        constrained = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "response_format": {"type": "json_object"}})
        assert constrained.status_code == 200
        assert constrained.json()["choices"][0]["message"]["content"].startswith("{")
        samples = scrape(server.url)
        assert metric(samples, mn.STEP_DURATION + "_count") > 0
        assert httpx.get(server.url + "/health").status_code == 200
    assert not engine.is_running and not engine._process.is_alive()
    assert engine._process.exitcode == 0  # it stopped on STOP, not on a signal
    asyncio.run(engine.shutdown())  # idempotent


def test_sigterm_drains_through_the_engine_process_then_stops_it(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    command = [str(Path(sys.executable).with_name("metronome")), "serve", "--model", TINY, "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "64", "--engine-process", "on"]
    with open(log_path, "w") as log:
        serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: _status(url + "/ready") == 200 or serve.poll() is not None, timeout=120, what="ready")
        started = re.search(r"engine core in process (\d+) \(on\)", log_path.read_text())
        assert started, log_path.read_text()
        body = {"model": TINY, "prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
            chunks = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
            first = next(chunks)
            serve.send_signal(signal.SIGTERM)  # mid-stream: the stream runs to its end, then the process exits
            rest = list(chunks)
        assert rest[-1] == "[DONE]"
        finishes = [json.loads(chunk)["choices"][0]["finish_reason"] for chunk in [first, *rest[:-1]]]
        assert finishes == [None] * 200 + ["length"]
        assert serve.wait(timeout=60) == 0, log_path.read_text()
        assert not _alive(int(started.group(1)))
    finally:
        serve.kill()
        serve.wait()


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _row(request_id: str, token_id: int, index: int) -> tuple:
    # TokenEvent's fields, as the engine process sends them
    return (request_id, token_id, "x", index, 0.0, token_id < 0, "abort" if token_id < 0 else None, 3, index + 1)


def test_a_steps_running_streams_are_woken_before_new_requests_first_tokens_and_aborts():
    rows = [_row("new-1", 7, 0), _row("steady-a", 7, 41), _row("gone", -1, 5), _row("new-2", 7, 0),
            _row("steady-b", 7, 12)]
    assert [row[0] for row in streams_first(rows)] == ["steady-a", "steady-b", "new-1", "gone", "new-2"]
    steady_only = [_row("a", 7, 3), _row("b", 7, 9)]
    assert streams_first(steady_only) == steady_only
    assert [TokenEvent(*row).request_id for row in streams_first(rows)][:2] == ["steady-a", "steady-b"]
