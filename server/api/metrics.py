"""Prometheus metrics of one server: exactly the names, labels and buckets of metronome/contract/metric_names.py.

`ServerMetrics` is an EngineObserver: the engine thread calls `on_step` after every step and `on_rejected` when
it turns a request away (prometheus-client is thread-safe). Time between tokens is the exception: the routes
observe it as each token reaches its response (token_gaps.py), which is what clients and the SLO see; the
engine's own gaps stay in its StepStats for the engine benchmarks. Gauges that describe engine state are also refreshed
from an `EngineStats` snapshot at scrape time, so an idle engine still reports its current KV usage. The
config gauges (prefill budget and per-lane sizes, queue policy, generation) are set by the config path, from the
config that was applied, so they never flip back to an older value reported by a step that was already in flight.

With several API server processes (`serve --api-servers N`) every process holds a `ServerMetrics(multiprocess=
True)` over prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, set by api_servers.py before
prometheus_client is imported), and `render` merges every process's files, so any server's /metrics shows the
whole server: counters and histograms sum (step metrics and the engine's token counters come only from server 0,
which alone gets StepStats; TBT from the process that served each request). Gauges are "mostrecent": the config
gauges are set only by server 0 (the one that watches the config file), the engine-state gauges by whichever
process refreshed from its snapshot last (every server gets the same snapshot after each step). Only the
`primary` process (server 0) counts kernel compiles from the snapshot, so they are counted once.

`render` also writes the endpoint picker's series (vLLM's names, picker_aliases.py), computed from the families
it renders.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from metronome.contract import metric_names as names
from metronome.contract.budget import lane_budgets, prefill_budget
from metronome.contract.config import QueuePolicy, SchedulerConfig
from metronome.server.api.client_rate import REJECT_REASON as CLIENT_RATE
from metronome.server.api.client_share import REJECT_REASON as CLIENT_SHARE
from metronome.server.api.picker_aliases import WithAliases

KNOWN_QUEUES = ("fcfs", "short", "long", "sjf")
# Every reason exists at 0 from the start; the engine names the first two, body_limit.py "too_large",
# client_share.py "client_share" (a client over its share of the waiting queue or the running requests),
# client_rate.py "client_rate" (a client over its prompt-token rate).
KNOWN_REJECT_REASONS = ("overloaded", "invalid", "draining", "too_large", CLIENT_SHARE, CLIENT_RATE)
CONTENT_TYPE = CONTENT_TYPE_LATEST
SHARED_GAUGE_MODE = "mostrecent"  # with several processes: the last value any of them set


def multiprocess_values() -> bool:
    """Whether prometheus_client keeps values in PROMETHEUS_MULTIPROC_DIR files (chosen when it was imported)."""
    return bool(getattr(values.ValueClass, "_multiprocess", False))


class ServerMetrics:
    """One registry per server; every series carries `model`."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *, multiprocess: bool = False,
                 primary: bool = True):
        """`multiprocess`: one of several API server processes (see the module doc); `primary`: server 0."""
        if multiprocess and not multiprocess_values():
            raise RuntimeError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before prometheus_client "
                               "is imported")
        self.model_name = model_name
        self.multiprocess = multiprocess
        self.primary = primary
        self.registry = registry if registry is not None else CollectorRegistry()
        model = [names.MODEL_LABEL]
        reg = self.registry
        mode = {"multiprocess_mode": SHARED_GAUGE_MODE} if multiprocess else {}

        def gauge(name: str, doc: str, labels: list[str] = model) -> Gauge:
            return Gauge(name, doc, labels, registry=reg, **mode)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = model) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        step = model + [names.STEP_KIND_LABEL]  # decode and mixed steps have different fixed costs

        # By prompt lane: policy switching compares short requests' TBT with the whole; sum by (le) gives the whole.
        self.tbt = Histogram(names.TIME_BETWEEN_TOKENS,
                             "Time between consecutive tokens of a request as the server hands them to the client, "
                             "by prompt lane.", model + [names.LANE_LABEL], buckets=names.TBT_BUCKETS, registry=reg)
        self.ttft = histogram(names.TIME_TO_FIRST_TOKEN, "Arrival to first token.", names.TTFT_BUCKETS)
        self.e2e = histogram(names.REQUEST_E2E, "Arrival to finish.", names.E2E_BUCKETS)
        self.step_duration = histogram(names.STEP_DURATION, "Wall time of one engine step, by kind.",
                                       names.STEP_BUCKETS, step)
        self.step_tokens = histogram(names.STEP_TOKENS, "Tokens computed in one engine step, by kind.",
                                     tuple(float(b) for b in names.STEP_TOKEN_BUCKETS), step)
        self.scheduler_overhead = histogram(names.SCHEDULER_OVERHEAD,
                                            "Host time per step outside the forward pass, by kind.",
                                            names.OVERHEAD_BUCKETS, step)

        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens computed.", model, registry=reg)
        self.prompts = Counter(names.PROMPTS, "Requests whose first token was emitted, by prompt lane.",
                               model + [names.LANE_LABEL], registry=reg)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Tokens generated.", model, registry=reg)
        self.preemptions = Counter(names.PREEMPTIONS, "Sequences preempted (recomputed).", model, registry=reg)
        self.rejected = Counter(names.REQUESTS_REJECTED, "Requests turned away, by reason.", model + ["reason"],
                                registry=reg)
        self.reload_errors = Counter(names.CONFIG_RELOAD_ERRORS, "Config files that failed to load.", model,
                                     registry=reg)
        self.compiles_after_ready = Counter(names.KERNEL_COMPILES_AFTER_READY,
                                            "Kernel variants compiled after the engine was ready (each stalls a step).",
                                            model, registry=reg)
        self._compiles_counted = 0

        self.running = gauge(names.REQUESTS_RUNNING, "Requests running.")
        self.prefilling = gauge(names.REQUESTS_PREFILLING, "Running requests whose prompt is not fully prefilled.")
        self.waiting = gauge(names.REQUESTS_WAITING, "Requests waiting, by queue.", model + ["queue"])
        self.kv_usage = gauge(names.KV_CACHE_USAGE, "Fraction of KV blocks in use.")
        self.kv_leaked = gauge(names.KV_BLOCKS_LEAKED, "KV blocks held by no live sequence.")
        self.kv_cache_config = gauge(names.KV_CACHE_CONFIG_INFO, "1, labelled with the KV cache's block size and "
                                     "block count.", model + [names.KV_BLOCK_SIZE_LABEL, names.KV_NUM_BLOCKS_LABEL])
        self._kv_shape_set = False
        self.chunk_size = gauge(names.CHUNK_SIZE, "Prefill tokens one step may carry under the applied config "
                                "(split: the larger of its two lanes).")
        self.lane_chunk_size = gauge(names.LANE_CHUNK_SIZE, "Prefill tokens a prompt of this lane may advance "
                                     "in one step (split: short and long sizes).", model + [names.LANE_LABEL])
        self.queue_policy = gauge(names.QUEUE_POLICY_INFO, "1 for the effective queue policy.", model + ["policy"])
        self.generation = gauge(names.CONFIG_GENERATION, "Generation of the applied config file.")
        self.config_applied = gauge(names.CONFIG_APPLIED_TIME, "Unix time the current config was applied.")

        # Create every labelled child up front so that each name is exported before its first event.
        for metric in (self.ttft, self.e2e, self.prompt_tokens, self.generation_tokens, self.preemptions,
                       self.reload_errors, self.compiles_after_ready, self.running, self.prefilling, self.kv_usage,
                       self.kv_leaked, self.chunk_size, self.generation, self.config_applied):
            metric.labels(model_name)
        for metric in (self.step_duration, self.step_tokens, self.scheduler_overhead):
            for kind in names.STEP_KINDS:
                metric.labels(model_name, kind)
        self._tbt_by_lane = {lane: self.tbt.labels(model_name, lane) for lane in names.LANES}
        for lane in names.LANES:
            self.prompts.labels(model_name, lane)
            self.lane_chunk_size.labels(model_name, lane)
        for queue in KNOWN_QUEUES:
            self.waiting.labels(model_name, queue)
        for reason in KNOWN_REJECT_REASONS:
            self.rejected.labels(model_name, reason)
        for policy in QueuePolicy:
            self.queue_policy.labels(model_name, policy.value)

    # ------------------------------------------------------------------ EngineObserver (engine thread)

    def on_step(self, step, stats) -> None:
        m = self.model_name
        for lane in step.first_token_lanes:
            self.prompts.labels(m, lane).inc()
        ttft = self.ttft.labels(m)
        for latency in step.first_token_latencies_s:
            ttft.observe(latency)
        e2e = self.e2e.labels(m)
        for latency in step.finished_e2e_s:
            e2e.observe(latency)
        if step.num_tokens > 0:
            kind = step.kind
            self.step_duration.labels(m, kind).observe(step.duration_s)
            self.step_tokens.labels(m, kind).observe(step.num_tokens)
            self.scheduler_overhead.labels(m, kind).observe(step.scheduler_overhead_s)
        if step.new_prompt_tokens:
            self.prompt_tokens.labels(m).inc(step.new_prompt_tokens)
        if step.generated_tokens:
            self.generation_tokens.labels(m).inc(step.generated_tokens)
        if step.num_preemptions:
            self.preemptions.labels(m).inc(step.num_preemptions)
        self.refresh(stats)

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ the routes (event loop)

    def observe_token_gap(self, lane: str, seconds: float) -> None:
        self._tbt_by_lane[lane].observe(seconds)

    # ------------------------------------------------------------------ state

    def refresh(self, stats) -> None:
        """Set the engine-state gauges from a snapshot."""
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.prefilling.labels(m).set(stats.num_prefilling)
        for queue in set(KNOWN_QUEUES) | set(stats.num_waiting):
            self.waiting.labels(m, queue).set(stats.num_waiting.get(queue, 0))
        self.kv_usage.labels(m).set(stats.kv_usage_ratio)
        self.kv_leaked.labels(m).set(stats.kv_blocks_leaked)
        if not self._kv_shape_set and stats.kv_block_size > 0:  # the cache's shape is fixed for the engine's life
            self.kv_cache_config.labels(m, str(stats.kv_block_size), str(stats.kv_blocks_total)).set(1)
            self._kv_shape_set = True
        compiles = getattr(stats, "kernel_compiles_after_ready", 0)
        # A counter only rises: add what is new since the last refresh (server 0 only: the others see the same).
        if self.primary and compiles > self._compiles_counted:
            self.compiles_after_ready.labels(m).inc(compiles - self._compiles_counted)
            self._compiles_counted = compiles

    def set_config(self, scheduler: SchedulerConfig, generation: int) -> None:
        m = self.model_name
        self.chunk_size.labels(m).set(prefill_budget(scheduler))
        for lane, size in lane_budgets(scheduler).items():
            self.lane_chunk_size.labels(m, lane).set(size)
        current = QueuePolicy(scheduler.queue_policy).value
        for policy in QueuePolicy:
            self.queue_policy.labels(m, policy.value).set(1 if policy.value == current else 0)
        self.generation.labels(m).set(generation)
        self.config_applied.labels(m).set(time.time())

    def count_reload_error(self) -> None:
        self.reload_errors.labels(self.model_name).inc()

    def render(self) -> bytes:
        """The exposition text, with the endpoint picker's aliases computed from the same families."""
        if self.multiprocess:  # every process's files, merged at scrape time
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(WithAliases(merged))
        return generate_latest(WithAliases(self.registry))
