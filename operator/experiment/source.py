"""The experiment's one piece of I/O: its windows from Prometheus (the queries and their parsing are queries.py's).
Every failure is a MetricsUnavailable, as for the control loop's reading."""
from __future__ import annotations

from collections.abc import Sequence

from metronome.operator.experiment.queries import QueryError, Windows, build_queries, window_readings
from metronome.operator.experiment.verdict import WindowReading
from metronome.operator.metrics_source import MetricsUnavailable, PrometheusMetricsSource, ServiceSelector


def read_windows(source: PrometheusMetricsSource, selector: ServiceSelector, candidate_pods: Sequence[str],
                 windows: Windows, tbt_target_s: float | None) -> list[WindowReading]:
    """Every complete window of both groups (none when `windows.count` is 0)."""
    if windows.count == 0:
        return []
    start, end = windows.end(1), windows.end(windows.count)
    queries = build_queries(selector, candidate_pods, windows.seconds)
    results = {group: {key: source.range_query(query, start, end, windows.seconds) for key, query in by_key.items()}
               for group, by_key in queries.items()}
    try:
        return window_readings(results, windows, tbt_target_s, selector.pod_label)
    except QueryError as exc:
        raise MetricsUnavailable(MetricsUnavailable.BAD_RESPONSE, f"experiment windows: {exc}") from exc
