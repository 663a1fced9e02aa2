"""`metronome bench loop`'s pure parts: the operator's queries answered from /metrics scrapes (the same Observation
the Prometheus source would build), the phased workload, and the report (goodput, oracle, targets)."""
from __future__ import annotations

import math

import pytest

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.contract.histogram import histogram_quantile
from metronome.operator import metrics_source as ms
from metronome.server.api.metrics import ServerMetrics
from metronome.server.bench.load.records import RequestRecord
from metronome.server.bench.load.workloads import LongShortSpec, TokenSampler, WorkloadError, WorkloadSpec
from metronome.server.bench.loop.phases import Phase, parse_phases, phase_bounds, schedule
from metronome.server.bench.loop.report import good_requests, loop_targets, oracle, window_stats
from metronome.server.bench.loop.scrape import observe, parse_scrape, query_results
from metronome.server.engine.outputs import EngineStats, StepStats

ENGINE = EngineStats(num_running=2, num_waiting={}, num_prefilling=1, kv_usage_ratio=0.1, kv_blocks_total=10,
                     kv_blocks_free=9, kv_blocks_leaked=0, preemptions_total=0, scheduler=SchedulerConfig())


def step(gaps, lanes, tokens, seconds, prefill=0, first_lanes=(), generated=0):
    return StepStats(duration_s=seconds, num_tokens=tokens, num_prefill_tokens=prefill,
                     num_decode_tokens=tokens - prefill, token_gaps_s=list(gaps), token_gap_lanes=list(lanes),
                     first_token_latencies_s=[0.2] * len(first_lanes), first_token_lanes=list(first_lanes),
                     generated_tokens=generated, new_prompt_tokens=prefill)


def scrapes_of_two_pods():
    """Two pods observed at t = 0, 5, 10, 15, 20 with known token gaps and steps in between."""
    pods = {"a": ServerMetrics("m"), "b": ServerMetrics("m")}
    for metrics in pods.values():
        metrics.set_config(SchedulerConfig(), 3)
    history = {pod: [] for pod in pods}
    all_gaps = []
    for t in range(0, 25, 5):
        if t:
            for index, metrics in enumerate(pods.values()):
                gaps = [0.01 * (index + 1) + 0.001 * t] * 10
                all_gaps += gaps
                metrics.on_step(step(gaps, ["short"] * 10, tokens=10 + t, seconds=0.01 + 0.001 * t, prefill=t,
                                     first_lanes=["long"], generated=10), ENGINE)
                for gap in gaps:  # the routes time the gaps (token_gaps.py)
                    metrics.observe_token_gap("short", gap)
        for pod, metrics in pods.items():
            history[pod].append(parse_scrape(metrics.render().decode(), pod, float(t)))
    return history, all_gaps


def test_the_operator_queries_are_answered_from_scrapes_like_prometheus():
    history, all_gaps = scrapes_of_two_pods()
    window = ms.QueryWindow(window_seconds=20, sub_window_seconds=5)
    results = query_results(history, window, end=20.0)
    assert set(results) == set(ms.QUERY_KEYS)
    observation = observe(history, window, end=20.0)
    assert observation.sample_count == len(all_gaps) == 80
    buckets = {}
    for gap in all_gaps:  # what a histogram with the shared bounds holds, summed by le across pods
        for le in (*names.TBT_BUCKETS, math.inf):
            buckets[le] = buckets.get(le, 0) + (gap <= le)
    assert observation.tbt_p99_s == pytest.approx(histogram_quantile(0.99, buckets.items()))
    assert observation.output_tokens_per_s == pytest.approx(2 * 4 * 10 / 20)
    assert observation.pod_generations == {"a": 3, "b": 3}
    # One step per pod per sub-window: 4 points each, tokens 15..30, step time rising with them.
    assert sorted((s.pod, s.tokens_per_step) for s in observation.step_samples) == \
        sorted((pod, 10.0 + t) for pod in "ab" for t in (5, 10, 15, 20))
    for sample in observation.step_samples:
        assert sample.step_seconds == pytest.approx(0.01 + 0.001 * (sample.tokens_per_step - 10))
    assert {s.kind for s in observation.step_samples} == {"mixed"}  # every step carried prefill tokens
    # The lanes: every gap came from a short prompt, every first token from a long one.
    assert observation.short_tbt_p99_s == pytest.approx(observation.tbt_p99_s)
    assert observation.long_prompt_share == 1.0
    assert (observation.waiting_requests, observation.waiting_growth) == (0, 0)
    # 0 prefilling at the first scrape, 1 at the four after it: 0.8 a pod, summed over the two
    assert observation.prefilling_requests == pytest.approx(1.6)
    assert set(observation.config_applied_at) == {"a", "b"} and min(observation.config_applied_at.values()) > 0


def test_one_scrape_gives_series_but_no_samples_and_none_gives_no_series():
    history, _ = scrapes_of_two_pods()
    first = observe({pod: scrapes[:1] for pod, scrapes in history.items()}, ms.QueryWindow(20, 5), end=0.0)
    assert (first.sample_count, first.tbt_p99_s, first.pod_generations) == (0, None, {"a": 3, "b": 3})
    with pytest.raises(ms.MetricsUnavailable, match="no Metronome series"):
        observe({pod: [] for pod in history}, ms.QueryWindow(20, 5), end=0.0)


def test_phases_parse_and_bad_ones_name_the_flag():
    phases = parse_phases("chat:2:60, long-short:1.5:30:0.5,long-short:8:10")
    assert phases == [Phase("chat", 2, 60), Phase("long-short", 1.5, 30, 0.5), Phase("long-short", 8, 10)]
    assert phase_bounds(phases) == [(0, 60), (60, 90), (90, 100)]
    for bad in ("", "chat:2", "burst:2:10", "chat:0:10", "chat:x:10", "chat:2:10:0.5", "long-short:2:10:1.5",
                "chat:2:10::0", "chat:2:10::1.5", "long-short:2:10:1:5:6"):
        with pytest.raises(WorkloadError, match="--phases"):
            parse_phases(bad)


def test_a_phase_output_length_applies_to_its_requests_only():
    phases = parse_phases("long-short:50:2:1:700,chat:50:2::33,long-short:50:2")
    assert [p.output_len for p in phases] == [700, 33, None]
    assert [p.long_fraction for p in phases] == [1.0, None, None]
    spec = WorkloadSpec(long_short=LongShortSpec(long_prompt_len=100, short_prompt_len=10, output_len=4))
    requests = list(schedule(phases, spec, TokenSampler(500, low=300), seed=2))
    by_phase = {n: {s.request.max_tokens for s in requests if s.phase == n} for n in range(3)}
    assert by_phase == {0: {700}, 1: {33}, 2: {4}}
    assert {len(s.request.prompt_token_ids) for s in requests if s.phase == 0} == {100}


def test_every_run_gets_the_same_requests_inside_their_phases():
    phases = parse_phases("long-short:20:5:0,long-short:20:5:1")
    spec = WorkloadSpec(long_short=LongShortSpec(long_prompt_len=100, short_prompt_len=10, output_len=4))
    first = list(schedule(phases, spec, TokenSampler(500, low=300), seed=1))
    assert first == list(schedule(phases, spec, TokenSampler(500, low=300), seed=1))
    assert [s.request.index for s in first] == list(range(len(first)))
    assert all(0 <= s.offset_s < 5 and s.request.kind == "short" for s in first if s.phase == 0)
    assert all(5 <= s.offset_s < 10 and s.request.kind == "long" for s in first if s.phase == 1)
    assert {s.phase for s in first} == {0, 1}


def record(index, sent, times, ok=True):
    return RequestRecord(index=index, kind="short", max_tokens=len(times), sent_s=sent, token_times_s=list(times),
                         output_tokens=len(times), end_s=times[-1] if ok else None, error=None if ok else "boom")


def test_goodput_counts_tokens_of_requests_that_met_both_slos_when_they_were_emitted():
    records = [record(0, 0.0, [0.1, 0.2, 0.3]),  # good
               record(1, 0.0, [0.1, 0.9, 1.0]),  # one 0.8 s gap: misses a 0.5 s TBT target
               record(2, 0.0, [2.5, 2.6]),  # TTFT 2.5 s: misses a 2 s limit
               record(3, 0.0, [0.1, 0.2], ok=False)]
    good = good_requests(records, slo_tbt_s=0.5, slo_ttft_s=2.0)
    assert good == {0}
    stats = window_stats(records, good, 0.0, 1.0)
    assert (stats.tokens, stats.goodput_tok_s, stats.throughput_tok_s) == (7, 3.0, 7.0)
    assert stats.requests_started == 3 and stats.tbt_p99_ms is not None


def test_the_oracle_is_the_best_static_config_per_phase():
    statics = {"static 4096/fcfs": [{"goodput_tok_s": 100.0}, {"goodput_tok_s": 20.0}],
               "static 512/split": [{"goodput_tok_s": 80.0}, {"goodput_tok_s": 50.0}]}
    best = oracle(statics, durations=[60.0, 30.0])
    assert [b["config"] for b in best["best_by_phase"]] == ["static 4096/fcfs", "static 512/split"]
    assert best["goodput_tok_s"] == pytest.approx((100 * 60 + 50 * 30) / 90)
    assert best["static_losses"]["static 4096/fcfs"]["worst_loss"] == pytest.approx(0.6)
    assert best["static_losses"]["static 512/split"]["worst_phase"] == 0


def test_the_summary_says_when_the_oracle_is_a_single_static_config():
    from metronome.server.bench.loop.cli import _over_statics

    one = oracle({"static 512/split": [{"goodput_tok_s": 80.0}]}, durations=[60.0])
    assert _over_statics(one) == " of 1 static config: a comparison with that config, not an oracle"
    two = oracle({"a": [{"goodput_tok_s": 1.0}], "b": [{"goodput_tok_s": 2.0}]}, durations=[60.0])
    assert _over_statics(two) == " of 2 static configs"


def interval(chunk, tbt_ms, ttft_ms=100.0, to=None):
    return {"chunk_size": chunk, "client": {"tbt_p99_ms": tbt_ms, "ttft_p99_ms": ttft_ms},
            "decision": {"changed": to is not None, "actions": ["chunk_down" if to is not None else "hold"],
                         "to": {"chunk_size": to if to is not None else chunk}}}


def test_loop_targets_convergence_steadiness_and_the_ttft_guard():
    intervals = [interval(4096, 90, to=1024), interval(1024, 45, to=512), interval(512, 25),
                 interval(512, 26, ttft_ms=900), interval(512, 24, to=1024), interval(1024, 28, ttft_ms=900)]
    targets = loop_targets(intervals, [0, 0, 0, 0, 1, 1], target_ms=30, ttft_limit_ms=500, settle_intervals=2)
    assert targets["intervals_to_slo"] == 2  # decided after intervals 1 and 2; interval 3 is within target
    assert targets["intervals_to_slo_by_phase"] == [2, 0]
    warm = {**interval(4096, 20), "decision": {"changed": False, "actions": ["warm_up"], "to": {"chunk_size": 4096}}}
    later = loop_targets([warm, *intervals], [0, 0, 0, 0, 0, 1, 1], target_ms=30, ttft_limit_ms=500)
    assert later["intervals_to_slo"] == 2  # counted from the first decision, not from the warm-up interval
    assert targets["steady_intervals"] == 2 and targets["steady_changes"] == 0
    assert targets["ttft_over_limit_after_shrink"] == [4]  # interval 6 follows a growth, not a shrink
    # down, down in phase 0 (a violating start walked down), up in phase 1: a new phase may turn, no reversal
    assert targets["reversals_within_phases"] == 0


def test_a_chunk_that_turns_back_within_a_phase_is_a_reversal():
    see_saw = [interval(512, 25, to=563), interval(563, 28, to=512), interval(512, 24, to=563),
               interval(563, 27), interval(563, 26, to=619)]
    targets = loop_targets(see_saw, [0] * 5, target_ms=30, ttft_limit_ms=None, settle_intervals=0)
    assert targets["reversals_within_phases"] == 2  # up, down (1), up (2), then up again: no third
    policy_only = [interval(512, 25, to=512), interval(512, 25, to=563)]  # a policy switch moves no chunk
    assert loop_targets(policy_only, [0, 0], target_ms=30, ttft_limit_ms=None)["reversals_within_phases"] == 0
