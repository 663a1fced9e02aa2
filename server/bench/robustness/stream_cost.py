"""`metronome bench stream-cost`: the CPU one streamed token costs the server's API process and its engine process.

With the engine core in a process of its own (`--engine-process on`), everything the API process does is HTTP:
taking requests, receiving each step's tokens from the engine and writing one SSE chunk per token per stream. Its
CPU per token bounds how many tokens per second one API process can stream before its event loop, not the GPU,
sets the streams' TBT: at ~42 µs per token an H200's ~5,500 tokens/s take a quarter of a core, in bursts of one
token per running stream every step (docs/perf/isolation.md). The bench starts `metronome serve` on 127.0.0.1,
streams `--streams` requests of `--tokens` tokens each at once per round, and reads the CPU time of the engine
process and of every API process (one, or the `--api-servers N` of them summed; utime + stime from /proc, in
clock ticks of 10 ms: keep a round's API time well above that) around every round.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from metronome.contract.errors import MetronomeError
from metronome.contract.rfc3339 import format_time
from metronome.server.bench.robustness.local_server import local_server_process


@dataclass(frozen=True)
class CpuTimes:
    api_s: float
    engine_s: float


@dataclass(frozen=True)
class RoundResult:
    tokens: int
    wall_s: float
    tokens_per_s: float
    api_us_per_token: float
    engine_us_per_token: float


def process_cpu_seconds(stat_line: str, ticks_per_second: float) -> float:
    """utime + stime of a /proc/PID/stat line (fields 14 and 15; the command name may hold spaces and ')')."""
    fields = stat_line.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_second


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's children list, /proc/PID/task/*/children)."""
    children: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            children += [int(p) for p in handle.read().split()]
    return children


def is_spawned_worker(cmdline: bytes) -> bool:
    """A multiprocessing "spawn" child (the engine process), not the resource tracker spawn also starts."""
    return b"multiprocessing.spawn import spawn_main" in cmdline


def start_time(stat_line: str) -> int:
    """A /proc/PID/stat line's start time (field 22, clock ticks after boot)."""
    return int(stat_line.rpartition(")")[2].split()[19])


def split_processes(serve_pid: int) -> tuple[int, list[int]]:
    """(the engine process, the API processes: serve itself and its API workers under --api-servers N). The
    engine is the first spawned child: serve spawns its workers only once the engine is ready (they are handed
    its ReadyInfo)."""
    spawned = []
    for pid in child_pids(serve_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if not is_spawned_worker(handle.read()):
                continue
        with open(f"/proc/{pid}/stat") as handle:
            spawned.append((start_time(handle.read()), pid))
    if not spawned:
        raise MetronomeError(f"no engine process under serve (pid {serve_pid}): is --engine-process on?")
    spawned.sort()
    return spawned[0][1], [serve_pid, *(pid for _, pid in spawned[1:])]


def round_result(tokens: int, wall_s: float, before: CpuTimes, after: CpuTimes) -> RoundResult:
    if tokens <= 0 or wall_s <= 0:
        raise MetronomeError(f"a round streamed {tokens} tokens in {wall_s:.3f} s: nothing to measure")
    return RoundResult(tokens=tokens, wall_s=round(wall_s, 3), tokens_per_s=round(tokens / wall_s, 1),
                       api_us_per_token=round((after.api_s - before.api_s) / tokens * 1e6, 2),
                       engine_us_per_token=round((after.engine_s - before.engine_s) / tokens * 1e6, 2))


def summarize(rounds: list[RoundResult]) -> dict:
    def median(key: str) -> float:
        return round(statistics.median(getattr(r, key) for r in rounds), 2)

    return {"rounds": [asdict(r) for r in rounds], "median_api_us_per_token": median("api_us_per_token"),
            "median_engine_us_per_token": median("engine_us_per_token"),
            "median_tokens_per_s": median("tokens_per_s")}


async def _stream_one(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> int:
    body = {"model": model, "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    count = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise MetronomeError(f"the server answered {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["finish_reason"] is None:
                count += 1  # a token's chunk (the last chunk only carries the finish reason)
    if count != tokens:
        raise MetronomeError(f"a stream brought {count} tokens, not the {tokens} asked for (ignore_eos)")
    return count


async def _one_round(url: str, model: str, streams: int, tokens: int, cpu) -> RoundResult:
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        before, started = cpu(), time.perf_counter()
        counts = await asyncio.gather(*(_stream_one(client, url, model, tokens) for _ in range(streams)))
        wall, after = time.perf_counter() - started, cpu()
    return round_result(sum(counts), wall, before, after)


def run(model: str, streams: int, tokens: int, rounds: int, serve_args: list[str]) -> dict:
    ticks = os.sysconf("SC_CLK_TCK")
    args = ["--model", model, "--engine-process", "on", "--max-num-seqs", str(max(streams, 1)), *serve_args]
    with local_server_process(args) as (url, process):
        engine, api = split_processes(process.pid)

        def cpu() -> CpuTimes:
            def seconds(pid: int) -> float:
                with open(f"/proc/{pid}/stat") as handle:
                    return process_cpu_seconds(handle.read(), ticks)

            return CpuTimes(sum(seconds(pid) for pid in api), seconds(engine))

        served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(_one_round(url, served, min(streams, 4), min(tokens, 16), cpu))  # warm-up, not reported
        results = [asyncio.run(_one_round(url, served, streams, tokens, cpu)) for _ in range(rounds)]
    return {"command": "bench stream-cost", "model": model, "streams": streams, "tokens": tokens,
            "serve_args": serve_args, "api_processes": len(api),
            "date": format_time(), **summarize(results)}


def main(args) -> int:
    result = run(args.model, args.streams, args.tokens, args.rounds, list(args.serve_arg or []))
    for number, r in enumerate(result["rounds"], 1):
        print(f"round {number}: {r['tokens']} tokens in {r['wall_s']:.2f} s ({r['tokens_per_s']:.0f}/s); "
              f"API process {r['api_us_per_token']:.1f} µs/token, engine process {r['engine_us_per_token']:.1f}")
    print(f"median: API process {result['median_api_us_per_token']:.1f} µs of CPU per streamed token, engine "
          f"process {result['median_engine_us_per_token']:.1f}; {result['median_tokens_per_s']:.0f} tokens/s")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0
