"""Turn per-request token timestamps into latency percentiles, throughput and goodput. Pure functions.

Definitions (also in docs/bench.md):
- TTFT of a request = first token time - send time (queueing and prefill included, as a client sees it).
- TBT gaps of a request = differences between consecutive token times; run TBT percentiles pool every gap of
  every completed request, so they weigh requests by their length, like the server's TBT histogram.
- Throughput window = first send to last completion of the run's completed requests.
- Goodput under a TBT SLO: a request is *good* when it completed and the 99th percentile of its own gaps is
  <= the SLO (with 128 output tokens that is nearly its worst gap, but one stray hiccup is tolerated);
  it is *strictly good* when every gap is <= the SLO. Requests with fewer than two tokens have no gaps and
  count as good. If a TTFT SLO is given, good also requires TTFT <= it. goodput_ratio = good / sent requests
  (errors count as not good); goodput_tokens_per_s = output tokens of good requests / window.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from metronome.server.bench.load.records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def gaps(token_times: Sequence[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


def ttft(record: RequestRecord) -> float | None:
    if record.sent_s is None or not record.token_times_s:
        return None
    return record.token_times_s[0] - record.sent_s


@dataclass
class LatencySummary:
    """Percentiles of one latency, in milliseconds (None when there were no samples)."""

    count: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


def latency_summary(seconds: Sequence[float]) -> LatencySummary:
    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    return LatencySummary(
        count=len(seconds),
        mean_ms=ms(mean(seconds)),
        p50_ms=ms(percentile(seconds, 50)),
        p90_ms=ms(percentile(seconds, 90)),
        p99_ms=ms(percentile(seconds, 99)),
        max_ms=ms(max(seconds) if seconds else None),
    )


def is_good(record: RequestRecord, slo_tbt_s: float, slo_ttft_s: float | None = None, strict: bool = False) -> bool:
    """Whether one request met the SLO (see the module docstring for the exact rule)."""
    if not record.ok:
        return False
    if slo_ttft_s is not None:
        first = ttft(record)
        if first is None or first > slo_ttft_s:
            return False
    request_gaps = gaps(record.token_times_s)
    if not request_gaps:
        return True
    worst = max(request_gaps) if strict else percentile(request_gaps, 99)
    return worst <= slo_tbt_s  # type: ignore[operator]


@dataclass
class RunSummary:
    num_requests: int = 0  # records in the run (sent or not)
    num_completed: int = 0
    num_errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0  # the throughput window
    request_throughput: float = 0.0  # completed requests / s
    output_tokens: int = 0
    token_stamps: int = 0  # timestamps behind the TBT gaps; < output_tokens when a server merged tokens into chunks
    output_tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    ttft: LatencySummary = field(default_factory=LatencySummary)
    tbt: LatencySummary = field(default_factory=LatencySummary)
    e2e: LatencySummary = field(default_factory=LatencySummary)
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> {count, ttft, tbt}
    slo_tbt_ms: float | None = None
    slo_ttft_ms: float | None = None
    meets_slo: bool | None = None  # pooled TBT p99 <= SLO (and TTFT p99 <= its SLO, if given)
    goodput_ratio: float | None = None
    strict_goodput_ratio: float | None = None
    goodput_tokens_per_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _error_kind(error: str) -> str:
    return error.split(":", 1)[0].strip() or "error"


def summarize(records: Iterable[RequestRecord], slo_tbt_ms: float | None = None,
              slo_ttft_ms: float | None = None) -> RunSummary:
    records = list(records)
    completed = [r for r in records if r.ok]
    summary = RunSummary(num_requests=len(records), num_completed=len(completed),
                         num_errors=sum(1 for r in records if r.error is not None))
    for r in records:
        if r.error is not None:
            kind = _error_kind(r.error)
            summary.error_kinds[kind] = summary.error_kinds.get(kind, 0) + 1

    if completed:
        start = min(r.sent_s for r in completed)  # type: ignore[type-var]
        end = max(r.end_s for r in completed)  # type: ignore[type-var]
        summary.duration_s = max(end - start, 0.0)
    summary.output_tokens = sum(r.output_tokens for r in completed)
    summary.token_stamps = sum(len(r.token_times_s) for r in completed)
    summary.prompt_tokens = sum(r.prompt_tokens or 0 for r in completed)
    if summary.duration_s > 0:
        summary.request_throughput = len(completed) / summary.duration_s
        summary.output_tokens_per_s = summary.output_tokens / summary.duration_s

    ttfts = [t for t in (ttft(r) for r in completed) if t is not None]
    all_gaps = [g for r in completed for g in gaps(r.token_times_s)]
    summary.ttft = latency_summary(ttfts)
    summary.tbt = latency_summary(all_gaps)
    summary.e2e = latency_summary([r.end_s - r.sent_s for r in completed])  # type: ignore[operator]

    for kind in sorted({r.kind for r in completed}):
        of_kind = [r for r in completed if r.kind == kind]
        summary.by_kind[kind] = {
            "count": len(of_kind),
            "ttft": asdict(latency_summary([t for t in (ttft(r) for r in of_kind) if t is not None])),
            "tbt": asdict(latency_summary([g for r in of_kind for g in gaps(r.token_times_s)])),
        }

    if slo_tbt_ms is not None:
        slo_s = slo_tbt_ms / 1000.0
        slo_ttft_s = None if slo_ttft_ms is None else slo_ttft_ms / 1000.0
        summary.slo_tbt_ms = slo_tbt_ms
        summary.slo_ttft_ms = slo_ttft_ms
        tbt_ok = summary.tbt.p99_ms is None or summary.tbt.p99_ms <= slo_tbt_ms
        ttft_ok = slo_ttft_ms is None or (summary.ttft.p99_ms is not None and summary.ttft.p99_ms <= slo_ttft_ms)
        summary.meets_slo = bool(completed) and tbt_ok and ttft_ok
        sent = [r for r in records if r.sent_s is not None]
        good = [r for r in sent if is_good(r, slo_s, slo_ttft_s)]
        strict = [r for r in sent if is_good(r, slo_s, slo_ttft_s, strict=True)]
        summary.goodput_ratio = len(good) / len(sent) if sent else None
        summary.strict_goodput_ratio = len(strict) / len(sent) if sent else None
        summary.goodput_tokens_per_s = (sum(r.output_tokens for r in good) / summary.duration_s
                                        if summary.duration_s > 0 else 0.0)
    return summary
