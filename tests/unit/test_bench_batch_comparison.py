"""The same-batch comparison with transformers: our engine runs the batch once per `--batch-chunk-size` entry, the
first is the compared one (its throughput config) and each is recorded with its chunk size; and the CLI runs
`--sections saturation` end to end on the CPU."""
from __future__ import annotations

import argparse
import json

import pytest

from metronome.server.bench import cli
from metronome.server.bench.engine.command import compare_batches

TINY = ["--model", "random:tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
        "--max-model-len", "1024", "--no-progress"]


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="metronome bench")
    cli.configure(parser)
    return cli.run(parser.parse_args(argv))


def _entry(chunk: int, tok_s: float, p99: float) -> dict:
    return {"params": {"chunk_size": chunk}, "summary": {"output_tokens_per_s": tok_s, "tbt": {"p99_ms": p99}}}


def test_the_first_chunk_is_compared_and_every_chunk_gets_its_ratio():
    comparison = {"chunk_size": 2048, "metronome": _entry(2048, 6000.0, 40.0),
                  "metronome_other_chunks": [_entry(512, 5000.0, 25.0)],
                  "transformers": {"output_tokens_per_s": 500.0, "summary": {"tbt": {"p99_ms": 1500.0}}}}
    compare_batches(comparison)
    assert comparison["output_tokens_per_s_ratio"] == pytest.approx(12.0)
    assert comparison["output_tokens_per_s_ratio_by_chunk"] == pytest.approx({"2048": 12.0, "512": 10.0})
    assert comparison["tbt_p99_ms"] == {"metronome": 40.0, "transformers": 1500.0, "lower": True,
                                        "metronome_by_chunk": {"2048": 40.0, "512": 25.0}}


def test_a_failed_transformers_run_gives_no_ratio():
    comparison = {"chunk_size": 512, "metronome": _entry(512, 5000.0, 25.0), "transformers": {"error": "no"}}
    compare_batches(comparison)
    assert "output_tokens_per_s_ratio" not in comparison and "tbt_p99_ms" not in comparison


def test_cli_records_each_batch_chunk_and_the_saturation_section(tmp_path):
    out = tmp_path / "engine.json"
    rc = bench(["engine", *TINY, "--sections", "device,saturation,hf", "--copy-mb", "4", "--matmul-size", "64",
                "--reps", "2", "--long-prompt-len", "60", "--short-prompt-len", "8", "--output-len", "4",
                "--hf-requests", "3", "--batch-chunk-size", "32,16", "--warmup-requests", "1", "--skip-hf",
                "--saturation-prompt-len", "40", "--saturation-output-len", "24", "--saturation-chunk-size", "128",
                "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    batch = doc["batch_comparison"]
    assert batch["chunk_size"] == 32 and batch["metronome"]["params"]["chunk_size"] == 32
    assert [e["params"]["chunk_size"] for e in batch["metronome_other_chunks"]] == [16]
    assert all(e["summary"]["num_completed"] == 3 for e in [batch["metronome"], *batch["metronome_other_chunks"]])
    sat = doc["saturation"]
    # 512 blocks, watermark 5: 507 usable, 64 tokens = 4 blocks -> 126 requests, under the default cap of 512.
    assert sat["requests"] == sat["requests_that_fit"] == 126 and sat["max_requests"] == 512
    assert sat["whole_run"]["output_tokens"] == 126 * 24 and sat["whole_run"]["preemptions"] == 0
    assert doc["model"]["max_num_seqs_at_start"] == 512
    assert doc["model"]["prefix_caching"] is False  # each chunk replays the same prompts: no cache between them
    assert doc["config"]["batch_chunk_size"] == [32, 16]
