"""The engine core: requests in, one step at a time, token events out. Single-threaded; the AsyncEngine runs it
on a background thread.

Async scheduling (one step of lookahead, as vLLM's): a call of `step()` schedules, prepares and launches step
n+1 and only then reads step n's sampled ids (copied to the host behind n's work) and emits them, so the host
work of n+1 overlaps the device's work on n. What does not depend on token values (computed counts, blocks,
positions) is done before n+1 is scheduled: each sampled token is a PENDING placeholder in token_ids until its
step is read, and n+1 reads it on the device. What does depend on them (the token ids, detokenizing, stop checks,
prefix-cache hashes of blocks that contain them) waits for the read. A sequence that finishes at n was already
scheduled into n+1: that row's output is dropped, and its blocks are freed once n+1 is read (`_Launched.retired`).
Requests whose choice needs the host to see their earlier tokens (penalties, grammars, logprobs:
sampler.needs_sync) and tensor parallelism run synchronously: the same code, with each step read right after
it is launched. A step returns the events and StepStats of the step whose tokens it read.
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import InvalidRequestError
from metronome.kernels import compile_watch
from metronome.server.engine.block_manager import BlockManager
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.grammar import Grammars, advance
from metronome.server.engine.kv_cache import bytes_per_block, kv_cache_dtype, plan_num_blocks
from metronome.server.engine.kv_layout import kv_layout
from metronome.server.engine.mixed_overlap import MixedOverlap
from metronome.server.engine.model_runner import InFlightTokens, ModelRunner
from metronome.server.engine.nano_batches import NanoPipeline
from metronome.server.engine.output_text import OutputText
from metronome.server.engine.outputs import EngineStats, GenerationResult, StepStats, TokenEvent
from metronome.server.engine.request_limits import RequestLimits, check_grammar, check_waiting
from metronome.server.engine.sampler import PendingSample, SampleResult, needs_sync
from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.scheduler import ScheduledBatch, Scheduler
from metronome.server.engine.sequence import PENDING, Sequence, SequenceStatus
from metronome.server.engine.warm_batch import run_warm_batch
from metronome.server.models.quant.kv_scales import install_kv_scales

if TYPE_CHECKING:
    from metronome.server.engine.tp_launch import WorkerPool

ABORT_TOKEN_ID = -1
log = logging.getLogger("metronome.engine")


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device; its tokens are read by `_read`."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the sampled rows, in order
    indices: list[int]  # where each row's token goes in its seq.token_ids (PENDING until read)
    sample: PendingSample | SampleResult | None  # None when no row samples
    stats: StepStats  # the batch's shape and host time so far; tokens and duration are added when read
    started: float  # perf_counter() when its scheduling began
    members: set[Sequence] = field(default_factory=set)  # every sequence the step computes
    retired: list[Sequence] = field(default_factory=list)  # members that finished before it was read

    def in_flight_tokens(self) -> InFlightTokens | None:
        if not isinstance(self.sample, PendingSample):
            return None
        return InFlightTokens(self.sample.ids, {seq: i for i, seq in enumerate(self.seqs)})


def async_scheduling_enabled(mode: str, device: torch.device, tensor_parallel: bool) -> bool:
    """EngineConfig.async_scheduling: "auto" is on for CUDA; tensor parallel always runs synchronously (every rank
    takes the step's inputs from rank 0's host)."""
    return not tensor_parallel and (mode == "on" or (mode == "auto" and device.type == "cuda"))


class EngineCore:
    def __init__(self, loaded: Any, config: EngineConfig, scheduler_config: SchedulerConfig,
                 workers: WorkerPool | None = None):
        """`workers`: rank 0's tensor-parallel worker processes (tp_launch.py); None at tensor_parallel_size 1."""
        config.validate()
        self.workers = workers
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        model_config = loaded.config
        self.vocab_size: int = model_config.vocab_size
        model_max = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise InvalidRequestError(
                f"max_model_len {config.max_model_len} exceeds the model's context of {model_max} tokens",
                param="max_model_len")
        self.max_model_len: int = config.max_model_len or model_max
        device = torch.device(loaded.device)
        set_moe_backend = getattr(loaded.model, "set_moe_backend", None)
        if set_moe_backend is not None:  # a mixture of experts: how its experts run (a dense model has none)
            from metronome.server.models.moe import resolve_moe_backend
            try:
                resolve_moe_backend(config.moe_backend, device)  # an explicit choice must run on this device
            except ValueError as error:
                raise InvalidRequestError(str(error), param="moe_backend") from None
            set_moe_backend(config.moe_backend)
        dtype = loaded.dtype if isinstance(loaded.dtype, torch.dtype) else getattr(torch, str(loaded.dtype))
        kv_heads = model_config.num_key_value_heads if workers is None else workers.kv_heads_per_rank
        backend_name = getattr(getattr(loaded.model, "attention_backend", None), "name", config.attention_backend)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype, backend_name)
        # an FP8 cache's scales: the checkpoint's, else calibrated on the model (before any cache exists)
        self.kv_scales = install_kv_scales(loaded, config.block_size) if kv_dtype == torch.float8_e4m3fn else None
        # Layers with a sliding window keep their KV in groups of their own, whose blocks behind the window are
        # freed (kv_layout.py); a block is one block of every layer of a group.
        self.kv_layout = kv_layout(getattr(model_config, "layer_windows", None)
                                   or (None,) * model_config.num_hidden_layers)
        per_block = bytes_per_block(self.kv_layout.group_size, config.block_size, kv_heads, model_config.head_dim,
                                    kv_dtype)
        num_blocks = plan_num_blocks(config, per_block, device)
        if workers is not None:
            num_blocks = workers.agree_num_blocks(num_blocks)  # every rank allocates the same cache
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.watermark, self.kv_layout.group_windows)
        self.scheduler = Scheduler(scheduler_config, self.block_manager,
                                   long_rope_from=getattr(loaded.model, "long_rope_from", None))
        runner_class = ModelRunner if workers is None else workers.runner_class
        self.runner = runner_class(loaded.model, model_config.num_hidden_layers, kv_heads,
                                   model_config.head_dim, num_blocks, config.block_size, self.max_model_len, dtype,
                                   device, seed=config.seed, layout=self.kv_layout, kv_dtype=kv_dtype)
        if device.type == "cuda":
            compile_watch.install()  # before the first kernel: start-up compiles are counted too
        # "cuda_graphs" (decode steps replay captured graphs) or "eager: <why>"; reported in stats().
        self.execution_mode = "eager: cuda_graphs disabled in the engine config"
        if workers is not None:
            self.execution_mode = "eager: tensor parallel (graphs are not captured across ranks)"
        elif config.cuda_graphs:
            if config.mixed_overlap == "on":
                self.runner.overlap = MixedOverlap(device)
            elif config.mixed_overlap == "pipeline":
                self.runner.pipeline = NanoPipeline(device)
            self.execution_mode = self.runner.setup_cuda_graphs(scheduler_config.max_num_seqs, self.max_model_len)
        self._warm_up(device, workers is None)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids or ())
        # Constrained decoding (response_format): llguidance's tokenizer is built on a background thread now.
        self.grammars = Grammars(self.tokenizer, self.vocab_size, list(self.eos_token_ids), device) \
            if Grammars.available() else None
        self._matchers: dict[str, Any] = {}  # request id -> its grammar matcher
        self._special: set[str] = set()  # live requests that edit logits or want logprobs (else: the plain path)
        self._sync_only: set[str] = set()  # live requests whose steps must run synchronously (needs_sync)
        self.async_scheduling = async_scheduling_enabled(config.async_scheduling, device, workers is not None)
        self._inflight: _Launched | None = None  # launched, tokens not read yet (async scheduling)
        self._last_read = 0.0  # perf_counter() when the last step's tokens were read
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._abort_events: list[TokenEvent] = []
        self._failures: list[tuple[str, Exception]] = []  # requests one of whose tokens could not be emitted
        self.warm_batch = (0, 0, 0.0)  # the start-up burst (warm_batch.py): sequences, steps, seconds
        if device.type == "cuda" and workers is None:
            self.warm_batch = run_warm_batch(self)
        compile_watch.mark_ready()  # any compile from now on stalls serving: counted in kernel_compiles_after_ready

    def _warm_up(self, device: torch.device, single_rank: bool) -> None:
        """Compile every kernel variant serving can launch now (graph capture compiled most); __init__ then runs
        the warm-up burst and marks the engine ready."""
        if device.type == "cuda" and single_rank:
            self.runner.warm_up(self.max_model_len)

    @classmethod
    def from_config(cls, config: EngineConfig, scheduler_config: SchedulerConfig | None = None) -> EngineCore:
        from metronome.server.models import load_model  # heavy: only when an engine is built

        config.validate()
        if config.tensor_parallel_size > 1:
            from metronome.server.engine.tp_launch import start_tensor_parallel

            return start_tensor_parallel(cls, config, scheduler_config or SchedulerConfig())
        started = time.perf_counter()
        loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                            attention_backend=config.attention_backend, seed=config.seed, block_size=config.block_size,
                            quantization=config.quantization)
        loaded_at = time.perf_counter()
        log.info("model %s loaded in %.1fs: %s on %s", loaded.name, loaded_at - started,
                 str(loaded.dtype).removeprefix("torch."), loaded.device)
        core = cls(loaded, config, scheduler_config or SchedulerConfig())
        log.info("engine set up in %.1fs: %s", time.perf_counter() - loaded_at, core.startup_summary())
        return core

    @property
    def overlap_mode(self) -> str:
        """Which of MIXED_OVERLAP the engine was set up with ("off" where none can run, e.g. without graphs)."""
        runner = self.runner
        if getattr(runner, "overlap", None) is not None:
            return "on"
        return "pipeline" if getattr(runner, "pipeline", None) is not None else "off"

    def startup_summary(self) -> str:
        """KV cache size, the concurrency it allows at full context, and how steps run (graphs or eager)."""
        bm = self.block_manager
        groups = len(bm.full_groups) or 1  # a full-context sequence holds a block per token in each full group
        tokens = bm.num_blocks * bm.block_size // groups
        windows = (f" ({len(bm.full_groups)} full and {len(bm.window_groups)} sliding-window KV groups of "
                   f"{self.kv_layout.group_size} layers)" if bm.window_groups else "")
        kv_dtype = str(self.runner.kv_caches[0][0].dtype).removeprefix("torch.")
        scales = f", scales {self.kv_scales.source}" if self.kv_scales is not None else ""
        return (f"KV cache {bm.num_blocks} blocks x {bm.block_size} tokens{windows} = {tokens} tokens ({kv_dtype}"
                f"{scales}); max concurrency {tokens / self.max_model_len:.2f} requests of {self.max_model_len} tokens "
                "(max_model_len); "
                f"execution {self.execution_mode}; async scheduling {'on' if self.async_scheduling else 'off'}; "
                f"mixed-step overlap {self.overlap_mode}; "
                f"attention {self.attention_description}"
                + (f"; {self.loaded.quantization.describe()}" if self.loaded.quantization is not None else "")
                + (f"; warm-up burst of {self.warm_batch[0]} sequences in {self.warm_batch[1]} steps, "
                   f"{self.warm_batch[2]:.2f}s" if self.warm_batch[0] else ""))

    @property
    def attention_description(self) -> str:
        """The attention backend ("auto" names its route per batch class)."""
        backend = getattr(self.loaded.model, "attention_backend", None)
        describe = getattr(backend, "describe", None)
        return describe() if describe is not None else str(getattr(backend, "name", backend))

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the engine cannot step afterwards)."""
        if self.workers is not None:
            self.workers.shutdown()

    # --- requests ------------------------------------------------------------------------------------------
    @functools.cached_property
    def limits(self) -> RequestLimits:
        """The request checks (request_limits.py) over this engine's vocabulary, context and KV capacity."""
        return RequestLimits(self.vocab_size, self.max_model_len, self.block_manager.max_admissible_tokens())

    def prepare_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a request and tokenize it; touches no engine state (safe from any thread)."""
        token_ids = self.limits.prepare(prompt, params, self.tokenizer.encode)
        if params.grammar is not None:
            self.check_grammar(params.grammar)
        return token_ids

    def check_grammar(self, grammar) -> None:
        """Compile a grammar into the cache (safe from any thread; the API calls it on a worker thread first, so
        that compiling never holds the event loop); InvalidRequestError when it does not compile."""
        check_grammar(self.grammars, grammar)

    def check_capacity(self) -> None:
        check_waiting(self.scheduler.num_waiting, self.config.max_waiting)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:
        token_ids = self.prepare_request(prompt, params)
        if request_id is not None and request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.check_capacity()
        return self.add_prepared(token_ids, params, request_id, arrival_time)

    def add_prepared(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     arrival_time: float | None = None) -> str:
        """Enqueue an already validated request (see prepare_request)."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        seq = Sequence(request_id, token_ids, params, arrival_time if arrival_time is not None else time.monotonic(),
                       next(self._order))
        if params.seed is not None and not params.is_greedy:
            seq.generator = self.runner.sampler.make_generator(params.seed)
        seq.detokenizer = OutputText(self.tokenizer.incremental_decoder(), params.stop)
        if params.grammar is not None:
            self._matchers[request_id] = self.grammars.matcher(params.grammar)
        if params.changes_logits or params.logprobs is not None:
            self._special.add(request_id)
        if needs_sync(params):
            self._sync_only.add(request_id)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Free the request's blocks (now, or once a step in flight that computes it is read); its finished
        event (reason "abort") comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        seq.drop_pending()  # a token in flight is never emitted
        self._release(seq, "abort")
        self._abort_events.append(TokenEvent(request_id, ABORT_TOKEN_ID, seq.detokenizer.take_delta(True),
                                             seq.num_output_tokens, time.monotonic(), True, "abort",
                                             seq.num_prompt_tokens, seq.num_output_tokens))

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        log.exception("request %s failed while emitting a token; the other requests go on", seq.request_id,
                      exc_info=exc)
        if seq.status is not SequenceStatus.FINISHED:  # it may have failed after its finish freed it
            self._seqs.pop(seq.request_id, None)
            seq.drop_pending()
            self._release(seq, "error")
        self._failures.append((seq.request_id, exc))

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(request id, exception) of requests ended by an error of their own since the last call: the caller
        tells each one's client; nothing else is affected."""
        failures, self._failures = self._failures, []
        return failures

    def abort_all(self) -> list[str]:
        """Abort every request without abort events (the caller reports the failure); returns their ids."""
        self._inflight = None  # a failed step's results are not read; its retired members are freed below
        ids = list(self._seqs)
        for request_id in ids:
            self.abort(request_id)
        for seq in list(self.scheduler.retiring):
            self.scheduler.release(seq)
        self._abort_events.clear()
        return ids

    def reconfigure(self, scheduler_config: SchedulerConfig) -> None:
        """Between steps (this is single-threaded, so now is a step boundary)."""
        self.scheduler.reconfigure(scheduler_config)

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._abort_events) or self._inflight is not None

    @property
    def in_flight(self) -> bool:
        """Whether a launched step's tokens are still to be read (the next step() reads them)."""
        return self._inflight is not None

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> tuple[list[TokenEvent], StepStats]:
        """Schedule and launch the next step, read the tokens of the one before it (async scheduling) or of this
        one (synchronous), and return their events and that step's stats."""
        t0 = time.perf_counter()
        events, self._abort_events = self._abort_events, []
        prev, self._inflight = self._inflight, None
        lookahead = self.async_scheduling and not self._sync_only
        if prev is not None and not lookahead:  # a request needs synchronous steps now: read the step in flight
            return events, self._read(prev, events)  # first; the next call runs synchronously
        batch = self.scheduler.schedule()
        launched = self._launch(batch, prev, t0) if not batch.is_empty else None
        if lookahead:
            self._inflight = launched  # sequences of it that finish when `prev` is read are retired, not freed
        stats = self._read(prev, events) if prev is not None else None
        if launched is not None:
            self.scheduler.complete_step(launched.batch)  # after `prev` is read: new full blocks hash real tokens
            if not lookahead:
                stats = self._read(launched, events)
        if stats is None:  # nothing was read: an idle step, or the first of a lookahead run
            stats = StepStats(duration_s=time.perf_counter() - t0)
            stats.scheduler_overhead_s = stats.duration_s
        if launched is None:
            stats.num_preemptions += len(batch.preempted)
        return events, stats

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None, t0: float) -> _Launched:
        """Prepare, run and sample `batch` without waiting for the device; its sampled tokens become PENDING."""
        stats = StepStats(num_preemptions=len(batch.preempted), num_seqs=batch.num_seqs,
                          num_tokens=batch.num_tokens, num_prefill_tokens=batch.num_prefill_tokens,
                          num_decode_tokens=batch.num_decode_tokens)
        for seq, n in batch.entries:  # prompt tokens computed for the first time (not recompute, not cache hits)
            if seq.num_preemptions == 0 and seq.num_computed_tokens < seq.num_prompt_tokens:
                stats.new_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        inputs = self.runner.prepare(batch, prev.in_flight_tokens() if prev is not None else None)
        stats.cuda_graph = inputs.graph_step is not None
        stats.forward = inputs.kind
        t1 = time.perf_counter()
        logits = self.runner.forward_logits(inputs)
        seqs = inputs.sampling_seqs
        sample = self._sample(logits, seqs) if logits is not None else None
        indices = []
        for seq in seqs:
            tokens = seq.token_ids
            indices.append(len(tokens))
            tokens.append(PENDING)
        stats.scheduler_overhead_s = t1 - t0
        return _Launched(batch, seqs, indices, sample, stats, t0, {seq for seq, _ in batch.entries})

    def _read(self, launched: _Launched, events: list[TokenEvent]) -> StepStats:
        """Wait for a launched step's tokens (only for them), emit them, free what finished before it ran out."""
        sample = launched.sample
        sampled = sample.result() if isinstance(sample, PendingSample) else sample
        t2 = time.perf_counter()
        stats = launched.stats
        if sampled is not None:
            now = time.monotonic()
            short_threshold = self.scheduler.config.short_prompt_threshold
            finished = SequenceStatus.FINISHED
            for seq, index, token, token_logprobs in zip(launched.seqs, launched.indices, sampled.tokens,
                                                         sampled.logprobs):
                if seq.status is not finished:  # else it ended (or was aborted) after this step was scheduled
                    try:
                        events.append(self._emit(seq, index, token, now, stats, short_threshold, token_logprobs))
                    except Exception as exc:  # this request's text or grammar failed: end it, not the batch
                        self._fail(seq, exc)
        for seq in launched.retired:
            self.scheduler.release(seq)
        t3 = time.perf_counter()
        stats.scheduler_overhead_s += t3 - t2
        stats.duration_s = t3 - max(launched.started, self._last_read)  # from the previous read, if later
        self._last_read = t3
        return stats

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> PendingSample | SampleResult:
        """The chosen ids (on their way to the host), or with logprobs, read now. Runs right after the forward was
        launched: the grammar masks of constrained rows are filled on the host meanwhile (grammar.py); penalties
        read each row's token history."""
        params = [s.params for s in seqs]
        generators = [s.generator for s in seqs]
        sampler = self.runner.sampler
        if not self._special:  # nothing to edit or report: no per-row checks on the hot path
            return PendingSample(sampler.choose(logits, params, generators, plain=True))
        mask = None
        if self._matchers:
            rows = [i for i, s in enumerate(seqs) if s.request_id in self._matchers]
            if rows:
                mask = self.grammars.mask(rows, [self._matchers[seqs[i].request_id] for i in rows])
        histories = [(s.token_ids, s.num_prompt_tokens) if s.params.uses_penalties else None for s in seqs] \
            if any(p.uses_penalties for p in params) else None
        if any(p.logprobs is not None for p in params):
            return sampler.sample(logits, params, generators, histories, mask)
        return PendingSample(sampler.choose(logits, params, generators, histories, mask))

    def _emit(self, seq: Sequence, index: int, token: int, now: float, stats: StepStats, short_threshold: int,
              logprobs=None) -> TokenEvent:
        """seq's sampled token at token_ids[index] (a PENDING placeholder; a later one may follow under async
        scheduling). Runs once per generated token between GPU steps: plain attribute reads, no repeated
        properties."""
        seq.token_ids[index] = token
        stats.generated_tokens += 1
        last = seq.last_token_time
        lane = "short" if seq.num_prompt_tokens <= short_threshold else "long"  # metric_names.LANES
        if last is None:
            stats.first_token_latencies_s.append(now - seq.arrival_time)
            stats.first_token_lanes.append(lane)
        else:
            stats.token_gaps_s.append(now - last)
            stats.token_gap_lanes.append(lane)
        seq.last_token_time = now
        matcher = self._matchers.get(seq.request_id)
        grammar_done = matcher is not None and advance(matcher, token)
        num_tokens = index + 1
        reason, text_cut = self._finish_reason(seq, token, num_tokens)
        if reason is None and grammar_done:
            reason = "stop"  # the constrained text is complete
        if reason is not None:
            if not text_cut and seq.detokenizer.flush():  # held-back text may still complete a stop string
                reason = "stop"
            seq.drop_pending()  # the token of a step in flight, if any: that row's output is dropped
            self._finish(seq, reason)
            stats.finished_e2e_s.append(now - seq.arrival_time)
        finished = reason is not None
        num_output = num_tokens - seq.num_prompt_tokens
        return TokenEvent(seq.request_id, token, seq.detokenizer.take_delta(finished), num_output - 1, now, finished,
                          reason, seq.num_prompt_tokens, num_output, logprobs)

    def _finish_reason(self, seq: Sequence, token: int, num_tokens: int) -> tuple[str | None, bool]:
        """(finish reason or None, whether a stop string cut the text); num_tokens: up to this token."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop", False  # the stop token's text is not part of the output
        if seq.detokenizer.push(token):
            return "stop", True
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length", False
        return None, False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._seqs.pop(seq.request_id, None)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        """seq left the engine: its blocks are freed now, or once the step in flight that computes it is read."""
        inflight = self._inflight
        if inflight is not None and seq in inflight.members and seq.status is SequenceStatus.RUNNING:
            self.scheduler.retire(seq)
            inflight.retired.append(seq)
        else:
            self.scheduler.remove(seq)
        self.runner.release(seq)
        self._matchers.pop(seq.request_id, None)
        self._special.discard(seq.request_id)
        self._sync_only.discard(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # --- convenience and introspection ---------------------------------------------------------------------
    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams]
                 ) -> list[GenerationResult]:
        """Run the prompts concurrently to completion; results in prompt order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("one SamplingParams per prompt (or a single one for all)", param="params")
        prepared = [self.prepare_request(p, sp) for p, sp in zip(prompts, params_list)]  # all valid before any runs
        ids = [self.add_prepared(t, sp) for t, sp in zip(prepared, params_list)]
        seqs = {rid: self._seqs[rid] for rid in ids}
        pending = set(ids)
        while pending:
            events, _ = self.step()
            for event in events:
                if event.finished:
                    pending.discard(event.request_id)
        self.drain()
        return [GenerationResult(rid, seqs[rid].prompt_token_ids, seqs[rid].output_token_ids,
                                 seqs[rid].detokenizer.text, seqs[rid].finish_reason) for rid in ids]

    def drain(self) -> list[TokenEvent]:
        """Read the step in flight, if any, launching none: afterwards every finished request's blocks are free."""
        events: list[TokenEvent] = []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._read(prev, events)
        return events

    def live_sequences(self) -> list[Sequence]:
        """The sequences that hold KV blocks (running, and finished ones a step in flight still computes)."""
        return self.scheduler.live_sequences()

    def check_no_leaks(self) -> None:
        self.block_manager.check_no_leaks(self.scheduler.live_sequences())

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.waiting_counts(),
            num_prefilling=sum(1 for seq in self.scheduler.running if seq.is_prefilling),
            kv_usage_ratio=bm.usage_ratio,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_leaked=bm.count_leaked(self.scheduler.live_sequences()),
            preemptions_total=self.scheduler.preemptions_total,
            scheduler=self.scheduler.config,
            execution_mode=self.execution_mode,
            kernel_compiles_after_ready=compile_watch.after_ready(),
            kv_block_size=bm.block_size,
        )
