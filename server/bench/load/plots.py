"""Benchmark figures (matplotlib, Agg backend: no display needed).

One PNG, two panels: the TBT distribution of every run (CDF, log-scaled milliseconds), and TBT p99 against
output throughput across runs, one line per configuration (e.g. chunk size), with the SLO drawn in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from metronome.contract.errors import MetronomeError


class PlotError(MetronomeError):
    """The figure cannot be written (bad path, nothing to plot)."""


@dataclass
class PlotRun:
    label: str  # one run, e.g. "chunk 512 fcfs @ 4 req/s"
    group: str  # the line it belongs to in the p99-vs-throughput panel, e.g. "chunk 512 / fcfs"
    gaps_ms: list[float] = field(default_factory=list)
    output_tokens_per_s: float = 0.0
    tbt_p99_ms: float | None = None


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def plot_runs(runs: list[PlotRun], path: str | Path, slo_tbt_ms: float | None = None, title: str | None = None) -> Path:
    if not runs:
        raise PlotError("nothing to plot: no runs")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (cdf_ax, p99_ax) = plt.subplots(1, 2, figsize=(13, 5))
    try:
        many = len(runs) > 12
        for run in runs:
            if run.gaps_ms:
                xs, ys = _cdf([max(g, 1e-3) for g in run.gaps_ms])
                cdf_ax.step(xs, ys, where="post", linewidth=1.0, label=None if many else run.label)
        cdf_ax.set_xscale("log")
        cdf_ax.set_xlabel("time between tokens (ms)")
        cdf_ax.set_ylabel("fraction of gaps ≤ x")
        cdf_ax.set_title("TBT distribution per run")
        cdf_ax.grid(True, which="both", alpha=0.3)

        groups: dict[str, list[PlotRun]] = {}
        for run in runs:
            if run.tbt_p99_ms is not None:
                groups.setdefault(run.group, []).append(run)
        for group, members in groups.items():
            members.sort(key=lambda r: r.output_tokens_per_s)
            p99_ax.plot([r.output_tokens_per_s for r in members], [r.tbt_p99_ms for r in members], marker="o",
                        label=group)
        p99_ax.set_xlabel("output throughput (tokens/s)")
        p99_ax.set_ylabel("TBT p99 (ms)")
        p99_ax.set_title("TBT p99 vs throughput")
        p99_ax.grid(True, alpha=0.3)

        for ax in (cdf_ax, p99_ax):
            if slo_tbt_ms is not None:
                if ax is cdf_ax:
                    ax.axvline(slo_tbt_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_tbt_ms:g} ms")
                else:
                    ax.axhline(slo_tbt_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_tbt_ms:g} ms")
            handles, _ = ax.get_legend_handles_labels()
            if handles:
                ax.legend(fontsize=7, loc="best")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110)
        except OSError as exc:
            raise PlotError(f"cannot write plot {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return path
