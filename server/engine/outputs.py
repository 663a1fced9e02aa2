"""What the engine hands out: per-token events, per-step stats (metrics source) and snapshots."""
from __future__ import annotations

from dataclasses import dataclass, field

from metronome.contract.config import SchedulerConfig


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's log-probability under the model, and the `k` most likely tokens' (id, logprob)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One per generated token, in order, per request (plus one token-less event for an abort)."""

    request_id: str
    token_id: int  # -1 on an abort event, which carries no token
    text: str  # detokenized delta ("" while a multi-byte char is incomplete or a stop string may be forming)
    index: int  # 0-based position in the output
    time: float  # time.monotonic() when the token was emitted
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    prompt_tokens: int
    completion_tokens: int  # tokens generated so far including this one
    logprobs: TokenLogprobs | None = None  # when the request asked for logprobs


@dataclass
class StepStats:
    """Produced by every engine step and handed to observers (metrics). Under async scheduling a step() call
    launches one step and reads the one before: its stats describe the step it read (batch shape, tokens), with
    the time since the previous read as its duration; a call that read nothing reports num_tokens 0."""

    duration_s: float = 0.0
    scheduler_overhead_s: float = 0.0  # host time: schedule + prepare inputs + postprocess, not model forward
    # (under async scheduling it overlaps the device's work on the step before, so it may exceed duration_s)
    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    new_prompt_tokens: int = 0  # prompt tokens computed this step (recomputation after preemption excluded)
    generated_tokens: int = 0
    token_gaps_s: list[float] = field(default_factory=list)  # TBT of every token whose request already had one
    first_token_latencies_s: list[float] = field(default_factory=list)  # arrival -> first token
    token_gap_lanes: list[str] = field(default_factory=list)  # prompt lane ("short"/"long") of each token gap
    first_token_lanes: list[str] = field(default_factory=list)  # prompt lane of each first-token latency
    finished_e2e_s: list[float] = field(default_factory=list)  # arrival -> finish
    num_preemptions: int = 0
    cuda_graph: bool = False  # this step replayed a captured (decode) CUDA graph
    forward: str = "eager"  # how the forward ran: "graph" (decode graph), "piecewise" (mixed-step graphs),
    # "overlap" (a mixed step as its decode graph beside its chunk's piecewise graphs), "eager"

    @property
    def kind(self) -> str:
        """"mixed" when the step carried prefill tokens, else "decode" (the `kind` label of the step metrics)."""
        return "mixed" if self.num_prefill_tokens else "decode"


@dataclass
class EngineStats:
    """A snapshot of the engine's state."""

    num_running: int
    num_waiting: dict[str, int]  # per queue name: "fcfs" | "short" | "long" | "sjf"
    num_prefilling: int  # running sequences whose prompt is not fully prefilled
    kv_usage_ratio: float
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_leaked: int
    preemptions_total: int
    scheduler: SchedulerConfig
    execution_mode: str = "eager"  # "cuda_graphs" or "eager: <why>" (see ModelRunner.setup_cuda_graphs)
    kernel_compiles_after_ready: int = 0  # Triton variants compiled since the engine was ready (each a stall)
    kv_block_size: int = 0  # tokens per KV block (0: not told)


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
