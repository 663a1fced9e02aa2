"""`metronome serve --api-servers 2`: two API server processes on one port in front of one engine process. Real
processes, sockets and pipes (random:tiny on the CPU); one in-process server is the reference for the text."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from api_helpers import TINY, ServerThread, build_server_parts, k8s_config_dir, wait_until
from prometheus_client.parser import text_string_to_metric_families

from metronome.contract import metric_names as mn
from metronome.server.api.api_servers import SERVER_HEADER, check_api_servers
from metronome.server.bench.configfile import atomic_configmap_write
from metronome.server.bench.processes import free_port
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine_process import ProcessEngine
from metronome.server.engine.sampling import SamplingParams

HEADER = SERVER_HEADER.decode()
CONFIG = "generation: 1\nscheduler:\n  queue_policy: fcfs\n  chunk_size: 256\n"  # fcfs: chunk_size is the budget
METRONOME = str(Path(sys.executable).with_name("metronome"))


@dataclass
class Serve:
    process: subprocess.Popen
    url: str
    log: Path
    config: Path
    children: set[int] = frozenset()  # every process below it once both servers were ready

    def log_text(self) -> str:
        return self.log.read_text()

    @property
    def engine_pid(self) -> int:
        return int(re.search(r"engine core in process (\d+)", self.log_text()).group(1))

    @property
    def server_pids(self) -> list[int]:
        return [int(pid) for pid in re.search(r"2 API servers on \S+ \(PIDs ([\d, ]+)\)", self.log_text())
                .group(1).split(", ")]


def start_serve(root: Path) -> Serve:
    port = free_port()
    config = k8s_config_dir(root / "vol", CONFIG)
    log_path = root / "serve.log"
    command = [METRONOME, "serve", "--model", TINY, "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
               "--num-kv-blocks", "1024", "--api-servers", "2", "--engine-process", "on", "--config", str(config),
               "--config-poll-seconds", "0.1"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    serve = Serve(process, f"http://127.0.0.1:{port}", log_path, config)
    try:
        wait_until(lambda: {"0", "1"} <= answered(serve, "/ready", 200) or process.poll() is not None, timeout=120,
                   what="both API servers ready")
        assert process.poll() is None, serve.log_text()
        serve.children = descendants(process.pid)
        assert {serve.engine_pid, serve.server_pids[1]} <= serve.children
    except BaseException:
        stop(serve)
        raise
    return serve


_seen: dict[tuple[str, str, int], set[str]] = {}


def answered(serve: Serve, path: str, status: int) -> set[str]:
    """One more GET on a new connection; the API servers that have answered `path` with `status` so far."""
    seen = _seen.setdefault((serve.url, path, status), set())
    try:
        reply = httpx.get(serve.url + path, timeout=5)
    except httpx.HTTPError:
        return seen
    if reply.status_code == status:
        seen.add(reply.headers[HEADER])
    return seen


def stop(serve: Serve) -> None:
    """Whatever a failed test left: the main process and every process it had started."""
    serve.process.kill()
    serve.process.wait()
    for pid in serve.children:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(") ", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def assert_no_orphans(pids: set[int]) -> None:
    wait_until(lambda: not any(_alive(pid) for pid in pids), timeout=30, what=f"processes {sorted(pids)} to exit")


def scrape_from(serve: Serve, index: str) -> dict:
    """/metrics as answered by API server `index` (new connections until it is the one that answers)."""
    def attempt():
        reply = httpx.get(serve.url + "/metrics", timeout=10)
        return reply if reply.headers[HEADER] == index else None

    reply = wait_until(attempt, timeout=30, what=f"/metrics from API server {index}", interval=0.0)
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def total(samples: dict, name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def stream(url: str, prompt: str, max_tokens: int, started: threading.Event | None = None,
           go: threading.Event | None = None) -> dict:
    """One streaming completion: its text, usage, the server that answered and the last data line."""
    body = {"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
        lines = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
        chunks = [next(lines)]
        if started is not None:
            started.set()
            go.wait()
        chunks += list(lines)
        server = reply.headers.get(HEADER)  # None from a single server
    events = [json.loads(chunk) for chunk in chunks if chunk != "[DONE]"]
    text = "".join(choice["text"] for event in events for choice in event.get("choices", ()))
    usage = next((event["usage"] for event in events if event.get("usage")), None)
    return {"text": text, "usage": usage, "server": server, "last": chunks[-1], "events": events}


# ------------------------------------------------------------------------------------------ one engine, two clients


class Steps:
    def __init__(self):
        self.steps = 0

    def on_step(self, step, stats):
        self.steps += 1

    def on_rejected(self, reason):
        pass


async def collect(engine, prompt: str, params: SamplingParams, request_id: str) -> list:
    return [event async for event in engine.generate(prompt, params, request_id)]


async def collect_rest(events) -> list:
    return [event async for event in events]


async def test_one_engine_process_keeps_two_clients_apart_and_frees_a_leaving_clients_requests():
    config = EngineConfig(model=TINY, device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=512)
    zero_steps, one_steps = Steps(), Steps()
    zero = ProcessEngine.launch(config, observers=[zero_steps], clients=2)
    [(commands, replies)] = zero.spare_channels
    zero.spare_channels = []
    one = ProcessEngine.attach(zero.info, commands, replies, observers=[one_steps])
    await zero.start()
    await one.start()
    try:
        short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        alone = await collect(zero, "the other prompt", short, "first")
        a, b = await asyncio.gather(collect(zero, "one prompt", short, "same-id"),
                                    collect(one, "the other prompt", short, "same-id"))  # ids: unique per client
        assert [len(a), len(b)] == [12, 12] and {event.request_id for event in a + b} == {"same-id"}
        assert [event.token_id for event in b] == [event.token_id for event in alone]
        assert zero_steps.steps > 0 and one_steps.steps == 0  # step stats reach client 0 only

        # An abort (as a drain that runs out of time sends) ends client 1's stream with its "abort" event.
        stopped = one.generate("stop me", SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True), "stop")
        await anext(stopped)
        await one.abort("stop")
        rest = await asyncio.wait_for(collect_rest(stopped), 60)  # a guard: a lost abort event would hang
        assert rest[-1].finish_reason == "abort" and len(rest) < 480

        # Client 1 leaves mid-request: were its request not aborted, it would still run when the shorter one ends.
        doomed = one.generate("a long one", SamplingParams(max_tokens=480, temperature=0.0, ignore_eos=True),
                              "doomed")
        await anext(doomed)
        survivor = asyncio.create_task(collect(zero, "a long one", SamplingParams(max_tokens=100, temperature=0.0,
                                                                                  ignore_eos=True), "survivor"))
        await asyncio.to_thread(one.close)
        assert len(await survivor) == 100
        stats = zero.stats()
        assert stats.num_running == 0 and stats.kv_blocks_free == stats.kv_blocks_total
        await doomed.aclose()
    finally:
        await one.shutdown()
        await zero.shutdown()
    assert zero._process.exitcode == 0


# ------------------------------------------------------------------------------------------ one shared server


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    serve = start_serve(tmp_path_factory.mktemp("api-servers"))
    yield serve
    stop(serve)


PROMPTS = [f"stream number {i} says" for i in range(40)]
TOKENS = 24


def test_forty_streams_over_two_servers_match_one_server_and_both_metrics_agree(serve):
    before = scrape_from(serve, "0")
    with ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda prompt: stream(serve.url, prompt, TOKENS), PROMPTS))
    _, _, app = build_server_parts(num_kv_blocks=256)
    with ServerThread(app) as reference:
        expected = [stream(reference.url, prompt, TOKENS)["text"] for prompt in PROMPTS]
    assert {result["server"] for result in results} == {"0", "1"}
    assert [result["usage"]["completion_tokens"] for result in results] == [TOKENS] * 40
    assert [result["text"] for result in results] == expected
    streamed = TOKENS * len(PROMPTS)

    def grown(index: str):
        samples = scrape_from(serve, index)
        generated = total(samples, mn.GENERATION_TOKENS) - total(before, mn.GENERATION_TOKENS)
        return samples if generated == streamed else None

    for index in ("0", "1"):  # the engine's counter comes with server 0's next message: poll for it
        samples = wait_until(lambda index=index: grown(index), timeout=30,
                             what=f"server {index} to count {streamed} tokens")
        gaps = total(samples, mn.TIME_BETWEEN_TOKENS + "_count") - total(before, mn.TIME_BETWEEN_TOKENS + "_count")
        assert gaps == streamed - len(PROMPTS)  # every token but each request's first closes a gap
        steps = total(samples, mn.STEP_DURATION + "_count") - total(before, mn.STEP_DURATION + "_count")
        assert steps >= TOKENS  # observed (once) in server 0, seen from both


def test_a_config_reload_in_server_0_reaches_both_servers(serve):
    for index in ("0", "1"):
        assert total(scrape_from(serve, index), mn.CHUNK_SIZE) == 256
    atomic_configmap_write(serve.config, "generation: 2\nscheduler:\n  queue_policy: fcfs\n  chunk_size: 128\n"
                                         "  short_prompt_threshold: 64\n")
    for index in ("0", "1"):
        wait_until(lambda index=index: total(scrape_from(serve, index), mn.CHUNK_SIZE) == 128, timeout=30,
                   what=f"chunk size 128 from server {index}")
        assert total(scrape_from(serve, index), mn.CONFIG_GENERATION) == 2

    def engine_scheduler(index: str) -> dict | None:  # what the /v1 routes of that server read
        reply = httpx.get(serve.url + "/v1/config", timeout=5)
        return reply.json()["engine_scheduler"] if reply.headers[HEADER] == index else None

    for index in ("0", "1"):
        seen = wait_until(lambda index=index: engine_scheduler(index), timeout=30,
                          what=f"/v1/config from server {index}", interval=0.0)
        assert (seen["chunk_size"], seen["short_prompt_threshold"]) == (128, 64)


def test_sigterm_drains_both_servers_then_everything_exits(serve):
    """Last test of the shared server: it ends it."""
    processes = serve.children
    count, started, go = 16, [threading.Event() for _ in range(16)], threading.Event()
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(stream, serve.url, f"drain {i}", 120, started[i], go) for i in range(count)]
        for event in started:
            assert event.wait(60)
        serve.process.send_signal(signal.SIGTERM)  # every stream is open
        go.set()
        results = [future.result() for future in futures]
    assert {result["server"] for result in results} == {"0", "1"}
    assert [result["usage"]["completion_tokens"] for result in results] == [120] * count
    assert [result["last"] for result in results] == ["[DONE]"] * count
    assert serve.process.wait(timeout=60) == 0, serve.log_text()
    assert_no_orphans(processes)


# ------------------------------------------------------------------------------------------ failures


def test_a_killed_worker_takes_the_server_down_with_a_failure_exit(tmp_path):
    serve = start_serve(tmp_path)
    try:
        processes = serve.children
        os.kill(serve.server_pids[1], signal.SIGKILL)
        assert serve.process.wait(timeout=60) != 0
        assert "exited with code -9: shutting the server down" in serve.log_text()
        assert_no_orphans(processes)
    finally:
        stop(serve)


def test_a_killed_engine_fails_the_streams_and_health_on_both_servers(tmp_path):
    serve = start_serve(tmp_path)
    try:
        processes = serve.children
        count, started, go = 8, [threading.Event() for _ in range(8)], threading.Event()
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(stream, serve.url, f"doomed {i}", 1500, started[i], go) for i in range(count)]
            for event in started:
                assert event.wait(60)
            os.kill(serve.engine_pid, signal.SIGKILL)
            go.set()
            results = [future.result() for future in futures]
        for result in results:
            assert result["last"] == "[DONE]"
            assert "the engine process" in result["events"][-1]["error"]["message"]
        wait_until(lambda: {"0", "1"} <= answered(serve, "/health", 503), timeout=30, what="/health 503 from both")
        serve.process.send_signal(signal.SIGTERM)
        serve.process.wait(timeout=60)
        assert_no_orphans(processes)
    finally:
        stop(serve)


def test_several_api_servers_need_the_engine_in_its_own_process():
    check_api_servers(1, "off")
    check_api_servers(2, "auto")
    with pytest.raises(ValueError, match="--api-servers 2 .*--engine-process on or auto"):
        check_api_servers(2, "off")
    refused = subprocess.run([METRONOME, "serve", "--model", TINY, "--device", "cpu", "--api-servers", "2",
                              "--engine-process", "off"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert "--api-servers" in refused.stderr and "--engine-process" in refused.stderr
