"""`bench engine --sections saturation`: output tokens/s with the KV cache full, against the HBM floor.

N requests of `prompt_len` random tokens, each generating exactly `output_len` tokens (greedy, eos ignored),
are submitted at once; N is as many as the KV cache holds whole (prompt + output, in blocks, the admission
watermark left free), capped by a flag. Every engine step is timed on the host: it returns once its tokens are
on the host (under async scheduling, the tokens and stats of the step before, so each call lasts one step
period). The steps after the last prompt chunk are pure decode: their output tokens/s is compared with its
floor, batch ÷ ((weight bytes + KV bytes the step reads) ÷ measured copy bandwidth), from the mean batch and
the mean KV tokens read per step (Σ tokens ÷ Σ floor time over those steps, exactly). The whole run's tokens/s
(prefill included) is reported beside it. Steps are counted by how their forward ran (decode CUDA graph,
piecewise graphs, eager): a decode batch above the largest captured graph size does not replay a decode graph.
"""
from __future__ import annotations

import math
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from metronome.contract.config import QueuePolicy, SchedulerConfig
from metronome.server.bench.engine import model_math
from metronome.server.bench.engine.sections import EngineBenchError, drain, greedy_params
from metronome.server.bench.load.workloads import TokenSampler

FORWARD_KINDS = ("graph", "piecewise", "overlap", "eager")


@dataclass(frozen=True)
class SatStep:
    """One timed engine step of the saturation run."""

    seconds: float
    prefill_tokens: int
    decode_tokens: int
    output_tokens: int  # tokens emitted (a prompt's first token or a decode's next one)
    kv_tokens_read: float  # context tokens the step's decodes attended over (a window layer counts its window)
    forward: str  # "graph" | "piecewise" | "overlap" | "eager"
    preemptions: int = 0


def requests_that_fit(usable_blocks: int, block_size: int, prompt_len: int, output_len: int,
                      blocks_per_request: int | None = None) -> int:
    """How many requests of prompt_len + output_len tokens the cache holds at once, each in whole blocks (in every
    KV group: blocks_per_request, from BlockManager.blocks_held, where the model has sliding-window groups)."""
    return usable_blocks // (blocks_per_request or math.ceil((prompt_len + output_len) / block_size))


def plan_requests(usable_blocks: int, block_size: int, prompt_len: int, output_len: int, cap: int,
                  blocks_per_request: int | None = None) -> int:
    fit = requests_that_fit(usable_blocks, block_size, prompt_len, output_len, blocks_per_request)
    if fit < 1:
        raise EngineBenchError(f"the KV cache ({usable_blocks} usable blocks of {block_size} tokens) cannot hold one "
                               f"request of {prompt_len} + {output_len} tokens: lower --saturation-prompt-len / "
                               "--saturation-output-len or raise --gpu-memory-utilization")
    return min(fit, cap)


def _forward_counts(steps: list[SatStep]) -> dict[str, int]:
    counts = Counter(s.forward for s in steps)
    return {kind: counts.get(kind, 0) for kind in FORWARD_KINDS}


def summarize(steps: list[SatStep], weight_bytes: int, kv_bytes_per_token: int, bandwidth: float | None,
              decode_graph_max_batch: int | None, execution_mode: str = "") -> dict[str, Any]:
    """The whole run and its pure-decode part against the floor; notes where decode steps ran without graphs. Pure."""
    wall = sum(s.seconds for s in steps)
    out = sum(s.output_tokens for s in steps)
    whole = {"steps": len(steps), "seconds": wall, "output_tokens": out,
             "output_tokens_per_s": out / wall if wall else None,
             "prefill_steps": sum(1 for s in steps if s.prefill_tokens),
             "prefill_tokens": sum(s.prefill_tokens for s in steps),
             "preemptions": sum(s.preemptions for s in steps), "forward": _forward_counts(steps)}
    decode = [s for s in steps if not s.prefill_tokens and s.decode_tokens]
    result: dict[str, Any] = {"whole_run": whole, "decode_part": {"steps": 0}, "notes": []}
    if not decode:
        result["notes"].append("no pure-decode step: the run never got past its prompts")
        return result
    seconds = sum(s.seconds for s in decode)
    tokens = sum(s.output_tokens for s in decode)
    # The batch is the tokens a step emitted: under async scheduling a step may also carry rows of sequences that
    # finished the step before, whose outputs are dropped (counted in decode_tokens, not emitted, no KV counted).
    mean_batch = tokens / len(decode)
    mean_kv = sum(s.kv_tokens_read for s in decode) / len(decode)
    part: dict[str, Any] = {
        "steps": len(decode), "seconds": seconds, "output_tokens": tokens, "output_tokens_per_s": tokens / seconds,
        "mean_batch": mean_batch, "max_batch": max(s.output_tokens for s in decode),
        "mean_scheduled_decodes": sum(s.decode_tokens for s in decode) / len(decode), "mean_kv_tokens_read": mean_kv,
        "step_ms_median": statistics.median(s.seconds for s in decode) * 1000, "forward": _forward_counts(decode),
        "floor_bytes_per_step": weight_bytes + kv_bytes_per_token * mean_kv,
    }
    if bandwidth:
        floor = model_math.decode_floor_tokens_per_s(weight_bytes, kv_bytes_per_token, mean_batch, mean_kv,
                                                     bandwidth)
        part.update({"floor_step_ms": part["floor_bytes_per_step"] / bandwidth * 1000, "floor_tokens_per_s": floor,
                     "ratio_to_floor": floor / part["output_tokens_per_s"],  # step time / floor time, as decode's
                     "share_of_floor": part["output_tokens_per_s"] / floor})
    result["decode_part"] = part
    counts = part["forward"]
    not_graph = counts["piecewise"] + counts["overlap"] + counts["eager"]
    if not_graph:
        where = (f"no decode graph was captured: {execution_mode or 'eager'}" if decode_graph_max_batch is None
                 else f"decode graphs are captured for batches up to {decode_graph_max_batch}")
        result["notes"].append(f"{not_graph} of {len(decode)} decode steps did not replay a decode CUDA graph "
                               f"({counts['piecewise']} piecewise, {counts['eager']} eager; {where}; the largest "
                               f"decode batch was {part['max_batch']})")
    return result


def _graph_limits(core: Any) -> tuple[int | None, int | None]:
    runner = getattr(core, "runner", None)
    graphs, pieces = getattr(runner, "graphs", None), getattr(runner, "pieces", None)
    return (graphs.max_size if graphs is not None else None,
            pieces.max_tokens if pieces is not None else None)


def run_requests(core: Any, prompts: list[list[int]], output_len: int, max_steps: int) -> tuple[list[SatStep],
                                                                                               list[int]]:
    """Submit every prompt at once and step until all finish; the timed steps and each request's token count."""
    config = core.loaded.config
    ids = [core.add_request(prompt, greedy_params(output_len)) for prompt in prompts]
    prompt_len = dict(zip(ids, (len(p) for p in prompts)))
    generated = dict.fromkeys(ids, 0)
    steps: list[SatStep] = []
    try:
        for _ in range(max_steps):
            if not core.has_unfinished():
                break
            t0 = time.perf_counter()
            events, stats = core.step()
            seconds = time.perf_counter() - t0
            emitted, kv = 0, 0
            for event in events:
                if event.token_id < 0 or event.request_id not in generated:
                    continue
                before = generated[event.request_id]
                if before:  # a decode: it attended over the prompt and every token generated before this one
                    kv += model_math.effective_kv_tokens(config, prompt_len[event.request_id] + before)
                generated[event.request_id] = before + 1
                emitted += 1
            steps.append(SatStep(seconds, stats.num_prefill_tokens, stats.num_decode_tokens, emitted, kv,
                                 getattr(stats, "forward", "eager"), stats.num_preemptions))
        if core.has_unfinished():
            raise EngineBenchError(f"saturation: {len(prompts)} requests did not finish in {max_steps} steps")
    finally:
        drain(core, ids)
    return steps, [generated[i] for i in ids]


def saturation_section(core: Any, prompt_len: int, output_len: int, max_requests: int, chunk: int,
                       sampler: TokenSampler, seed: int, bandwidth: float | None,
                       dtype_bytes: int | model_math.ByteWidths) -> dict[str, Any]:
    if prompt_len + output_len > core.max_model_len:
        raise EngineBenchError(f"--saturation-prompt-len {prompt_len} + --saturation-output-len {output_len} exceeds "
                               f"max_model_len {core.max_model_len}")
    bm = core.block_manager
    usable = bm.num_blocks - bm.watermark_blocks
    per_request = bm.blocks_held(prompt_len + output_len, chunk) if hasattr(bm, "blocks_held") else None
    n = plan_requests(usable, bm.block_size, prompt_len, output_len, max_requests, per_request)
    core.reconfigure(SchedulerConfig(chunk_size=chunk, max_num_seqs=n, queue_policy=QueuePolicy.FCFS))
    rng = random.Random(f"metronome-saturation-{seed}")
    prompts = [list(sampler.sample(prompt_len, rng)) for _ in range(n)]
    max_steps = 2 * (math.ceil(n * prompt_len / chunk) + n + output_len) + 16
    steps, counts = run_requests(core, prompts, output_len, max_steps)
    wrong = [c for c in counts if c != output_len]
    if wrong:
        raise EngineBenchError(f"saturation: {len(wrong)} of {n} requests generated other than {output_len} tokens "
                               f"(e.g. {wrong[0]})")
    graph_max, piece_max = _graph_limits(core)
    config = core.loaded.config
    result = {"prompt_len": prompt_len, "output_len": output_len, "chunk_size": chunk, "requests": n,
              "requests_that_fit": requests_that_fit(usable, bm.block_size, prompt_len, output_len, per_request),
              "max_requests": max_requests, "kv_blocks_usable": usable, "block_size": bm.block_size,
              "decode_graph_max_batch": graph_max, "piecewise_max_tokens": piece_max,
              "execution_mode": getattr(core, "execution_mode", "eager"), "bandwidth_bytes_per_s": bandwidth}
    result.update(summarize(steps, model_math.weights_read_per_decode_step(config, dtype_bytes),
                            model_math.kv_bytes_per_token(config, dtype_bytes), bandwidth, graph_max,
                            result["execution_mode"]))
    if n == max_requests and result["requests_that_fit"] > n:
        result["notes"].append(f"capped at --saturation-max-requests {max_requests}: the KV cache holds "
                               f"{result['requests_that_fit']}")
    return result
