"""The autotuner's riskier moves go through an experiment (operator/experiment/canary.py): which moves are risky,
the canary it proposes (rebuilt from its status record while it runs), and the hold-off after a rejected one."""
from __future__ import annotations

from metronome.contract.config import SchedulerConfig, ServerConfigFile
from metronome.operator.experiment.canary import canary_wanted, held_off, risk, running_canary
from metronome.operator.experiment.children import PodView
from metronome.operator.experiment.lifecycle import Observed, scheduler_record, step
from metronome.operator.experiment.record import AUTOTUNE, Phase, Record

FCFS_512 = SchedulerConfig(chunk_size=512, queue_policy="fcfs")


def test_policy_switches_and_large_budget_changes_are_risky():
    split = SchedulerConfig(chunk_size=512, queue_policy="split", short_chunk_size=512, long_chunk_size=512)
    assert risk(FCFS_512, split, 0.5) == "a queue-policy switch (fcfs -> split)"
    assert risk(FCFS_512, SchedulerConfig(chunk_size=128, queue_policy="fcfs"), 0.5) == (
        "a prefill-budget change of 75 % (512 -> 128)")
    assert risk(FCFS_512, SchedulerConfig(chunk_size=384, queue_policy="fcfs"), 0.5) is None  # a small step
    assert risk(FCFS_512, SchedulerConfig(chunk_size=1024, queue_policy="fcfs"), 0.5) == (
        "a prefill-budget change of 100 % (512 -> 1024)")


def test_a_pending_canary_is_rebuilt_from_its_record_and_starts():
    proposed = SchedulerConfig(chunk_size=128, queue_policy="fcfs")
    wanted = canary_wanted(proposed, window_seconds=60, min_samples=100)
    observed = Observed(replicas=3, pods=tuple(PodView(n, True, "control") for n in "abc"),
                        served=ServerConfigFile(generation=7, scheduler=FCFS_512), pod_generations={"a": 6, "b": 7,
                                                                                                    "c": 7})
    pending = step(wanted, None, observed, 1000.0).record
    assert (pending.phase, pending.source, pending.candidate) == (Phase.PENDING, AUTOTUNE, scheduler_record(proposed))
    rebuilt = running_canary(pending, window_seconds=60, min_samples=100)
    assert rebuilt == wanted
    assert running_canary(pending, window_seconds=30, min_samples=100) is None  # another window: another experiment
    started = step(rebuilt, pending, Observed(**{**observed.__dict__, "pod_generations": {"a": 7, "b": 7, "c": 7}}),
                   1010.0)
    assert started.record.phase is Phase.STARTING and started.candidate_config.scheduler == proposed
    assert len(started.record.candidate_pods) == 2  # 50 % of 3, rounded


def test_a_rejected_candidate_is_held_off_and_every_canary_is_followed_by_a_cooldown():
    proposed = SchedulerConfig(chunk_size=128, queue_policy="fcfs")
    reverted = Record(id="x", source=AUTOTUNE, phase=Phase.REVERTED, reason="TBTWorse", message="",
                      candidate=scheduler_record(proposed), decided_at=1000.0)
    assert "cooling down" in held_off(reverted, proposed, 1030.0, cooldown_seconds=60)
    assert "ended Reverted" in held_off(reverted, proposed, 1100.0, cooldown_seconds=60)
    assert held_off(reverted, SchedulerConfig(chunk_size=96, queue_policy="fcfs"), 1100.0, 60) is None
    assert held_off(reverted, proposed, 1000.0 + 601, 60) is None
    promoted = reverted.but(phase=Phase.PROMOTED)
    assert held_off(promoted, proposed, 1100.0, 60) is None
    assert held_off(reverted.but(source="spec"), proposed, 1030.0, 60) is None
