"""The measurements of `metronome bench engine`, each on an EngineCore (or an AsyncEngine around it).

- decode: build B sequences of `context` tokens through the engine's own prefill, then time steps that are pure
  decode (every sequence has its first token; the step's prefill count is checked to be zero);
- prefill: prompts with max_tokens=1 so every step is pure prefill; tokens/s and FLOP/s;
- long-short: the workload at Poisson rates per chunk size, through AsyncEngine, with per-step host overhead.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from metronome.contract.config import QueuePolicy, SchedulerConfig
from metronome.contract.errors import MetronomeError
from metronome.server.bench.engine import model_math
from metronome.server.bench.engine.gc_pauses import GcPauses
from metronome.server.bench.load.clients import EngineClient
from metronome.server.bench.load.results import RunEntry
from metronome.server.bench.load.runner import LoadPattern, StopRule, run_load
from metronome.server.bench.load.stats import percentile, summarize
from metronome.server.bench.load.workloads import TokenSampler, WorkloadSpec, iter_requests, take

UNCHUNKED = 1 << 20


class EngineBenchError(MetronomeError):
    """A measurement could not be made as specified (too little KV cache, the engine did not progress)."""


def greedy_params(max_tokens: int) -> Any:
    from metronome.server.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(core: Any, request_ids: list[str], max_steps: int = 10_000) -> None:
    """Abort what is left and step until the engine is empty, so the next measurement starts clean."""
    for rid in request_ids:
        core.abort(rid)
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise EngineBenchError("the engine did not empty after aborting the benchmark's requests")


def kv_blocks_usable(core: Any) -> int:
    bm = core.block_manager
    return int(bm.num_blocks * (1.0 - getattr(core.config, "watermark", 0.0)))


def kv_blocks_needed(core: Any, sequences: int, num_tokens: int, step_tokens: int) -> int:
    """Blocks `sequences` sequences of num_tokens tokens hold (sliding-window layers: a window and a step)."""
    return sequences * core.block_manager.blocks_held(num_tokens, step_tokens)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# --- decode ----------------------------------------------------------------------------------------------------


def decode_point(core: Any, batch: int, context: int, steps: int, sampler: TokenSampler, seed: int,
                 prefill_chunk: int, bandwidth: float | None, dtype_bytes: int | model_math.ByteWidths,
                 warmup_steps: int = 3) -> dict:
    prefill_steps = math.ceil(batch * context / prefill_chunk) + batch + 2  # worst case: one admission per step
    max_tokens = prefill_steps + warmup_steps + steps + 4
    need = kv_blocks_needed(core, batch, context + max_tokens, prefill_chunk)
    if context + max_tokens > core.max_model_len:
        return {"batch": batch, "skipped": f"context {context} + {max_tokens} tokens exceeds max_model_len "
                                           f"{core.max_model_len}"}
    if need > kv_blocks_usable(core):
        return {"batch": batch, "skipped": f"the KV cache has {kv_blocks_usable(core)} usable blocks; this point needs "
                                           f"{need} (raise --gpu-memory-utilization or --kv-cache-memory-gb)"}
    core.reconfigure(SchedulerConfig(chunk_size=prefill_chunk, max_num_seqs=max(batch, 1),
                                     queue_policy=QueuePolicy.FCFS))
    rng = random.Random(f"metronome-decode-{seed}-{batch}")
    ids = [core.add_request(list(sampler.sample(context, rng)), greedy_params(max_tokens)) for _ in range(batch)]
    generated = dict.fromkeys(ids, 0)

    def step() -> Any:
        events, stats = core.step()
        for event in events:
            if event.token_id >= 0 and event.request_id in generated:
                generated[event.request_id] += 1
        return stats

    try:
        for _ in range(prefill_steps):
            if all(generated.values()):
                break
            step()
        if not all(generated.values()):
            raise EngineBenchError(f"decode batch {batch}: prefill of {batch} x {context} tokens did not finish "
                                   f"in {prefill_steps} steps")
        for _ in range(warmup_steps):
            step()
        wall, overhead, kv_tokens, kv_bytes, mixed, graph_steps = [], [], [], [], 0, 0
        config = core.loaded.config
        for _ in range(steps):
            kv_tokens.append(sum(context + g for g in generated.values()))
            # per sequence and layer: its context, or its window on a sliding-window layer
            kv_bytes.append(sum(model_math.kv_bytes_read(config, dtype_bytes, context + g) for g in generated.values()))
            t0 = time.perf_counter()
            stats = step()
            wall.append(time.perf_counter() - t0)
            overhead.append(stats.scheduler_overhead_s)
            if stats.num_prefill_tokens or stats.num_decode_tokens != batch:
                mixed += 1
            graph_steps += bool(getattr(stats, "cuda_graph", False))
    finally:
        drain(core, ids)
    median = statistics.median(wall)
    result: dict[str, Any] = {
        "batch": batch, "context": context, "steps": steps, "step_ms_median": median * 1000,
        "step_ms_p90": _ms(percentile(wall, 90)), "step_ms_min": min(wall) * 1000,
        "tokens_per_s": batch / median, "scheduler_overhead_ms_median": statistics.median(overhead) * 1000,
        "scheduler_overhead_share": statistics.median(o / w for o, w in zip(overhead, wall)),
        "kv_tokens_read_median": statistics.median(kv_tokens), "non_decode_steps": mixed,
        "cuda_graph_steps": graph_steps,
    }
    floor_bytes = model_math.weights_read_per_decode_step(config, dtype_bytes, batch) + int(
        statistics.median(kv_bytes))
    result["floor_bytes"] = floor_bytes
    if bandwidth:
        floor_s = floor_bytes / bandwidth
        result["floor_ms"] = floor_s * 1000
        result["ratio_to_floor"] = median / floor_s
    return result


def decode_section(core: Any, batch_sizes: list[int], context: int, steps: int, sampler: TokenSampler, seed: int,
                   prefill_chunk: int, bandwidth: float | None, dtype_bytes: int | model_math.ByteWidths) -> list[dict]:
    return [decode_point(core, b, context, steps, sampler, seed, prefill_chunk, bandwidth, dtype_bytes)
            for b in batch_sizes]


# --- prefill ---------------------------------------------------------------------------------------------------


def _prefill_once(core: Any, prompt_len: int, prompts: int, sampler: TokenSampler, rng: random.Random,
                  max_steps: int) -> tuple[int, float, list[float]]:
    ids = [core.add_request(list(sampler.sample(prompt_len, rng)), greedy_params(1)) for _ in range(prompts)]
    tokens, seconds, overhead = 0, 0.0, []
    try:
        for _ in range(max_steps):
            if not core.has_unfinished():
                break
            t0 = time.perf_counter()
            _, stats = core.step()
            elapsed = time.perf_counter() - t0
            if stats.num_prefill_tokens:
                tokens += stats.num_prefill_tokens
                seconds += elapsed
                overhead.append(stats.scheduler_overhead_s / elapsed if elapsed else 0.0)
    finally:
        drain(core, ids)
    return tokens, seconds, overhead


def prefill_section(core: Any, prompt_len: int, prompts: int, chunk: int, sampler: TokenSampler, seed: int,
                    matmul_tflops: float | None) -> dict:
    if prompt_len + 1 > core.max_model_len:
        raise EngineBenchError(f"prefill prompt of {prompt_len} tokens exceeds max_model_len {core.max_model_len}")
    need = kv_blocks_needed(core, prompts, prompt_len + 1, chunk)
    if need > kv_blocks_usable(core):
        raise EngineBenchError(f"the KV cache has {kv_blocks_usable(core)} usable blocks; the prefill test needs "
                               f"{need}")
    core.reconfigure(SchedulerConfig(chunk_size=chunk, max_num_seqs=max(prompts, 1),
                                     queue_policy=QueuePolicy.FCFS))
    max_steps = 4 * (math.ceil(prompts * prompt_len / chunk) + prompts) + 10
    rng = random.Random(f"metronome-prefill-{seed}")
    _prefill_once(core, prompt_len, min(prompts, 2), sampler, rng, max_steps)  # warm-up: compile, allocator
    tokens, seconds, overhead = _prefill_once(core, prompt_len, prompts, sampler, rng, max_steps)
    if tokens != prompts * prompt_len or seconds <= 0:
        raise EngineBenchError(f"prefill computed {tokens} of {prompts * prompt_len} prompt tokens")
    flops = model_math.prefill_flops(core.loaded.config, [prompt_len] * prompts)
    result = {"prompt_len": prompt_len, "prompts": prompts, "chunk_size": chunk, "tokens": tokens,
              "seconds": seconds, "tokens_per_s": tokens / seconds, "flops": flops,
              "achieved_tflops": flops / seconds / 1e12,
              "scheduler_overhead_share": statistics.median(overhead) if overhead else None}
    if matmul_tflops:
        result["share_of_matmul_peak"] = result["achieved_tflops"] / matmul_tflops
    return result


# --- long-short under load -------------------------------------------------------------------------------------


@dataclass
class StepCollector:
    """An EngineObserver that keeps every non-empty step's timing (called on the engine thread), and the garbage
    collector's pauses between collector.gc.start() and stop()."""

    steps: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    gc: GcPauses = field(default_factory=GcPauses)

    def on_step(self, step: Any, stats: Any) -> None:
        if step.num_tokens:
            self.steps.append((step.duration_s, step.scheduler_overhead_s, step.num_tokens, step.num_preemptions,
                               len(step.token_gaps_s)))

    def on_rejected(self, reason: str) -> None:
        pass

    def reset(self) -> None:
        self.steps = []
        self.gc.reset()

    def summary(self) -> dict[str, Any]:
        steps = list(self.steps)
        if not steps:
            return {"steps": 0}
        durations = [s[0] for s in steps]
        total = sum(durations)
        # The step time a token gap waits, weighted by the gaps each step closes: TBT p99 equals this p99 when no
        # token waits more than one step, and the step p99 (one vote per step) can sit far below it when a few
        # slow steps carry many decodes.
        per_gap = [s[0] for s in steps for _ in range(s[4])]
        return {"steps": len(steps), "step_ms_median": statistics.median(durations) * 1000,
                "step_ms_p99": _ms(percentile(durations, 99)), "step_ms_max": max(durations) * 1000,
                "step_ms_p99_per_gap": _ms(percentile(per_gap, 99)) if per_gap else None,
                "tokens_per_step_mean": sum(s[2] for s in steps) / len(steps),
                "scheduler_overhead_share": sum(s[1] for s in steps) / total if total else None,
                "preemptions": sum(s[3] for s in steps), "gc_pauses": self.gc.summary()}


def chunk_label(chunk: int) -> str:
    return "unchunked" if chunk >= UNCHUNKED else str(chunk)


async def longshort_section(core: Any, spec: WorkloadSpec, sampler: TokenSampler, chunk_sizes: list[int],
                            rates: list[float], policy: str, max_num_seqs: int, stop: StopRule, seed: int,
                            slo_tbt_ms: float, progress: bool, batch_requests: int | None,
                            batch_chunks: list[int], warmup_requests: int = 16,
                            overlap_variants: list[str] | None = None) -> tuple[list[RunEntry], list[RunEntry]]:
    """Runs per (chunk, rate); plus, if batch_requests, the same first N requests sent at once (the batch that
    the transformers peer also gets), once per chunk size in batch_chunks. overlap_variants ("off", "on"): each
    (chunk, rate) runs once per variant, one right after the other, the engine's mixed-step overlap switched
    between runs (the engine must have been built with it)."""
    from metronome.server.engine.async_engine import AsyncEngine
    from metronome.server.engine.serving_process import freeze_startup_heap

    collector = StepCollector()
    engine = AsyncEngine(core, observers=[collector])
    client = EngineClient(engine)
    runs: list[RunEntry] = []
    batch_entries: list[RunEntry] = []
    async def warm_up(count: int) -> None:
        """Unmeasured requests at once, with other prompts: kernels compile for the shapes this chunk size makes
        (a compile inside a measured run would show up as a one-second TBT stall)."""
        if count:
            await run_load(client, iter_requests(spec, sampler, seed + 1_000_003), LoadPattern(rate=math.inf),
                           StopRule(num_requests=count, drain_timeout_s=stop.drain_timeout_s))

    await engine.start()
    try:
        collector.gc.start()
        for chunk in chunk_sizes:
            engine.reconfigure(SchedulerConfig(chunk_size=chunk, queue_policy=policy, max_num_seqs=max_num_seqs))
            await warm_up(warmup_requests)
            for rate in sorted(rates):
                for variant in overlap_variants or [None]:
                    if variant is not None:
                        set_mixed_overlap(core, variant)
                    freeze_startup_heap()  # earlier runs' records are not walked by this run's collections
                    collector.reset()
                    label = f"chunk {chunk_label(chunk)} @ {rate:g} req/s"
                    if variant is not None:
                        label += f", overlap {variant}"
                    result = await run_load(client, iter_requests(spec, sampler, seed), LoadPattern(rate=rate), stop,
                                            seed=seed, progress=progress, label=label)
                    params = {"chunk_size": chunk, "queue_policy": policy, "rate": rate,
                              "steps": collector.summary(), "scheduler": engine.stats().scheduler.snake_dict()}
                    if variant is not None:
                        params["mixed_overlap"] = variant
                    runs.append(RunEntry(label, params, summarize(result.records, slo_tbt_ms), result.records,
                                         result.started_at, result.wall_s))
        for batch_chunk in batch_chunks if batch_requests else []:
            engine.reconfigure(SchedulerConfig(chunk_size=batch_chunk, queue_policy=policy,
                                               max_num_seqs=max_num_seqs))
            await warm_up(warmup_requests)
            collector.reset()
            requests = take(iter_requests(spec, sampler, seed), batch_requests)
            label = f"batch of {len(requests)} at once, chunk {chunk_label(batch_chunk)}"
            result = await run_load(client, iter(requests), LoadPattern(rate=math.inf),
                                    StopRule(num_requests=len(requests), drain_timeout_s=stop.drain_timeout_s,
                                             request_timeout_s=stop.request_timeout_s),
                                    seed=seed, progress=progress, label=label)
            params = {"chunk_size": batch_chunk, "queue_policy": policy, "rate": math.inf,
                      "steps": collector.summary()}
            batch_entries.append(RunEntry(label, params, summarize(result.records, slo_tbt_ms), result.records,
                                          result.started_at, result.wall_s))
    finally:
        collector.gc.stop()
        await engine.shutdown()
    return runs, batch_entries


def set_mixed_overlap(core: Any, variant: str) -> None:
    """Switch the engine's mixed-step overlap ("on" or "pipeline") on or off between runs (its graphs were
    captured at start)."""
    switches = {"on": getattr(core.runner, "overlap", None), "pipeline": getattr(core.runner, "pipeline", None)}
    if variant != "off" and switches[variant] is None:
        raise EngineBenchError(f"the {variant} variant needs an engine started with --mixed-overlap {variant}")
    for mode, switch in switches.items():
        if switch is not None:
            switch.enabled = mode == variant


def overlap_comparison(runs: list[RunEntry]) -> list[dict[str, Any]]:
    """Per (chunk, rate) run with the overlap off and on (`mode`: "on" or "pipeline"; the `_on` fields are its):
    TBT p99 and output tokens/s of each, the p99's drop (a share of off's) and the throughput's change. Pure."""
    pairs: dict[tuple[int, float], dict[str, RunEntry]] = {}
    for run in runs:
        variant = run.params.get("mixed_overlap")
        if variant is not None:
            pairs.setdefault((run.params["chunk_size"], run.params["rate"]), {})[variant] = run
    rows = []
    for (chunk, rate), pair in sorted(pairs.items()):
        modes = sorted(set(pair) - {"off"})
        if "off" not in pair or len(modes) != 1:
            continue
        off, on = pair["off"].summary, pair[modes[0]].summary
        p99_off, p99_on = off.tbt.p99_ms, on.tbt.p99_ms
        rows.append({
            "chunk_size": chunk, "rate": rate, "mode": modes[0], "tbt_p99_ms_off": p99_off, "tbt_p99_ms_on": p99_on,
            "tbt_p99_reduction": 1 - p99_on / p99_off if p99_off and p99_on is not None else None,
            "output_tokens_per_s_off": off.output_tokens_per_s, "output_tokens_per_s_on": on.output_tokens_per_s,
            "throughput_change": (on.output_tokens_per_s / off.output_tokens_per_s - 1
                                  if off.output_tokens_per_s else None),
            "completed": (off.num_completed == off.num_requests, on.num_completed == on.num_requests)})
    return rows


def capacity_table(runs: list[RunEntry], slo_tbt_ms: float) -> list[dict[str, Any]]:
    """Per chunk size (and mixed-overlap variant, where runs have one): capacity (highest rate with every request
    done and TBT p99 <= SLO), best throughput."""
    by_chunk: dict[tuple[int, str | None], list[RunEntry]] = {}
    for run in runs:
        by_chunk.setdefault((run.params["chunk_size"], run.params.get("mixed_overlap")), []).append(run)
    rows = []
    for (chunk, variant), members in by_chunk.items():
        members.sort(key=lambda r: r.params["rate"])
        passing = [r for r in members if r.summary.num_completed == r.summary.num_requests
                   and r.summary.tbt.p99_ms is not None and r.summary.tbt.p99_ms <= slo_tbt_ms]
        top = members[-1]
        rows.append({
            "chunk_size": chunk, "label": chunk_label(chunk) + (f", overlap {variant}" if variant else ""),
            "capacity_rate": max((r.params["rate"] for r in passing), default=None),
            "max_output_tokens_per_s": max(r.summary.output_tokens_per_s for r in members),
            "highest_rate": top.params["rate"], "tbt_p99_ms_at_highest_rate": top.summary.tbt.p99_ms,
            "ttft_p99_ms_at_highest_rate": top.summary.ttft.p99_ms,
            **({"mixed_overlap": variant} if variant else {}),
        })
    unchunked = next((r for r in rows if r["chunk_size"] >= UNCHUNKED), None)
    for row in rows:
        if unchunked is None or row is unchunked:
            continue
        base_tput = unchunked["max_output_tokens_per_s"]
        row["throughput_cost_vs_unchunked"] = 1 - row["max_output_tokens_per_s"] / base_tput if base_tput else None
        base_cap, cap = unchunked["capacity_rate"], row["capacity_rate"]
        if cap is None:
            row["capacity_ratio_vs_unchunked"] = 0.0 if base_cap else None
        else:
            row["capacity_ratio_vs_unchunked"] = cap / base_cap if base_cap else None
            if not base_cap:
                row["note"] = "unchunked met the SLO at no tested rate: the ratio is unbounded"
    return rows
