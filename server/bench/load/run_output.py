"""What every bench command writes besides its own results: its flags as the JSON's `config`, and its runs as
the plot's lines. Shared by `bench run`/`sweep` (commands.py) and `bench engine` (engine/command.py)."""
from __future__ import annotations

import argparse
from typing import Any

from metronome.server.bench.load.plots import PlotRun
from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.stats import gaps


def args_config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
            if not k.startswith("_") and not callable(v)}


def plot_entries(runs: list[RunEntry], group_of) -> list[PlotRun]:
    return [PlotRun(label=r.label, group=group_of(r), gaps_ms=[g * 1000 for rec in r.records if rec.ok
                                                                for g in gaps(rec.token_times_s)],
                    output_tokens_per_s=r.summary.output_tokens_per_s, tbt_p99_ms=r.summary.tbt.p99_ms)
            for r in runs]
