"""hack/fp8_summary.py: the FP8 targets read from the bench JSON of a GPU run (synthetic documents here)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fp8_summary", ROOT / "hack" / "fp8_summary.py")
fp8_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fp8_summary)


def _run(rate: float, chunk: int, p99: float) -> dict:
    return {"params": {"rate": rate, "chunk_size": chunk}, "summary": {"tbt": {"p99_ms": p99}}}


def test_targets_and_tbt_order_from_bench_documents(tmp_path):
    fp8 = {"saturation": {"whole_run": {"output_tokens_per_s": 18_500.0}, "decode_part": {"ratio_to_floor": 1.2},
                          "requests": 512},
           "decode": [{"batch": 1, "ratio_to_floor": 1.35}, {"batch": 64, "ratio_to_floor": 1.1}],
           "prefill": {"tokens_per_s": 30_000.0}, "model": {"kv_blocks": 200},
           "longshort": {"runs": [_run(16, 256, 10), _run(16, 512, 12), _run(16, 1 << 20, 50),
                                  _run(48, 256, 20), _run(48, 512, 19), _run(48, 1 << 20, 90)]}}
    bf16 = {"prefill": {"tokens_per_s": 20_000.0}, "model": {"kv_blocks": 100}}
    (tmp_path / "fp8-engine.json").write_text(json.dumps(fp8))
    (tmp_path / "bf16-engine.json").write_text(json.dumps(bf16))
    assert fp8_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "fp8-summary.json").read_text())
    met = {t["key"]: t["met"] for t in summary["targets"]}
    assert met == {"saturation_whole_run_output_tokens_per_s": True, "decode_b1_ratio_to_fp8_floor": False,
                   "decode_b64_ratio_to_fp8_floor": True, "prefill_tokens_per_s_fp8_over_bf16": True}
    values = summary["values"]
    assert values["prefill_tokens_per_s_fp8_over_bf16"] == 1.5
    assert values["tbt_p99_ms_by_rate_and_chunk"]["16"] == {"256": 10, "512": 12, "1048576": 50}
    assert values["smaller_chunk_lower_p99_at_every_rate"] is False  # 512 beat 256 at rate 48


def test_missing_documents_leave_targets_unmeasured(tmp_path):
    assert fp8_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "fp8-summary.json").read_text())
    assert all(t["met"] is None and t["value"] is None for t in summary["targets"])
