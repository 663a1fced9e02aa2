"""`metronome bench` end to end on random:tiny (CPU): run, sweep, engine, and against a real `metronome serve`."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import httpx
import pytest
from api_helpers import k8s_config_dir

from metronome.server.bench import cli
from metronome.server.bench.robustness.local_server import local_server

TINY = ["--model", "random:tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
        "--max-model-len", "1024", "--no-progress"]
SMALL = ["--long-prompt-len", "120", "--short-prompt-len", "12", "--output-len", "6", "--warmup-requests", "1"]


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="metronome bench")
    cli.configure(parser)
    return cli.run(parser.parse_args(argv))


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_in_process_writes_json_and_png(tmp_path, capsys):
    out, plot = tmp_path / "run.json", tmp_path / "run.png"
    rc = bench(["run", *TINY, *SMALL, "--rate", "40,inf", "--num-requests", "4", "--slo-tbt-ms", "5000",
                "--out", str(out), "--plot", str(plot)])
    assert rc == 0
    assert "metronome bench run" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["schema"] == "metronome-bench/1" and doc["kind"] == "run"
    assert {"host", "date", "command", "torch", "device", "python"} <= set(doc["environment"])
    assert doc["config"]["workload"] == "long-short"
    assert [run["params"]["rate"] for run in doc["runs"]] == [40.0, None]  # inf is written as null
    for run in doc["runs"]:
        assert run["summary"]["num_completed"] == 4 and run["summary"]["meets_slo"] is True
        assert len(run["records"]) == 4
        for record in run["records"]:
            assert record["error"] is None and record["output_tokens"] == 6  # ignore_eos: exact lengths
            assert len(record["token_times_s"]) == 6 and record["prompt_tokens"] in (12, 120)
            assert record["token_times_s"] == sorted(record["token_times_s"])
    assert is_png(plot)


def test_default_sub_command_is_run_and_bad_jsonl_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt": "hi", "max_tokens": 2}\n{"prompt": "x"}\n')
    assert bench([*TINY, "--workload", "jsonl", "--jsonl", str(bad), "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2:" in err and "max_tokens" in err


def test_sweep_in_process_prints_a_table_and_a_recommendation(tmp_path, capsys):
    out, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = bench(["sweep", *TINY, *SMALL, "--chunk-sizes", "16,unchunked", "--policies", "fcfs,split",
                "--rates", "50", "--num-requests", "3", "--slo-tbt-ms", "10000,0.001", "--out", str(out),
                "--plot", str(plot)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Recommended configuration per TBT SLO" in printed
    assert "TBT SLO 10000 ms: best = chunk_size" in printed
    assert "TBT SLO 0.001 ms: no configuration met the SLO" in printed
    doc = json.loads(out.read_text())
    assert doc["kind"] == "sweep" and len(doc["runs"]) == 4
    for run in doc["runs"]:  # the engine really ran with the configuration asked for
        effective = run["params"]["scheduler"]
        assert effective["chunk_size"] == run["params"]["chunk_size"]
        assert effective["queue_policy"] == run["params"]["queue_policy"]
    asked = {(r["params"]["chunk_size"], r["params"]["queue_policy"]) for r in doc["runs"]}
    assert asked == {(16, "fcfs"), (1 << 20, "fcfs"), (16, "split"), (1 << 20, "split")}
    best = doc["recommendations"][0]["best"]
    assert (best["chunk_size"], best["queue_policy"]) in asked and len(doc["recommendations"][0]["alternatives"]) == 2
    assert doc["recommendations"][1]["best"] is None
    assert is_png(plot)


def test_sweep_against_a_url_needs_the_config_file(capsys):
    assert bench(["sweep", "--url", "http://127.0.0.1:9", "--rates", "1"]) == 2
    assert "--config-file" in capsys.readouterr().err


def test_engine_cpu_smoke_writes_one_json(tmp_path, capsys):
    out, plot = tmp_path / "engine.json", tmp_path / "engine.png"
    rc = bench(["engine", *TINY, "--copy-mb", "4", "--matmul-size", "64", "--reps", "2", "--batch-sizes", "1,3",
                "--context", "48", "--decode-steps", "3", "--prefill-prompt-len", "40", "--prefill-prompts", "2",
                "--prefill-chunk", "128", "--rates", "30", "--chunk-sizes", "16,unchunked", "--num-requests", "3",
                "--long-prompt-len", "100", "--short-prompt-len", "10", "--output-len", "5", "--hf-requests", "3",
                "--batch-chunk-size", "32", "--warmup-requests", "2", "--skip-hf",
                "--out", str(out), "--plot", str(plot)])
    assert rc == 0
    assert "engine targets" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["kind"] == "engine" and doc["model"]["name"] == "random:tiny"
    assert doc["device"]["copy"]["bandwidth_bytes_per_s"] > 0 and doc["device"]["matmul_tflops"] > 0
    assert [d["batch"] for d in doc["decode"]] == [1, 3]
    for point in doc["decode"]:
        assert point["non_decode_steps"] == 0 and point["step_ms_median"] > 0 and point["ratio_to_floor"] > 0
        assert point["kv_tokens_read_median"] >= point["batch"] * 48
    assert doc["prefill"]["tokens"] == 80 and doc["prefill"]["tokens_per_s"] > 0
    capacity = {row["label"]: row for row in doc["longshort"]["capacity"]}
    assert set(capacity) == {"16", "unchunked"}
    assert len(doc["longshort"]["runs"]) == 2
    assert all(run["summary"]["num_completed"] == 3 for run in doc["longshort"]["runs"])
    assert doc["batch_comparison"]["metronome"]["summary"]["num_completed"] == 3
    assert "transformers" not in doc["batch_comparison"]  # --skip-hf
    assert {t["key"] for t in doc["targets"]} >= {"decode_b1_ratio_to_floor", "prefill_share_of_matmul_peak"}
    assert is_png(plot)


def test_engine_cpu_smoke_with_fp8_weights_reports_fp8_floors(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = bench(["engine", *TINY, "--quantization", "fp8", "--sections", "device,decode,prefill", "--copy-mb", "4",
                "--matmul-size", "64", "--reps", "2", "--batch-sizes", "2", "--context", "24", "--decode-steps", "2",
                "--prefill-prompt-len", "20", "--prefill-prompts", "2", "--prefill-chunk", "64", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    model = doc["model"]
    assert "fp8" in model["quantization"] and model["bytes_per_element"]["linear"] == 1
    assert model["bytes_per_element"]["scales_per_row"] == 1.0  # per-channel scales on the fly
    assert model["bytes_per_element"]["kv"] == model["bytes_per_element"]["dtype"] == 4  # fp32 on the CPU
    assert doc["prefill"]["matmul_peak"] == "fp8_matmul_tflops"  # measured on FP8 GPUs only: no share on the CPU
    assert "share_of_matmul_peak" not in doc["prefill"] and "fp8_matmul" not in doc["device"]
    from metronome.server.bench.engine import model_math
    from metronome.server.models.presets import preset_config

    widths = model_math.ByteWidths(4, 1, 4, 1.0)
    assert model["weights_read_per_decode_step_bytes"] == model_math.weights_read_per_decode_step(
        preset_config("tiny"), widths) < model_math.weights_read_per_decode_step(preset_config("tiny"), 4)


def test_engine_refuses_cuda_without_a_gpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench(["engine", "--model", "random:tiny", "--skip-hf", "--no-progress"]) == 2
    assert "--device cpu" in capsys.readouterr().err


# --- against a real server -------------------------------------------------------------------------------------


def test_run_and_sweep_against_metronome_serve(tmp_path):
    config = k8s_config_dir(tmp_path / "cm", "generation: 1\nscheduler:\n  chunk_size: 256\n  queue_policy: fcfs\n")
    serve_args = ["--model", "random:tiny", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "512",
                  "--max-model-len", "1024", "--config", str(config), "--config-poll-seconds", "0.1"]
    with local_server(serve_args, ready_timeout_s=240) as url:
        out = tmp_path / "http.json"
        assert bench(["run", "--url", url, *SMALL, "--rate", "inf", "--num-requests", "3", "--no-progress",
                      "--out", str(out)]) == 0
        run = json.loads(out.read_text())["runs"][0]
        assert run["summary"]["num_completed"] == 3 and run["summary"]["output_tokens"] == 18
        assert run["summary"]["token_stamps"] == sum(len(r["token_times_s"]) for r in run["records"])
        for record in run["records"]:
            assert record["error"] is None and record["output_tokens"] == 6 and record["finish_reason"] == "length"
            assert 1 <= len(record["token_times_s"]) <= 6  # chunks; tokens without text ride with the next

        sweep_out = tmp_path / "sweep.json"
        assert bench(["sweep", "--url", url, "--config-file", str(config), *SMALL, "--chunk-sizes", "16,64",
                      "--policies", "fcfs", "--rates", "50", "--num-requests", "2", "--no-progress",
                      "--reload-timeout", "60", "--out", str(sweep_out)]) == 0
        runs = json.loads(sweep_out.read_text())["runs"]
        assert [(r["params"]["chunk_size"], r["params"]["generation"]) for r in runs] == [(16, 2), (64, 3)]
        assert [r["params"]["scheduler"]["chunk_size"] for r in runs] == [16, 64]
        assert config.is_symlink() and os.readlink(config) == "..data/server.yaml"
        served = httpx.get(url + "/v1/config", timeout=5).json()
        assert served["generation"] == 3 and served["scheduler"]["chunk_size"] == 64


def test_engine_longshort_interleaves_overlap_variants(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = bench(["engine", *TINY, "--sections", "longshort", "--rates", "30,40", "--chunk-sizes", "16",
                "--num-requests", "2", "--long-prompt-len", "40", "--short-prompt-len", "8", "--output-len", "3",
                "--warmup-requests", "1", "--mixed-overlap-variants", "off,on", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = doc["longshort"]["runs"]
    assert [(r["params"]["rate"], r["params"]["mixed_overlap"]) for r in runs] == [
        (30, "off"), (30, "on"), (40, "off"), (40, "on")]  # back to back per rate
    assert [row["rate"] for row in doc["longshort"]["overlap_comparison"]] == [30, 40]
    assert {row["label"] for row in doc["longshort"]["capacity"]} == {"16, overlap off", "16, overlap on"}
    assert doc["model"]["mixed_overlap"] == "on"  # the variants need its graphs: the engine starts with it
    assert "overlap: off vs on" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench(["engine", *TINY, "--mixed-overlap-variants", "off,sometimes"])
