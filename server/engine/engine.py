"""The synchronous engine core: requests in, one step at a time, token events out. Single-threaded; the
AsyncEngine runs it on a background thread."""
from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import EngineOverloadedError, InvalidRequestError
from metronome.kernels import compile_watch
from metronome.server.engine.block_manager import BlockManager
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.grammar import Grammars, advance
from metronome.server.engine.kv_cache import bytes_per_block, plan_num_blocks
from metronome.server.engine.model_runner import ModelRunner
from metronome.server.engine.output_text import OutputText
from metronome.server.engine.outputs import EngineStats, GenerationResult, StepStats, TokenEvent
from metronome.server.engine.sampling import SamplingParams
from metronome.server.engine.scheduler import Scheduler
from metronome.server.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from metronome.server.engine.tp_launch import WorkerPool

ABORT_TOKEN_ID = -1
log = logging.getLogger("metronome.engine")


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
        dtype = loaded.dtype if isinstance(loaded.dtype, torch.dtype) else getattr(torch, str(loaded.dtype))
        kv_heads = model_config.num_key_value_heads if workers is None else workers.kv_heads_per_rank
        per_block = bytes_per_block(model_config.num_hidden_layers, config.block_size,
                                    kv_heads, model_config.head_dim, dtype)
        num_blocks = plan_num_blocks(config, per_block, device)
        if workers is not None:
            num_blocks = workers.agree_num_blocks(num_blocks)  # every rank allocates the same cache
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.watermark)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        runner_class = ModelRunner if workers is None else workers.runner_class
        self.runner = runner_class(loaded.model, model_config.num_hidden_layers, kv_heads,
                                   model_config.head_dim, num_blocks, config.block_size, self.max_model_len, dtype,
                                   device, seed=config.seed)
        if device.type == "cuda":
            compile_watch.install()  # before the first kernel: start-up compiles are counted too
        # "cuda_graphs" (decode steps replay captured graphs) or "eager: <why>"; reported in stats().
        self.execution_mode = "eager: cuda_graphs disabled in the engine config"
        if workers is not None:
            self.execution_mode = "eager: tensor parallel (graphs are not captured across ranks)"
        elif config.cuda_graphs:
            self.execution_mode = self.runner.setup_cuda_graphs(scheduler_config.max_num_seqs, self.max_model_len)
        self._warm_up(device, workers is None)
        self.eos_token_ids = frozenset(model_config.eos_token_ids) | frozenset(self.tokenizer.eos_token_ids or ())
        # Constrained decoding (response_format): llguidance's tokenizer is built on a background thread now.
        self.grammars = Grammars(self.tokenizer, self.vocab_size, list(self.eos_token_ids), device) \
            if Grammars.available() else None
        self._matchers: dict[str, Any] = {}  # request id -> its grammar matcher
        self._special: set[str] = set()  # live requests that edit logits or want logprobs (else: the plain path)
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self._abort_events: list[TokenEvent] = []

    def _warm_up(self, device: torch.device, single_rank: bool) -> None:
        """Compile every kernel variant serving can launch now (graph capture compiled most), then mark the
        engine ready: any compile after this is a stall, counted in stats().kernel_compiles_after_ready."""
        if device.type == "cuda" and single_rank:
            self.runner.warm_up(self.max_model_len)
        compile_watch.mark_ready()

    @classmethod
    def from_config(cls, config: EngineConfig, scheduler_config: SchedulerConfig | None = None) -> EngineCore:
        from metronome.server.models import load_model  # heavy: only when an engine is built

        config.validate()
        if config.tensor_parallel_size > 1:
            from metronome.server.engine.tp_launch import start_tensor_parallel

            return start_tensor_parallel(cls, config, scheduler_config or SchedulerConfig())
        started = time.perf_counter()
        loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                            attention_backend=config.attention_backend, seed=config.seed, block_size=config.block_size)
        loaded_at = time.perf_counter()
        log.info("model %s loaded in %.1fs: %s on %s", loaded.name, loaded_at - started,
                 str(loaded.dtype).removeprefix("torch."), loaded.device)
        core = cls(loaded, config, scheduler_config or SchedulerConfig())
        log.info("engine set up in %.1fs: %s", time.perf_counter() - loaded_at, core.startup_summary())
        return core

    def startup_summary(self) -> str:
        """KV cache size, the concurrency it allows at full context, and how steps run (graphs or eager)."""
        bm = self.block_manager
        tokens = bm.num_blocks * bm.block_size
        return (f"KV cache {bm.num_blocks} blocks x {bm.block_size} tokens = {tokens} tokens; max concurrency "
                f"{tokens / self.max_model_len:.2f} requests of {self.max_model_len} tokens (max_model_len); "
                f"execution {self.execution_mode}")

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent; the engine cannot step afterwards)."""
        if self.workers is not None:
            self.workers.shutdown()

    # --- requests ------------------------------------------------------------------------------------------
    def prepare_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Validate a request and tokenize it; touches no engine state (safe from any thread)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling params must be a SamplingParams", param="params")
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            token_ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                   or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.vocab_size}); got {bad[0]!r}", param="prompt")
        else:
            raise InvalidRequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                                      param="prompt")
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                "(the prompt must leave room for at least one generated token)", param="prompt")
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens", param="max_tokens")
        capacity = self.block_manager.max_admissible_tokens()
        if n + params.max_tokens > capacity:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache capacity of "
                f"{capacity} tokens for one request", param="prompt" if n > capacity else "max_tokens")
        self._check_extras(params)
        return token_ids

    def _check_extras(self, params: SamplingParams) -> None:
        """What depends on the model: logit_bias ids inside the vocabulary, a grammar that compiles."""
        bad = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary of {self.vocab_size}",
                                      param="logit_bias")
        if params.grammar is not None:
            self.check_grammar(params.grammar)

    def check_grammar(self, grammar) -> None:
        """Compile a grammar into the cache (safe from any thread; the API calls it on a worker thread first, so
        that compiling never holds the event loop); InvalidRequestError when it does not compile."""
        if self.grammars is None:
            raise InvalidRequestError("constrained decoding needs the llguidance package (the server extra)",
                                      param="response_format")
        self.grammars.check(grammar)

    def check_capacity(self) -> None:
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise EngineOverloadedError(
                f"engine overloaded: {self.scheduler.num_waiting} requests waiting (max_waiting "
                f"{self.config.max_waiting}); retry later")

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
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its finished event (reason "abort") comes with the next step."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self.scheduler.remove(seq)
        self.runner.release(seq)
        self._matchers.pop(request_id, None)
        self._special.discard(request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        self._abort_events.append(TokenEvent(request_id, ABORT_TOKEN_ID, seq.detokenizer.take_delta(True),
                                             seq.num_output_tokens, time.monotonic(), True, "abort",
                                             seq.num_prompt_tokens, seq.num_output_tokens))

    def abort_all(self) -> list[str]:
        """Abort every request without abort events (the caller reports the failure); returns their ids."""
        ids = list(self._seqs)
        for request_id in ids:
            self.abort(request_id)
        self._abort_events.clear()
        return ids

    def reconfigure(self, scheduler_config: SchedulerConfig) -> None:
        """Between steps (this is single-threaded, so now is a step boundary)."""
        self.scheduler.reconfigure(scheduler_config)

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._abort_events)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> tuple[list[TokenEvent], StepStats]:
        t0 = time.perf_counter()
        events, self._abort_events = self._abort_events, []
        batch = self.scheduler.schedule()
        stats = StepStats(num_preemptions=len(batch.preempted), num_seqs=batch.num_seqs,
                          num_tokens=batch.num_tokens, num_prefill_tokens=batch.num_prefill_tokens,
                          num_decode_tokens=batch.num_decode_tokens)
        if batch.is_empty:
            stats.duration_s = stats.scheduler_overhead_s = time.perf_counter() - t0
            return events, stats
        for seq, n in batch.entries:  # prompt tokens computed for the first time (not recompute, not cache hits)
            if seq.num_preemptions == 0 and seq.num_computed_tokens < seq.num_prompt_tokens:
                stats.new_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
        inputs = self.runner.prepare(batch)
        stats.cuda_graph = inputs.graph_step is not None
        stats.forward = inputs.kind
        t1 = time.perf_counter()
        logits = self.runner.forward_logits(inputs)
        seqs = inputs.sampling_seqs
        sampled = self._sample(logits, seqs) if logits is not None else None
        tokens = sampled.tokens if sampled is not None else []
        logprobs = sampled.logprobs if sampled is not None else []
        t2 = time.perf_counter()
        self.scheduler.complete_step(batch)
        now = time.monotonic()
        short_threshold = self.scheduler.config.short_prompt_threshold
        for seq, token, token_logprobs in zip(seqs, tokens, logprobs):
            events.append(self._emit(seq, token, now, stats, short_threshold, token_logprobs))
        t3 = time.perf_counter()
        stats.duration_s = t3 - t0
        stats.scheduler_overhead_s = (t1 - t0) + (t3 - t2)
        return events, stats

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """The chosen ids. Runs right after the forward was launched: the grammar masks of constrained rows are
        filled on the host meanwhile (grammar.py); penalties read each row's token history."""
        params = [s.params for s in seqs]
        generators = [s.generator for s in seqs]
        if not self._special:  # nothing to edit or report: no per-row checks on the hot path
            return self.runner.sampler.sample(logits, params, generators, plain=True)
        mask = None
        if self._matchers:
            rows = [i for i, s in enumerate(seqs) if s.request_id in self._matchers]
            if rows:
                mask = self.grammars.mask(rows, [self._matchers[seqs[i].request_id] for i in rows])
        histories = [(s.token_ids, s.num_prompt_tokens) if s.params.uses_penalties else None for s in seqs] \
            if any(p.uses_penalties for p in params) else None
        return self.runner.sampler.sample(logits, params, generators, histories, mask)

    def _emit(self, seq: Sequence, token: int, now: float, stats: StepStats, short_threshold: int,
              logprobs=None) -> TokenEvent:
        # Runs once per generated token between GPU steps: plain attribute reads, no repeated properties.
        seq.token_ids.append(token)
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
        reason, text_cut = self._finish_reason(seq, token)
        if reason is None and grammar_done:
            reason = "stop"  # the constrained text is complete
        if reason is not None:
            if not text_cut and seq.detokenizer.flush():  # held-back text may still complete a stop string
                reason = "stop"
            self._finish(seq, reason)
            stats.finished_e2e_s.append(now - seq.arrival_time)
        finished = reason is not None
        num_output = len(seq.token_ids) - seq.num_prompt_tokens
        return TokenEvent(seq.request_id, token, seq.detokenizer.take_delta(finished), num_output - 1, now, finished,
                          reason, seq.num_prompt_tokens, num_output, logprobs)

    def _finish_reason(self, seq: Sequence, token: int) -> tuple[str | None, bool]:
        """(finish reason or None, whether a stop string cut the text)."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop", False  # the stop token's text is not part of the output
        if seq.detokenizer.push(token):
            return "stop", True
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length", False
        return None, False

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        self.runner.release(seq)
        self._matchers.pop(seq.request_id, None)
        self._special.discard(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)

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
        return [GenerationResult(rid, seqs[rid].prompt_token_ids, seqs[rid].output_token_ids,
                                 seqs[rid].detokenizer.text, seqs[rid].finish_reason) for rid in ids]

    def live_sequences(self) -> list[Sequence]:
        return self.scheduler.live_sequences()

    def check_no_leaks(self) -> None:
        self.block_manager.check_no_leaks(self.scheduler.live_sequences())

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.waiting_counts(),
            kv_usage_ratio=bm.usage_ratio,
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_leaked=bm.count_leaked(self.scheduler.live_sequences()),
            preemptions_total=self.scheduler.preemptions_total,
            scheduler=self.scheduler.config,
            execution_mode=self.execution_mode,
            kernel_compiles_after_ready=compile_watch.after_ready(),
        )
