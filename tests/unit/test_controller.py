"""The controller's rules one by one: no data, settling, deadband, both policies, cap and bounds, fallback,
floor → scale or unreachable, policy switching with hysteresis, advise and off modes, spec parsing."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metronome.operator.spec import SpecError, parse_spec
from metronome.operator.tuning.controller import decide
from metronome.operator.tuning.decision import ActionKind, CurrentConfig
from metronome.operator.tuning.observation import Observation, StepSample
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy

A, B = 0.008, 20e-6  # step = a + b * tokens
DECODES = 20
NOW = 10_000.0


def step_samples(a=A, b=B, tokens=(100, 200, 300, 450, 600, 800)) -> tuple[StepSample, ...]:
    return tuple(StepSample(t, a + b * t, 500, f"pod-{i % 2}") for i, t in enumerate(tokens))


def observation(tbt_ms: float, **fields) -> Observation:
    base = dict(window_seconds=60, sample_count=5000, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=900.0,
                decode_batch_size=DECODES, step_samples=step_samples(), pod_generations={"a": 3, "b": 3})
    base.update(fields)
    return Observation(**base)


def spec(**fields) -> AutotuneSpec:
    return AutotuneSpec(**{"tbt_p99_target_s": 0.030, "mode": AutotuneMode.APPLY, "min_chunk": 64,
                           "max_chunk": 8192, "cooldown_seconds": 60, "policy_switching": False,
                           "max_replicas": 1, **fields})


def config(chunk=4096, policy="fcfs", replicas=1, generation=3, last_change=None) -> CurrentConfig:
    return CurrentConfig(chunk, policy, replicas, generation, last_change)


def full_chunk_ms(chunk: int) -> float:
    return (A + B * (DECODES + chunk)) * 1000


# --- no data, off, settling ----------------------------------------------------------------------------------

def test_no_observation_changes_nothing():
    decision = decide(None, config(), spec(), NOW)
    assert not decision.changed and not decision.metrics_available
    assert decision.actions == (ActionKind.NO_DATA,) and decision.reason == "metrics unavailable"
    assert (decision.chunk_size, decision.queue_policy, decision.replicas) == (4096, "fcfs", 1)
    assert decision.slo_met is None


@pytest.mark.parametrize("obs", [observation(90, sample_count=10), observation(90, tbt_p99_s=None),
                                 observation(90, tbt_p99_s=float("nan"))])
def test_too_few_samples_is_no_data(obs):
    decision = decide(obs, config(), spec(min_samples=100), NOW)
    assert not decision.changed and not decision.metrics_available
    assert decision.reason.startswith("metrics unavailable")


def test_off_mode_reports_the_slo_but_decides_nothing():
    decision = decide(observation(90), config(), spec(mode=AutotuneMode.OFF), NOW)
    assert not decision.changed and not decision.proposed_change and decision.metrics_available
    assert decision.slo_met is False and decision.tbt_ratio == pytest.approx(3.0)
    assert "autotune is off" in decision.reason


@pytest.mark.parametrize("since,obs_fields,text", [
    (30, {}, "cooldown"),
    (70, {"window_seconds": 120}, "window still holds samples"),
    (70, {"pod_generations": {"a": 4, "b": 3}}, "1/2 pods not yet on config generation 4"),
    (70, {"pod_generations": {"a": 4}}, "1 pod(s) report where 2 replica(s) are wanted"),
    (70, {"pod_generations": {"a": 4, "b": 4, "c": 4}}, "3 pod(s) report where 2 replica(s) are wanted"),
])
def test_settling_holds(since, obs_fields, text):
    current = config(replicas=2, generation=4, last_change=NOW - since)
    decision = decide(observation(90, **obs_fields), current, spec(), NOW)
    assert not decision.changed and decision.actions == (ActionKind.HOLD,)
    assert text in decision.reason and decision.slo_met is False


def test_lagging_pods_stop_blocking_after_the_settle_timeout():
    current = config(replicas=2, generation=4, last_change=NOW - 400)
    decision = decide(observation(90, pod_generations={"a": 4, "b": 3}), current, spec(), NOW)
    assert decision.changed


def test_a_replica_still_starting_holds_the_chunk_until_it_reports():
    """Right after a scale-up the window is the old replica's queue: a chunk cut from there (TBT p99 2.4x the
    target in an end-to-end run, cut 96 -> 32) is wrong once the new replica shares the load."""
    current = config(chunk=96, replicas=2, generation=4, last_change=NOW - 70)
    starting = decide(observation(2400, pod_generations={"a": 4}), current, spec(), NOW)
    assert not starting.changed and "1 pod(s) report where 2 replica(s) are wanted" in starting.reason
    both = decide(observation(2400, pod_generations={"a": 4, "b": 4}), current, spec(), NOW)
    assert both.changed and both.chunk_size < 96
    never = decide(observation(2400, pod_generations={"a": 4}), config(chunk=96, replicas=2, generation=4,
                                                                        last_change=NOW - 400), spec(), NOW)
    assert never.changed  # a replica that never comes stops blocking after the settle timeout


# --- model policy --------------------------------------------------------------------------------------------

def test_model_shrinks_to_the_predicted_chunk_capped_per_interval():
    decision = decide(observation(full_chunk_ms(4096)), config(4096), spec(), NOW)
    # Closed form: (27 ms - 8 ms) / 20 µs - 20 decodes = 930 → 896; the cap allows /4 = 1024 this interval.
    assert decision.changed and decision.chunk_size == 1024
    assert decision.actions == (ActionKind.CHUNK_DOWN,) and decision.policy_used == "model"
    assert "r²=1.00" in decision.reason and "at chunk 896" in decision.reason and "per interval" in decision.reason
    assert decision.fit_r_squared == pytest.approx(1.0)
    nxt = decide(observation(full_chunk_ms(1024)), config(1024), spec(), NOW)
    assert nxt.chunk_size == 896
    assert nxt.predicted_tbt_p99_s == pytest.approx(full_chunk_ms(896) / 1000, rel=0.05)
    assert nxt.predicted_tbt_p99_s <= 0.030 * 0.9


def test_model_without_cap_lands_on_a_granule_under_the_margin():
    decision = decide(observation(full_chunk_ms(2048)), config(2048), spec(max_step_down=16), NOW)
    assert decision.chunk_size == 896 and decision.chunk_size % 64 == 0
    assert full_chunk_ms(896) <= 27.0 < full_chunk_ms(960)


def test_model_p99_factor_makes_it_more_careful():
    """Observed p99 1.2× the modelled full-chunk step: the model scales its predictions by that much."""
    decision = decide(observation(1.2 * full_chunk_ms(1024)), config(1024), spec(), NOW)
    expected = int(((0.027 / 1.2 - A) / B - DECODES) // 64 * 64)
    assert decision.chunk_size == expected
    assert "p99 factor 1.20" in decision.reason


def test_model_grows_when_well_under_target_and_caps_growth():
    decision = decide(observation(12.0), config(256), spec(), NOW)
    assert decision.changed and decision.chunk_size == 512 and decision.actions == (ActionKind.CHUNK_UP,)
    decision = decide(observation(full_chunk_ms(512) * 0.9 if full_chunk_ms(512) * 0.9 < 21 else 15.0),
                      config(512), spec(), NOW)
    assert decision.chunk_size == 896


def test_model_does_not_grow_while_first_tokens_are_on_time():
    ttft = spec(ttft_p99_target_s=2.0)
    on_time = decide(observation(12.0, ttft_p99_s=0.47, waiting_growth=1.0), config(256), ttft, NOW)
    assert not on_time.changed and on_time.chunk_size == 256 and "first tokens are on time" in on_time.reason
    # First tokens getting late (over half the limit), or a growing queue: the room is used as before.
    late = decide(observation(12.0, ttft_p99_s=1.2), config(256), ttft, NOW)
    assert late.changed and late.chunk_size == 512
    queued = decide(observation(12.0, ttft_p99_s=0.47, waiting_growth=8.0), config(256), ttft, NOW)
    assert queued.chunk_size > 256
    # The report's rule keeps growing, as the report does; without a TTFT limit the model grows too.
    assert decide(observation(12.0, ttft_p99_s=0.47), config(256), spec(ttft_p99_target_s=2.0,
                  policy=TuningPolicy.MULTIPLICATIVE), NOW).chunk_size > 256
    assert decide(observation(12.0, ttft_p99_s=0.47), config(256), spec(), NOW).chunk_size == 512
    # Over target it still shrinks: the rule only stops growth.
    assert decide(observation(60.0, ttft_p99_s=0.47), config(1024), ttft, NOW).chunk_size < 1024


def test_model_never_moves_against_the_observation():
    # Met with room but the model finds no larger chunk under target × margin: hold rather than shrink.
    slow_steps = step_samples(a=0.025)
    decision = decide(observation(20.0, step_samples=slow_steps), config(512), spec(), NOW)
    assert not decision.changed and "no room to grow" in decision.reason
    # Violated while the model believes the current size fits: still step down.
    decision = decide(observation(40.0, step_samples=step_samples(b=1e-6)), config(1024), spec(), NOW)
    assert decision.changed and decision.chunk_size < 1024


@pytest.mark.parametrize("ratio,policy", [(0.75, TuningPolicy.MODEL), (0.94, TuningPolicy.MODEL),
                                          (0.7, TuningPolicy.MULTIPLICATIVE), (1.0, TuningPolicy.MULTIPLICATIVE)])
def test_deadband_holds(ratio, policy):
    decision = decide(observation(30.0 * ratio), config(1024), spec(policy=policy), NOW)
    assert not decision.changed and "deadband" in decision.reason and decision.slo_met


def test_model_acts_above_its_band_before_the_slo_breaks():
    decision = decide(observation(29.0), config(1024), spec(), NOW)
    assert decision.changed and decision.chunk_size < 1024 and decision.slo_met


@pytest.mark.parametrize("samples,problem", [
    (step_samples()[:3], "only 3 step points"),
    (step_samples(b=-1e-6), "non-positive slope"),
    (tuple(StepSample(t, A + B * t + (0.01 if i % 2 else -0.01), 10) for i, t in enumerate(range(100, 700, 100))),
     "r²="),
    (tuple(StepSample(t, A + B * t, 10) for t in (500, 501, 502, 503)), "spread"),
    ((), "need at least 2 usable points"),
])
def test_poor_fit_over_target_falls_back_to_a_proportional_step(samples, problem):
    s = spec()
    decision = decide(observation(45.0, step_samples=samples), config(1000), s, NOW)
    # 1000 x 30 ms x 0.9 / 45 ms = 600, on the chunk granularity: never below the chunk that meets the target
    assert decision.policy_used == "model-proportional" and decision.chunk_size % s.chunk_granularity == 0
    assert 600 - s.chunk_granularity < decision.chunk_size <= 600
    assert "proportional fallback" in decision.reason and problem in decision.reason
    far = decide(observation(150.0, step_samples=samples), config(4096), s, NOW)
    assert far.chunk_size == 4096 // 4  # capped at maxStepDown per decision, not x0.9


def test_far_over_target_the_chunk_goes_before_a_policy_switch():
    s = spec(policy_switching=True, base_queue_policy="fcfs")
    far = decide(observation(5 * 30.0, long_prompt_share=0.3), config(4096), s, NOW)
    assert far.actions == (ActionKind.CHUNK_DOWN,) and far.queue_policy == "fcfs" and far.chunk_size < 4096
    near = decide(observation(45.0, long_prompt_share=0.3), config(1024), s, NOW)
    assert near.actions == (ActionKind.POLICY_SWITCH,)


def test_poor_fit_near_target_does_not_grow():
    decision = decide(observation(29.0, step_samples=()), config(1000), spec(), NOW)
    assert not decision.changed and "within target" in decision.reason


def test_no_decode_gauge_uses_the_lightest_step_point():
    decision = decide(observation(full_chunk_ms(1024), decode_batch_size=None), config(1024), spec(), NOW)
    assert "decode batch 100" in decision.reason and decision.chunk_size < 1024


# --- multiplicative policy (the background report's rule) -------------------------------------------------------

def test_multiplicative_follows_the_report():
    mult = spec(policy=TuningPolicy.MULTIPLICATIVE, min_throughput_tokens_per_s=500)
    down = decide(observation(45.0), config(1000), mult, NOW)
    assert down.chunk_size == 900 and down.actions == (ActionKind.CHUNK_DOWN,)
    up = decide(observation(10.0), config(1000), mult, NOW)
    assert up.chunk_size == 1100 and up.actions == (ActionKind.CHUNK_UP,)
    # Over target but throughput not above its floor: the report's else-branch grows the chunk.
    starved = decide(observation(45.0, output_tokens_per_s=400.0), config(1000), mult, NOW)
    assert starved.chunk_size == 1100 and "floor" in starved.reason


def test_multiplicative_moves_small_chunks_and_respects_bounds():
    mult = spec(policy=TuningPolicy.MULTIPLICATIVE, min_chunk=8, max_chunk=2000)
    assert decide(observation(10.0), config(8), mult, NOW).chunk_size == 9
    assert decide(observation(10.0), config(1900), mult, NOW).chunk_size == 2000
    held = decide(observation(10.0), config(2000), mult, NOW)
    assert not held.changed and "at its bound" in held.reason


def test_bounds_win_over_the_cap_and_the_deadband():
    decision = decide(observation(27.0), config(8192), spec(max_chunk=1024), NOW)
    assert decision.changed and decision.chunk_size == 1024 and "outside the bounds" in decision.reason
    assert decide(observation(27.0), config(32), spec(min_chunk=128), NOW).chunk_size == 128


# --- floor: scale or report ----------------------------------------------------------------------------------

def test_floor_scales_replicas_within_bounds():
    s = spec(min_chunk=256, scale_replicas=True, min_replicas=1, max_replicas=3)
    decision = decide(observation(60.0), config(256, replicas=2), s, NOW)
    assert decision.changed and decision.replicas == 3 and decision.chunk_size == 256
    assert decision.actions == (ActionKind.SCALE_UP,) and not decision.slo_unreachable


@pytest.mark.parametrize("policy", list(TuningPolicy))
def test_floor_without_scaling_is_unreachable(policy):
    decision = decide(observation(60.0), config(256, replicas=3),
                      spec(policy=policy, min_chunk=256, scale_replicas=True, max_replicas=3), NOW)
    assert not decision.changed and decision.slo_unreachable
    assert decision.actions == (ActionKind.SLO_UNREACHABLE,) and "maximum 3" in decision.reason
    off = decide(observation(60.0), config(256), spec(policy=policy, min_chunk=256), NOW)
    assert off.slo_unreachable and "scaleReplicas is off" in off.reason


def test_model_heads_for_the_floor_when_nothing_fits():
    decision = decide(observation(60.0, step_samples=step_samples(a=0.040)), config(1024), spec(min_chunk=128), NOW)
    assert decision.chunk_size == 256 and "heading for the floor" in decision.reason  # /4 cap first
    decision = decide(observation(60.0, step_samples=step_samples(a=0.040)), config(256), spec(min_chunk=128), NOW)
    assert decision.chunk_size == 128


def test_model_throughput_floor_blocks_shrinking():
    decision = decide(observation(60.0, output_tokens_per_s=100.0), config(1024),
                      spec(min_throughput_tokens_per_s=500, scale_replicas=True, max_replicas=2), NOW)
    assert decision.replicas == 2 and decision.chunk_size == 1024 and "below its floor" in decision.reason


# --- queue policy switching ----------------------------------------------------------------------------------

def test_switches_to_split_when_long_prompts_inflate_tbt_and_back_with_hysteresis():
    s = spec(policy_switching=True, base_queue_policy="fcfs")
    to_split = decide(observation(45.0, long_prompt_share=0.3), config(1024), s, NOW)
    assert to_split.changed and to_split.queue_policy == "split" and to_split.chunk_size == 1024
    assert to_split.actions == (ActionKind.POLICY_SWITCH,)
    on_split = config(1024, policy="split")
    stay = decide(observation(45.0, long_prompt_share=0.1), on_split, s, NOW)  # between the thresholds
    assert stay.queue_policy == "split"
    back = decide(observation(20.0, long_prompt_share=0.02), on_split, s, NOW)
    assert back.changed and back.queue_policy == "fcfs" and "back to fcfs" in back.reason


def test_no_switch_without_inflated_short_tbt_or_when_disabled():
    s = spec(policy_switching=True)
    quiet = decide(observation(45.0, long_prompt_share=0.3, short_tbt_p99_s=0.020), config(1024), s, NOW)
    assert quiet.queue_policy == "fcfs"
    assert decide(observation(45.0, long_prompt_share=0.3), config(1024), spec(), NOW).queue_policy == "fcfs"
    assert decide(observation(45.0, long_prompt_share=None), config(1024), s, NOW).queue_policy == "fcfs"
    # Under the short-prompt threshold split would raise the step budget to the threshold: the chunk rule acts.
    small = decide(observation(45.0, long_prompt_share=0.3), config(256), s, NOW)
    assert small.queue_policy == "fcfs" and small.chunk_size < 256
    split_base = spec(policy_switching=True, base_queue_policy="split")
    assert decide(observation(20.0, long_prompt_share=0.0), config(1024, policy="split"),
                  split_base, NOW).queue_policy == "split"


# --- advise mode ---------------------------------------------------------------------------------------------

def test_advise_records_the_proposal_without_acting():
    decision = decide(observation(full_chunk_ms(4096)), config(4096), spec(mode=AutotuneMode.ADVISE), NOW)
    assert not decision.changed and decision.advisory and decision.proposed_change
    assert decision.chunk_size == 1024 and decision.reason.startswith("advise only:")
    assert decision.describe_change(config(4096)) == "chunk 4096→1024"
    held = decide(observation(28.0), config(1024), spec(mode=AutotuneMode.ADVISE), NOW)
    assert held.advisory and not held.proposed_change and held.describe_change(config(1024)) == "no change"


# --- properties over random observations ---------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(chunk=st.integers(64, 8192), tbt_ms=st.floats(1.0, 500.0), policy=st.sampled_from(list(TuningPolicy)),
       a=st.floats(0.0, 0.05), b=st.floats(-1e-5, 1e-4), decodes=st.floats(0, 256),
       throughput=st.floats(0, 5000))
def test_decisions_stay_in_bounds_and_follow_the_observation(chunk, tbt_ms, policy, a, b, decodes, throughput):
    s = spec(policy=policy, min_chunk=64, max_chunk=8192)
    obs = observation(tbt_ms, step_samples=step_samples(a=a, b=b), decode_batch_size=decodes,
                      output_tokens_per_s=throughput)
    decision = decide(obs, config(chunk), s, NOW)
    assert 64 <= decision.chunk_size <= 8192
    assert chunk / s.max_step_down - 64 <= decision.chunk_size <= chunk * s.max_step_up
    if decision.chunk_size > chunk:
        assert tbt_ms < 30.0 or (policy is TuningPolicy.MULTIPLICATIVE and throughput <= 0)
    if decision.chunk_size < chunk:
        assert tbt_ms > 30.0 * (s.deadband_high if policy is TuningPolicy.MODEL else 1.0)
    assert decision.changed == ((decision.chunk_size, decision.replicas) != (chunk, 1))
    assert decision.reason


# --- spec parsing --------------------------------------------------------------------------------------------

def autotune_of(spec: dict) -> AutotuneSpec:
    return parse_spec({"model": {"source": "random:tiny"}, **spec}).autotune


def test_spec_from_resource():
    parsed = autotune_of({
        "replicas": 2, "maxReplicas": 4,
        "server": {"chunkSize": 2048, "queuePolicy": "sjf"},
        "slo": {"tbtP99Ms": 50, "ttftP99Ms": 800, "minThroughputTokensPerSecond": 1000},
        "autotune": {"mode": "advise", "policy": "multiplicative", "intervalSeconds": 15, "minChunkSize": 128,
                     "maxChunkSize": 4096, "cooldownSeconds": 45, "policySwitching": True, "scaleReplicas": True},
    })
    assert parsed.tbt_p99_target_s == 0.05 and parsed.ttft_p99_target_s == 0.8
    assert parsed.min_throughput_tokens_per_s == 1000
    assert parsed.mode is AutotuneMode.ADVISE and parsed.policy is TuningPolicy.MULTIPLICATIVE
    assert (parsed.min_chunk, parsed.max_chunk, parsed.interval_seconds, parsed.cooldown_seconds) == (128, 4096, 15, 45)
    assert parsed.policy_switching and parsed.scale_replicas
    assert (parsed.min_replicas, parsed.max_replicas) == (1, 4) and parsed.base_queue_policy == "sjf"
    defaults = autotune_of({"slo": {"tbtP99Ms": 40}})  # the CRD's defaults
    assert defaults.mode is AutotuneMode.OFF and defaults.policy is TuningPolicy.MODEL
    assert defaults.policy_switching and (defaults.min_replicas, defaults.max_replicas) == (1, 8)


def test_every_autotune_field_of_the_resource_reaches_the_spec():
    raw = {"replicas": 2, "minReplicas": 1, "maxReplicas": 3,
           "server": {"chunkSize": 1024, "queuePolicy": "fcfs"},
           "slo": {"tbtP99Ms": 45, "minThroughputTokensPerSecond": 200},
           "autotune": {"mode": "apply", "maxStepUp": 1.5, "maxStepDown": 2, "margin": 0.85, "deadbandLow": 0.6,
                        "deadbandHigh": 0.9, "chunkGranularity": 32, "cooldownSeconds": 90, "scaleReplicas": True}}
    parsed = autotune_of(raw)
    assert (parsed.max_step_up, parsed.max_step_down, parsed.margin, parsed.deadband_low, parsed.deadband_high) == (
        1.5, 2, 0.85, 0.6, 0.9)
    assert parsed.chunk_granularity == 32 and parsed.cooldown_seconds == 90 and parsed.scale_replicas
    assert parsed.max_replicas == 3 and parsed.min_throughput_tokens_per_s == 200 and parsed.tbt_p99_target_s == 0.045
    with pytest.raises(SpecError, match="tbtP99Ms"):  # no SLO: the spec parses, the controller refuses
        decide(None, config(), autotune_of({}), NOW)


@pytest.mark.parametrize("resource,field", [
    ({}, "spec.slo.tbtP99Ms"),
    ({"slo": {"tbtP99Ms": "fast"}}, "spec.slo.tbtP99Ms"),
    ({"slo": {"tbtP99Ms": -5}}, "tbtP99Ms"),
    ({"slo": {"tbtP99Ms": 30}, "autotune": {"mode": "sometimes"}}, "spec.autotune.mode"),
    ({"slo": {"tbtP99Ms": 30}, "autotune": {"policy": "pid"}}, "spec.autotune.policy"),
    ({"slo": {"tbtP99Ms": 30}, "autotune": {"minChunkSize": 512, "maxChunkSize": 256}}, "minChunkSize"),
    ({"slo": {"tbtP99Ms": 30}, "autotune": {"minChunkSize": 1.5}}, "spec.autotune.minChunkSize"),
    ({"slo": {"tbtP99Ms": 30}, "autotune": {"scaleReplicas": "yes"}}, "spec.autotune.scaleReplicas"),
    ({"slo": {"tbtP99Ms": 30}, "server": {"queuePolicy": "lifo"}}, "spec.server: queuePolicy"),
    ({"slo": {"tbtP99Ms": 30}, "minReplicas": 3, "maxReplicas": 2}, "replica bounds"),
    ({"slo": [30]}, "spec.slo"),
])
def test_bad_spec_is_a_typed_error_naming_the_field(resource, field):
    with pytest.raises(SpecError) as caught:
        decide(None, config(), autotune_of(resource), NOW)
    assert field in str(caught.value)


def test_spec_invariants():
    with pytest.raises(SpecError):
        spec(margin=0.99, deadband_high=0.95)
    with pytest.raises(SpecError):
        spec(long_share_on=0.1, long_share_off=0.2)
    assert replace(spec(), min_chunk=128).min_chunk == 128


# --- the budget under each queue policy ----------------------------------------------------------------------

def test_split_budget_is_the_larger_lane_and_decisions_land_on_the_lanes():
    from metronome.contract.budget import prefill_budget
    from metronome.contract.config import SchedulerConfig
    from metronome.operator.tuning.actuation import scheduler_for

    served = SchedulerConfig(chunk_size=512, queue_policy="split", short_chunk_size=2048, long_chunk_size=512)
    current = CurrentConfig.from_scheduler(served, replicas=2, generation=5)
    assert (current.chunk_size, current.queue_policy, current.short_prompt_threshold) == (2048, "split", 512)
    assert prefill_budget(SchedulerConfig(chunk_size=300, queue_policy="sjf")) == 300
    decision = decide(observation(full_chunk_ms(2048)), current, spec(), NOW)
    assert decision.chunk_size == 896
    written = scheduler_for(decision, served)
    assert (written.long_chunk_size, written.short_chunk_size, written.chunk_size) == (896, 896, 896)
    assert prefill_budget(written) == 896 and written.max_num_seqs == served.max_num_seqs
    small = scheduler_for(replace(decision, chunk_size=256), served)
    assert (small.long_chunk_size, small.short_chunk_size) == (256, 512)  # short prompts still fit whole
    # Split cannot go below the short-prompt threshold: at 512 and still violated, that is the floor.
    at_floor = decide(observation(40.0), CurrentConfig.from_scheduler(small, 2, 6), spec(), NOW)
    assert at_floor.slo_unreachable and "floor 512" in at_floor.reason
    # Back to fcfs: the budget moves to chunk_size.
    fcfs = scheduler_for(replace(decision, queue_policy="fcfs", chunk_size=384), written)
    assert (fcfs.queue_policy.value, fcfs.chunk_size) == ("fcfs", 384)


def test_split_floor_leaves_for_fcfs_when_the_slo_needs_a_smaller_budget():
    from metronome.contract.config import SchedulerConfig
    from metronome.operator.tuning.actuation import scheduler_for

    served = SchedulerConfig(chunk_size=512, queue_policy="split", short_chunk_size=512, long_chunk_size=512)
    current = CurrentConfig.from_scheduler(served, replicas=1, generation=6)
    switching = spec(policy_switching=True, long_share_on=0.2, long_share_off=0.05)
    # 40 ms at a 30 ms target with a = 8 ms, b = 20 µs/token: the model wants ~300 tokens, split stops at 512.
    decision = decide(observation(40.0, long_prompt_share=0.3), current, switching, NOW)
    assert decision.changed and decision.queue_policy == "fcfs" and 128 <= decision.chunk_size < 512
    assert decision.actions == (ActionKind.CHUNK_DOWN, ActionKind.POLICY_SWITCH) and not decision.slo_unreachable
    assert "short-prompt threshold 512" in decision.reason
    written = scheduler_for(decision, served)
    assert (written.queue_policy.value, written.chunk_size) == ("fcfs", decision.chunk_size)
    # Under fcfs below the threshold, rule 3 does not switch back to split (it would raise the budget again),
    # even with long prompts and short requests over target.
    after = CurrentConfig.from_scheduler(written, replicas=1, generation=7)
    again = decide(observation(full_chunk_ms(after.chunk_size), long_prompt_share=0.3, short_tbt_p99_s=0.040),
                   after, switching, NOW)
    assert again.queue_policy == "fcfs"
    # Policy switching off: the resource's policy is fixed, split's floor is the floor.
    fixed = decide(observation(40.0, long_prompt_share=0.3), current, spec(), NOW)
    assert fixed.slo_unreachable and fixed.queue_policy == "split" and "floor 512" in fixed.reason
    # The model's prefill floor still holds: 25k prompt tokens/s per pod (×1.2) need more than 512 per step,
    # so nothing moves; 20k need 448, which fcfs gives and split could not.
    busy = decide(observation(40.0, long_prompt_share=0.3, prompt_tokens_per_s=50_000.0), current, switching, NOW)
    assert (busy.queue_policy, busy.chunk_size) == ("split", 512) and "prefill" in busy.reason
    fed = decide(observation(40.0, long_prompt_share=0.3, prompt_tokens_per_s=40_000.0), current, switching, NOW)
    assert (fed.queue_policy, fed.chunk_size) == ("fcfs", 448) and "prefill needs chunk ≥ 448" in fed.reason
