"""The operator's queries of the servers' prompt lanes and steps: short requests' TBT and the long-prompt share
from the server's prompt lanes (no more fixed assumed means), step points per kind, each pod's config-applied
time, and the waiting queue with its growth."""
from __future__ import annotations

import pytest

from metronome.contract import metric_names as names
from metronome.operator import metrics_source as ms

WINDOW = ms.QueryWindow(window_seconds=60, sub_window_seconds=15)
NOW = 1_700_000_000.0


def instant(value, **labels):
    return {"metric": labels, "value": [NOW, str(value)]}


def ranged(points, **labels):
    return {"metric": labels, "values": [[NOW - 15 * (len(points) - 1 - i), str(v)] for i, v in enumerate(points)]}


def results(**overrides) -> dict:
    base = {key: [] for key in ms.QUERY_KEYS}
    base.update({
        ms.TBT_P99: [instant(0.05)], ms.TBT_COUNT: [instant(5000)],
        ms.TBT_P99_BY_LANE: [instant(0.021, lane="short"), instant(0.062, lane="long")],
        ms.PROMPTS_BY_LANE: [instant(30, lane="short"), instant(10, lane="long")],
        ms.STEP_TOKENS_RATE: [ranged([800, 900], pod="p", kind="decode"), ranged([6000, 7000], pod="p", kind="mixed")],
        ms.STEP_SECONDS_RATE: [ranged([0.5, 0.5], pod="p", kind="decode"), ranged([0.45, 0.45], pod="p", kind="mixed")],
        ms.STEP_COUNT_RATE: [ranged([40, 45], pod="p", kind="decode"), ranged([20, 20], pod="p", kind="mixed")],
        ms.GENERATION_BY_POD: [instant(4, pod="p"), instant(4, pod="q")],
        ms.APPLIED_BY_POD: [instant(NOW - 30, pod="p"), instant(0, pod="q")],
        ms.WAITING: [instant(12)], ms.WAITING_GROWTH: [instant(7)],
    })
    base.update(overrides)
    return base


def test_queries_group_tbt_and_prompts_by_lane_and_steps_by_kind():
    queries = ms.build_queries(ms.ServiceSelector("ns", "chat"), WINDOW)
    assert queries[ms.TBT_P99_BY_LANE] == (
        f'histogram_quantile(0.99, sum by (le, {names.LANE_LABEL}) (rate({names.TIME_BETWEEN_TOKENS}_bucket'
        '{namespace="ns",model="chat"}[60s])))')
    assert queries[ms.PROMPTS_BY_LANE] == (
        f'sum by (lane) (increase({names.PROMPTS}{{namespace="ns",model="chat"}}[60s]))')
    assert f"by (pod, instance, {names.STEP_KIND_LABEL})" in queries[ms.STEP_COUNT_RATE]
    assert names.CONFIG_APPLIED_TIME in queries[ms.APPLIED_BY_POD]
    assert queries[ms.WAITING_GROWTH] == f'sum(delta({names.REQUESTS_WAITING}{{namespace="ns",model="chat"}}[60s]))'


def test_lanes_applied_times_queue_and_step_kinds_reach_the_observation():
    obs = ms.observation_from_results(results(), WINDOW)
    assert obs.short_tbt_p99_s == pytest.approx(0.021)
    assert obs.long_prompt_share == pytest.approx(0.25)
    assert obs.config_applied_at == {"p": NOW - 30}  # q exports 0: never applied, so no time
    assert (obs.waiting_requests, obs.waiting_growth) == (12, 7)
    kinds = sorted((s.kind, round(s.tokens_per_step)) for s in obs.step_samples)
    assert kinds == [("decode", 20), ("decode", 20), ("mixed", 300), ("mixed", 350)]
    assert [s.mixed for s in obs.step_samples if s.kind == "mixed"] == [True, True]


def test_no_prompts_in_the_window_means_no_share_and_no_short_lane_means_no_short_tbt():
    obs = ms.observation_from_results(results(**{ms.PROMPTS_BY_LANE: [instant(0, lane="short")],
                                                 ms.TBT_P99_BY_LANE: [instant("NaN", lane="long")]}), WINDOW)
    assert obs.long_prompt_share is None and obs.short_tbt_p99_s is None
