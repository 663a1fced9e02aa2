"""`metronome bench loop --servers 2 --scale-replicas` on this machine: real `metronome serve` processes
(random:tiny, CPU) started and stopped by the operator's replica decisions. A 1 ms TBT target at the chunk floor
cannot be met, so the loop adds a server (the load then reaches both through the routes file); the quiet phase
after it is idle, so the loop drains one again (out of the routes, then stopped) — and every request completes.
A mechanism check: no timing is asserted."""
from __future__ import annotations

import argparse
import json

from metronome.server.bench.loop import cli as loop_cli


def test_the_loop_starts_and_drains_servers_and_no_request_fails(tmp_path):
    parser = argparse.ArgumentParser()
    loop_cli.configure(parser)
    out = tmp_path / "loop.json"
    args = parser.parse_args([
        "--model", "random:tiny", "--device", "cpu", "--servers", "2", "--scale-replicas",
        "--phases", "long-short:6:16,long-short:0.05:12", "--long-prompt-len", "300", "--short-prompt-len", "16",
        "--output-len", "12", "--slo-tbt-ms", "1", "--initial", "64,fcfs", "--interval", "2", "--window", "4",
        "--scrape-interval", "0.5",
        "--autotune", '{"cooldownSeconds": 1, "minChunkSize": 64, "policySwitching": false, '
                      '"scaleDownStabilizationSeconds": 2}',
        "--tuning-policies", "multiplicative",
        "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    assert loop_cli.main(args) == 0
    result = json.loads(out.read_text())
    (loop_run,) = result["runs"]
    assert loop_run["label"] == "loop multiplicative"

    decisions = [i["decision"] for i in loop_run["intervals"] if i["decision"]["changed"]]
    ups = [d for d in decisions if "scale_up" in d["actions"]]
    downs = [d for d in decisions if "scale_down" in d["actions"]]
    assert ups and ups[0]["to"]["servers"] == 2, [d["summary"] for d in decisions]
    assert downs and downs[-1]["to"]["servers"] == 1 and "no requests" in downs[-1]["reason"]
    assert [i["servers"] for i in loop_run["intervals"]][0] == 1 and loop_run["intervals"][-1]["servers"] == 1

    # Both servers took load; the second was launched by the loop and stopped by it, inside the run.
    timeline = {s["name"]: s for s in loop_run["server_timeline"]}
    assert set(timeline) == {"server-0", "server-1"}
    assert timeline["server-1"]["launched_s"] > 0 and timeline["server-1"]["stopped_s"] is not None
    by_server = loop_run["requests"]["by_server"]
    assert set(by_server) == {timeline["server-0"]["url"], timeline["server-1"]["url"]}
    assert all(count > 0 for count in by_server.values())

    # Drained, not cut: every request completed, none aborted, none refused.
    counts = loop_run["requests"]
    assert counts["completed"] == counts["sent"] == counts["scheduled"] > 0
    assert counts["aborted"] == 0 and counts["errors"] == []

    # The cost side: the second server counts for the part of the run it lived, its start-up included.
    duration = sum(p["duration_s"] for p in result["phases"])
    lived = timeline["server-1"]["stopped_s"] - timeline["server-1"]["launched_s"]
    assert abs(loop_run["server_seconds"] - (duration + lived)) < 1.0
    assert "goodput_per_server_s" in loop_run and "goodput_per_server_s" in loop_run["phases"][0]
