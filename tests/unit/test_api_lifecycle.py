"""Readiness and graceful drain: in-process (the Lifecycle and the routes) and a real `metronome serve` + SIGTERM."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from api_helpers import ServerThread, build_server_parts, scrape, wait_until

from metronome.server.api.lifecycle import Lifecycle
from metronome.server.bench.processes import free_port

METRONOME = Path(sys.executable).with_name("metronome")  # the venv's console script


def test_drain_waits_for_inflight_requests():
    async def scenario():
        lifecycle = Lifecycle(ready=True)
        lifecycle.begin("a")
        lifecycle.begin("b")
        aborted: list[str] = []

        async def finish_later():
            await asyncio.sleep(0.05)
            lifecycle.end("a")
            await asyncio.sleep(0.05)
            lifecycle.end("b")

        async def abort(request_id):
            aborted.append(request_id)

        finisher = asyncio.create_task(finish_later())
        clean = await lifecycle.drain(60.0, abort)
        await finisher
        return lifecycle, clean, aborted

    lifecycle, clean, aborted = asyncio.run(scenario())
    assert clean and aborted == [] and not lifecycle.inflight
    assert lifecycle.draining and not lifecycle.accepting


def test_drain_timeout_aborts_what_is_left():
    async def scenario():
        lifecycle = Lifecycle(ready=True)
        lifecycle.begin("stuck")
        aborted: list[str] = []

        async def abort(request_id):
            aborted.append(request_id)
            lifecycle.end(request_id)  # an aborted stream ends right after

        return await lifecycle.drain(0.01, abort), aborted

    clean, aborted = asyncio.run(scenario())
    assert not clean and aborted == ["stuck"]


def test_draining_server_is_unready_refuses_new_work_and_finishes_streams():
    _, state, app = build_server_parts()
    with ServerThread(app) as server:
        body = {"prompt": "drain me", "max_tokens": 300, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        lines: list[str] = []
        first_chunk = threading.Event()

        def stream():
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        state.lifecycle.start_draining()

        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503 and "draining" in ready.json()["error"]["message"]
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503
        assert "shutting down" in refused.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200

        reader.join(timeout=120)
        data = [line for line in lines if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert json.loads(data[-2][len("data: "):])["usage"]["completion_tokens"] == 300
        wait_until(lambda: not state.lifecycle.inflight, timeout=10, what="no request in flight")


def read_stream(url: str, body: dict, first: threading.Event, out: list) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        out.append(response.status_code)
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(line)
                first.set()


def test_sigterm_during_streaming_completes_every_stream_and_exits_0(tmp_path):
    assert METRONOME.exists(), f"console script missing: {METRONOME} (run `make venv`)"
    port = free_port()
    log_path = tmp_path / "serve.log"
    # One sequence at a time, so two streams are still queued when SIGTERM arrives.
    command = [str(METRONOME), "serve", "--model", "random:tiny", "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "1024",
               "--max-num-seqs", "1", "--drain-seconds", "120", "--log-level", "info"]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        wait_until(lambda: _get_status(url + "/ready") == 200 or process.poll() is not None, timeout=180,
                   what="metronome serve ready")
        assert process.poll() is None, log_path.read_text()
        first = threading.Event()
        streams = []
        for i in range(3):
            body = {"messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 300,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            out: list = []
            thread = threading.Thread(target=read_stream, args=(url, body, first, out))
            thread.start()
            streams.append((thread, out))
        assert first.wait(120)
        # SIGTERM only once the server holds all three (one running, two queued): a stream whose request had not
        # reached the server yet would rightly be refused with 503.
        wait_until(lambda: _requests_held(url) == 3, timeout=60, what="all three requests inside the server")
        process.send_signal(signal.SIGTERM)

        wait_until(lambda: _get_status(url + "/ready") == 503, timeout=30, what="/ready 503 while draining")
        late = httpx.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["message"]

        for thread, _ in streams:
            thread.join(timeout=300)
        assert process.wait(timeout=120) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "draining" in log_path.read_text()
    for _, out in streams:
        assert out[0] == 200 and out[-1] == "data: [DONE]"
        usage = json.loads(out[-2][len("data: "):])["usage"]
        finish = json.loads(out[-3][len("data: "):])["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == 300 and finish == "length"


def _requests_held(url: str) -> float:
    samples = scrape(url)
    return sum(v for (name, _), v in samples.items()
               if name in ("metronome_requests_running", "metronome_requests_waiting"))


def _get_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def test_health_fails_when_the_engine_thread_is_gone():
    engine, _, app = build_server_parts()
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        asyncio.run(engine.shutdown())  # behind the server's back, as a crashed step thread would be
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
        assert httpx.get(server.url + "/ready").status_code == 503
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["message"]
