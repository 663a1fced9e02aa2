"""Metric names, labels and buckets: the one list shared by the server (which exports them) and the operator
(which queries them), the operator's own series, and the endpoint picker's aliases. Every server series carries
the `model` label (the picker's aliases: vLLM's `model_name`); the operator's carry namespace and inferenceservice.
"""
from __future__ import annotations

from dataclasses import dataclass

PREFIX = "metronome_"

# Buckets resolve milliseconds: an H200 decode step is 3.5-8 ms, vLLM's first TBT bucket (10 ms) is too coarse.
# Steps of 2.5 ms up to 30 ms and 5 ms up to 50 ms, where TBT targets are set: with a 20-25 ms bucket a 22 ms
# target could not tell 20.1 ms from 24.9 ms (on the H200 the p99 read 19.6-20.0 ms for 27 intervals in a row
# while clients saw 19-24 ms). The 5 s and 10 s bounds keep CPU servers (tests, demo) from clamping p99 at 2.5 s,
# which misleads the step fit.
TBT_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025, 0.0275, 0.03, 0.035,
               0.04, 0.045, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0)
STEP_BUCKETS = TBT_BUCKETS
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192, 16384)

MODEL_LABEL = "model"
STEP_KIND_LABEL = "kind"  # on the step histograms: "decode" (no prefill tokens) or "mixed"
STEP_KINDS = ("decode", "mixed")
# On TBT and PROMPTS: "short" when the request's prompt has at most the scheduler's short_prompt_threshold tokens
# (whatever the queue policy), else "long". What policy switching reads: short requests' TBT and the long share.
LANE_LABEL = "lane"
LANES = ("short", "long")

TIME_BETWEEN_TOKENS = PREFIX + "time_between_tokens_seconds"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
REQUEST_E2E = PREFIX + "request_e2e_seconds"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
PROMPTS = PREFIX + "prompts_total"  # label: lane; requests whose first token was emitted
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
REQUESTS_RUNNING = PREFIX + "requests_running"
REQUESTS_WAITING = PREFIX + "requests_waiting"  # label: queue
# Admitted requests whose prompt is not fully prefilled yet: beyond one a pod (one a lane under split) they wait
# their turn for the prefill budget inside the batch, a queue that requests_waiting does not show.
REQUESTS_PREFILLING = PREFIX + "requests_prefilling"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_ratio"
KV_BLOCKS_LEAKED = PREFIX + "kv_blocks_leaked"
# Value 1; labels block_size (tokens per KV block) and num_blocks (blocks the cache holds): the cache's shape.
KV_CACHE_CONFIG_INFO = PREFIX + "kv_cache_config_info"
KV_BLOCK_SIZE_LABEL = "block_size"
KV_NUM_BLOCKS_LABEL = "num_blocks"
PREEMPTIONS = PREFIX + "preemptions_total"
REQUESTS_REJECTED = PREFIX + "requests_rejected_total"  # label: reason
STEP_DURATION = PREFIX + "step_duration_seconds"
STEP_TOKENS = PREFIX + "step_tokens"
SCHEDULER_OVERHEAD = PREFIX + "scheduler_overhead_seconds"
# The step's prefill budget (metronome.contract.budget.prefill_budget: under split the larger lane), and per
# prompt lane what a prompt of that lane may advance in one step (split's two sizes; fcfs/sjf: the budget).
CHUNK_SIZE = PREFIX + "chunk_size"
LANE_CHUNK_SIZE = PREFIX + "lane_chunk_size"  # label: lane
QUEUE_POLICY_INFO = PREFIX + "queue_policy_info"  # label: policy
CONFIG_GENERATION = PREFIX + "config_generation"
# Unix time at which the server applied its current config: the controller's settling window starts when the
# last pod applied the new generation, not when the ConfigMap was written (a kubelet takes 30-90 s to project it).
CONFIG_APPLIED_TIME = PREFIX + "config_applied_timestamp_seconds"
CONFIG_RELOAD_ERRORS = PREFIX + "config_reload_errors_total"
KERNEL_COMPILES_AFTER_READY = PREFIX + "kernel_compiles_after_ready_total"  # Triton variants compiled while serving

ALL_NAMES = (
    TIME_BETWEEN_TOKENS, TIME_TO_FIRST_TOKEN, REQUEST_E2E, PROMPT_TOKENS, GENERATION_TOKENS, REQUESTS_RUNNING,
    REQUESTS_WAITING, KV_CACHE_USAGE, KV_BLOCKS_LEAKED, PREEMPTIONS, REQUESTS_REJECTED, STEP_DURATION, STEP_TOKENS,
    SCHEDULER_OVERHEAD, CHUNK_SIZE, QUEUE_POLICY_INFO, CONFIG_GENERATION, CONFIG_RELOAD_ERRORS,
    KERNEL_COMPILES_AFTER_READY, PROMPTS, CONFIG_APPLIED_TIME, LANE_CHUNK_SIZE, KV_CACHE_CONFIG_INFO,
    REQUESTS_PREFILLING,
)


# --- the operator's own series (its /metrics, `metronome operator --metrics-port`) ------------------------------
# Labelled with the InferenceService's namespace and name (`namespace` and `model` on the servers' series), under
# names no scrape config gives its targets: the operator pod's own `namespace` would otherwise overwrite one.
OPERATOR_PREFIX = PREFIX + "operator_"
SERVICE_NAMESPACE_LABEL = "inferenceservice_namespace"
SERVICE_LABEL = "inferenceservice"
# The control loop's decisions, by action (the tuner's action kinds: chunk_down, chunk_up, policy_switch,
# scale_up, scale_down, slo_unreachable, hold, no_data) and whether they were applied or only advised (label
# `applied`).
OPERATOR_DECISIONS = OPERATOR_PREFIX + "decisions_total"
DECISION_ACTION_LABEL = "action"
DECISION_APPLIED_LABEL = "applied"
# The service's SLO targets, by objective (`tbt_p99`, `ttft_p99`), for dashboards to draw next to the servers'.
OPERATOR_SLO_TARGET = OPERATOR_PREFIX + "slo_target_seconds"
SLO_OBJECTIVE_LABEL = "objective"
SLO_OBJECTIVES = ("tbt_p99", "ttft_p99")
# The replicas the loop's last reading says the service needs: what carries the offered load with
# autotune.scaleDownHeadroom by the step model (a scale-up's count while no chunk meets the SLO), within
# [minReplicas, maxReplicas], whoever sets the replicas. An HPA (an External metric through prometheus-adapter with
# an AverageValue target of 1) or KEDA's prometheus scaler (threshold 1) can drive the service by it.
OPERATOR_DESIRED_REPLICAS = OPERATOR_PREFIX + "desired_replicas"
OPERATOR_NAMES = (OPERATOR_DECISIONS, OPERATOR_SLO_TARGET, OPERATOR_DESIRED_REPLICAS)

# --- the endpoint picker's names -----------------------------------------------------------------------------
# The Gateway API Inference Extension's endpoint picker (and llm-d's router after it) scrapes each pod of an
# InferencePool for its queue, running requests and KV usage, by default under vLLM's names; pods labelled
# engine-type `vllm` (or unlabelled) are read that way. The server exports these as aliases: each is computed at
# scrape time from the Metronome series named here, its labels renamed (`model` → vLLM's `model_name`) and every
# other label summed away (the waiting queues add up to vLLM's one queue). vLLM's `vllm:lora_requests_info`
# is not exported: Metronome serves no adapters, as vLLM without --enable-lora.
PICKER_ENGINE_TYPE = "vllm"
# The pod labels a picker reads the engine type from (the operator puts both on every server pod): the Gateway API
# Inference Extension's picker (v1.x) reads the first, llm-d's router the second; both read an unlabelled pod as
# vLLM.
PICKER_ENGINE_TYPE_LABEL_KEYS = ("inference.networking.k8s.io/engine-type", "llm-d.ai/engine-type")
PICKER_MODEL_LABEL = "model_name"


@dataclass(frozen=True)
class PickerAlias:
    name: str  # the picker's series
    source: str  # Metronome's series it is computed from
    labels: tuple[tuple[str, str], ...]  # (Metronome's label, the picker's label); other labels are summed away


PICKER_ALIASES = (
    PickerAlias("vllm:num_requests_waiting", REQUESTS_WAITING, ((MODEL_LABEL, PICKER_MODEL_LABEL),)),
    PickerAlias("vllm:num_requests_running", REQUESTS_RUNNING, ((MODEL_LABEL, PICKER_MODEL_LABEL),)),
    # A fraction in [0, 1], as vLLM's despite its name.
    PickerAlias("vllm:kv_cache_usage_perc", KV_CACHE_USAGE, ((MODEL_LABEL, PICKER_MODEL_LABEL),)),
    # The picker reads the cache's shape from these two labels (GIE's CacheConfigBlockSizeInfoMetricName and
    # CacheConfigNumGPUBlocksMetricName).
    PickerAlias("vllm:cache_config_info", KV_CACHE_CONFIG_INFO,
                ((MODEL_LABEL, PICKER_MODEL_LABEL), (KV_BLOCK_SIZE_LABEL, "block_size"),
                 (KV_NUM_BLOCKS_LABEL, "num_gpu_blocks"))),
)
