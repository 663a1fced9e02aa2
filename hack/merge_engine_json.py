"""Merge the parts of a split `metronome bench engine` run into one results JSON, and compare decode with and
without CUDA graphs: `python hack/merge_engine_json.py OUT.json PART.json... [--eager EAGER.json] [--mixed M.json]`.

The GPU script (hack/gpu_run.sh) runs the benchmark in pieces so that a piece that overruns its time limit loses
only itself. Sections are taken from the parts in order (a later part does not overwrite a section an earlier
one has); `targets` are evaluated again over the merged document. With --eager, a `decode_cuda_graphs` table puts
each batch size's graph and eager step times side by side. With --mixed (hack/profile_mixed.py's output), its
summary becomes `mixed_step`; `mixed_step_targets` then judges the mixed step, the long-short order and capacity by
chunk size, the largest token gap and the compiles after ready, and reports saturation's tok/s against its floor.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SECTION_KEYS = ("device", "decode", "prefill", "saturation", "longshort", "batch_comparison")


def merge(parts: list[dict]) -> dict:
    merged: dict = {}
    for part in parts:
        for key, value in part.items():
            if key in SECTION_KEYS or key not in merged:
                merged.setdefault(key, value)
    merged["parts"] = [{"config": p.get("config"), "sections": [k for k in SECTION_KEYS if k in p]} for p in parts]
    return merged


def graph_vs_eager(graphs: list[dict], eager: list[dict]) -> list[dict]:
    by_batch = {row["batch"]: row for row in eager if "step_ms_median" in row}
    rows = []
    for row in graphs:
        other = by_batch.get(row.get("batch"))
        if "step_ms_median" not in row or other is None:
            continue
        rows.append({"batch": row["batch"], "graphs_step_ms": row["step_ms_median"],
                     "eager_step_ms": other["step_ms_median"],
                     "speedup": other["step_ms_median"] / row["step_ms_median"],
                     "graphs_ratio_to_floor": row.get("ratio_to_floor"),
                     "eager_ratio_to_floor": other.get("ratio_to_floor"),
                     "graph_steps": row.get("cuda_graph_steps"), "steps": row.get("steps")})
    return rows


SLO_TBT_MS, SLO_TTFT_MS, MAX_GAP_MS = 30.0, 2000.0, 200.0


def _chunk_order(label: str) -> float:
    return float("inf") if label == "unchunked" else float(label)


def longshort_table(runs: list[dict]) -> dict[str, dict[float, dict]]:
    """{chunk label: {rate: {tbt_p99_ms, ttft_p99_ms, tbt_max_ms, completed}}} from the long-short runs."""
    table: dict[str, dict[float, dict]] = {}
    for run in runs:
        params, summary = run.get("params", {}), run.get("summary", {})
        chunk = params.get("chunk_size")
        label = "unchunked" if chunk is not None and chunk >= 1 << 20 else str(chunk)
        table.setdefault(label, {})[float(params.get("rate", 0))] = {
            "tbt_p99_ms": (summary.get("tbt") or {}).get("p99_ms"),
            "ttft_p99_ms": (summary.get("ttft") or {}).get("p99_ms"),
            "tbt_max_ms": (summary.get("tbt") or {}).get("max_ms"),
            "completed": summary.get("num_completed") == summary.get("num_requests"),
            "output_tokens_per_s": summary.get("output_tokens_per_s")}
    return dict(sorted(table.items(), key=lambda kv: _chunk_order(kv[0])))


def capacity(rates: dict[float, dict]) -> float | None:
    """The highest rate whose run kept TBT p99 <= 30 ms and TTFT p99 <= 2 s with every request completed."""
    ok = [rate for rate, r in rates.items() if r["completed"] and r["tbt_p99_ms"] is not None
          and r["tbt_p99_ms"] <= SLO_TBT_MS and r["ttft_p99_ms"] is not None and r["ttft_p99_ms"] <= SLO_TTFT_MS]
    return max(ok) if ok else None


def mixed_step_targets(doc: dict) -> list[dict]:
    out = []

    def target(key: str, goal: str, value, met) -> None:
        out.append({"key": key, "target": goal, "value": value, "met": met})

    mixed = (doc.get("mixed_step") or {}).get("summary", {}).get("piecewise")
    ratio = mixed.get("ratio_to_floor") if mixed else None
    target("mixed_step_ratio_to_floor", "<= 1.3", ratio, None if ratio is None else ratio <= 1.3)
    for row in doc.get("decode") or []:
        if row.get("batch") in (1, 64) and row.get("ratio_to_floor") is not None:
            goal = 1.35 if row["batch"] == 1 else 1.3
            target(f"decode_b{row['batch']}_ratio_to_floor", f"<= {goal}", row["ratio_to_floor"],
                   row["ratio_to_floor"] <= goal)
    table = longshort_table((doc.get("longshort") or {}).get("runs") or [])
    if table:
        rates = sorted(set.intersection(*(set(r) for r in table.values())))
        for rate in rates:
            p99s = [table[label][rate]["tbt_p99_ms"] for label in table]
            rising = all(a is not None and b is not None and a < b for a, b in zip(p99s, p99s[1:]))
            target(f"tbt_p99_rises_with_chunk_at_{rate:g}", "256 < 512 < ... < unchunked",
                   [None if v is None else round(v, 1) for v in p99s], rising)
        if "512" in table:
            kept = [rate for rate, r in table["512"].items() if r["completed"]]
            if kept:
                top = max(kept)
                value = table["512"][top]["tbt_p99_ms"]
                target(f"chunk512_tbt_p99_at_{top:g}_ms", "<= 30", value, value is not None and value <= SLO_TBT_MS)
        if "512" in table and "unchunked" in table:
            ours, theirs = capacity(table["512"]), capacity(table["unchunked"])
            met = None if ours is None and theirs is None else (
                ours is not None and (theirs is None or ours >= 2 * theirs))  # theirs None: unchunked never met it
            target("capacity_512_vs_unchunked", ">= 2 (rates: 512 / unchunked)", [ours, theirs], met)
        gaps = [r["tbt_max_ms"] for rates_ in table.values() for r in rates_.values() if r["tbt_max_ms"] is not None]
        if gaps:
            target("largest_tbt_gap_ms", "< 200", max(gaps), max(gaps) < MAX_GAP_MS)
    sat = (doc.get("saturation") or {}).get("decode_part") or {}
    if sat.get("output_tokens_per_s") is not None:  # reported against its floor, with no threshold
        target("saturation_decode_tokens_per_s", "reported vs floor (SGLang: 16.2k tok/s on an H100)",
               {"tokens_per_s": sat["output_tokens_per_s"], "floor_tokens_per_s": sat.get("floor_tokens_per_s"),
                "ratio_to_floor": sat.get("ratio_to_floor"), "mean_batch": sat.get("mean_batch"),
                "whole_run_tokens_per_s": doc["saturation"]["whole_run"].get("output_tokens_per_s")}, None)
    compiles = [part.get("kernel_compiles_after_ready") for part in doc.get("compiles_after_ready", [])]
    compiles = [c for c in compiles if c is not None]
    if compiles:
        target("kernel_compiles_after_ready", "== 0", sum(compiles), sum(compiles) == 0)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("parts", nargs="+")
    parser.add_argument("--eager", help="a decode-only run with --enforce-eager")
    parser.add_argument("--mixed", help="hack/profile_mixed.py's JSON (the mixed step vs its floor)")
    args = parser.parse_args(argv)
    parts = [json.loads(Path(p).read_text()) for p in args.parts if Path(p).is_file()]
    if not parts:
        print("no part to merge", file=sys.stderr)
        return 1
    doc = merge(parts)
    from metronome.server.bench.engine.command import evaluate_targets

    doc["targets"] = evaluate_targets(doc)
    if args.eager and Path(args.eager).is_file():
        eager = json.loads(Path(args.eager).read_text())
        doc["decode_eager"] = {"execution_mode": (eager.get("model") or {}).get("execution_mode"),
                               "decode": eager.get("decode")}
        doc["decode_cuda_graphs"] = graph_vs_eager(doc.get("decode") or [], eager.get("decode") or [])
    mixed = json.loads(Path(args.mixed).read_text()) if args.mixed and Path(args.mixed).is_file() else None
    if mixed is not None:
        doc["mixed_step"] = {k: v for k, v in mixed.items() if k != "steps"}
    doc["compiles_after_ready"] = [{"part": i, "kernel_compiles_after_ready":
                                    (p.get("model") or {}).get("kernel_compiles_after_ready")}
                                   for i, p in enumerate(parts)] + (
        [{"part": "mixed", "kernel_compiles_after_ready": mixed.get("kernel_compiles_after_ready")}] if mixed else [])
    doc["mixed_step_targets"] = mixed_step_targets(doc)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    model = doc.get("model") or {}
    print(f"merged {len(parts)} part(s) into {args.out}; execution mode: {model.get('execution_mode')}, "
          f"capture {model.get('cuda_graph_capture_s')} s")
    for row in doc.get("decode_cuda_graphs", []):
        print(f"decode batch {row['batch']}: default run {row['graphs_step_ms']:.2f} ms ({row['graph_steps']}/"
              f"{row['steps']} steps replayed graphs), --enforce-eager {row['eager_step_ms']:.2f} ms: "
              f"{row['speedup']:.2f}x")
    for target in doc["targets"]:
        value = target["value"]
        print(f"target {target['key']}: {'-' if value is None else f'{value:.3g}'} ({target['target']}) "
              f"met={target['met']}")
    for target in doc["mixed_step_targets"]:
        print(f"mixed-step target {target['key']}: {target['value']} ({target['target']}) met={target['met']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
