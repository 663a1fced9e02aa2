"""The MoE micro-benchmark's plumbing (hack/bench_moe.py --smoke): tiny shapes on the CPU under Triton's
interpreter, so the GPU call that times the real shapes does not fail on a bug here. Speed is the GPU's business."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from metronome.server.models.moe_experts import grouped_mm_available


def test_smoke_run_times_every_path_and_checks_it_against_naive(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    script = Path(__file__).resolve().parents[2] / "hack" / "bench_moe.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--tokens", "3", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    paths = {(row["model"], row["path"]) for row in rows}
    expected = ("naive", "triton") + (("grouped_mm",) if grouped_mm_available() else ())
    assert paths == {(m, p) for m in ("tiny-qwen3", "tiny-gpt-oss") for p in expected}
    for row in rows:
        assert "error" not in row, row
        assert row["us"] > 0 and row["distinct_experts"] >= 1 and row["max_rel_err"] < 2e-2, row
        assert row["speedup_vs_naive"] is not None
