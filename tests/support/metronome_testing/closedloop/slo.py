"""Pure: pick a TBT target for a CPU run from what the servers measured at the initial chunk size.

Step time on CPU varies several-fold between an idle 2-core machine and a busy one, so a fixed target would be
either trivially met or out of reach somewhere. Under long-short load, the median token gap is a decode step
(≈ a + b·decodes) and the p99 gap is a step that also prefills a full chunk (≈ a + b·(decodes + chunk)), so
    b ≈ (p99 − median) / chunk,    p99 at the floor chunk ≈ median + b · floor.
The target is a bucket bound of the TBT histogram (Prometheus' quantile is exact at bucket bounds, so Met and
Violated are crisp there), below its largest finite bound (beyond it histogram_quantile clamps to that bound and
a violation would read as Met), reachable at the floor chunk with slack, and clearly violated at the initial chunk.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from metronome.contract.metric_names import TBT_BUCKETS


class CalibrationError(ValueError):
    """No bucket bound makes a meaningful target for these measurements (the message gives the numbers)."""


@dataclass(frozen=True)
class Calibration:
    target_s: float
    per_token_s: float  # b: the cost of one more token in a step
    floor_p99_s: float  # predicted p99 TBT at the floor chunk
    median_s: float
    p99_s: float

    def describe(self) -> str:
        return (f"at the initial chunk: median gap {self.median_s * 1e3:.0f} ms, p99 {self.p99_s * 1e3:.0f} ms → "
                f"{self.per_token_s * 1e3:.2f} ms per prefill token, predicted p99 at the floor chunk "
                f"{self.floor_p99_s * 1e3:.0f} ms → target {self.target_s * 1e3:.0f} ms")


def choose_tbt_target(median_s: float, p99_s: float, initial_chunk: int, floor_chunk: int,
                      buckets: Sequence[float] = TBT_BUCKETS, reach_slack: float = 1.25,
                      violation_factor: float = 1.5) -> Calibration:
    if not (median_s > 0 and p99_s >= median_s and initial_chunk > floor_chunk > 0):
        raise CalibrationError(f"need 0 < median ({median_s}) <= p99 ({p99_s}) and initial chunk ({initial_chunk}) > "
                               f"floor ({floor_chunk}) > 0")
    per_token = (p99_s - median_s) / initial_chunk
    at_floor = median_s + per_token * floor_chunk
    bounds = sorted(b for b in buckets if math.isfinite(b))[:-1]
    fitting = [b for b in bounds if b >= reach_slack * at_floor and p99_s >= violation_factor * b]
    if not fitting:
        raise CalibrationError(
            f"no TBT bucket bound lies in [{reach_slack} x {at_floor * 1e3:.0f} ms, {p99_s * 1e3:.0f} ms / "
            f"{violation_factor}]: the chunk size barely moves the p99 here (median gap {median_s * 1e3:.0f} ms, "
            f"p99 {p99_s * 1e3:.0f} ms at chunk {initial_chunk}); the machine is too busy for a meaningful run")
    return Calibration(target_s=fitting[-1], per_token_s=per_token, floor_p99_s=at_floor, median_s=median_s,
                       p99_s=p99_s)
