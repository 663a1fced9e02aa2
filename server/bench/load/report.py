"""Printing results as rich tables on stdout."""
from __future__ import annotations

from typing import Any

from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.sweep import Choice, Recommendation


def console() -> Any:
    import sys

    from rich.console import Console

    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 160)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def runs_table(runs: list[RunEntry], title: str = "Benchmark runs") -> Any:
    from rich.table import Table

    table = Table(title=title)
    for name in ("run", "done/sent", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TBT p50", "TBT p90", "TBT p99",
                 "TBT max", "goodput", "SLO"):
        table.add_column(name, justify="left" if name == "run" else "right")
    for run in runs:
        s = run.summary
        sent = sum(1 for r in run.records if r.sent_s is not None) if run.records else s.num_requests
        slo = "-" if s.meets_slo is None else ("yes" if s.meets_slo else "NO")
        table.add_row(run.label, f"{s.num_completed}/{sent}", _fmt(s.request_throughput, 2),
                      _fmt(s.output_tokens_per_s), _fmt(s.ttft.p50_ms), _fmt(s.ttft.p99_ms), _fmt(s.tbt.p50_ms),
                      _fmt(s.tbt.p90_ms), _fmt(s.tbt.p99_ms), _fmt(s.tbt.max_ms),
                      "-" if s.goodput_ratio is None else f"{100 * s.goodput_ratio:.0f}%", slo)
    return table


def _choice_row(rank: str, choice: Choice) -> list[str]:
    return [rank, str(choice.chunk_size), choice.queue_policy, _fmt(choice.capacity_rate, 2),
            _fmt(choice.output_tokens_per_s), _fmt(choice.tbt_p99_ms), _fmt(choice.ttft_p99_ms)]


def recommendation_table(recommendations: list[Recommendation]) -> Any:
    from rich.table import Table

    table = Table(title="Recommended configuration per TBT SLO (measured)")
    for name in ("TBT SLO (ms)", "rank", "chunk", "policy", "capacity (req/s)", "out tok/s", "TBT p99", "TTFT p99"):
        table.add_column(name, justify="right")
    for rec in recommendations:
        if rec.best is None:
            table.add_row(f"{rec.slo_tbt_ms:g}", "-", "-", "-", "-", "-", "-", "-")
            continue
        table.add_row(f"{rec.slo_tbt_ms:g}", *_choice_row("best", rec.best))
        for i, alt in enumerate(rec.alternatives, start=2):
            table.add_row("", *_choice_row(f"#{i}", alt))
    return table


def recommendation_lines(recommendations: list[Recommendation]) -> list[str]:
    lines = []
    for rec in recommendations:
        if rec.best is None:
            lines.append(f"TBT SLO {rec.slo_tbt_ms:g} ms: {rec.note}")
            continue
        b = rec.best
        line = (f"TBT SLO {rec.slo_tbt_ms:g} ms: best = chunk_size {b.chunk_size}, queue_policy {b.queue_policy} "
                f"({b.output_tokens_per_s:.1f} output tok/s at {b.rate:g} req/s, TBT p99 {b.tbt_p99_ms:.1f} ms)")
        if rec.alternatives:
            line += "; runner-up: " + ", ".join(f"chunk {a.chunk_size}/{a.queue_policy} "
                                                f"({a.output_tokens_per_s:.1f} tok/s)" for a in rec.alternatives)
        lines.append(line)
    return lines
