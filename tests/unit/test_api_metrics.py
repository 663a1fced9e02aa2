"""/metrics: every metric name of the contract with the `model` label, millisecond buckets, and values that follow
the load."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from api_helpers import TINY, ServerThread, build_server_parts, metric, scrape, wait_until
from prometheus_client.parser import text_string_to_metric_families

from metronome.contract import metric_names as names
from metronome.contract.config import SchedulerConfig
from metronome.server.api.metrics import ServerMetrics
from metronome.server.engine.outputs import EngineStats, StepStats


@pytest.fixture(scope="module")
def server():
    engine, _, app = build_server_parts(scheduler=SchedulerConfig(chunk_size=32, max_num_seqs=4))
    with ServerThread(app) as running:
        running.engine = engine
        yield running


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def test_every_name_is_exported_with_the_model_label(server):
    text = httpx.get(server.url + "/metrics").text
    for name in names.ALL_NAMES:
        assert name in text, name
    aliases = {alias.name for alias in names.PICKER_ALIASES}
    for family in text_string_to_metric_families(text):
        label = names.PICKER_MODEL_LABEL if family.name in aliases else names.MODEL_LABEL
        for sample in family.samples:
            assert sample.labels.get(label) == TINY, sample


def test_the_endpoint_pickers_names_are_exported_from_the_same_values(server):
    """What the picker reads by default (vLLM's names), each equal to the Metronome series it stands for, in the
    same scrape; the cache's shape is the engine's."""
    found = families(server.url)
    for alias in names.PICKER_ALIASES:
        assert alias.name in found, alias.name
    sample = lambda name: one(found[name].samples)  # noqa: E731
    assert sample("vllm:num_requests_running").value == sample(names.REQUESTS_RUNNING).value
    waiting = sum(s.value for s in found[names.REQUESTS_WAITING].samples)
    assert sample("vllm:num_requests_waiting").value == waiting
    assert sample("vllm:kv_cache_usage_perc").value == sample(names.KV_CACHE_USAGE).value
    info = sample("vllm:cache_config_info")
    assert info.value == 1
    core = server.engine.core
    assert (int(info.labels["block_size"]), int(info.labels["num_gpu_blocks"])) == (
        core.block_manager.block_size, core.block_manager.num_blocks)


def one(samples):
    (only,) = samples
    return only


def test_histogram_buckets_are_the_shared_ones(server):
    found = families(server.url)
    for name, buckets in [(names.TIME_BETWEEN_TOKENS, names.TBT_BUCKETS), (names.TIME_TO_FIRST_TOKEN,
                          names.TTFT_BUCKETS), (names.REQUEST_E2E, names.E2E_BUCKETS),
                          (names.STEP_DURATION, names.STEP_BUCKETS), (names.SCHEDULER_OVERHEAD,
                          names.OVERHEAD_BUCKETS), (names.STEP_TOKENS, names.STEP_TOKEN_BUCKETS)]:
        family = found[name]
        bounds = [float(s.labels["le"]) for s in family.samples
                  if s.name == name + "_bucket" and s.labels.get(names.STEP_KIND_LABEL, "decode") == "decode"
                  and s.labels.get(names.LANE_LABEL, "short") == "short"]
        assert bounds == [float(b) for b in buckets] + [float("inf")], name


def test_counters_and_histograms_move_under_load(server):
    before = scrape(server.url)
    bodies = [{"prompt": "x" * (10 + 37 * i), "max_tokens": 5 + i, "ignore_eos": True, "stream": i % 2 == 0}
              for i in range(6)]

    def send(body):
        return httpx.post(server.url + "/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        replies = list(pool.map(send, bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    generated = sum(b["max_tokens"] for b in bodies)

    def settled():  # observers run on the engine thread, possibly just after the last token went out
        samples = scrape(server.url)
        done = metric(samples, names.REQUEST_E2E + "_count") - metric(before, names.REQUEST_E2E + "_count")
        return samples if done == len(bodies) else None

    after = wait_until(settled, timeout=30, what="metrics of the finished requests")

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta(names.GENERATION_TOKENS) == generated
    assert delta(names.PROMPT_TOKENS) > 0
    assert delta(names.TIME_TO_FIRST_TOKEN + "_count") == len(bodies)
    assert delta(names.REQUEST_E2E + "_count") == len(bodies)
    # One TBT observation per token after the first, streamed or not.
    assert delta(names.TIME_BETWEEN_TOKENS + "_count") == generated - len(bodies)
    assert delta(names.TIME_BETWEEN_TOKENS + "_sum") > 0
    assert delta(names.STEP_DURATION + "_count") > 0
    assert delta(names.STEP_TOKENS + "_sum") >= generated
    assert delta(names.SCHEDULER_OVERHEAD + "_count") == delta(names.STEP_DURATION + "_count")
    wait_until(lambda: metric(scrape(server.url), names.REQUESTS_RUNNING) == 0, timeout=30, what="idle engine")
    idle = scrape(server.url)
    assert metric(idle, names.KV_CACHE_USAGE) == 0
    assert metric(idle, names.KV_BLOCKS_LEAKED) == 0
    assert metric(idle, names.REQUESTS_WAITING) == 0
    # split: the step's budget is its larger lane (short, 2048 by default), not chunk_size (32), which split never reads
    assert metric(idle, names.CHUNK_SIZE) == 2048
    assert metric(idle, names.LANE_CHUNK_SIZE, lane="long") == 512
    assert metric(idle, names.QUEUE_POLICY_INFO, policy="split") == 1


def test_invalid_requests_are_counted(server):
    before = metric(scrape(server.url), names.REQUESTS_REJECTED, reason="invalid")
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 0}).status_code == 400
    assert httpx.post(server.url + "/v1/completions", json={"prompt": 7}).status_code == 400
    after = metric(scrape(server.url), names.REQUESTS_REJECTED, reason="invalid")
    assert after - before == 2


def test_observer_maps_step_stats_exactly():
    metrics = ServerMetrics("m")
    step = StepStats(duration_s=0.009, scheduler_overhead_s=0.0004, num_tokens=40, num_prefill_tokens=37,
                     num_decode_tokens=3, num_seqs=4, new_prompt_tokens=37, generated_tokens=4,
                     token_gaps_s=[0.003, 0.0055, 0.011], first_token_latencies_s=[0.05], finished_e2e_s=[0.2],
                     token_gap_lanes=["short", "short", "long"], first_token_lanes=["long"],
                     num_preemptions=2)
    stats = EngineStats(num_running=3, num_waiting={"short": 2, "long": 1}, num_prefilling=2,
                        kv_usage_ratio=0.25,
                        kv_blocks_total=100, kv_blocks_free=75, kv_blocks_leaked=0, preemptions_total=2,
                        scheduler=SchedulerConfig())
    metrics.on_step(step, stats)
    metrics.on_rejected("overloaded")
    value = lambda name, **labels: metrics.registry.get_sample_value(name, {"model": "m", **labels})  # noqa: E731
    # The engine's own gaps are not the TBT clients see: the routes observe that (test_token_gaps.py).
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="short") == 0
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="long") == 0
    for lane, gap in (("short", 0.003), ("short", 0.0055), ("long", 0.011)):
        metrics.observe_token_gap(lane, gap)
    assert value(names.TIME_BETWEEN_TOKENS + "_bucket", le="0.004", lane="short") == 1
    assert value(names.TIME_BETWEEN_TOKENS + "_bucket", le="0.006", lane="short") == 2
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="short") == 2
    assert value(names.TIME_BETWEEN_TOKENS + "_count", lane="long") == 1
    assert value(names.PROMPTS, lane="long") == 1 and value(names.PROMPTS, lane="short") == 0
    assert value(names.TIME_TO_FIRST_TOKEN + "_sum") == pytest.approx(0.05)
    assert value(names.REQUEST_E2E + "_count") == 1
    assert value(names.STEP_TOKENS + "_bucket", le="64.0", kind="mixed") == 1  # it carried prefill tokens
    assert value(names.STEP_TOKENS + "_bucket", le="32.0", kind="mixed") == 0
    assert value(names.SCHEDULER_OVERHEAD + "_bucket", le="0.0005", kind="mixed") == 1
    assert value(names.STEP_DURATION + "_count", kind="decode") == 0
    assert value(names.PROMPT_TOKENS) == 37 and value(names.GENERATION_TOKENS) == 4
    assert value(names.PREEMPTIONS) == 2
    assert value(names.REQUESTS_RUNNING) == 3 and value(names.REQUESTS_PREFILLING) == 2
    assert value(names.REQUESTS_WAITING, queue="short") == 2 and value(names.REQUESTS_WAITING, queue="fcfs") == 0
    assert value(names.KV_CACHE_USAGE) == 0.25
    assert value(names.REQUESTS_REJECTED, reason="overloaded") == 1


def test_picker_aliases_sum_away_the_labels_they_drop():
    """The waiting queues add up to the picker's one queue, per model; other label sets stay apart."""
    from prometheus_client import CollectorRegistry, Gauge

    from metronome.server.api.picker_aliases import alias_families

    registry = CollectorRegistry()
    waiting = Gauge(names.REQUESTS_WAITING, "w", [names.MODEL_LABEL, "queue"], registry=registry)
    waiting.labels("a", "short").set(2)
    waiting.labels("a", "long").set(5)
    waiting.labels("b", "fcfs").set(1)
    (family,) = alias_families(registry.collect())
    assert family.name == "vllm:num_requests_waiting"
    assert {s.labels[names.PICKER_MODEL_LABEL]: s.value for s in family.samples} == {"a": 7, "b": 1}
