"""The timeline of `metronome bench loop` (matplotlib, Agg): one PNG, four panels over the run's seconds, phase
boundaries drawn in — the chunk size each loop run served (its queue policy as the marker: o fcfs, s split,
^ sjf), the clients' TBT p99 per interval against the target, TTFT p99 against its limit, and goodput per interval
(loop runs solid, static configs thin and dashed) — and a fifth, the servers each run had, once more than one ran."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from metronome.server.bench.load.plots import PlotError

MARKERS = {"fcfs": "o", "split": "s", "sjf": "^"}


def plot_timeline(result: dict[str, Any], path: str | Path) -> Path:
    runs = result["runs"]
    if not runs or not any(run["intervals"] for run in runs):
        raise PlotError("nothing to plot: no intervals")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    # A fifth panel, the servers each run had, where more than one server ever ran.
    counted = any(i.get("servers", 1) > 1 for run in runs for i in run["intervals"])
    fig, axes = plt.subplots(5 if counted else 4, 1, figsize=(11, 13 if counted else 11), sharex=True)
    chunk_ax, tbt_ax, ttft_ax, good_ax = axes[:4]
    for number, run in enumerate(runs):
        if counted:
            axes[4].step([i["t_end"] for i in run["intervals"]], [i.get("servers_live", 1) for i in run["intervals"]],
                         where="post", label=run["label"], color=f"C{number}",
                         lw=0.9 if run["static"] else 1.8, ls="--" if run["static"] else "-")
        color = f"C{number}"
        style = dict(color=color, lw=0.9, ls="--", alpha=0.7) if run["static"] else dict(color=color, lw=1.8)
        t = [i["t_end"] for i in run["intervals"]]
        if not run["static"]:
            chunk_ax.step(t, [i["chunk_size"] for i in run["intervals"]], where="post", label=run["label"],
                          color=color, lw=1.8)
            for policy, marker in MARKERS.items():
                points = [(i["t_end"], i["chunk_size"]) for i in run["intervals"] if i["queue_policy"] == policy]
                if points:
                    chunk_ax.scatter(*zip(*points, strict=True), marker=marker, color=color, s=22, zorder=3)
        tbt_ax.plot(t, [i["client"]["tbt_p99_ms"] for i in run["intervals"]], label=run["label"], **style)
        ttft_ax.plot(t, [i["client"]["ttft_p99_ms"] for i in run["intervals"]], label=run["label"], **style)
        good_ax.plot(t, [i["client"]["goodput_tok_s"] for i in run["intervals"]],
                     label=f"{run['label']} ({run['goodput_tok_s']:.1f} tok/s)", **style)
    slo = result["slo"]
    tbt_ax.axhline(slo["tbt_p99_ms"], color="k", lw=1, ls=":", label=f"target {slo['tbt_p99_ms']:g} ms")
    if slo["ttft_p99_ms"] is not None:
        ttft_ax.axhline(slo["ttft_p99_ms"], color="k", lw=1, ls=":", label=f"limit {slo['ttft_p99_ms']:g} ms")
    start = 0.0
    for phase in result["phases"]:
        for ax in axes:
            ax.axvline(start, color="grey", lw=0.6)
        chunk_ax.text(start + 1, 1.02, phase["label"], transform=chunk_ax.get_xaxis_transform(), fontsize=8)
        start += phase["duration_s"]
    chunk_ax.set_yscale("log", base=2)
    chunk_ax.set_ylabel("chunk size (tokens)\no fcfs, s split, ^ sjf")
    tbt_ax.set_yscale("log")
    tbt_ax.set_ylabel("TBT p99 per interval (ms)")
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("TTFT p99 per interval (ms)")
    good_ax.set_ylabel("goodput (tok/s)")
    if counted:
        axes[4].set_ylabel("servers taking load")
        axes[4].yaxis.get_major_locator().set_params(integer=True)
    axes[-1].set_xlabel("seconds since the load started")
    # Label the chunk sizes served (a log axis would label only powers of two) and write every log axis's
    # labels as plain numbers (TBT's minor labels would read 6×10¹; TTFT spans decades: majors are enough).
    served = sorted({i["chunk_size"] for run in runs if not run["static"] for i in run["intervals"]})
    if served:
        chunk_ax.set_yticks(served)
        chunk_ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in (chunk_ax, tbt_ax, ttft_ax):
        ax.yaxis.set_major_formatter(ScalarFormatter())
    tbt_ax.yaxis.set_minor_formatter(ScalarFormatter())
    ttft_ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"metronome bench loop — interval {result['interval_s']:g} s, window {result['window_s']:g} s",
                 y=0.995)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
    return Path(path)
