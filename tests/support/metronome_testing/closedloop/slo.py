"""Pure: pick a TBT target for a CPU run from what the servers measured at the initial chunk size.

Step time on CPU varies several-fold between an idle 2-core machine and a busy one, so a fixed target would be
either trivially met or out of reach somewhere. Under long-short load, the median token gap is a decode step
(≈ a + b·decodes) and the p99 gap is a step that also prefills a full chunk (≈ a + b·(decodes + chunk)), so
    b ≈ (p99 − median) / chunk,    p99 at the floor chunk ≈ median + b · floor.
The target is a bucket bound of the TBT histogram (Prometheus' quantile is exact at bucket bounds, so Met and
Violated are crisp there), below its largest finite bound (beyond it histogram_quantile clamps to that bound and
a violation would read as Met), reachable at the floor chunk with slack, and clearly violated at the initial chunk.

The replica test's load step is measured, not predicted: a CPU server's TTFT under a closed loop grows with the
clients it carries only once its prefill budget (or its max_num_seqs) is saturated, and how far it grows between
`clients` and twice that varied from run to run (a CI run's one server met a limit its 4-client TTFT predicted it
would exceed 1.3-fold, and the loop rightly never scaled). So one server's TTFT p99 is measured at a few client
counts with the loop holding (choose_load_step takes them): N clients on two servers are N / 2 on each, which one
server measured. The limit is a TTFT bucket bound — between two bounds histogram_quantile interpolates, and a few
slow first tokens in a wide bucket (10 s to 20 s) read as a p99 near its top — that one server clearly exceeds
and two servers clearly meet, with more room on the two-server side: two servers on a 2-core machine share their
cores with the control plane and the load.
The same sharing slows each server's steps, so the TBT target the step is judged against is set again for two
servers (choose_shared_tbt_target): a CI run saw 1.03 s p99 on two servers at the floor chunk, where one server's
gaps predicted 349 ms.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from metronome.contract.metric_names import TBT_BUCKETS, TTFT_BUCKETS


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


def usable_bounds(buckets: Sequence[float]) -> list[float]:
    """The finite bucket bounds a quantile can be judged at exactly: all but the largest, beyond which
    histogram_quantile clamps."""
    return sorted(b for b in buckets if math.isfinite(b))[:-1]


def choose_tbt_target(median_s: float, p99_s: float, initial_chunk: int, floor_chunk: int,
                      buckets: Sequence[float] = TBT_BUCKETS, reach_slack: float = 1.25,
                      violation_factor: float = 1.5) -> Calibration:
    if not (median_s > 0 and p99_s >= median_s and initial_chunk > floor_chunk > 0):
        raise CalibrationError(f"need 0 < median ({median_s}) <= p99 ({p99_s}) and initial chunk ({initial_chunk}) > "
                               f"floor ({floor_chunk}) > 0")
    per_token = (p99_s - median_s) / initial_chunk
    at_floor = median_s + per_token * floor_chunk
    bounds = usable_bounds(buckets)
    fitting = [b for b in bounds if b >= reach_slack * at_floor and p99_s >= violation_factor * b]
    if not fitting:
        raise CalibrationError(
            f"no TBT bucket bound lies in [{reach_slack} x {at_floor * 1e3:.0f} ms, {p99_s * 1e3:.0f} ms / "
            f"{violation_factor}]: the chunk size barely moves the p99 here (median gap {median_s * 1e3:.0f} ms, "
            f"p99 {p99_s * 1e3:.0f} ms at chunk {initial_chunk}); the machine is too busy for a meaningful run")
    return Calibration(target_s=fitting[-1], per_token_s=per_token, floor_p99_s=at_floor, median_s=median_s,
                       p99_s=p99_s)


@dataclass(frozen=True)
class LoadStep:
    clients: int  # the stepped-up load, all servers together
    limit_s: float  # the TTFT limit: a TTFT bucket bound
    one_server_s: float  # TTFT p99 measured with all of them on one server
    two_servers_s: float  # ... measured on one server with half of them: what each of two carries

    def describe(self) -> str:
        return (f"{self.clients} clients: TTFT p99 {self.one_server_s * 1e3:.0f} ms on one server, "
                f"{self.two_servers_s * 1e3:.0f} ms with half of them → limit {self.limit_s * 1e3:.0f} ms")


def load_levels(clients: int, factors: Sequence[int] = (3, 6, 4, 8)) -> list[int]:
    """The client counts to measure one server at, in order, after `clients` itself: each even count's half is
    measured before it (6c needs 3c, 8c needs 4c). A CPU server's TTFT barely grows with the clients it batches
    (quiet runs measured 4.2-4.6, 4.4-5.3, 5.5-6.8 and 5.0-7.1 s p99 at 4, 8, 12 and 16 clients) and jumps once
    they queue past its max_num_seqs (16 in the replica test: 19.1-22.9 s at 24), so the steps measured queue on
    one server and not on two: 24 against 12 first, then 32 against 16. Two servers at 16 each sit at
    max_num_seqs, where one request more than its share queues whole on a server; at 12 each that takes four."""
    return [clients * f for f in factors]


def choose_load_step(measured: Mapping[int, float], buckets: Sequence[float] = TTFT_BUCKETS,
                     over_margin: float = 1.3, under_margin: float = 2.0) -> LoadStep | None:
    """From one server's TTFT p99 at each client count measured so far: the smallest load N whose half was
    measured too, with a TTFT bucket bound that one server (at N) exceeds by `over_margin` and each of two servers
    (at N / 2) meets by `under_margin` (the bound nearest the middle of that band); None while none fits (measure
    the next level). At 1.2 a CI run's one server, 1.22x over its limit, stayed under it for 7 minutes; two
    servers sharing the 2-core machine (with the load, the operator and the control plane on it too) measured up to
    1.62x what one server measured at half their load.
    """
    if any(not (n > 0 and ttft > 0) for n, ttft in measured.items()):
        raise CalibrationError(f"need positive client counts and TTFT p99s, got {dict(measured)}")
    bounds = usable_bounds(buckets)
    for total in sorted(measured):
        if total % 2 or total // 2 not in measured:
            continue
        one, two = measured[total], measured[total // 2]
        low, high = two * under_margin, one / over_margin
        fitting = [b for b in bounds if low <= b <= high]
        if fitting:
            middle = math.sqrt(low * high)
            limit = min(fitting, key=lambda b: abs(math.log(b / middle)))
            return LoadStep(clients=total, limit_s=limit, one_server_s=one, two_servers_s=two)
    return None


def choose_shared_tbt_target(one_server_p99_s: float, at_least_s: float, buckets: Sequence[float] = TBT_BUCKETS,
                             sharing: float = 3.0) -> float:
    """The TBT target for two servers sharing a 2-core machine: the smallest bucket bound at or above `sharing`
    times the p99 one server measured alone (and at least `at_least_s`, the one-server target)."""
    if not one_server_p99_s > 0:
        raise CalibrationError(f"need a positive TBT p99 ({one_server_p99_s})")
    wanted = max(at_least_s, sharing * one_server_p99_s)
    fitting = [b for b in usable_bounds(buckets) if b >= wanted]
    if not fitting:
        raise CalibrationError(f"no TBT bucket bound lies above {wanted * 1e3:.0f} ms ({sharing:g} x the "
                               f"{one_server_p99_s * 1e3:.0f} ms p99 of one server); the machine is too busy")
    return fitting[0]
