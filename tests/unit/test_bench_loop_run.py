"""`metronome bench loop` end to end on this machine: real `metronome serve` processes (random:tiny, CPU), the
operator's decide() on what their /metrics say, a decision written by the `..data` swap and applied by the
servers, a static run on the same servers, the JSON and the PNG. A mechanism check: no timing is asserted."""
from __future__ import annotations

import argparse
import json

from metronome.server.bench.loop import cli as loop_cli
from metronome.server.bench.loop import runner as loop


def test_the_loop_retunes_real_servers_and_a_static_run_holds(tmp_path, monkeypatch):
    written = []  # runs in the JSON each time it is written: after every run, so a command cut short keeps them
    report = loop.report
    monkeypatch.setattr(loop, "report", lambda runs, *rest: written.append(len(runs)) or report(runs, *rest))
    parser = argparse.ArgumentParser()
    loop_cli.configure(parser)
    out, plot = tmp_path / "loop.json", tmp_path / "loop.png"
    args = parser.parse_args([
        "--model", "random:tiny", "--device", "cpu", "--reuse-servers", "--serve-arg=--no-prefix-caching",
        "--phases", "long-short:6:8", "--long-prompt-len", "600", "--short-prompt-len", "16", "--output-len", "12",
        "--slo-tbt-ms", "1", "--initial", "2048,fcfs", "--interval", "2", "--window", "4", "--scrape-interval", "0.5",
        "--autotune", '{"cooldownSeconds": 1, "minChunkSize": 32, "policySwitching": false}',
        "--tuning-policies", "multiplicative", "--client-processes", "2", "--warmup", "2",
        "--static", "256,fcfs", "--work-dir", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)])
    assert loop_cli.main(args) == 0
    assert written == [1, 2, 2]
    result = json.loads(out.read_text())
    loop_run, static_run = result["runs"]
    assert (loop_run["label"], static_run["label"]) == ("loop multiplicative", "static 256/fcfs")
    # every request of the schedule once, from two client processes, none of the warm-up's among them
    counts = loop_run["requests"]
    assert counts["completed"] == counts["sent"] == counts["scheduled"] == static_run["requests"]["scheduled"] > 0
    # A 1 ms target is unreachable: the x0.9 rule shrinks the budget, the servers apply each new generation.
    changes = [i for i in loop_run["intervals"] if i["decision"]["changed"]]
    assert changes and all(c["decision"]["to"]["chunk_size"] < c["chunk_size"] for c in changes)
    served = [i for i in loop_run["intervals"] if i["generation"] > 1 and i["observed"]]
    assert served and max(i["pods_on_generation"] for i in served) == 1
    assert all(i["decision"]["actions"] == ["static"] and i["chunk_size"] == 256 for i in static_run["intervals"])
    assert static_run["intervals"][0]["generation"] > loop_run["last_generation"]  # its own config, on reuse
    assert result["oracle"]["best_by_phase"][0]["config"] == "static 256/fcfs"
    assert plot.stat().st_size > 10_000
