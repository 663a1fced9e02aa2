"""The FP8 targets from the JSON hack/gpu_fp8.sh leaves in a folder, written back as fp8-summary.json and printed.

    python3 -m hack.fp8_summary OUT_DIR

Reads fp8-engine.json and bf16-engine.json (`metronome bench engine`), fp8-accuracy.json (tests/gpu/test_fp8_gpu.py)
and fp8-gemm.json (hack/fp8_gemm_bench.py), whichever exist. Reports; asserts nothing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TARGETS = {  # key: (comparison, threshold)
    "saturation_whole_run_output_tokens_per_s": (">=", 18_000.0),
    "decode_b1_ratio_to_fp8_floor": ("<=", 1.3),
    "decode_b64_ratio_to_fp8_floor": ("<=", 1.25),
    "prefill_tokens_per_s_fp8_over_bf16": (">=", 1.4),
}


def _decode_ratio(doc: dict, batch: int) -> float | None:
    row = next((r for r in doc.get("decode") or [] if r.get("batch") == batch), None)
    return None if row is None else row.get("ratio_to_floor")


def tbt_order(doc: dict) -> dict[str, Any]:
    """TBT p99 per chunk size at each rate, and whether smaller chunks gave lower p99 at every rate."""
    by_rate: dict[float, dict[int, float]] = {}
    for run in (doc.get("longshort") or {}).get("runs") or []:
        params, tbt = run["params"], (run["summary"].get("tbt") or {})
        if tbt.get("p99_ms") is not None:
            by_rate.setdefault(params["rate"], {})[params["chunk_size"]] = tbt["p99_ms"]
    ordered = {rate: all(a < b for a, b in zip([p for _, p in sorted(chunks.items())],
                                                 [p for _, p in sorted(chunks.items())][1:]))
               for rate, chunks in by_rate.items()}
    return {"tbt_p99_ms_by_rate_and_chunk": {str(r): {str(c): p for c, p in sorted(v.items())}
                                             for r, v in sorted(by_rate.items())},
            "smaller_chunk_lower_p99_at_every_rate": all(ordered.values()) if ordered else None}


def summarize(fp8: dict | None, bf16: dict | None, accuracy: dict | None, gemm: dict | None) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if fp8:
        saturation = fp8.get("saturation") or {}
        values["saturation_whole_run_output_tokens_per_s"] = (saturation.get("whole_run") or {}).get(
            "output_tokens_per_s")
        values["saturation_decode_part_ratio_to_floor"] = (saturation.get("decode_part") or {}).get("ratio_to_floor")
        values["saturation_requests"] = saturation.get("requests")
        values["decode_b1_ratio_to_fp8_floor"] = _decode_ratio(fp8, 1)
        values["decode_b64_ratio_to_fp8_floor"] = _decode_ratio(fp8, 64)
        values["fp8_prefill_share_of_fp8_matmul_peak"] = (fp8.get("prefill") or {}).get("share_of_matmul_peak")
        values["kv_blocks_fp8"] = (fp8.get("model") or {}).get("kv_blocks")
        values["model"] = {k: (fp8.get("model") or {}).get(k) for k in ("quantization", "kv_cache_dtype",
                                                                         "bytes_per_element", "execution_mode")}
        values["device"] = {k: (fp8.get("device") or {}).get(k) for k in ("bandwidth_gb_per_s", "matmul_tflops",
                                                                          "fp8_matmul_tflops")}
        values.update(tbt_order(fp8))
    if bf16:
        values["kv_blocks_bf16"] = (bf16.get("model") or {}).get("kv_blocks")
        values["decode_b1_ratio_to_bf16_floor"] = _decode_ratio(bf16, 1)
        values["decode_b64_ratio_to_bf16_floor"] = _decode_ratio(bf16, 64)
    if fp8 and bf16:
        ours, theirs = (fp8.get("prefill") or {}).get("tokens_per_s"), (bf16.get("prefill") or {}).get("tokens_per_s")
        values["prefill_tokens_per_s"] = {"fp8": ours, "bf16": theirs}
        values["prefill_tokens_per_s_fp8_over_bf16"] = ours / theirs if ours and theirs else None
    if accuracy:
        values["accuracy"] = accuracy
    if gemm:
        values["gemm_best_by_shape_and_rows"] = {
            name: {m: row.get("best") for m, row in shape["by_rows"].items()} for name, shape in gemm["shapes"].items()}
    targets = []
    for key, (op, threshold) in TARGETS.items():
        value = values.get(key)
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        targets.append({"key": key, "target": f"{op} {threshold:g}", "value": value, "met": met})
    return {"values": values, "targets": targets}


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 -m hack.fp8_summary OUT_DIR", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    summary = summarize(_load(folder, "fp8-engine.json"), _load(folder, "bf16-engine.json"),
                        _load(folder, "fp8-accuracy.json"), _load(folder, "fp8-gemm.json"))
    (folder / "fp8-summary.json").write_text(json.dumps(summary, indent=1))
    for target in summary["targets"]:
        print(f"{target['key']}: {target['value']} (target {target['target']}, met {target['met']})")
    order = summary["values"].get("smaller_chunk_lower_p99_at_every_rate")
    print(f"smaller chunk, lower TBT p99 at every rate: {order}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
