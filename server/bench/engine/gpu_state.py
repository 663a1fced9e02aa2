"""What the GPU's clocks, temperature and power did while a benchmark section ran.

The same code's whole saturation runs on the H200 differ by a few per cent with their place in a call, and the
median decode step by up to 15 % from one machine to the next (docs/perf/fp8-h200.md): a run late in a call may
find the GPU hotter, at its power cap, its SM clock lowered. A section run under `watch` records that: nvidia-smi
in its loop mode (`-lms`, one sample every PERIOD_MS, a process of its own, so the engine's host thread is not
slowed) reports the SM and memory clocks, the temperature, the power draw and the active clock-event (throttle)
reasons, and `summarize` reduces the samples to means, extremes and the share of samples each kind of slowdown was
active. Where nvidia-smi is missing or cannot report on the device, the section records why instead.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import fmean
from typing import Any

PERIOD_MS = 500
# The clock-event reasons were called throttle reasons before driver 535; older nvidia-smi knows only that name.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
BASE_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw")
# NVML's clock-event reason bits, grouped by what slowed the clocks.
POWER_CAP = 0x4  # software power cap
THERMAL = 0x20 | 0x40  # software and hardware thermal slowdown
HARDWARE_SLOWDOWN = 0x8 | 0x80  # hardware slowdown, power brake
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GpuSample:
    sm_clock_mhz: float | None
    mem_clock_mhz: float | None
    temperature_c: float | None
    power_w: float | None
    reasons: int | None  # NVML clock-event reason bits; None where not reported


def _number(text: str) -> float | None:
    text = text.strip()
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_sample(line: str) -> GpuSample | None:
    """One line of `--format=csv,noheader,nounits` output for BASE_FIELDS plus a reason field (None: not a
    sample, e.g. a blank line or a message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(BASE_FIELDS) + 1:
        return None
    values = [_number(p) for p in parts[:-1]]
    if all(v is None for v in values):
        return None
    try:
        reasons = int(parts[-1], 16)
    except ValueError:
        reasons = None
    return GpuSample(*values, reasons)


def _stats(values: Sequence[float | None]) -> dict[str, float] | None:
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"mean": fmean(known), "min": min(known), "max": max(known), "first": known[0], "last": known[-1]}


def summarize(samples: Sequence[GpuSample], period_ms: int = PERIOD_MS) -> dict[str, Any]:
    """Means and extremes of each quantity, and the share of samples in which the clocks were held down by the
    power cap, by heat, or by a hardware slowdown. Pure."""
    summary: dict[str, Any] = {"samples": len(samples), "period_ms": period_ms}
    for key in ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w"):
        summary[key] = _stats([getattr(s, key) for s in samples])
    reasons = [s.reasons for s in samples if s.reasons is not None]
    if reasons:
        summary["share_power_capped"] = sum(bool(r & POWER_CAP) for r in reasons) / len(reasons)
        summary["share_thermal_slowdown"] = sum(bool(r & THERMAL) for r in reasons) / len(reasons)
        summary["share_hardware_slowdown"] = sum(bool(r & HARDWARE_SLOWDOWN) for r in reasons) / len(reasons)
    return summary


def describe(summary: dict[str, Any]) -> str:
    """One line for the console."""
    if "unavailable" in summary:
        return f"gpu state: {summary['unavailable']}"
    sm, power, temp = summary.get("sm_clock_mhz"), summary.get("power_w"), summary.get("temperature_c")
    parts = [f"{summary['samples']} samples"]
    if sm:
        parts.append(f"SM clock {sm['mean']:.0f} MHz ({sm['min']:.0f}-{sm['max']:.0f})")
    if power:
        parts.append(f"power {power['mean']:.0f} W (max {power['max']:.0f})")
    if temp:
        parts.append(f"{temp['first']:.0f} -> {temp['last']:.0f} C")
    if "share_power_capped" in summary:
        parts.append(f"power-capped {summary['share_power_capped']:.0%}, thermal "
                     f"{summary['share_thermal_slowdown']:.0%}, hardware {summary['share_hardware_slowdown']:.0%}")
    return "gpu state: " + ", ".join(parts)


def _query(executable: str, target: str, fields: Sequence[str]) -> list[str]:
    return [executable, "-i", target, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def choose_fields(executable: str, target: str) -> tuple[str, ...]:
    """The query this nvidia-smi answers: the reason field under its current name, else its old one. Raises
    RuntimeError with nvidia-smi's message when neither works (no such GPU, no driver)."""
    message = ""
    for reason in REASON_FIELDS:
        fields = (*BASE_FIELDS, reason)
        try:
            done = subprocess.run(_query(executable, target, fields), capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{executable} did not answer: {exc}") from exc
        if done.returncode == 0 and parse_sample(done.stdout.splitlines()[0] if done.stdout else "") is not None:
            return fields
        message = (done.stderr or done.stdout).strip().splitlines()[0] if (done.stderr or done.stdout) else ""
    raise RuntimeError(f"{executable} cannot report on {target}: {message or 'no sample'}")


class GpuWatch:
    """Samples one GPU from a background nvidia-smi process until stopped."""

    def __init__(self, executable: str, target: str, fields: Sequence[str], period_ms: int = PERIOD_MS):
        self.period_ms = period_ms
        self.samples: list[GpuSample] = []
        # Line-buffered where coreutils' stdbuf exists: into a pipe, C stdio would hold the samples in a 4 KB block
        # until the loop ends, and a terminated process never writes its last block.
        line_buffered = [stdbuf, "-oL"] if (stdbuf := shutil.which("stdbuf")) else []
        self._process = subprocess.Popen([*line_buffered, *_query(executable, target, fields), "-lms", str(period_ms)],
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-state", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> dict[str, Any]:
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5)
        return summarize(self.samples, self.period_ms)


def gpu_target(device: Any) -> str | None:
    """nvidia-smi's name for a torch CUDA device (its UUID, right under CUDA_VISIBLE_DEVICES); None off CUDA."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is None:  # a torch without it: the index, right unless CUDA_VISIBLE_DEVICES renumbers the GPUs
        return str(index)
    uuid = str(uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


@contextmanager
def watch(target: str | None, executable: str | None = None,
          period_ms: int = PERIOD_MS) -> Iterator[dict[str, Any]]:
    """Sample the GPU nvidia-smi knows as `target` (gpu_target) while the block runs. The dict yielded is filled
    when the block ends: with summarize()'s keys and the seconds watched, or {"unavailable": why}; with no target
    (not a CUDA device) it stays empty."""
    state: dict[str, Any] = {}
    if target is None:
        yield state
        return
    executable = executable or shutil.which("nvidia-smi")
    started = time.monotonic()
    try:
        if executable is None:
            raise RuntimeError("nvidia-smi is not on PATH")
        sampler = GpuWatch(executable, target, choose_fields(executable, target), period_ms)
    except (RuntimeError, OSError) as exc:
        state["unavailable"] = str(exc)
        yield state
        return
    try:
        yield state
    finally:
        state.update(sampler.stop(), seconds=time.monotonic() - started)
