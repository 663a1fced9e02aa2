"""Sweep logic: the grid, the scheduler per point, the recommendation rule, and the ConfigMap-style file swap."""
from __future__ import annotations

import os

import pytest

from metronome.contract.config import SchedulerConfig, load_server_config
from metronome.server.bench.configfile import ConfigFileError, atomic_configmap_write
from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.stats import LatencySummary, RunSummary
from metronome.server.bench.load.sweep import SweepConfig, SweepError, grid, parse_policies, recommend, scheduler_for


def entry(chunk, policy, rate, tput, p99, completed=10):
    summary = RunSummary(num_requests=10, num_completed=completed, output_tokens_per_s=tput,
                         tbt=LatencySummary(count=100, p99_ms=p99), ttft=LatencySummary(count=10, p99_ms=5 * p99))
    return RunEntry(f"chunk {chunk} / {policy} @ {rate}", {"chunk_size": chunk, "queue_policy": policy, "rate": rate},
                    summary)


RUNS = [
    entry(256, "fcfs", 1, 100, 20), entry(256, "fcfs", 2, 190, 28), entry(256, "fcfs", 4, 300, 45),
    entry(2048, "fcfs", 1, 110, 60), entry(2048, "fcfs", 2, 210, 90), entry(2048, "fcfs", 4, 380, 150),
    entry(512, "split", 1, 105, 22), entry(512, "split", 2, 205, 29), entry(512, "split", 4, 330, 41),
]


def test_recommendation_is_the_highest_throughput_within_the_slo():
    rec = recommend(RUNS, slo_tbt_ms=30)
    assert (rec.best.chunk_size, rec.best.queue_policy, rec.best.rate) == (512, "split", 2)
    assert rec.best.output_tokens_per_s == 205 and rec.best.capacity_rate == 2
    assert [(a.chunk_size, a.queue_policy) for a in rec.alternatives] == [(256, "fcfs")]  # 2048 never met 30 ms


def test_looser_slo_prefers_big_chunks():
    rec = recommend(RUNS, slo_tbt_ms=200)
    assert (rec.best.chunk_size, rec.best.rate) == (2048, 4)
    assert [(a.chunk_size, a.queue_policy) for a in rec.alternatives] == [(512, "split"), (256, "fcfs")]


def test_no_configuration_meets_the_slo():
    rec = recommend(RUNS, slo_tbt_ms=10)
    assert rec.best is None and rec.alternatives == []
    assert "no configuration met" in rec.note and "20.0 ms" in rec.note


def test_runs_without_completions_never_qualify():
    rec = recommend([entry(256, "fcfs", 1, 0, 1, completed=0)], slo_tbt_ms=30)
    assert rec.best is None


def test_grid_and_scheduler_per_point():
    points = grid([256, 512], ["fcfs", "split"])
    assert points == [SweepConfig(256, "fcfs"), SweepConfig(512, "fcfs"), SweepConfig(256, "split"),
                      SweepConfig(512, "split")]
    base = SchedulerConfig(max_num_seqs=64)
    fcfs = scheduler_for(base, SweepConfig(256, "fcfs"))
    assert fcfs.chunk_size == 256 and fcfs.queue_policy.value == "fcfs" and fcfs.max_num_seqs == 64
    split = scheduler_for(base, SweepConfig(1024, "split"))
    assert split.long_chunk_size == 1024 and split.chunk_size == 1024 and split.short_chunk_size == 2048
    with pytest.raises(SweepError):
        scheduler_for(base, SweepConfig(0, "fcfs"))


def test_parse_policies():
    assert parse_policies("fcfs, split,sjf") == ["fcfs", "split", "sjf"]
    with pytest.raises(SweepError, match="choose from"):
        parse_policies("fcfs,lifo")
    with pytest.raises(SweepError):
        parse_policies(" , ")


def test_configmap_write_converts_a_plain_file_then_swaps_atomically(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("generation: 1\n")
    first = atomic_configmap_write(path, "generation: 2\nscheduler:\n  chunk_size: 256\n")
    assert path.is_symlink() and os.readlink(path) == os.path.join("..data", "server.yaml")
    assert os.readlink(tmp_path / "..data") == first.name
    assert load_server_config(path).scheduler.chunk_size == 256

    second = atomic_configmap_write(path, "generation: 3\nscheduler:\n  chunk_size: 512\n")
    assert os.readlink(tmp_path / "..data") == second.name
    assert not first.exists()  # the old data directory is gone, as the kubelet leaves it
    loaded = load_server_config(path)
    assert (loaded.generation, loaded.scheduler.chunk_size) == (3, 512)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("..")) == ["server.yaml"]


def test_configmap_write_into_a_missing_folder(tmp_path):
    with pytest.raises(ConfigFileError, match="not a folder"):
        atomic_configmap_write(tmp_path / "absent" / "server.yaml", "generation: 1\n")


def test_an_experiment_manifest_carries_the_swept_fields():
    import yaml

    from metronome.operator.experiment.settings import parse_experiment
    from metronome.server.bench.load.experiment_manifest import experiment_manifest
    from metronome.server.bench.load.sweep import Choice, Recommendation, SweepError

    choice = Choice(chunk_size=1024, queue_policy="split", rate=4.0, output_tokens_per_s=950.0, tbt_p99_ms=41.2,
                    ttft_p99_ms=300.0, capacity_rate=4.0)
    text = experiment_manifest(Recommendation(50.0, choice), "chat")
    assert text.startswith("# metronome bench sweep: chunk 1024 / split met the 50 ms TBT SLO")
    body = yaml.safe_load(text)
    assert body["metadata"] == {"name": "chat"} and body["kind"] == "InferenceService"
    assert body["spec"]["experiment"]["candidate"] == {"chunkSize": 1024, "queuePolicy": "split",
                                                       "longChunkSize": 1024}  # what the sweep set under split
    assert parse_experiment(body["spec"]["experiment"], 60).name == "sweep-split-1024"
    with pytest.raises(SweepError, match="no configuration met the 50 ms TBT SLO"):
        experiment_manifest(Recommendation(50.0, None, note="the lowest TBT p99 was 80 ms"), "chat")
