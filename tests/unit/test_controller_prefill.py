"""The controller keeps prefill fed: TTFT p99 and queue growth are constraints, the step model sees a
mixed step's fixed cost, and a change is judged only after the last pod applied it.

The simulated plant is one GPU-like chunked-prefill server (serving_fleet.py): a step costs a + b·tokens, plus a
fixed m when it carries prefill tokens (more kernels and launches), so a small chunk spends most of its time on
fixed costs and prefill throughput C / (a + m + b·(D + C)) falls with C. It reports what the operator's PromQL
would: p99 TBT and TTFT interpolated from the shared buckets, the waiting queue and its growth, prompt tokens per
second, and one (tokens, seconds) point per step kind and sub-window.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from serving_fleet import Fleet, Hardware, Workload

from metronome.operator.tuning.controller import decide, waiting_for_prefill
from metronome.operator.tuning.decision import ActionKind, CurrentConfig
from metronome.operator.tuning.observation import Observation, StepSample
from metronome.operator.tuning.settings import AutotuneMode, AutotuneSpec, TuningPolicy
from metronome.operator.tuning.step_model import fit_step_time, smallest_chunk_for_prefill

TARGET_S, TTFT_LIMIT_S = 0.050, 2.0
INTERVAL_S = 20.0
A, B, M = 0.010, 25e-6, 0.012  # decode step a + b·tokens; a mixed step costs m more


def fleet(rate: float, seed: int) -> Fleet:
    return Fleet(Workload(rate, long_fraction=0.2, long_prompt=(1500, 2500), short_prompt=(20, 80),
                          output=(100, 200)), Hardware(A, B, M), seed=seed)


def spec(**fields) -> AutotuneSpec:
    return AutotuneSpec(**{"tbt_p99_target_s": TARGET_S, "ttft_p99_target_s": TTFT_LIMIT_S,
                           "mode": AutotuneMode.APPLY, "policy": TuningPolicy.MODEL, "interval_seconds": INTERVAL_S,
                           "cooldown_seconds": INTERVAL_S, "min_chunk": 64, "max_chunk": 8192,
                           "policy_switching": False, "max_replicas": 1, **fields})


def run_loop(start_chunk: int, intervals: int, rate: float, seed: int, autotune: AutotuneSpec):
    plant = fleet(rate, seed)
    plant.run(start_chunk, 10.0)
    current = CurrentConfig(start_chunk, "fcfs", 1, generation=1)
    trace = []
    for _ in range(intervals):
        window, waiting = plant.run(current.chunk_size, INTERVAL_S)
        observation = plant.observe(window, waiting, current.generation, INTERVAL_S)
        decision = decide(observation, current, autotune, now=plant.now)
        trace.append((current.chunk_size, observation, decision))
        if decision.changed:
            current = CurrentConfig(decision.chunk_size, "fcfs", 1, current.generation + 1, plant.now)
    return trace


def prefill_lags(observation: Observation) -> bool:
    return ((observation.ttft_p99_s or 0) > TTFT_LIMIT_S
            or (observation.waiting_growth or 0) >= spec().queue_growth_limit)


@pytest.mark.parametrize("policy", [TuningPolicy.MODEL, TuningPolicy.MULTIPLICATIVE])
def test_a_starved_prefill_makes_the_budget_grow_and_never_shrink(policy):
    # Chunk 64 at 6 req/s: each mixed step is mostly fixed cost, prefill falls behind, TTFT and the queue grow.
    trace = run_loop(64, 12, rate=6.0, seed=3, autotune=spec(policy=policy))
    assert prefill_lags(trace[0][1]), "the plant should start prefill-bound"
    for chunk, observation, decision in trace:
        if prefill_lags(observation):
            assert decision.chunk_size >= chunk, decision.reason
    grown = [d for _, _, d in trace if ActionKind.CHUNK_UP in d.actions]
    assert grown and "prefill is the bottleneck" in grown[0].reason
    final_chunk, final, _ = trace[-1]
    assert final_chunk > 64 and final.ttft_p99_s < TTFT_LIMIT_S and final.tbt_p99_s <= TARGET_S


def test_from_a_violating_start_the_loop_shrinks_only_as_far_as_prefill_allows():
    trace = run_loop(4096, 14, rate=6.0, seed=5, autotune=spec())
    assert trace[0][1].tbt_p99_s > TARGET_S
    shrinks = [(chunk, obs, d) for chunk, obs, d in trace if d.changed and d.chunk_size < chunk]
    assert shrinks and all(not prefill_lags(obs) for _, obs, _ in shrinks)
    steady = trace[-5:]
    assert all(obs.tbt_p99_s <= TARGET_S and obs.ttft_p99_s <= TTFT_LIMIT_S for _, obs, _ in steady)
    assert sum(d.changed for _, _, d in steady) <= 1


def test_the_fit_separates_the_fixed_cost_of_a_mixed_step():
    decode = [(40.0, A + B * 40), (60.0, A + B * 60)]
    mixed = [(40.0 + c, A + M + B * (40 + c)) for c in (128, 256, 512)]
    points = decode + mixed
    fit = fit_step_time([t for t, _ in points], [s for _, s in points], mixed=[False, False, True, True, True])
    assert fit.kinds == "decode+mixed" and fit.r_squared == pytest.approx(1.0)
    assert (fit.intercept_s, fit.mixed_extra_s, fit.slope_s_per_token) == (
        pytest.approx(A), pytest.approx(M), pytest.approx(B))
    one_line = fit_step_time([t for t, _ in points], [s for _, s in points])
    assert one_line.slope_s_per_token > 1.5 * B  # one line through both kinds overstates the per-token cost
    # Prefill demand of 20 000 tokens/s at 40 decodes needs C / (a + m + b(40 + C)) >= 20 000.
    floor = smallest_chunk_for_prefill(fit, 40, 20_000, 64, 8192)
    assert floor / fit.step_seconds(40 + floor) >= 20_000 > (floor - 64) / fit.step_seconds(40 + floor - 64)
    assert smallest_chunk_for_prefill(fit, 40, 1 / B, 64, 8192) is None  # b·λ >= 1: no chunk keeps up


def test_without_spread_inside_a_kind_the_fit_is_one_line():
    # Every decode step at 40 tokens, every mixed step at 552: the gap between kinds cannot be split into a fixed
    # cost and a per-token cost, so the fit falls back to one line through all points.
    tokens = [40.0, 40.0, 552.0, 552.0]
    fit = fit_step_time(tokens, [A + B * 40, A + B * 40, A + M + B * 552, A + M + B * 552],
                        mixed=[False, False, True, True])
    assert fit.kinds == "all" and fit.mixed_extra_s == 0.0
    assert fit.step_seconds(552) == pytest.approx(A + M + B * 552)


def applied_observation(tbt_ms: float, applied: dict[str, float]) -> Observation:
    return Observation(window_seconds=60, sample_count=5000, tbt_p99_s=tbt_ms / 1000, output_tokens_per_s=900.0,
                       pod_generations={"a": 4, "b": 4}, config_applied_at=applied)


def test_a_change_is_judged_only_a_full_window_after_the_last_pod_applied_it():
    now = 10_000.0
    current = CurrentConfig(4096, "fcfs", 2, generation=4, last_change_time=now - 120)
    autotune = spec(cooldown_seconds=30, policy=TuningPolicy.MULTIPLICATIVE)
    # Written 120 s ago; pod b's kubelet projected it 75 s later, so only 45 s of the 60 s window follow it.
    held = decide(applied_observation(90, {"a": now - 110, "b": now - 45}), current, autotune, now)
    assert not held.changed and "last pod applied generation 4 (45 s ago)" in held.reason
    acted = decide(applied_observation(90, {"a": now - 110, "b": now - 61}), current, autotune, now)
    assert acted.changed and acted.chunk_size < 4096
    # Servers that do not export the applied time: the write time counts, as before.
    assert decide(applied_observation(90, {}), current, autotune, now).changed


def test_prefill_guard_with_no_tbt_room_holds_or_scales():
    observation = Observation(window_seconds=60, sample_count=5000, tbt_p99_s=0.080, ttft_p99_s=5.0,
                              output_tokens_per_s=900.0, pod_generations={"a": 3}, waiting_requests=40,
                              waiting_growth=25)
    current = CurrentConfig(512, "fcfs", 1, generation=3)
    held = decide(observation, current, spec(), 10_000.0)
    assert (held.chunk_size, held.replicas, held.changed) == (512, 1, False)
    assert held.slo_unreachable and "TBT is over target too, not shrinking" in held.reason
    assert "40.0 requests waiting for prefill on average" in held.reason
    scaled = decide(observation, current, spec(scale_replicas=True, max_replicas=3), 10_000.0)
    assert (scaled.chunk_size, scaled.replicas, scaled.actions) == (512, 2, (ActionKind.SCALE_UP,))


def test_slow_first_tokens_with_nobody_waiting_do_not_block_a_shrink():
    # Long steps make every token late, the first one too; with no queue, prefill is not what is short.
    observation = Observation(window_seconds=60, sample_count=5000, tbt_p99_s=0.120, ttft_p99_s=3.0,
                              output_tokens_per_s=900.0, pod_generations={"a": 3}, waiting_requests=0.0,
                              waiting_growth=0.0)
    decision = decide(observation, CurrentConfig(4096, "fcfs", 1, generation=3),
                      spec(policy=TuningPolicy.MULTIPLICATIVE), 10_000.0)
    assert decision.changed and decision.chunk_size < 4096 and "prefill" not in decision.reason


def test_prompts_queued_inside_the_batch_are_a_prefill_bottleneck():
    # A load step under a large max_num_seqs: every request is admitted at once, nobody waits for admission, and
    # the prompts wait their turn for the prefill budget inside the batch (a CPU e2e run saw TTFT p99 over its
    # limit with 0.0-0.1 requests waiting, and the guard fired or not by chance).
    late = dict(window_seconds=60, sample_count=5000, tbt_p99_s=0.080, ttft_p99_s=5.0, output_tokens_per_s=900.0,
                pod_generations={"a": 3}, waiting_requests=0.0, waiting_growth=0.0)
    current = CurrentConfig(512, "fcfs", 1, generation=3)
    scaling = spec(scale_replicas=True, max_replicas=2)
    queued = decide(Observation(**late, prefilling_requests=4.6), current, scaling, 10_000.0)
    assert (queued.replicas, queued.actions) == (2, (ActionKind.SCALE_UP,))
    assert "3.6 requests waiting for prefill on average" in queued.reason
    # One prompt prefilling at a time is prefill being served, not a queue: the chunk goes first.
    served = decide(Observation(**late, prefilling_requests=0.9), current, scaling, 10_000.0)
    assert served.replicas == 1 and "prefill is the bottleneck" not in served.reason


def test_waiting_for_prefill_counts_prompts_beyond_one_a_pod_and_lane():
    two_pods = dict(window_seconds=60, sample_count=100, tbt_p99_s=0.05, pod_generations={"a": 3, "b": 3})
    assert waiting_for_prefill(Observation(**two_pods, waiting_requests=1.5, prefilling_requests=5.0), "fcfs") == 4.5
    assert waiting_for_prefill(Observation(**two_pods, waiting_requests=0.0, prefilling_requests=1.9), "fcfs") == 0.0
    # split prefills a short and a long prompt side by side on each pod
    assert waiting_for_prefill(Observation(**two_pods, prefilling_requests=3.5), "split") == 0.0
    assert waiting_for_prefill(Observation(**two_pods, prefilling_requests=5.0), "split") == 1.0
    # servers that do not export the gauge: the admission queue alone, as before
    assert waiting_for_prefill(Observation(**two_pods, waiting_requests=2.0), "fcfs") == 2.0


def test_a_queue_behind_a_huge_chunk_does_not_block_shrinking_to_what_prefill_needs():
    # The H200 loop run: chunk 4096, TBT p99 5x the target, a few more requests waiting than a window ago (and first
    # tokens late enough, 70 % of the TTFT limit, for the queue to count). The queue is no reason to keep a budget
    # far above the chunk whose prefill throughput covers the demand.
    points = tuple(StepSample(t, A + B * t + (M if kind == "mixed" else 0.0), 50, "pod-0", kind)
                   for kind, tokens in (("decode", (40, 60, 80)), ("mixed", (600, 1500, 4000))) for t in tokens)
    observation = Observation(window_seconds=60, sample_count=5000, tbt_p99_s=0.150, ttft_p99_s=1.4,
                              output_tokens_per_s=4000.0, pod_generations={"a": 3}, waiting_requests=3,
                              waiting_growth=6, step_samples=points, decode_batch_size=60,
                              prompt_tokens_per_s=8000.0)
    autotune = spec(max_step_down=8)
    decision = decide(observation, CurrentConfig(4096, "fcfs", 1, generation=3), autotune, 10_000.0)
    fit = fit_step_time([p.tokens_per_step for p in points], [p.step_seconds for p in points],
                        [p.steps for p in points], [p.mixed for p in points])
    needed = smallest_chunk_for_prefill(fit, 60, 8000.0 * autotune.prefill_headroom, autotune.chunk_granularity,
                                        autotune.max_chunk)
    assert decision.actions == (ActionKind.CHUNK_DOWN,) and needed <= decision.chunk_size < 4096
    assert "prefill is the bottleneck" in decision.reason and "above what prefill needs" in decision.reason
    # The report's rule has no prefill model: it still holds the budget.
    held = decide(observation, CurrentConfig(4096, "fcfs", 1, generation=3),
                  spec(policy=TuningPolicy.MULTIPLICATIVE), 10_000.0)
    assert not held.changed and "not shrinking the budget" in held.reason


def test_without_a_fit_prefill_grows_the_budget_only_while_the_step_up_stays_under_target():
    # The H200 loop run: TTFT 7.4 s and a growing queue, TBT p99 29.9 ms against 30 ms, no usable fit: ×1.1
    # took the chunk over the target (39.9 ms next) for prefill it could not catch up with anyway.
    def starved(tbt_ms: float) -> Observation:
        return Observation(window_seconds=60, sample_count=5000, tbt_p99_s=tbt_ms / 1000, ttft_p99_s=7.4,
                           output_tokens_per_s=500.0, pod_generations={"a": 3}, waiting_requests=105,
                           waiting_growth=141)
    current = CurrentConfig(768, "fcfs", 1, generation=3)
    autotune = spec(tbt_p99_target_s=0.030)
    held = decide(starved(29.9), current, autotune, 10_000.0)
    assert not held.changed and "no room left under the TBT target (100% of it)" in held.reason
    grown = decide(starved(24.0), current, autotune, 10_000.0)
    assert grown.actions == (ActionKind.CHUNK_UP,) and grown.chunk_size == round(768 * autotune.multiplicative_up)


def test_without_a_fit_the_model_grows_only_within_its_margin():
    # An H200 loop run at 22 ms: fcfs 256, TBT p99 19.5 ms, the queue 37 longer: ×1.1 to 282 aimed at 97 %
    # of the target and gave 24.5 ms (111 %) one interval later, and the next shrink lost the phase's goodput.
    queue = Observation(window_seconds=6, sample_count=8000, tbt_p99_s=0.0195, ttft_p99_s=1.18,
                        output_tokens_per_s=5000.0, pod_generations={"a": 3}, waiting_requests=23.6,
                        waiting_growth=37)
    current = CurrentConfig(256, "fcfs", 1, generation=3)
    model = spec(tbt_p99_target_s=0.022, margin=0.85)
    held = decide(queue, current, model, 10_000.0)
    assert not held.changed and held.slo_unreachable and "no room left under the TBT target" in held.reason
    # The report's rule steers to the target itself: the same step up is room for it.
    grown = decide(queue, current, replace(model, policy=TuningPolicy.MULTIPLICATIVE), 10_000.0)
    assert grown.actions == (ActionKind.CHUNK_UP,) and grown.chunk_size == 282


def phase_start(ttft_ms: float | None) -> Observation:
    # The H200 loop run at t=60 s, the start of a 45 req/s phase: TBT p99 32.3 ms over a 30 ms target, the queue
    # 6 longer than 15 s before (the limit is 5), 1.2 requests waiting on average, no usable step fit.
    return Observation(window_seconds=15, sample_count=44842, tbt_p99_s=0.0323,
                       ttft_p99_s=None if ttft_ms is None else ttft_ms / 1000, output_tokens_per_s=3234.0,
                       pod_generations={"a": 3}, waiting_requests=1.2, waiting_growth=6)


def test_a_growing_queue_with_early_first_tokens_is_a_transient_not_starved_prefill():
    current, autotune = CurrentConfig(704, "fcfs", 1, generation=3), spec(tbt_p99_target_s=0.030)
    # Every first token within a quarter of the 2 s limit: the controller shrinks for TBT as it would without a queue.
    shrunk = decide(phase_start(480), current, autotune, 10_000.0)
    assert shrunk.actions == (ActionKind.CHUNK_DOWN,) and shrunk.chunk_size < 704 and not shrunk.slo_unreachable
    assert "prefill" not in shrunk.reason
    # First tokens past half the limit, or no TTFT to judge by: the same queue growth is starved prefill again.
    for late in (spec(tbt_p99_target_s=0.030), spec(tbt_p99_target_s=0.030, ttft_p99_target_s=None)):
        held = decide(phase_start(1100 if late.ttft_p99_target_s else 480), current, late, 10_000.0)
        assert (held.chunk_size, held.changed, held.slo_unreachable) == (704, False, True), held.reason
        assert "the queue grew by 6 waiting requests in 15 s" in held.reason
    unknown = decide(phase_start(None), current, autotune, 10_000.0)
    assert unknown.slo_unreachable and "the queue grew by 6" in unknown.reason


def test_under_target_with_first_tokens_on_time_the_budget_holds():
    # A light load (1 req/s): TBT p99 well under the band, first tokens in a fraction of the TTFT limit. A larger
    # chunk would buy no throughput (the arrivals set it) and lengthen every step: the model holds. Without a TTFT
    # limit it cannot tell, and uses the room as before.
    held = run_loop(256, 8, rate=1.0, seed=7, autotune=spec())
    assert all(obs.tbt_p99_s < spec().deadband_low * TARGET_S for _, obs, _ in held)
    assert all(obs.ttft_p99_s <= 0.5 * TTFT_LIMIT_S for _, obs, _ in held)
    assert not any(d.changed for _, _, d in held)
    assert "first tokens are on time" in held[-1][2].reason
    grown = run_loop(256, 8, rate=1.0, seed=7, autotune=spec(ttft_p99_target_s=None))
    assert any(ActionKind.CHUNK_UP in d.actions for _, _, d in grown)


def test_prefill_headroom_sets_how_close_to_its_prefill_limit_the_model_shrinks():
    # An H200 loop run at 22 ms: fcfs 512, p99 24.9 ms, first tokens on time, the queue steady; the fit
    # through points at 512 (a = 5.9 ms, b = 20.6 µs/token), ~100 decodes, 21,400 prompt tokens/s arriving.
    points = tuple(StepSample(t, 0.0059 + 20.6e-6 * t, 200, "pod-0", kind)
                   for kind, tokens in (("decode", (90, 100, 110)), ("mixed", (560, 600, 640))) for t in tokens)
    observation = Observation(window_seconds=6, sample_count=30000, tbt_p99_s=0.0249, ttft_p99_s=0.689,
                              output_tokens_per_s=5400.0, pod_generations={"a": 3}, waiting_requests=1.5,
                              waiting_growth=0.0, step_samples=points, decode_batch_size=100,
                              prompt_tokens_per_s=21_400.0)
    current = CurrentConfig(512, "fcfs", 1, generation=3)
    chunks = {}
    for headroom in (1.2, 1.0):
        autotune = spec(tbt_p99_target_s=0.022, margin=0.85, prefill_headroom=headroom)
        decision = decide(observation, current, autotune, 10_000.0)
        chunks[headroom] = decision.chunk_size
        assert decision.changed and "prefill needs chunk" in decision.reason, decision.reason
    # The TBT budget asks for 256 both times; the floor binds: 20 % ahead of the arrivals (448, as on the H200),
    # or at the predicted limit itself.
    fit = fit_step_time([p.tokens_per_step for p in points], [p.step_seconds for p in points],
                        [p.steps for p in points], [p.mixed for p in points])
    floors = {h: smallest_chunk_for_prefill(fit, 100, 21_400.0 * h, 64, 8192) for h in chunks}
    assert chunks == floors and chunks[1.2] == 448 and 256 < chunks[1.0] < chunks[1.2]


def test_prefill_headroom_is_a_spec_field_with_its_bounds():
    from metronome.contract.config import SchedulerConfig
    from metronome.operator.spec import SLOSpec, parse_autotune

    slo = SLOSpec(tbt_p99_ms=22.0)
    parsed = parse_autotune({"mode": "apply", "prefillHeadroom": 1.0}, {}, slo, SchedulerConfig())
    assert parsed.prefill_headroom == 1.0
    assert parse_autotune({"mode": "apply"}, {}, slo, SchedulerConfig()).prefill_headroom == 1.2
    with pytest.raises(ValueError, match="prefillHeadroom"):
        parse_autotune({"mode": "apply", "prefillHeadroom": 0.8}, {}, slo, SchedulerConfig())


# --- without a fit the guard grows toward the aim, not all or nothing --------------------------------------------

def after_a_scale_up(tbt_s: float, ttft_s: float = 10.8, waiting: float = 1.5) -> Observation:
    # The e2e replica loop after its scale-up: two pods at chunk 32, where the proportional fallback had cut it on a
    # draining replica's TBT, first tokens 10.8 s against a 5 s limit with requests waiting, step points too
    # scattered for a fit.
    points = tuple(StepSample(t, s, 20, f"pod-{i % 2}")
                   for i, (t, s) in enumerate(zip((40, 60, 80, 100, 120, 140), (0.50, 0.30, 0.60, 0.35, 0.55, 0.40))))
    return Observation(window_seconds=20, sample_count=400, tbt_p99_s=tbt_s, ttft_p99_s=ttft_s,
                       output_tokens_per_s=40.0, pod_generations={"a": 4, "b": 4}, waiting_requests=waiting,
                       waiting_growth=0.0, step_samples=points)


def e2e_spec(**fields) -> AutotuneSpec:
    return spec(**{"tbt_p99_target_s": 1.0, "ttft_p99_target_s": 5.0, "min_chunk": 32, "max_chunk": 1024,
                   "chunk_granularity": 32, "deadband_low": 0.3, "multiplicative_up": 2.0, "scale_replicas": True,
                   "max_replicas": 2, **fields})


AFTER_SCALE_UP = CurrentConfig(32, "fcfs", 2, generation=4)


def aim_of(autotune: AutotuneSpec) -> float:
    return autotune.margin if autotune.policy is TuningPolicy.MODEL else 1.0


@pytest.mark.parametrize("policy", [TuningPolicy.MODEL, TuningPolicy.MULTIPLICATIVE])
def test_without_a_fit_a_starved_prefill_grows_toward_the_aim_where_the_full_step_would_pass_it(policy):
    # p99 at 59 % of the target: ×2 would predict 118 %, past the aim, and the guard held chunk 32 with first
    # tokens twice their limit. As far as the aim instead (p99 taken as proportional to the chunk).
    autotune = e2e_spec(policy=policy)
    aim = aim_of(autotune)
    points = after_a_scale_up(0.59).step_samples
    fit = fit_step_time([p.tokens_per_step for p in points], [p.step_seconds for p in points])
    assert fit.r_squared < autotune.min_fit_r2  # no usable fit
    grown = decide(after_a_scale_up(0.59), AFTER_SCALE_UP, autotune, 10_000.0)
    assert grown.actions == (ActionKind.CHUNK_UP,) and grown.policy_used == "prefill-guard", grown.reason
    assert grown.chunk_size == int(32 * aim / 0.59) == (48 if policy is TuningPolicy.MODEL else 54)
    assert f"(×{aim / 0.59:.2f}, toward the aim of {aim:.0%} of the target) → {grown.chunk_size}" in grown.reason
    # Still within the per-interval cap.
    capped = decide(after_a_scale_up(0.59), AFTER_SCALE_UP, e2e_spec(policy=policy, max_step_up=1.25), 10_000.0)
    assert capped.chunk_size == 40 and "(at most ×1.25 / ÷4 per interval)" in capped.reason
    # At the p99 the step predicts, no rule takes the grown chunk back: still starved, there is no more room
    # (replicas at their maximum: unreachable, held); caught up, p99 is inside the deadband.
    predicted = 0.59 * grown.chunk_size / 32
    assert predicted <= aim
    there = replace(AFTER_SCALE_UP, chunk_size=grown.chunk_size)
    for observation in (after_a_scale_up(predicted), after_a_scale_up(predicted, ttft_s=2.0, waiting=0.0)):
        held = decide(observation, there, autotune, 10_000.0)
        assert (held.chunk_size, held.changed) == (grown.chunk_size, False), held.reason


def test_without_a_fit_the_guard_holds_when_not_one_token_fits_within_the_aim():
    # p99 at 88 % of a 90 % aim: chunk 32 × 0.90 / 0.88 is 32.7, no whole token of room.
    held = decide(after_a_scale_up(0.88), AFTER_SCALE_UP, e2e_spec(), 10_000.0)
    assert (held.chunk_size, held.changed) == (32, False)
    assert held.slo_unreachable and "no room left under the TBT target (88% of it)" in held.reason
    # The report's rule at 90 % of the target with a 4-token chunk: ×1.1 fits, but one token (the least step)
    # would give 112.5 % and ×0.9 would take it back next window. 4 / 0.9 is 4.4: it holds instead.
    small = e2e_spec(policy=TuningPolicy.MULTIPLICATIVE, min_chunk=1, chunk_granularity=1, multiplicative_up=1.1)
    at_four = replace(AFTER_SCALE_UP, chunk_size=4)
    held = decide(after_a_scale_up(0.90), at_four, small, 10_000.0)
    assert (held.chunk_size, held.changed) == (4, False), held.reason
    assert "no room left under the TBT target (90% of it)" in held.reason
    shrunk = decide(after_a_scale_up(0.90 * 5 / 4, ttft_s=2.0, waiting=0.0), replace(at_four, chunk_size=5), small,
                    10_000.0)
    assert (shrunk.chunk_size, shrunk.actions) == (4, (ActionKind.CHUNK_DOWN,))


def test_without_a_fit_the_guard_takes_the_full_step_while_it_fits_and_shrinks_it_smoothly_to_the_aim():
    autotune = e2e_spec()
    chunks = []
    for tbt in (0.20, 0.35, 0.44, 0.47, 0.59, 0.75, 0.85, 0.87, 0.88, 0.93):
        decision = decide(after_a_scale_up(tbt), AFTER_SCALE_UP, autotune, 10_000.0)
        if tbt * autotune.multiplicative_up <= autotune.margin:  # the full step, as before
            assert decision.chunk_size == 64 and decision.reason.endswith("(×2) → 64"), decision.reason
        else:
            assert decision.chunk_size == max(32, int(32 * autotune.margin / tbt)), (tbt, decision.reason)
        chunks.append(decision.chunk_size)
    assert chunks == sorted(chunks, reverse=True) and chunks[0] == 64 and chunks[-1] == 32
    assert len(set(chunks)) > 3  # no jump from the full step straight to nothing
