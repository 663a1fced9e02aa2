"""The one prefill budget (metronome.contract.budget): what each policy admits per step, how a tuned budget is laid
out on the policy's fields and back, split's two sizes, and that the engine's queues and the server's gauges read
the same number."""
from __future__ import annotations

import pytest

from metronome.contract import metric_names as names
from metronome.contract.budget import lane_budgets, prefill_budget, split_sizes, with_budget
from metronome.contract.config import ConfigError, QueuePolicy, SchedulerConfig
from metronome.server.api.metrics import ServerMetrics
from metronome.server.engine.queues import WaitingQueues

CRD_DEFAULTS = SchedulerConfig()  # split, chunk 512, short 2048, long 512, threshold 512


def test_fcfs_and_sjf_admit_chunk_size_whatever_the_split_fields_say():
    for policy in ("fcfs", "sjf"):
        config = SchedulerConfig(queue_policy=policy, chunk_size=300, short_chunk_size=4096, long_chunk_size=64)
        assert prefill_budget(config) == 300
        assert lane_budgets(config) == {"short": 300, "long": 300}
        assert split_sizes(config) is None


def test_split_admits_its_larger_lane_and_ignores_chunk_size():
    assert (CRD_DEFAULTS.queue_policy, CRD_DEFAULTS.chunk_size) == (QueuePolicy.SPLIT, 512)
    assert prefill_budget(CRD_DEFAULTS) == 2048
    assert lane_budgets(CRD_DEFAULTS) == {"short": 2048, "long": 512}
    assert split_sizes(CRD_DEFAULTS) == "2048/512"
    wide_long = SchedulerConfig(short_chunk_size=512, long_chunk_size=1536)
    assert (prefill_budget(wide_long), split_sizes(wide_long)) == (1536, "512/1536")
    even = SchedulerConfig(short_chunk_size=768, long_chunk_size=768)
    assert (prefill_budget(even), split_sizes(even)) == (768, None)


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "split"])
@pytest.mark.parametrize("budget", [512, 640, 1024, 4096])
def test_a_tuned_budget_round_trips_through_the_config(policy, budget):
    laid_out = with_budget(CRD_DEFAULTS.model_copy(update={"max_num_seqs": 32}), budget, policy)
    assert prefill_budget(laid_out) == budget and laid_out.queue_policy.value == policy
    assert laid_out.chunk_size == budget  # a later switch of policy keeps the budget
    assert laid_out.max_num_seqs == 32  # the fields the budget does not own stay as given
    assert with_budget(laid_out, prefill_budget(laid_out), policy) == laid_out  # laying it out again changes nothing


def test_split_gives_both_lanes_the_budget_and_keeps_short_prompts_whole():
    laid_out = with_budget(CRD_DEFAULTS, 896, "split")
    assert lane_budgets(laid_out) == {"short": 896, "long": 896} and split_sizes(laid_out) is None
    # Below the short-prompt threshold short prompts still fit whole: the lanes differ, and the engine enforces
    # the threshold, which is what every view then reports.
    small = with_budget(CRD_DEFAULTS, 256, "split")
    assert lane_budgets(small) == {"short": 512, "long": 256}
    assert (prefill_budget(small), split_sizes(small)) == (512, "512/256")
    # Switching away moves the budget to chunk_size and leaves the lanes as they were.
    fcfs = with_budget(laid_out, 384, "fcfs")
    assert (prefill_budget(fcfs), fcfs.short_chunk_size, fcfs.long_chunk_size) == (384, 896, 896)


def test_an_impossible_layout_is_a_config_error_naming_its_source():
    with pytest.raises(ConfigError, match="^the decision: chunk_size"):
        with_budget(CRD_DEFAULTS, 0, "fcfs", source="the decision")


@pytest.mark.parametrize("config", [
    CRD_DEFAULTS,
    SchedulerConfig(queue_policy="fcfs", chunk_size=256),
    SchedulerConfig(queue_policy="sjf", chunk_size=384, short_chunk_size=4096),
    SchedulerConfig(short_chunk_size=1024, long_chunk_size=256),
], ids=["crd-defaults", "fcfs", "sjf", "split-1024/256"])
def test_the_engine_and_its_gauges_report_the_contracts_budget(config):
    assert WaitingQueues(config).prefill_budget == prefill_budget(config)
    metrics = ServerMetrics("m")
    metrics.set_config(config, generation=3)

    def sample(name, **labels):
        return metrics.registry.get_sample_value(name, {"model": "m", **labels})

    assert sample(names.CHUNK_SIZE) == prefill_budget(config)
    assert {lane: sample(names.LANE_CHUNK_SIZE, lane=lane) for lane in names.LANES} == lane_budgets(config)
