"""`metronome bench stream-cost`: CPU per streamed token of a local server's API and engine processes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from metronome.contract.errors import MetronomeError
from metronome.server.bench.robustness.stream_cost import (
    CpuTimes,
    is_spawned_worker,
    process_cpu_seconds,
    round_result,
    start_time,
    summarize,
)


def test_cpu_seconds_read_past_a_command_name_with_spaces_and_parens():
    # pid (comm) state ppid ... : utime and stime are fields 14 and 15 of the line
    line = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 9 0 77 0 0"
    assert process_cpu_seconds(line, 100) == pytest.approx(3.0)


def test_start_time_is_field_22():
    line = "4242 (python3 (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 9 0 77 0 0"
    assert start_time(line) == 77


def test_only_the_spawned_engine_counts_not_the_resource_tracker():
    assert is_spawned_worker(b"python3\0-c\0from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=8)")
    assert not is_spawned_worker(b"python3\0-c\0from multiprocessing.resource_tracker import main;main(7)")


def test_per_token_figures_and_their_medians():
    first = round_result(1000, 0.5, CpuTimes(1.0, 2.0), CpuTimes(1.05, 2.2))
    assert (first.tokens_per_s, first.api_us_per_token, first.engine_us_per_token) == (2000.0, 50.0, 200.0)
    second = round_result(1000, 0.4, CpuTimes(0.0, 0.0), CpuTimes(0.03, 0.1))
    summary = summarize([first, second, second])
    assert summary["median_api_us_per_token"] == 30.0 and summary["median_tokens_per_s"] == 2500.0
    with pytest.raises(MetronomeError, match="nothing to measure"):
        round_result(0, 0.5, CpuTimes(0, 0), CpuTimes(0, 0))


def test_a_real_server_streams_every_token_and_reports_both_processes(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "-m", "metronome.cli", "bench", "stream-cost", "--streams", "4",
                           "--tokens", "40", "--rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    [measured] = result["rounds"]
    assert measured["tokens"] == 4 * 40
    assert measured["api_us_per_token"] >= 0 and measured["engine_us_per_token"] > 0
    assert "µs of CPU per streamed token" in done.stdout and result["api_processes"] == 1


def test_several_api_servers_are_counted_together(tmp_path):
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, "-m", "metronome.cli", "bench", "stream-cost", "--streams", "8",
                           "--tokens", "20", "--rounds", "1", "--serve-arg=--api-servers=2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["api_processes"] == 2 and result["rounds"][0]["tokens"] == 8 * 20
