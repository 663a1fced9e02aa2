"""The GPU state a benchmark section records: nvidia-smi's samples parsed, summarised, and read from a live
(fake) nvidia-smi in loop mode."""
from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from metronome.server.bench.engine import gpu_state
from metronome.server.bench.engine.gpu_state import GpuSample, choose_fields, describe, parse_sample, summarize, watch


def test_parse_sample_reads_values_reasons_and_missing_fields():
    assert parse_sample("1980, 3201, 45, 512.34, 0x0000000000000004\n") == GpuSample(1980, 3201, 45, 512.34, 0x4)
    assert parse_sample("[N/A], 3201, 40, [N/A], [Not Supported]") == GpuSample(None, 3201, 40, None, None)
    assert parse_sample("No devices were found") is None
    assert parse_sample("") is None
    assert parse_sample("[N/A], [N/A], [N/A], [N/A], 0x0") is None  # nothing measured: not a sample


def test_summarize_gives_extremes_and_the_share_of_each_slowdown():
    samples = [GpuSample(1980, 3201, 40, 600, 0x0), GpuSample(1755, 3201, 52, 700, 0x4),
               GpuSample(1600, 3201, 60, 690, 0x4 | 0x20), GpuSample(1500, 3201, 61, 650, 0x80)]
    summary = summarize(samples, period_ms=250)
    assert summary["samples"] == 4 and summary["period_ms"] == 250
    assert summary["sm_clock_mhz"] == {"mean": 1708.75, "min": 1500, "max": 1980, "first": 1980, "last": 1500}
    assert summary["temperature_c"]["first"] == 40 and summary["temperature_c"]["last"] == 61
    assert summary["power_w"]["max"] == 700
    assert summary["share_power_capped"] == 0.5
    assert summary["share_thermal_slowdown"] == 0.25
    assert summary["share_hardware_slowdown"] == 0.25
    line = describe(summary)
    assert "SM clock 1709 MHz (1500-1980)" in line and "power-capped 50%" in line and "40 -> 61 C" in line


def test_summarize_without_samples_or_reasons_reports_only_what_it_has():
    empty = summarize([])
    assert empty["samples"] == 0 and empty["sm_clock_mhz"] is None and "share_power_capped" not in empty
    no_reasons = summarize([GpuSample(1980, None, 40, None, None)])
    assert no_reasons["mem_clock_mhz"] is None and "share_thermal_slowdown" not in no_reasons
    assert describe({"unavailable": "nvidia-smi is not on PATH"}) == "gpu state: nvidia-smi is not on PATH"


def _fake_smi(tmp_path, knows_event_reasons: bool = True, fails: bool = False) -> str:
    """An executable that answers like nvidia-smi: one sample, or one every -lms milliseconds until killed."""
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""
        import sys, time
        args = sys.argv[1:]
        query = next(a for a in args if a.startswith("--query-gpu="))
        if {fails!r}:
            print("No devices were found", file=sys.stderr)
            sys.exit(6)
        if "clocks_event_reasons" in query and not {knows_event_reasons!r}:
            print('Field "clocks_event_reasons.active" is not a valid field to query.')
            sys.exit(2)
        period = int(args[args.index("-lms") + 1]) / 1000 if "-lms" in args else None
        clock = 1980
        while True:
            print(f"{{clock}}, 3201, 45, 650.5, 0x0000000000000004", flush=True)
            if period is None:
                break
            clock -= 10
            time.sleep(period)
    """))
    os.chmod(script, 0o755)
    return str(script)


def test_choose_fields_falls_back_to_the_old_reason_name_and_names_a_failure(tmp_path):
    new = tmp_path / "new"
    old = tmp_path / "old"
    bad = tmp_path / "bad"
    for d in (new, old, bad):
        d.mkdir()
    assert choose_fields(_fake_smi(new), "GPU-1")[-1] == "clocks_event_reasons.active"
    assert choose_fields(_fake_smi(old, knows_event_reasons=False), "GPU-1")[-1] == "clocks_throttle_reasons.active"
    with pytest.raises(RuntimeError, match="cannot report on GPU-1: No devices were found"):
        choose_fields(_fake_smi(bad, fails=True), "GPU-1")


def test_watch_samples_a_live_nvidia_smi_until_the_block_ends(tmp_path):
    with watch("GPU-1", executable=_fake_smi(tmp_path), period_ms=50) as state:
        assert state == {}
        time.sleep(0.6)
    assert state["samples"] >= 4 and state["seconds"] >= 0.6
    assert state["sm_clock_mhz"]["first"] == 1980 and state["sm_clock_mhz"]["last"] < 1980  # the clock fell
    assert state["share_power_capped"] == 1.0 and state["share_thermal_slowdown"] == 0.0


def test_watch_records_why_it_could_not_sample_and_nothing_off_cuda(tmp_path):
    with watch("GPU-1", executable=str(tmp_path / "missing")) as state:
        pass
    assert "did not answer" in state["unavailable"]
    with watch("GPU-1", executable=_fake_smi(tmp_path, fails=True)) as state:
        pass
    assert "No devices were found" in state["unavailable"]
    with watch(None) as state:
        pass
    assert state == {}
    assert gpu_state.gpu_target(type("Cpu", (), {"type": "cpu"})()) is None
