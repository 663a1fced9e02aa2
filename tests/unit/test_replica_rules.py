"""The replica rules one by one: the offered load, the step model's replica count (checked against the fixed point it
solves), the busy-time and saturated fallbacks, the stabilization window, and the controller's use of them —
scale-up sized by the model, never past a pending scale, never while another autoscaler owns the replicas,
scale-down only once the window agrees, an idle service to minReplicas, advise mode proposing without acting."""
from __future__ import annotations

from dataclasses import replace

import pytest

from metronome.operator.tuning.controller import decide
from metronome.operator.tuning.decision import ActionKind, CurrentConfig
from metronome.operator.tuning.observation import Observation, StepSample
from metronome.operator.tuning.replicas import (
    OfferedLoad,
    Recommendation,
    busy_share,
    is_idle,
    model_prediction,
    model_replicas,
    offered_load,
    prune,
    saturated_replicas,
    stabilized_count,
    utilization_replicas,
)
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy
from metronome.operator.tuning.step_model import StepFit

A, B, M = 0.010, 20e-6, 0.002
NOW = 10_000.0
FIT = StepFit(intercept_s=A, slope_s_per_token=B, r_squared=1.0, points=20, token_min=20, token_max=600,
              token_mean=300, mixed_extra_s=M, kinds="decode+mixed")


def spec(**fields) -> AutotuneSpec:
    return AutotuneSpec(**{"tbt_p99_target_s": 0.025, "mode": AutotuneMode.APPLY, "policy": TuningPolicy.MODEL,
                           "cooldown_seconds": 20, "policy_switching": False, "scale_replicas": True,
                           "min_replicas": 1, "max_replicas": 6, "scale_down_stabilization_seconds": 120,
                           **fields})


def points(pods=("pod-0",), tokens=(30, 40, 50, 400, 500, 600), steps=200.0) -> tuple[StepSample, ...]:
    return tuple(StepSample(t, A + B * t + (M if t > 100 else 0.0), steps, pod, "mixed" if t > 100 else "decode")
                 for pod in pods for t in tokens)


def reading(tbt_ms: float, pods=("pod-0",), **fields) -> Observation:
    base = dict(window_seconds=20, sample_count=5000, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=1400.0,
                prompt_tokens_per_s=33_000.0, requests_per_s=11.0, ttft_p99_s=0.5, decode_batch_size=20,
                step_samples=points(pods), pod_generations={pod: 2 for pod in pods}, waiting_requests=1.0,
                waiting_growth=0.0)
    base.update(fields)
    return Observation(**base)


# --- the offered load ---------------------------------------------------------------------------------------------

def test_offered_load_adds_what_the_queue_gained_to_what_was_served():
    obs = reading(22, requests_per_s=7.0, prompt_tokens_per_s=21_000.0, output_tokens_per_s=896.0,
                  waiting_growth=80, mean_prompt_tokens=3000.0)
    load = offered_load(obs, replicas=1)
    assert load.requests_per_s == pytest.approx(7.0 + 80 / 20)
    assert load.prompt_tokens_per_s == pytest.approx(21_000 + 4 * 3000)
    assert load.output_tokens_per_s == pytest.approx(896 + 4 * 128)
    assert offered_load(reading(22, waiting_growth=-30), 1).requests_per_s == pytest.approx(11.0)  # a draining queue
    assert load.scaled(2.0).prompt_tokens_per_s == pytest.approx(2 * load.prompt_tokens_per_s)


def test_the_model_prediction_is_the_fixed_point_of_the_step_it_describes():
    # s = a + m + b·(D + C) with D = λo·s and C = λp·s, solved by iteration, against the closed form.
    load = OfferedLoad(11.0, 33_000.0, 1400.0, 1)
    autotune = spec(prefill_headroom=1.2, chunk_granularity=1)
    for replicas in (2, 3, 4):
        tbt, chunk = model_prediction(FIT, 1.0, load, replicas, 1, autotune)
        output, prompt = 1400.0 / replicas, 33_000.0 * 1.2 / replicas
        step = A + M
        for _ in range(200):
            step = A + M + B * (output * step + prompt * step)
        assert tbt == pytest.approx(step, rel=1e-3) and chunk == pytest.approx(prompt * step, abs=1)
    assert model_prediction(FIT, 1.0, load, 1, 64, autotune)[0] == pytest.approx((A + M) / (1 - B * 41_000))
    assert model_prediction(FIT, 1.0, load.scaled(1.5), 1, 64, autotune) is None  # b·(λo + λp) ≥ 1: saturated


def test_the_model_picks_the_smallest_replica_count_within_the_budget():
    load = OfferedLoad(11.0, 33_000.0, 1400.0, 1)
    estimate = model_replicas(FIT, 1.0, load, 64, spec(), budget_s=0.0225)
    assert estimate.enough and estimate.replicas == 2 and estimate.predicted_tbt_p99_s <= 0.0225
    assert estimate.chunk == 448  # 19,800 prompt tokens/s per replica at a 20.3 ms step, up to the granularity
    assert model_prediction(FIT, 1.0, load, 1, 64, spec())[0] > 0.0225
    # The p99 calibration scales every prediction: 10 % more and two replicas no longer fit.
    assert model_replicas(FIT, 1.1, load, 64, spec(), budget_s=0.0225).replicas == 3
    # A floor chunk lengthens every step: at split's floor of 512 two replicas no longer fit either.
    assert model_replicas(FIT, 1.0, load, 512, spec(), budget_s=0.0225).replicas == 3
    # Past the maximum: the maximum, flagged as not enough.
    short = model_replicas(FIT, 1.1, load.scaled(10), 64, spec(max_replicas=4), budget_s=0.0225)
    assert (short.replicas, short.enough) == (4, False)
    # An empty step already over the budget: replicas are not what the p99 is about.
    assert model_replicas(FIT, 4.0, load, 64, spec(), budget_s=0.0225) is None


def test_a_replica_is_never_sized_past_max_num_seqs():
    # Two replicas decode 700 tokens/s each at a 21.3 ms step: a decode batch of 14.9 (Little's law).
    load = OfferedLoad(11.0, 33_000.0, 1400.0, 1)
    assert model_replicas(FIT, 1.0, load, 64, spec(), budget_s=0.0225, max_batch=16).replicas == 2
    capped = model_replicas(FIT, 1.0, load, 64, spec(), budget_s=0.0225, max_batch=14)
    assert (capped.replicas, capped.enough) == (3, True)
    assert model_prediction(FIT, 1.0, load, 2, 64, spec(), max_batch=14) is None
    short = model_replicas(FIT, 1.0, load, 64, spec(max_replicas=4), budget_s=0.0225, max_batch=4)
    assert (short.replicas, short.enough) == (4, False) and "max_num_seqs 4" in short.basis


def test_without_a_fit_busy_time_or_the_saturated_prefill_rate_size_the_count():
    obs = reading(22, pods=("a", "b", "c"), step_samples=tuple(
        StepSample(50, 0.012, 100.0, pod, "mixed") for pod in ("a", "b", "c") for _ in range(4)))
    assert busy_share(obs) == pytest.approx(4 * 100 * 0.012 / 20)  # 24 % of each pod's time
    estimate = utilization_replicas(obs, offered_load(obs, 3), spec(), headroom=1.3)
    assert estimate.replicas == 2 and estimate.enough  # 0.24 · 3 · 1.3 = 0.94 → 2 pods at 47 % ≤ 60 %
    saturated = saturated_replicas(reading(25, prompt_tokens_per_s=22_000.0, waiting_growth=96,
                                           mean_prompt_tokens=3000.0, waiting_requests=50), offered_load(
        reading(25, prompt_tokens_per_s=22_000.0, waiting_growth=96, mean_prompt_tokens=3000.0), 1), spec())
    assert saturated.replicas == 2  # (22,000 + 14,400) · 1.2 / 22,000 = 1.99
    assert saturated_replicas(reading(25, waiting_requests=0.0), OfferedLoad(1, 1, 1, 1), spec()) is None


def test_idle_means_nothing_arrived_and_nothing_waits():
    assert is_idle(reading(0, sample_count=0, requests_per_s=0.0, output_tokens_per_s=0.0, waiting_requests=0.0))
    assert not is_idle(reading(0, sample_count=0, requests_per_s=0.5, output_tokens_per_s=0.0))
    assert not is_idle(reading(0, sample_count=0, requests_per_s=0.0, output_tokens_per_s=0.0, waiting_requests=2))
    assert not is_idle(reading(0, sample_count=0, requests_per_s=0.0, output_tokens_per_s=0.0, pod_generations={}))


def test_a_scale_down_count_needs_a_covered_window_and_is_its_largest_recommendation():
    window = 120.0
    assert stabilized_count((), 1, NOW, window) is None  # a restarted operator: nothing covers the window
    partial = (Recommendation(NOW - 60, 1), Recommendation(NOW - 40, 1))
    assert stabilized_count(partial, 1, NOW, window) is None
    covered = (Recommendation(NOW - 130, 3), Recommendation(NOW - 100, 2), Recommendation(NOW - 20, 1))
    assert stabilized_count(covered, 1, NOW, window) == 2  # 3 is older than the window
    assert stabilized_count(covered, 1, NOW, 0.0) == 1
    kept = prune((Recommendation(NOW - 300, 4), *covered), NOW, window)
    assert kept == covered  # the newest one before the window stays: it shows the window is covered


# --- the controller's replica rules -----------------------------------------------------------------------------

def test_no_chunk_meets_the_slo_so_replicas_scale_by_what_the_model_says():
    # TBT over target at split's floor chunk with the offered load of three replicas on one.
    obs = reading(40, prompt_tokens_per_s=20_000.0, output_tokens_per_s=900.0, ttft_p99_s=0.5)
    current = CurrentConfig(512, "split", 1, generation=2)
    decision = decide(obs, current, spec(max_replicas=6), NOW)
    assert decision.actions == (ActionKind.SCALE_UP,) and decision.changed
    assert decision.replicas >= 3 and decision.chunk_size == 512, decision.reason
    assert "the step model predicts" in decision.reason


def test_no_scale_up_while_pods_of_the_last_one_are_still_missing():
    obs = reading(40, prompt_tokens_per_s=20_000.0, output_tokens_per_s=900.0)
    current = CurrentConfig(512, "split", 3, generation=2, last_change_time=NOW - 60)
    held = decide(obs, current, spec(), NOW)
    assert not held.changed and "1 pod(s) report where 3 replica(s) are wanted" in held.reason
    # Pods that never come (no GPU for them) stop blocking after settle_timeout_seconds.
    late = decide(obs, CurrentConfig(512, "split", 3, generation=2, last_change_time=NOW - 400), spec(), NOW)
    assert late.changed and late.replicas > 3


def test_an_external_autoscaler_keeps_the_replicas_and_the_slo_is_reported_unreachable():
    obs = reading(40, prompt_tokens_per_s=20_000.0, output_tokens_per_s=900.0)
    current = CurrentConfig(512, "split", 1, generation=2, replicas_owner="HorizontalPodAutoscaler ml/chat")
    decision = decide(obs, current, spec(), NOW)
    assert decision.replicas == 1 and decision.slo_unreachable and not decision.changed
    assert "replicas are managed by HorizontalPodAutoscaler ml/chat" in decision.reason
    assert decision.recommended_replicas >= 3  # what it would want: the desired-replicas metric


def scale_down_case(pods: int):
    names = tuple(f"pod-{i}" for i in range(pods))
    obs = reading(15, pods=names, prompt_tokens_per_s=3000.0, output_tokens_per_s=300.0, requests_per_s=1.0,
                  ttft_p99_s=0.2, decode_batch_size=3)
    return obs, CurrentConfig(512, "fcfs", pods, generation=2)


def test_scale_down_waits_for_the_whole_window_to_agree():
    obs, current = scale_down_case(3)
    first = decide(obs, current, spec(), NOW)
    assert not first.changed and first.recommended_replicas == 1  # one replica carries 1.3 × this load
    early = decide(obs, current, spec(), NOW, (Recommendation(NOW - 60, 1),))
    assert not early.changed
    disagreed = decide(obs, current, spec(), NOW, (Recommendation(NOW - 130, 1), Recommendation(NOW - 60, 2)))
    assert disagreed.actions == (ActionKind.SCALE_DOWN,) and disagreed.replicas == 2
    agreed = decide(obs, current, spec(), NOW, (Recommendation(NOW - 130, 1), Recommendation(NOW - 60, 1)))
    assert agreed.actions == (ActionKind.SCALE_DOWN,) and agreed.replicas == 1 and agreed.changed
    assert "every recommendation of the last 120 s is ≤ 1" in agreed.reason
    assert "with ×1.3 the observed load" in agreed.reason
    # Never below minReplicas; never while something else sets them; advise mode only proposes.
    history = (Recommendation(NOW - 130, 1),)
    assert decide(obs, current, spec(min_replicas=2), NOW, history).replicas == 2
    owned = decide(obs, CurrentConfig(512, "fcfs", 3, generation=2, replicas_owner="ScaledObject ml/chat"), spec(),
                   NOW, history)
    assert owned.replicas == 3 and not owned.changed
    advised = decide(obs, current, spec(mode=AutotuneMode.ADVISE), NOW, history)
    assert not advised.changed and advised.proposed_change and advised.replicas == 1


def test_scale_down_keeps_the_replicas_the_servers_batch_cap_needs():
    # 390 output tokens/s (×1.3) at a 13.4 ms step is a decode batch of 5.2: one server under max_num_seqs 4 would
    # queue whole requests, where every TBT it reported still looked fine.
    obs, current = scale_down_case(3)
    history = (Recommendation(NOW - 130, 1),)
    uncapped = decide(obs, replace(current, max_num_seqs=256), spec(), NOW, history)
    assert uncapped.replicas == 1 and uncapped.actions == (ActionKind.SCALE_DOWN,)
    capped = decide(obs, replace(current, max_num_seqs=4), spec(), NOW, (Recommendation(NOW - 130, 2),))
    assert capped.recommended_replicas == 2 and capped.replicas == 2, capped.reason
    assert decide(obs, replace(current, max_num_seqs=2), spec(), NOW, history).replicas == 3


def test_no_scale_down_while_the_slo_is_broken_or_prefill_lags():
    obs, current = scale_down_case(3)
    history = (Recommendation(NOW - 130, 1),)
    for bad in (dict(tbt_p99_s=0.030), dict(ttft_p99_s=5.0, waiting_requests=3.0)):
        broken = Observation(**{**obs.__dict__, **bad})
        decision = decide(broken, current, spec(ttft_p99_target_s=2.0), NOW, history)
        assert decision.replicas == 3 and decision.recommended_replicas == 3, decision.reason


def test_an_idle_service_goes_to_min_replicas_once_the_window_agrees():
    idle = reading(0, pods=("a", "b"), sample_count=0, tbt_p99_s=None, requests_per_s=0.0, output_tokens_per_s=0.0,
                   prompt_tokens_per_s=0.0, waiting_requests=0.0, step_samples=())
    current = CurrentConfig(512, "fcfs", 2, generation=2)
    waiting = decide(idle, current, spec(), NOW)
    assert waiting.actions == (ActionKind.NO_DATA,) and waiting.recommended_replicas == 1 and not waiting.changed
    down = decide(idle, current, spec(), NOW, (Recommendation(NOW - 130, 1),))
    assert down.actions == (ActionKind.SCALE_DOWN,) and down.replicas == 1 and "no requests" in down.reason
    off = decide(idle, current, spec(scale_replicas=False), NOW, (Recommendation(NOW - 130, 1),))
    assert not off.changed
