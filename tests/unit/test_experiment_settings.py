"""spec.experiment parsed (operator/experiment/settings.py): the candidate over the served config (prefillBudget
through the one budget definition), the slice of replicas, windows or a duration, and errors naming the field."""
from __future__ import annotations

import pytest

from metronome.contract.budget import prefill_budget
from metronome.contract.config import SchedulerConfig
from metronome.operator.experiment.settings import (
    CandidateSpec,
    candidate_count,
    parse_experiment,
    validate_candidate,
)
from metronome.operator.spec import parse_spec
from metronome.operator.spec_error import SpecError


def parse(**fields):
    return parse_experiment({"candidate": {"chunkSize": 256}, **fields}, metrics_window_seconds=30)


def test_a_minimal_experiment_takes_the_defaults_and_the_metrics_window():
    spec = parse()
    assert (spec.share, spec.window_seconds, spec.windows, spec.duration_seconds) == ("50%", 30, 10, 300)
    assert spec.candidate == CandidateSpec({"chunk_size": 256})
    assert parse(durationSeconds=200, windowSeconds=20).windows == 10
    assert parse(name="a").identity != parse(name="b").identity and parse().identity == parse().identity
    body = {"model": {"source": "default"}, "metrics": {"windowSeconds": 20},
            "experiment": {"candidate": {"queuePolicy": "split", "prefillBudget": 1024}, "share": 1}}
    assert parse_spec(body).experiment.window_seconds == 20
    assert parse_spec({"model": {"source": "default"}}).experiment is None


def test_the_candidate_is_laid_over_the_served_config():
    served = SchedulerConfig(chunk_size=512, queue_policy="fcfs", max_num_seqs=32)
    scheduler, problem = validate_candidate(CandidateSpec({"queue_policy": "split"}, prefill_budget=1024), served)
    assert problem is None and scheduler.max_num_seqs == 32  # the served fields the candidate leaves alone stay
    assert (prefill_budget(scheduler), scheduler.short_chunk_size, scheduler.long_chunk_size) == (1024, 1024, 1024)
    plain, _ = validate_candidate(CandidateSpec({"queue_policy": "split"}), served)
    assert prefill_budget(plain) == 2048  # split's own sizes: why prefillBudget exists
    assert CandidateSpec({"queue_policy": "split"}, 1024).as_dict() == {"queuePolicy": "split", "prefillBudget": 1024}


@pytest.mark.parametrize("share, replicas, count", [
    ("50%", 2, 1), ("50%", 3, 2), ("10%", 4, 1), ("99%", 10, 9), (1, 2, 1), (5, 3, 2), ("50%", 1, None), (1, 0, None),
])
def test_the_slice_is_at_least_one_pod_and_never_all(share, replicas, count):
    assert candidate_count(share, replicas) == count


@pytest.mark.parametrize("fields, where, message", [
    ({"candidate": {}}, "candidate", "required"),
    ({"candidate": {"chunk": 1}}, "candidate.chunk", "not a reloadable scheduler field"),
    ({"candidate": {"chunkSize": 0}}, "candidate.chunkSize", "Input should be greater than"),
    ({"candidate": {"queuePolicy": "lifo"}}, "candidate.queuePolicy", "Input should be"),
    ({"candidate": {"chunkSize": 64, "prefillBudget": 128}}, "candidate.prefillBudget", "set it or chunkSize"),
    ({"windows": 6, "durationSeconds": 600}, "", "set windows or durationSeconds, not both"),
    ({"durationSeconds": 100}, "durationSeconds", "100 s holds 3 windows of 30 s; the comparison needs at least 5"),
    ({"windows": 4}, "windows", "must be within [5, 1000]"),
    ({"share": "100%"}, "share", "a count of pods or a percentage from 1% to 99% (never all)"),
    ({"share": 0}, "share", "at least one pod"),
    ({"confidence": 0.99}, "confidence", "must be within [0.5, 0.96]"),
    ({"gates": {"goodputLowerPercent": 100}}, "gates.goodputLowerPercent", "below 100"),
    ({"gates": {"errorRate": "yes"}}, "gates.errorRate", "expected a boolean"),
])
def test_bad_experiments_are_refused_naming_the_field(fields, where, message):
    with pytest.raises(SpecError) as refused:
        parse_experiment({"candidate": {"chunkSize": 256}, **fields}, 30)
    path = "spec.experiment" + (f".{where}" if where else "")
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
