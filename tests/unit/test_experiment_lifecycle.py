"""An experiment's life, step by step (operator/experiment/lifecycle.py, record.py, children.py): waiting for
replicas and a settled config (an experiment created while the autotuner is mid-change), labelling the candidate
slice, measuring, promoting or reverting, and aborting — never promoting — when a candidate pod dies."""
from __future__ import annotations

from metronome.contract import variant
from metronome.contract.config import SchedulerConfig, ServerConfigFile
from metronome.contract.rfc3339 import format_time, parse_time
from metronome.operator.experiment.children import PodView, label_changes, pod_views
from metronome.operator.experiment.lifecycle import Observed, Step, Wanted, step
from metronome.operator.experiment.record import Phase, Record, record_from_status
from metronome.operator.experiment.settings import CandidateSpec, ExperimentSpec
from metronome.operator.experiment.verdict import GroupWindow, WindowReading

SERVED = ServerConfigFile(generation=3, scheduler=SchedulerConfig(chunk_size=512, queue_policy="fcfs"))
SPEC = ExperimentSpec(candidate=CandidateSpec({"chunk_size": 128}), window_seconds=30, windows=6, min_samples=50)
WANTED = Wanted(SPEC, "spec")
T0 = 1_800_000_000.0


def pods(*names: str, unready: tuple[str, ...] = (), labels: dict[str, str] | None = None) -> tuple[PodView, ...]:
    labels = labels or {}
    return tuple(PodView(n, n not in unready, labels.get(n, variant.CONTROL), n in labels) for n in names)


def observed(**changes) -> Observed:
    values = dict(replicas=2, pods=pods("a", "b"), served=SERVED, pod_generations={"a": 3, "b": 3},
                  applied_at={"a": T0 - 100, "b": T0 - 100})
    return Observed(**{**values, **changes})


def reading(index: int, tbt: float, samples: float = 200, pods_seen: int = 1) -> WindowReading:
    control = GroupWindow(0.5, 4.0, 20.0, tbt_samples=200, requests=10, pods_seen=1)
    candidate = GroupWindow(0.5 * tbt, 4.0, 20.0, tbt_samples=samples, requests=10, pods_seen=pods_seen)
    return WindowReading(index, T0 + 30 * index, candidate, control)


LABELLED = pods("a", "b", labels={"a": variant.CANDIDATE, "b": variant.CONTROL})  # as Starting left them


def started() -> Step:
    """Pending → Starting in one step: the service is settled."""
    return step(WANTED, None, observed(), T0)


def running() -> Record:
    begun = started().record
    moving = step(WANTED, begun, observed(pod_generations={"a": 4, "b": 3}, applied_at={"a": T0 + 20.4, "b": T0}),
                  T0 + 30)
    assert moving.record.phase is Phase.RUNNING
    return moving.record


def test_a_settled_service_starts_by_labelling_one_pod_and_writing_the_candidate_config():
    first = started()
    record = first.record
    assert (record.phase, record.candidate_pods, record.candidate_generation, record.control_generation) == (
        Phase.STARTING, ("a",), 4, 3)
    assert first.labels == {"a": variant.CANDIDATE, "b": variant.CONTROL}
    assert first.candidate_config == ServerConfigFile(generation=4, scheduler=SchedulerConfig(
        chunk_size=128, queue_policy="fcfs"))
    assert first.pause_tuner and first.events[0].reason == "ExperimentStarted"
    assert "prefill budget 128 under fcfs" in record.message and "1 of 2 pods" in record.message
    assert (record.candidate["chunkSize"], record.candidate["queuePolicy"], record.candidate["maxNumSeqs"]) == (
        128, "fcfs", 256)  # the named field over the served config


def test_an_experiment_created_while_the_autotuner_is_mid_change_waits_for_the_config_to_settle():
    mid_change = observed(served=ServerConfigFile(generation=4, scheduler=SERVED.scheduler),
                          pod_generations={"a": 4, "b": 3})
    waiting = step(WANTED, None, mid_change, T0)
    assert (waiting.record.phase, waiting.record.reason) == (Phase.PENDING, "ConfigSettling")
    assert waiting.pause_tuner and not waiting.labels and waiting.candidate_config is None  # the tuner holds still
    again = step(WANTED, waiting.record, mid_change, T0 + 5)
    assert again.record.phase is Phase.PENDING and not again.events  # announced once
    settled = step(WANTED, again.record, observed(served=mid_change.served, pod_generations={"a": 4, "b": 4}), T0 + 9)
    assert settled.record.phase is Phase.STARTING and settled.candidate_config.generation == 5
    assert settled.record.control_generation == 4


def test_fewer_than_two_replicas_waits_with_a_warning_and_leaves_the_autotuner_alone():
    lone = step(WANTED, None, observed(replicas=1, pods=pods("a")), T0)
    assert (lone.record.phase, lone.record.reason, lone.pause_tuner) == (Phase.PENDING, "NotEnoughReplicas", False)
    assert lone.events[0].type == "Warning" and "at least 2" in lone.events[0].message
    assert step(WANTED, lone.record, observed(), T0 + 1).record.phase is Phase.STARTING


def test_measuring_starts_when_the_last_candidate_pod_applied_its_config():
    begun = started().record
    half = step(WANTED, begun, observed(pod_generations={"a": 3, "b": 3}), T0 + 10)
    assert half.record.phase is Phase.STARTING and "0/1 candidate pods" in half.record.message
    record = running()
    assert record.measuring_since == T0 + 21  # the candidate's apply time, rounded up: no sample before it counts


def test_a_better_candidate_is_promoted_as_the_served_config():
    record = running()
    end = step(WANTED, record, observed(pods=LABELLED, pod_generations={"a": 4, "b": 3},
                                         readings=[reading(i, 0.5) for i in range(1, 6)]), T0 + 300)
    assert (end.record.phase, end.record.reason) == (Phase.PROMOTED, "Better")
    assert end.control_config == ServerConfigFile(generation=5, scheduler=SchedulerConfig(chunk_size=128,
                                                                                          queue_policy="fcfs"))
    assert end.labels == {"a": variant.CONTROL} and end.delete_candidate_config
    assert end.events[0].reason == "ExperimentPromoted" and "generation 5" in end.record.message
    assert end.record.ratios["tbtP99"]["state"] == "better" and end.record.windows == 5


def test_a_worse_candidate_is_reverted_and_the_control_keeps_its_config():
    end = step(WANTED, running(), observed(pods=LABELLED, pod_generations={"a": 4, "b": 3},
                                            readings=[reading(i, 3.0) for i in range(1, 6)]), T0 + 300)
    assert (end.record.phase, end.record.reason, end.control_config) == (Phase.REVERTED, "TBTWorse", None)
    assert end.labels == {"a": variant.CONTROL} and end.delete_candidate_config


def test_a_candidate_pod_that_dies_aborts_the_experiment_and_nothing_is_promoted():
    record = running()
    good = [reading(i, 0.5) for i in range(1, 6)]
    end = step(WANTED, record, observed(pods=pods("b", "c"), readings=good), T0 + 300)
    assert (end.record.phase, end.record.reason, end.control_config) == (Phase.ABORTED, "CandidatePodLost", None)
    assert "candidate pod a is gone" in end.record.message and end.events[0].type == "Warning"


def test_a_candidate_pod_that_is_not_ready_pauses_and_its_silent_windows_never_count():
    record = running()
    silent = [reading(i, 0.5, pods_seen=0) for i in range(1, 5)]
    paused = step(WANTED, record, observed(pods=pods("a", "b", unready=("a",)), readings=silent), T0 + 200)
    assert (paused.record.phase, paused.record.reason) == (Phase.RUNNING, "CandidatePodNotReady")
    assert paused.record.windows == 0 and paused.record.windows_skipped == 4 and paused.control_config is None
    assert paused.events[0].reason == "ExperimentPaused"
    starved = [reading(i, 0.5, pods_seen=0) for i in range(1, 8)]
    end = step(WANTED, paused.record, observed(readings=starved), T0 + 300)
    assert (end.record.phase, end.record.reason) == (Phase.ABORTED, "NotEnoughData")


def test_the_control_changing_under_the_experiment_aborts_it():
    moved = ServerConfigFile(generation=5, scheduler=SchedulerConfig(chunk_size=64, queue_policy="fcfs"))
    end = step(WANTED, running(), observed(served=moved), T0 + 100)
    assert (end.record.phase, end.record.reason) == (Phase.ABORTED, "ControlChanged")


def test_removing_or_changing_the_experiment_ends_the_running_one():
    record = running()
    cancelled = step(None, record, observed(), T0 + 100)
    assert (cancelled.record.phase, cancelled.record.reason) == (Phase.ABORTED, "Cancelled")
    other = Wanted(ExperimentSpec(candidate=CandidateSpec({"chunk_size": 256}), windows=6), "spec")
    superseded = step(other, record, observed(), T0 + 100)
    assert superseded.record.reason == "Superseded"
    # The next step starts the new one; its candidate generation continues past the old candidate's.
    renewed = step(other, superseded.record, observed(), T0 + 110)
    assert renewed.record.phase is Phase.STARTING and renewed.candidate_config.generation == 5


def test_an_invalid_candidate_aborts_before_touching_any_pod():
    capped = Wanted(ExperimentSpec(candidate=CandidateSpec({"max_num_batched_tokens": 100}), windows=6), "spec")
    end = step(capped, None, observed(), T0)  # a cap below the served max_num_seqs (256)
    assert (end.record.phase, end.record.reason, end.labels) == (Phase.ABORTED, "InvalidCandidate", {})
    assert "max_num_batched_tokens (100) must be >= max_num_seqs (256)" in end.record.message
    same = Wanted(ExperimentSpec(candidate=CandidateSpec({"chunk_size": 512}), windows=6), "spec")
    assert "nothing to compare" in step(same, None, observed(), T0).record.message


def test_after_the_end_leftover_candidates_go_back_and_the_autotuner_waits_for_them():
    record = running()
    end = step(WANTED, record, observed(readings=[reading(i, 3.0) for i in range(1, 6)]), T0 + 300)
    lagging = observed(pods=pods("a", "b", labels={"a": variant.CANDIDATE}), pod_generations={"a": 4, "b": 3})
    after = step(WANTED, end.record, lagging, T0 + 310)
    assert after.record == end.record and after.labels == {"a": variant.CONTROL} and after.pause_tuner
    home = step(WANTED, end.record, observed(pods=pods("a", "b", labels={"a": "control"})), T0 + 330)
    assert not home.labels and not home.pause_tuner and home.record.phase is Phase.REVERTED


def test_the_record_round_trips_through_status():
    record = running().but(ratios={"tbtP99": {"ratio": 0.5}}, windows=3)
    status = record.to_status(format_time)
    assert status["summary"] == "Running 3/6" and status["candidatePods"] == ["a"]
    assert record_from_status(status, parse_time) == record
    assert record_from_status({"id": "x", "phase": "Bogus"}, parse_time) is None


def test_pods_and_labels_from_the_api():
    raw = [{"metadata": {"name": "b", "labels": {variant.LABEL: "candidate"}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}},
           {"metadata": {"name": "a"}, "status": {}},
           {"metadata": {"name": "c", "deletionTimestamp": "2026-01-01T00:00:00Z"}}]
    views = pod_views(raw)
    assert views == (PodView("a", False, "control", False), PodView("b", True, "candidate", True))
    assert label_changes(views, ["a"], everyone=True) == {"a": "candidate", "b": "control"}
    assert label_changes(views, (), everyone=False) == {"b": "control"}
