"""Redraw the TBT-p99-vs-throughput figure from a saved `metronome bench engine` JSON (its long-short section).

    .venv/bin/python hack/plot_engine_json.py docs/perf/h200-engine.json docs/perf/h200-tbt-vs-throughput.png

hack/gpu_run.sh brings the benchmark's own figure back (drawn from the runs in memory, with the TBT CDF); this
redraws the TBT p99 panel from a JSON when that figure is missing (the JSON keeps no per-token records, so the CDF
panel stays empty unless the run kept them).
"""
from __future__ import annotations

import json
import sys

from metronome.server.bench.load.plots import PlotRun, plot_runs


def runs_from_engine_json(doc: dict) -> list[PlotRun]:
    runs = []
    for run in doc["longshort"]["runs"]:
        chunk = run["params"]["chunk_size"]
        label = "unchunked" if chunk >= 1 << 20 else str(chunk)
        runs.append(PlotRun(label=run["label"], group=f"chunk {label}",
                            output_tokens_per_s=run["summary"]["output_tokens_per_s"],
                            tbt_p99_ms=run["summary"]["tbt"]["p99_ms"]))
    return runs


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_engine_json.py ENGINE.json OUT.png")
    with open(sys.argv[1]) as handle:
        doc = json.load(handle)
    slo = doc["longshort"].get("slo_tbt_ms")
    print(plot_runs(runs_from_engine_json(doc), sys.argv[2], slo,
                    title=f"{doc['model']['name']}: long-short, TBT p99 vs output throughput per chunk size"))
