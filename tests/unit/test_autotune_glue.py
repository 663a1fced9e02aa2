"""The autotune step between Prometheus and the API: no data, off, advise, apply, unreachable SLO, generation
counting, status fields, and the last change time that survives an operator restart."""
from __future__ import annotations

import pytest

from metronome.contract.budget import prefill_budget
from metronome.contract.config import SchedulerConfig, ServerConfigFile
from metronome.operator.changes import describe_transitions
from metronome.operator.metrics_source import MetricsUnavailable
from metronome.operator.spec import parse_service
from metronome.operator.status import Observed, compute_status
from metronome.operator.tuning.autotune import (
    ADVICE,
    AWAITING_PODS,
    CHUNK_AT_FLOOR,
    NO_SAMPLES,
    NOT_CONFIGURED,
    POLICY_SWITCHED,
    SCALED,
    TunerMemory,
    format_time,
    last_change_time,
    parse_time,
    pods_on_generation,
    serving_metrics,
    step,
)
from metronome.operator.tuning.observation import Observation, StepSample

NOW = 1_767_225_600.0  # 2026-01-01T00:00:00Z
A, B = 0.008, 20e-6  # the plant behind the step samples: step seconds = a + b * tokens


def service(mode="apply", policy="multiplicative", replicas=2, slo_ms=30, **autotune):
    spec = {
        "model": {"source": "default"}, "replicas": replicas, "minReplicas": 1, "maxReplicas": 3,
        "server": {"chunkSize": 1024, "queuePolicy": "fcfs"},
        "autotune": {"mode": mode, "policy": policy, "cooldownSeconds": 60, "minChunkSize": 64,
                     "policySwitching": False, **autotune},
        "metrics": {"windowSeconds": 20},
    }
    if slo_ms is not None:
        spec["slo"] = {"tbtP99Ms": slo_ms}
    return parse_service({"metadata": {"name": "chat", "namespace": "ml", "uid": "u", "generation": 4},
                          "spec": spec})


def served(chunk=1024, generation=3) -> ServerConfigFile:
    return ServerConfigFile(generation=generation, scheduler=SchedulerConfig(chunk_size=chunk, queue_policy="fcfs"))


def observation(tbt_ms=60.0, samples=5000, generations=None, **fields) -> Observation:
    tokens = (100, 200, 300, 450, 600, 800)
    base = dict(window_seconds=20, sample_count=samples, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=900.0,
                ttft_p99_s=0.25, decode_batch_size=20,
                step_samples=tuple(StepSample(t, A + B * t, 500, f"pod-{i % 2}") for i, t in enumerate(tokens)),
                pod_generations={"chat-a": 3, "chat-b": 3} if generations is None else generations)
    base.update(fields)
    return Observation(**base)


# --- status fields from a reading ----------------------------------------------------------------------------


def test_a_reading_becomes_status_fields_and_conditions():
    metrics = serving_metrics(observation(tbt_ms=24.04, generations={"a": 3, "b": 2}), None, served_generation=3)
    assert (metrics.available, metrics.reason) == (True, "MetricsRead")
    assert metrics.tbt_p99_ms == pytest.approx(24.04) and metrics.ttft_p99_ms == pytest.approx(250.0)
    assert metrics.throughput_tokens_per_second == 900.0 and metrics.pods_on_generation == 1

    svc = service()
    deployment = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 2,
                                                            "readyReplicas": 2, "availableReplicas": 2,
                                                            "updatedReplicas": 2}}
    status = compute_status(svc, Observed(deployment, served_config=served(), metrics=metrics), now=format_time(NOW))
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (status["tbtP99Ms"], status["ttftP99Ms"], status["throughputTokensPerSecond"]) == (24.0, 250.0, 900.0)
    assert status["slo"] == "Met" and conditions["SLOMet"]["status"] == "True"
    assert status["podsOnGeneration"] == 1
    assert (conditions["ConfigApplied"]["status"], conditions["ConfigApplied"]["reason"]) == (
        "False", "PodsOnOlderGeneration")


def test_pods_count_only_on_the_exact_served_generation():
    assert pods_on_generation({"a": 3, "b": 4, "c": 2}, 3) == 1
    assert pods_on_generation({}, 3) == 0
    assert pods_on_generation(None, 3) is None and pods_on_generation({"a": 3}, None) is None


@pytest.mark.parametrize("reason", [MetricsUnavailable.UNREACHABLE, MetricsUnavailable.NO_SERIES])
def test_prometheus_failures_are_metrics_available_false_with_a_warning_once(reason):
    down = MetricsUnavailable(reason, "no luck")
    result = step(service(), served(), {}, None, down, NOW)
    assert not result.metrics.available and result.metrics.reason == reason
    assert result.decision is not None and not result.decision.changed
    assert result.scheduler is None and result.replicas is None and result.last_decision is None
    assert result.pod_generations is None and result.events == () and result.problem is None

    svc = service()
    first = compute_status(svc, Observed(None, served_config=served(), metrics=result.metrics), now="t0")
    events = describe_transitions([], first["conditions"])
    assert ("Warning", reason) in [(e.type, e.reason) for e in events]
    again = compute_status(svc, Observed(None, served_config=served(), metrics=result.metrics), now="t1",
                           previous_conditions=first["conditions"])
    assert describe_transitions(first["conditions"], again["conditions"]) == []  # not every tick


def test_too_few_samples_changes_nothing_but_still_counts_generations():
    result = step(service(), served(), {}, observation(tbt_ms=500, samples=40), None, NOW)
    assert (result.metrics.available, result.metrics.reason) == (False, NO_SAMPLES)
    assert result.metrics.tbt_p99_ms is None and result.metrics.pods_on_generation == 2
    assert result.scheduler is None and not result.decision.changed


def test_no_prometheus_url_is_a_problem_only_when_autotune_is_on():
    on = step(service(mode="apply"), served(), {}, None, None, NOW)
    assert (on.metrics.available, on.metrics.reason) == (False, NOT_CONFIGURED)
    assert on.problem and "--prometheus-url" in on.problem
    off = step(service(mode="off"), served(), {}, None, None, NOW)
    assert off.metrics.reason == NOT_CONFIGURED and off.problem is None


def test_autotune_without_an_slo_is_a_problem_not_a_crash():
    result = step(service(slo_ms=None), served(), {}, observation(), None, NOW)
    assert result.decision is None and result.problem and "tbtP99Ms" in result.problem
    assert result.metrics.available  # status still shows what was measured


def test_mode_off_reads_but_never_decides():
    result = step(service(mode="off"), served(), {}, observation(tbt_ms=90), None, NOW)
    assert result.metrics.available and result.decision is None
    assert result.scheduler is None and result.last_decision is None and result.events == ()


# --- apply ---------------------------------------------------------------------------------------------------


def test_apply_serves_a_smaller_chunk_and_records_the_decision():
    result = step(service(), served(chunk=1024), {}, observation(tbt_ms=60), None, NOW)
    assert result.decision.changed and result.scheduler is not None
    assert result.scheduler.chunk_size == 922 and result.scheduler.queue_policy.value == "fcfs"  # round(1024 x 0.9)
    assert result.replicas is None
    record = result.last_decision
    assert record["time"] == "2026-01-01T00:00:00Z" and record["applied"] is True
    assert record["from"] == {"chunkSize": 1024, "queuePolicy": "fcfs", "replicas": 2}
    assert record["to"] == {"chunkSize": 922, "queuePolicy": "fcfs", "replicas": 2}
    assert record["policy"] == "multiplicative" and "60.0 ms" in record["reason"]
    assert result.config_reason.startswith("autotune: ") and "60.0 ms" in result.config_reason
    assert result.slo_override is None


def test_apply_with_the_model_policy_lands_inside_the_slo_in_one_step():
    result = step(service(policy="model"), served(chunk=4096), {}, observation(tbt_ms=(A + B * 4116) * 1e3), None, NOW)
    assert result.scheduler is not None and result.scheduler.chunk_size < 4096
    assert result.last_decision["policy"] == "model"


def test_an_unreachable_slo_sets_chunk_at_floor_and_changes_nothing():
    result = step(service(), served(chunk=64), {}, observation(tbt_ms=90), None, NOW)
    assert result.decision.slo_unreachable and result.scheduler is None and result.replicas is None
    assert result.last_decision is None
    reason, why = result.slo_override
    assert reason == CHUNK_AT_FLOOR and "scaleReplicas is off" in why

    svc = service()
    status = compute_status(svc, Observed(None, served_config=served(chunk=64), metrics=result.metrics,
                                          slo_override=result.slo_override), now="t0")
    slo = {c["type"]: c for c in status["conditions"]}["SLOMet"]
    assert (slo["status"], slo["reason"]) == ("False", CHUNK_AT_FLOOR) and status["slo"] == "Violated"
    assert "TBT p99 90.0 ms > 30 ms" in slo["message"]
    assert ("Warning", CHUNK_AT_FLOOR) in [(e.type, e.reason) for e in describe_transitions([], status["conditions"])]


def test_at_the_floor_with_scale_replicas_adds_a_replica_within_bounds():
    result = step(service(scaleReplicas=True), served(chunk=64), {}, observation(tbt_ms=90), None, NOW)
    assert result.replicas == 3 and result.scheduler is None
    assert [(e.type, e.reason) for e in result.events] == [("Normal", SCALED)]
    assert result.last_decision["to"]["replicas"] == 3 and result.last_decision["applied"] is True

    at_max = step(service(scaleReplicas=True, replicas=3), served(chunk=64), {}, observation(tbt_ms=90), None, NOW)
    assert at_max.replicas is None and at_max.slo_override[0] == CHUNK_AT_FLOOR
    assert "maximum 3" in at_max.slo_override[1]


def test_last_decision_names_the_budgets_the_servers_enforce_under_split():
    crd_defaults = ServerConfigFile(generation=3, scheduler=SchedulerConfig())  # split: short 2048, long 512
    result = step(service(), crd_defaults, {}, observation(tbt_ms=60), None, NOW)
    assert result.last_decision["from"]["chunkSize"] == 2048  # the short lane, not chunkSize 512
    assert result.last_decision["to"]["chunkSize"] == prefill_budget(result.scheduler) == 1843
    # A ceiling under the short-prompt threshold: the decision says 256, but split admits short prompts whole
    # within 512, so 512 is what the servers run and what lastDecision says.
    capped = step(service(minChunkSize=64, maxChunkSize=256), crd_defaults, {}, observation(tbt_ms=60), None, NOW)
    assert capped.decision.chunk_size == 256 and prefill_budget(capped.scheduler) == 512
    assert capped.last_decision["to"] == {"chunkSize": 512, "queuePolicy": "split", "replicas": 2}
    advised = step(service(mode="advise", minChunkSize=64, maxChunkSize=256), crd_defaults, {},
                   observation(tbt_ms=60), None, NOW)
    assert advised.last_decision["to"]["chunkSize"] == 512 and advised.scheduler is None


def test_a_queue_policy_switch_is_announced():
    at_split_floor = ServerConfigFile(generation=3, scheduler=SchedulerConfig(short_chunk_size=512,
                                                                              long_chunk_size=512))
    result = step(service(policy="model", policySwitching=True), at_split_floor, {},
                  observation(tbt_ms=40, long_prompt_share=0.3), None, NOW)
    assert result.scheduler.queue_policy.value == "fcfs" and result.scheduler.chunk_size < 512
    (event,) = result.events
    assert (event.type, event.reason) == ("Normal", POLICY_SWITCHED)
    assert event.message.startswith(f"queue policy split -> fcfs, prefill budget 512 -> {result.scheduler.chunk_size}")
    assert "short-prompt threshold" in event.message


# --- advise --------------------------------------------------------------------------------------------------


def test_advise_records_the_proposal_once_and_acts_on_nothing():
    result = step(service(mode="advise"), served(), {}, observation(tbt_ms=60), None, NOW)
    assert result.scheduler is None and result.replicas is None
    assert result.last_decision["applied"] is False and result.last_decision["to"]["chunkSize"] == 922
    (event,) = result.events
    assert (event.type, event.reason) == ("Normal", ADVICE) and "chunk 1024→922" in event.message

    status = {"lastDecision": result.last_decision}
    again = step(service(mode="advise"), served(), status, observation(tbt_ms=60), None, NOW + 30)
    assert again.last_decision is None and again.events == ()  # the same advice is not repeated
    # Advice is no change: it starts no cooldown.
    assert last_change_time(status) is None


# --- cooldown across restarts --------------------------------------------------------------------------------


def test_the_last_change_time_comes_back_from_status_after_a_restart():
    first = step(service(), served(chunk=1024), {}, observation(tbt_ms=60), None, NOW)
    status = {"lastDecision": first.last_decision}
    assert last_change_time(status) == NOW
    # A new process (no memory) 30 s later, within the 60 s cooldown: the change is not repeated.
    later = step(service(), served(chunk=921, generation=4), status, observation(tbt_ms=60, generations={"a": 4}),
                 None, NOW + 30, remembered_change_time=None)
    assert not later.decision.changed and "cooldown" in later.decision.reason
    # After the cooldown and the window, it acts again.
    much_later = step(service(), served(chunk=921, generation=4), status,
                      observation(tbt_ms=60, generations={"a": 4, "b": 4}), None, NOW + 90)
    assert much_later.scheduler is not None and much_later.scheduler.chunk_size < 921


def test_the_process_memory_covers_a_status_that_lags_behind():
    lagging = step(service(), served(chunk=921, generation=4), {}, observation(tbt_ms=60), None, NOW + 5,
                   remembered_change_time=NOW)
    assert not lagging.decision.changed and "cooldown" in lagging.decision.reason


def test_times_round_trip_and_bad_ones_are_ignored():
    assert parse_time(format_time(NOW)) == NOW
    assert parse_time("2026-01-01T00:00:00+00:00") == NOW
    assert parse_time("yesterday") is None and parse_time(None) is None
    assert last_change_time({"lastDecision": {"time": "garbage", "applied": True}}) is None
    assert last_change_time({}) is None and last_change_time(None) is None


# --- per-object memory ---------------------------------------------------------------------------------------


def test_tuner_memory_reads_at_the_interval_and_at_once_after_a_spec_change():
    memory = TunerMemory()
    assert memory.due(NOW, spec_generation=4)
    reading = step(service(), served(), {}, observation(tbt_ms=25), None, NOW)
    assert memory.remember(reading, NOW, spec_generation=4, interval_seconds=30) is None
    assert not memory.due(NOW + 29, 4) and memory.due(NOW + 30, 4)
    assert memory.due(NOW + 1, 5)  # spec changed: read now


def test_tuner_memory_counts_pods_against_the_generation_served_now():
    memory = TunerMemory()
    reading = step(service(), served(chunk=1024, generation=3), {}, observation(tbt_ms=60), None, NOW)
    memory.remember(reading, NOW, 4, 30)
    assert memory.last_change_time == NOW  # it applied a change
    assert memory.metrics_for(3).pods_on_generation == 2
    assert memory.metrics_for(4).pods_on_generation == 0  # just written: no pod is on it yet


def test_tuner_memory_announces_a_problem_once():
    memory = TunerMemory()
    blocked = step(service(slo_ms=None), served(), {}, observation(), None, NOW)
    assert memory.remember(blocked, NOW, 4, 30) == blocked.problem
    assert memory.remember(blocked, NOW + 30, 4, 30) is None
    fine = step(service(), served(), {}, observation(tbt_ms=25), None, NOW + 60)
    assert memory.remember(fine, NOW + 60, 4, 30) is None and memory.problem is None


def test_no_series_before_any_pod_is_ready_is_expected_not_a_warning():
    missing = MetricsUnavailable(MetricsUnavailable.NO_SERIES, "Prometheus has no Metronome series")
    waiting = serving_metrics(None, missing, served_generation=1, ready_pods=0)
    assert (waiting.available, waiting.reason) == (False, AWAITING_PODS)
    assert serving_metrics(None, missing, served_generation=1, ready_pods=2).reason == MetricsUnavailable.NO_SERIES
    status = compute_status(service(), Observed(None, served_config=served(), metrics=waiting), now="t0")
    assert ("Normal", AWAITING_PODS) in [(e.type, e.reason) for e in describe_transitions([], status["conditions"])]


def test_the_memory_keeps_the_recommendations_a_scale_down_must_agree_with():
    svc = service(policy="model", replicas=3, scaleReplicas=True, scaleDownStabilizationSeconds=60)
    quiet = observation(tbt_ms=12.0, generations={"chat-a": 3, "chat-b": 3, "chat-c": 3}, output_tokens_per_s=100.0,
                        prompt_tokens_per_s=500.0, requests_per_s=0.5, waiting_requests=0.0, waiting_growth=0.0,
                        decode_batch_size=2)
    memory = TunerMemory()
    for seconds in (0, 30):
        result = step(svc, served(), {}, quiet, None, NOW + seconds, recent=memory.recommendations)
        assert result.replicas is None, result.decision.reason  # the window is not covered yet
        memory.remember(result, NOW + seconds, 4, 30, svc.spec.autotune.scale_down_stabilization_seconds)
    assert [r.replicas for r in memory.recommendations] == [1, 1]
    result = step(svc, served(), {}, quiet, None, NOW + 60, recent=memory.recommendations)
    assert result.replicas == 1 and result.last_decision["to"]["replicas"] == 1
    assert [e.reason for e in result.events] == [SCALED] and "replicas 3 -> 1" in result.events[0].message
    memory.remember(result, NOW + 60, 4, 30, 60)
    memory.remember(result, NOW + 100, 4, 30, 60)
    assert [r.time for r in memory.recommendations] == [NOW + 30, NOW + 60, NOW + 100]  # older ones dropped
