"""Merge the parts of a split `metronome bench engine` run into one results JSON, and compare decode with and
without CUDA graphs: `python hack/merge_engine_json.py OUT.json PART.json... [--eager EAGER.json]`.

The GPU script (hack/gpu_run.sh) runs the benchmark in pieces so that a piece that overruns its time limit loses
only itself. Sections are taken from the parts in order (a later part does not overwrite a section an earlier
one has); `targets` are evaluated again over the merged document. With --eager, a `decode_cuda_graphs` table puts
each batch size's graph and eager step times side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SECTION_KEYS = ("device", "decode", "prefill", "longshort", "batch_comparison")


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("parts", nargs="+")
    parser.add_argument("--eager", help="a decode-only run with --enforce-eager")
    args = parser.parse_args(argv)
    parts = [json.loads(Path(p).read_text()) for p in args.parts if Path(p).is_file()]
    if not parts:
        print("no part to merge", file=sys.stderr)
        return 1
    doc = merge(parts)
    from metronome.server.bench.engine_bench import evaluate_targets

    doc["targets"] = evaluate_targets(doc)
    if args.eager and Path(args.eager).is_file():
        eager = json.loads(Path(args.eager).read_text())
        doc["decode_eager"] = {"execution_mode": (eager.get("model") or {}).get("execution_mode"),
                               "decode": eager.get("decode")}
        doc["decode_cuda_graphs"] = graph_vs_eager(doc.get("decode") or [], eager.get("decode") or [])
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
