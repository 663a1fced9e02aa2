"""What serving one streamed token costs a `metronome serve` process: CPU seconds per token (read from /proc: the whole
process, and its main thread, which runs the HTTP event loop) and
the token gaps its clients see, with N streams at once. A diagnostic for the HTTP side (docs/perf/serving-cpu.md): on a
GPU the engine thread's host work is small, and what the event loop spends per token shares the GIL with it.

    python -m hack.serving_cost --url http://127.0.0.1:8000 --pid $(pgrep -f 'metronome serve') --streams 128

The client is deliberately light (raw SSE lines, no JSON parsing), so that it is not the bottleneck.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import httpx

from metronome.server.bench.load.clients import sse_lines


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of the process, or of one of its threads (the main thread runs the HTTP event loop)."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream(http: httpx.AsyncClient, url: str, model: str, tokens: int, gaps: list[float]) -> int:
    body = {"model": model, "prompt": list(range(300, 332)), "max_tokens": tokens, "ignore_eos": True,
            "stream": True}
    count, last = 0, None
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in sse_lines(response):
            if line.startswith("data: {"):
                now = time.perf_counter()
                count += 1
                if last is not None:
                    gaps.append(now - last)
                last = now
    return count


async def measure(args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        model = (await http.get(args.url + "/v1/models")).json()["data"][0]["id"]
        await stream(http, args.url, model, 8, [])  # warm-up
        gaps: list[float] = []
        cpu0, loop0, t0 = cpu_seconds(args.pid), cpu_seconds(args.pid, args.pid), time.perf_counter()
        counts = await asyncio.gather(*(stream(http, args.url, model, args.tokens, gaps)
                                        for _ in range(args.streams)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(args.pid) - cpu0
        event_loop = cpu_seconds(args.pid, args.pid) - loop0
    tokens = sum(counts)
    gaps.sort()
    return {"streams": args.streams, "tokens": tokens, "wall_s": round(wall, 3), "server_cpu_s": round(cpu, 3),
            "server_cpu_us_per_token": round(cpu / tokens * 1e6, 1),
            "event_loop_cpu_us_per_token": round(event_loop / tokens * 1e6, 1), "tokens_per_s": round(tokens / wall),
            "gap_p50_ms": round(gaps[len(gaps) // 2] * 1e3, 2),
            "gap_p99_ms": round(gaps[int(len(gaps) * 0.99)] * 1e3, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--pid", type=int, required=True, help="the server process (its CPU time is read from /proc)")
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream (ignore_eos)")
    p.add_argument("--label", default="", help="carried into the JSON line")
    args = p.parse_args()
    print(json.dumps({"label": args.label, **asyncio.run(measure(args))}))


if __name__ == "__main__":
    main()
