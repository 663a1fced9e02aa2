"""Config reload: content polling through Kubernetes' `..data` symlink swap, merge over flags, bad files."""
from __future__ import annotations

import os

import httpx
import pytest
from api_helpers import ServerThread, build_server_parts, k8s_config_dir, metric, scrape, wait_until

from metronome.contract import metric_names as names
from metronome.contract.config import ConfigError, SchedulerConfig
from metronome.server.api.config_watch import ConfigStatus, ConfigWatcher
from metronome.server.api.metrics import ServerMetrics
from metronome.server.bench.configfile import atomic_configmap_write

# fcfs: the budget these tests watch is chunk_size itself (under split it is the larger lane; test_prefill_budget.py)
GOOD = "generation: 1\nscheduler:\n  chunk_size: 512\n  queue_policy: fcfs\n"


def make_watcher(path, base=None):
    base = base or SchedulerConfig(chunk_size=256, max_num_seqs=64, queue_policy="fcfs")
    applied: list[SchedulerConfig] = []
    metrics = ServerMetrics("m")
    status = ConfigStatus(config_file=str(path), generation=0, scheduler=base)
    watcher = ConfigWatcher(str(path), base, status, apply=applied.append, on_applied=metrics.set_config,
                            on_error=metrics.count_reload_error)
    return watcher, applied, metrics


def gauge(metrics: ServerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {"model": "m", **labels})
    assert value is not None, name
    return value


def test_kubernetes_symlink_swap_is_picked_up(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", GOOD)
    watcher, applied, metrics = make_watcher(path)
    assert watcher.load_initial().chunk_size == 512
    assert not watcher.poll_once()  # unchanged content: nothing to do

    atomic_configmap_write(path, "generation: 2\nscheduler:\n  chunk_size: 128\n  queue_policy: fcfs\n")
    assert os.path.islink(path) and os.path.islink(path.parent / "..data")
    assert watcher.poll_once()
    assert applied[-1].chunk_size == 128 and applied[-1].queue_policy.value == "fcfs"
    assert gauge(metrics, names.CHUNK_SIZE) == 128
    assert gauge(metrics, names.CONFIG_GENERATION) == 2
    assert gauge(metrics, names.QUEUE_POLICY_INFO, policy="fcfs") == 1
    assert gauge(metrics, names.QUEUE_POLICY_INFO, policy="split") == 0
    assert watcher.status.resolved_path.endswith("server.yaml") and "..2026" in watcher.status.resolved_path


def test_invalid_file_keeps_last_good_config_and_counts_once(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", GOOD)
    watcher, applied, metrics = make_watcher(path)
    watcher.load_initial()
    atomic_configmap_write(path, "generation: 3\nscheduler:\n  chunk_size: -5\n")
    assert not watcher.poll_once()
    assert not watcher.poll_once()  # the same bad file is reported once, not every poll
    assert gauge(metrics, names.CONFIG_RELOAD_ERRORS) == 1
    assert gauge(metrics, names.CHUNK_SIZE) == 512
    assert watcher.status.generation == 1
    assert "chunk_size" in watcher.status.last_reload_error
    assert len(applied) == 1

    atomic_configmap_write(path, "generation: 4\nscheduler: [not, a, mapping]\n")
    watcher.poll_once()
    assert gauge(metrics, names.CONFIG_RELOAD_ERRORS) == 2

    atomic_configmap_write(path, "generation: 5\nscheduler:\n  chunk_size: 64\n")
    assert watcher.poll_once()
    assert watcher.status.last_reload_error is None
    assert gauge(metrics, names.CHUNK_SIZE) == 64


def test_file_fields_override_flags_and_removed_fields_fall_back(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", "generation: 1\nscheduler:\n  queueP" "olicy: sjf\n")  # camelCase alias
    watcher, applied, _ = make_watcher(path, base=SchedulerConfig(chunk_size=300, max_num_seqs=8))
    first = watcher.load_initial()
    assert (first.chunk_size, first.max_num_seqs, first.queue_policy.value) == (300, 8, "sjf")
    atomic_configmap_write(path, "generation: 2\nscheduler:\n  chunk_size: 100\n")
    watcher.poll_once()
    assert (applied[-1].chunk_size, applied[-1].max_num_seqs) == (100, 8)
    assert applied[-1].queue_policy.value == SchedulerConfig().queue_policy.value  # removed: back to the flag value


def test_merged_cross_field_rule_is_checked(tmp_path):
    # The file alone is fine, but with the flag max_num_seqs=64 the token cap would starve decodes.
    path = k8s_config_dir(tmp_path / "vol", "generation: 1\nscheduler:\n  max_num_batched_tokens: 32\n")
    watcher, _, _ = make_watcher(path)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        watcher.load_initial()


@pytest.mark.parametrize("text, reason", [
    ("", "empty"),
    ("# nothing but a comment\n", "empty"),
    ("scheduler:\n  chunk_size: 64\n", "generation missing"),
    ("generation: 5\n", "scheduler missing"),
    ("generation: 5\nscheduler:\n", "scheduler"),  # a key without a value
])
def test_an_empty_or_partial_file_never_resets_the_server(tmp_path, text, reason):
    path = k8s_config_dir(tmp_path / "vol", "generation: 4\nscheduler:\n  chunk_size: 96\n")
    watcher, applied, metrics = make_watcher(path)
    watcher.load_initial()
    atomic_configmap_write(path, text)
    assert not watcher.poll_once()
    assert reason in watcher.status.last_reload_error
    assert (watcher.status.generation, applied[-1].chunk_size, len(applied)) == (4, 96, 1)
    assert gauge(metrics, names.CONFIG_RELOAD_ERRORS) == 1
    assert gauge(metrics, names.CONFIG_GENERATION) == 4 and gauge(metrics, names.CHUNK_SIZE) == 96


def test_an_empty_file_at_start_up_is_refused(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", "\n")
    watcher, applied, _ = make_watcher(path)
    with pytest.raises(ConfigError, match="empty"):
        watcher.load_initial()
    assert applied == []


def test_the_generation_never_goes_backwards(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", "generation: 7\nscheduler:\n  chunk_size: 96\n")
    watcher, applied, metrics = make_watcher(path)
    watcher.load_initial()
    atomic_configmap_write(path, "generation: 6\nscheduler:\n  chunk_size: 32\n")
    assert not watcher.poll_once()
    assert "older than the applied generation 7" in watcher.status.last_reload_error
    assert (watcher.status.generation, applied[-1].chunk_size) == (7, 96)
    assert gauge(metrics, names.CONFIG_RELOAD_ERRORS) == 1
    atomic_configmap_write(path, "generation: 7\nscheduler:\n  chunk_size: 48\n")  # the same generation again: allowed
    assert watcher.poll_once() and applied[-1].chunk_size == 48
    atomic_configmap_write(path, "generation: 8\nscheduler:\n  chunk_size: 64\n")
    assert watcher.poll_once() and watcher.status.generation == 8 and watcher.status.last_reload_error is None


def test_unreadable_file_is_an_error_not_a_crash(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", GOOD)
    watcher, _, metrics = make_watcher(path)
    watcher.load_initial()
    os.unlink(path.parent / "..data")  # dangling symlink
    assert not watcher.poll_once()
    assert "cannot read" in watcher.status.last_reload_error
    assert gauge(metrics, names.CONFIG_RELOAD_ERRORS) == 1
    assert gauge(metrics, names.CHUNK_SIZE) == 512


def test_engine_rejection_is_a_reload_error(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", GOOD)
    watcher, _, metrics = make_watcher(path)
    watcher.load_initial()

    def refuse(_config):
        raise ValueError("engine says no")

    watcher.apply = refuse
    atomic_configmap_write(path, "generation: 2\nscheduler:\n  chunk_size: 100\n")
    assert not watcher.poll_once()
    assert watcher.status.last_reload_error == "engine says no"
    assert watcher.status.generation == 1


def test_live_server_follows_the_swap_within_two_seconds(tmp_path):
    path = k8s_config_dir(tmp_path / "vol", GOOD)
    _, state, app = build_server_parts(config_file=str(path), poll_interval_s=0.5)
    with ServerThread(app) as server:
        samples = scrape(server.url)
        assert metric(samples, names.CHUNK_SIZE) == 512
        assert metric(samples, names.CONFIG_GENERATION) == 1

        atomic_configmap_write(path, "generation: 7\nscheduler:\n  chunk_size: 96\n  queue_policy: sjf\n")
        wait_until(lambda: metric(scrape(server.url), names.CHUNK_SIZE) == 96, timeout=2.0,
                   what="chunk_size 96 on /metrics")
        samples = scrape(server.url)
        assert metric(samples, names.CONFIG_GENERATION) == 7
        assert metric(samples, names.QUEUE_POLICY_INFO, policy="sjf") == 1
        body = httpx.get(server.url + "/v1/config").json()
        assert body["generation"] == 7 and body["scheduler"]["chunk_size"] == 96
        assert body["last_reload_error"] is None and body["config_file"] == str(path)
        # Requests still work on the new config, and the engine reports it as effective.
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
        wait_until(lambda: state_effective_chunk(server.url) == 96, timeout=10, what="engine applies chunk 96")

        atomic_configmap_write(path, "generation: 8\nscheduler:\n  chunk_size: lots\n")
        wait_until(lambda: httpx.get(server.url + "/v1/config").json()["last_reload_error"], timeout=10,
                   what="reload error on /v1/config")
        samples = scrape(server.url)
        assert metric(samples, names.CONFIG_RELOAD_ERRORS) == 1
        assert metric(samples, names.CHUNK_SIZE) == 96
        assert metric(samples, names.CONFIG_GENERATION) == 7
        body = httpx.get(server.url + "/v1/config").json()
        assert "chunk_size" in body["last_reload_error"] and body["generation"] == 7


def state_effective_chunk(url: str) -> int:
    return httpx.get(url + "/v1/config").json()["engine_scheduler"]["chunk_size"]


def test_serve_flags_give_the_base_that_the_file_overrides(tmp_path):
    from metronome.cli import build_parser
    from metronome.server.api.config_watch import load_config
    from metronome.server.engine.flags import engine_config_from_args, scheduler_from_args

    args = build_parser().parse_args(["serve", "--model", "random:tiny", "--chunk-size", "64", "--max-num-seqs", "8",
                                      "--queue-policy", "fcfs", "--max-waiting", "3", "--block-size", "32"])
    base = scheduler_from_args(args)
    assert (base.chunk_size, base.max_num_seqs, base.queue_policy.value) == (64, 8, "fcfs")
    engine = engine_config_from_args(args)
    assert (engine.model, engine.max_waiting, engine.block_size) == ("random:tiny", 3, 32)
    path = tmp_path / "server.yaml"
    path.write_text("generation: 2\nscheduler:\n  chunk_size: 1024\n")
    merged = load_config(str(path), base)[3]
    assert (merged.chunk_size, merged.max_num_seqs, merged.queue_policy.value) == (1024, 8, "fcfs")
