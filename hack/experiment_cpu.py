#!/usr/bin/env python3
"""How small a difference an experiment tells from noise on this CPU, and after how many windows.

    python hack/experiment_cpu.py [--window 10] [--windows 10] [--chunks 4096,3072,2048,1536,1024,512] [--out F]

Two `metronome serve` processes (random:tiny, one core each, as in tests/e2e/test_experiments.py) get the same
closed-loop request stream (half the prompts 3,000 tokens, 64 output tokens, 4 at a time per server). The control
serves chunk 4096 throughout; the candidate serves each chunk of --chunks in turn (4096 first: an A/A run), switched
by the `..data` swap the kubelet uses. Each phase records --windows windows of --window seconds; per window and
server, the p99 of the token gaps and of the time to first token and the output tokens per second, measured at the
client (the operator reads the same from Prometheus' histograms). Each phase's windows then go, one by one, through
the operator's own verdict (operator/experiment/verdict.py) under two settings: the CRD's defaults and the margins
of the e2e test; the first decision and the window it came at are what an experiment would have done.

Prints a table and writes the windows and verdicts as JSON (--out). Only 127.0.0.0/8 is contacted.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from metronome.operator.experiment.settings import CandidateSpec, ExperimentSpec, Gates
from metronome.operator.experiment.verdict import GroupWindow, WindowReading, judge
from metronome.server.bench.configfile import project
from metronome.server.bench.load.stats import percentile
from metronome.server.bench.robustness.local_server import local_server
from metronome_testing.closedloop import LoadDriver, LoadSpec

CONTROL_CHUNK = 4096
LOAD = LoadSpec(concurrency_per_server=4, long_fraction=0.5, long_prompt_len=3000, short_prompt_len=32, output_len=64,
                request_timeout_s=120.0, seed=7)
SERVE = ["--model", "random:tiny", "--max-model-len", "4096", "--kv-cache-memory-gb", "0.5", "--drain-seconds", "2"]
SETTINGS = {
    "crd-defaults": dict(min_improvement=0.05, gates=Gates(tbt_p99_worse=0.10, ttft_p99_worse=0.10,
                                                           goodput_lower=0.05)),
    "e2e-margins": dict(min_improvement=0.15, gates=Gates(tbt_p99_worse=0.25, ttft_p99_worse=2.0,
                                                          goodput_lower=0.30)),
}


def server_yaml(generation: int, chunk: int) -> str:
    return f"generation: {generation}\nscheduler:\n  chunk_size: {chunk}\n  queue_policy: fcfs\n  max_num_seqs: 16\n"


def measure(load: LoadDriver, since: float, seconds: float) -> dict:
    gaps = load.gaps_since(since)
    firsts = [r.token_times_s[0] - r.scheduled_s for r in list(load.stats.records)
              if r.token_times_s and since <= r.token_times_s[0] < since + seconds]
    return {"gaps": len(gaps), "tbt_p99_s": percentile(gaps, 99) if gaps else None,
            "ttft_p99_s": percentile(firsts, 99) if firsts else None, "tokens_per_s": len(gaps) / seconds,
            "errors": len(load.errors())}


def group(window: dict) -> GroupWindow:
    return GroupWindow(window["tbt_p99_s"], window["ttft_p99_s"], window["tokens_per_s"],
                       tbt_samples=window["gaps"], requests=1, errors=0, pods_seen=1)


def first_decision(readings: list[WindowReading], spec: ExperimentSpec) -> dict:
    for n in range(1, len(readings) + 1):
        verdict = judge(readings[:n], spec, candidate_pods=1)
        if verdict.decided:
            break
    return {"outcome": verdict.outcome.value, "reason": verdict.reason, "windows": verdict.counted,
            "ratios": verdict.ratios()}


def ratios(windows: list[dict], key: str) -> list[float]:
    """Candidate / control per window, sorted."""
    return sorted(w["candidate"][key] / w["control"][key] for w in windows if w["candidate"][key] and w["control"][key])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window (10)")
    parser.add_argument("--windows", type=int, default=10, help="windows per candidate (10)")
    parser.add_argument("--chunks", default="4096,3072,2048,1536,1024,512", help="candidate chunks, in order")
    parser.add_argument("--out", type=Path, help="write the windows and verdicts as JSON")
    args = parser.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    started, load_at_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    phases = []
    with tempfile.TemporaryDirectory() as work, contextlib.ExitStack() as stack:
        folders = [Path(work) / "control", Path(work) / "candidate"]
        for folder in folders:
            project(folder, {"server.yaml": server_yaml(1, CONTROL_CHUNK)})
        urls = [stack.enter_context(local_server(["--config", str(f / "server.yaml"), *SERVE])) for f in folders]
        loads = [LoadDriver([url], LOAD).start() for url in urls]
        for load in loads:
            stack.callback(load.stop)
        time.sleep(2 * args.window)  # past the first requests
        for generation, chunk in enumerate(chunks, start=2):
            project(folders[1], {"server.yaml": server_yaml(generation, chunk)})
            time.sleep(2.0)  # the server polls its config every 0.5 s
            windows = []
            for index in range(1, args.windows + 1):
                marks = [load.now() for load in loads]
                time.sleep(args.window)
                control, candidate = (measure(load, mark, args.window) for load, mark in zip(loads, marks))
                windows.append({"index": index, "control": control, "candidate": candidate})
                print(f"chunk {chunk} window {index}: TBT p99 {candidate['tbt_p99_s'] * 1e3:.0f} / "
                      f"{control['tbt_p99_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            readings = [WindowReading(w["index"], w["index"] * args.window, group(w["candidate"]), group(w["control"]))
                        for w in windows]
            verdicts = {name: first_decision(readings, ExperimentSpec(candidate=CandidateSpec({"chunk_size": chunk}),
                                                                      windows=args.windows, **settings))
                        for name, settings in SETTINGS.items()}
            phases.append({"candidate_chunk": chunk, "windows": windows, "verdicts": verdicts})
        errors = sum(len(load.errors()) for load in loads)
    print(f"| candidate chunk (control {CONTROL_CHUNK}) | TBT p99 ratio, median [min, max] | TTFT p99 ratio | "
          f"{' | '.join(f'verdict, {name}' for name in SETTINGS)} |")
    print("|---:|---|---|" + "---|" * len(SETTINGS))
    for phase in phases:
        tbt, ttft = ratios(phase["windows"], "tbt_p99_s"), ratios(phase["windows"], "ttft_p99_s")
        cells = [f"{v['outcome']} ({v['reason']}) at window {v['windows']}" for v in phase["verdicts"].values()]
        print(f"| {phase['candidate_chunk']} | {tbt[len(tbt) // 2]:.2f} [{tbt[0]:.2f}, {tbt[-1]:.2f}] | "
              f"{ttft[len(ttft) // 2]:.2f} [{ttft[0]:.2f}, {ttft[-1]:.2f}] | {' | '.join(cells)} |")
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv, "date": started, "machine": platform.platform(),
                                        "cpus": os.cpu_count(), "load_average": [load_at_start, os.getloadavg()],
                                        "window_s": args.window, "load": LOAD.__dict__, "serve": SERVE,
                                        "control_chunk": CONTROL_CHUNK, "failed_requests": errors,
                                        "phases": phases}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
