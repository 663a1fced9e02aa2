"""FP8's accuracy against the unquantised model on real weights: greedy agreement and the log-probability gap.

A reference engine (no quantisation, the model's cache) generates greedy tokens for a fixed set of prompts; each
FP8 engine (FP8 weights; FP8 weights and an FP8 KV cache) generates its own, and the reference's tokens are scored
under it, so the log-probability gap compares the same text under both models. Used by the GPU test
(tests/gpu/test_fp8_gpu.py) and by `hack/fp8_accuracy.py`, which runs it on either device and writes the JSON.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams
from metronome.server.models.quant.kv_scales import whole_prefill_scratch

NEW_TOKENS = 64
SUBJECTS = ["the ocean", "a lighthouse", "prime numbers", "the French revolution", "photosynthesis", "a rainy city",
            "black holes", "the history of tea"]
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "List three facts about {}:",
         "The most surprising thing about {} is", "Q: What do you know about {}?\nA:", "A poem about {}:\n",
         "In one paragraph, describe {}.", "Here is a summary of {}:"]
VARIANTS = (("fp8_weights", "auto"), ("fp8_weights_fp8_kv", "fp8"))  # (label, KV cache dtype), FP8 weights each


def prompt_texts(count: int | None = None) -> list[str]:
    """The 64 prompts (8 subjects x 8 forms), or the first `count`."""
    texts = [form.format(subject) for subject in SUBJECTS for form in FORMS]
    return texts if count is None else texts[:count]


def greedy(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens (eos ignored), all submitted at once; and how many steps replayed a graph."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
           for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    graph_steps = 0
    while engine.has_unfinished():
        events, stats = engine.step()
        graph_steps += bool(stats.cuda_graph)
        for event in events:
            if event.token_id >= 0:
                tokens[event.request_id].append(event.token_id)
    engine.check_no_leaks()
    return [tokens[rid] for rid in ids], graph_steps


def sequence_logprobs(engine: EngineCore, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[:i + 1]) for every i: one prefill of the whole sequence over a fresh cache of the
    engine's KV dtype (an FP8 cache uses the engine's scales), every layer over every token (a window layer's
    kernel applies its window)."""
    loaded = engine.loaded
    device, n = loaded.device, len(ids)
    caches, meta = whole_prefill_scratch(loaded.config, n, 16, engine.runner.kv_caches[0][0].dtype, device)
    tokens = torch.tensor(ids, device=device)
    with torch.inference_mode():
        hidden = loaded.model(tokens, torch.arange(n, device=device), caches, meta)
        logits = loaded.model.compute_logits(hidden).float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, tokens[1:, None])[:, 0].cpu()


def agreement(engine: EngineCore, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]],
              reference_logprobs: list[torch.Tensor], new_tokens: int) -> dict[str, Any]:
    """Greedy agreement with the reference's tokens, and |Δ log p| of those tokens under this engine's model."""
    logprobs = [sequence_logprobs(engine, p + e)[len(p) - 1:] for p, e in zip(prompts, expected)]
    matching_prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
                       for a, b in zip(got, expected)]
    delta = torch.cat([(f - b).abs() for f, b in zip(logprobs, reference_logprobs)])
    return {
        "quantization": None if engine.loaded.quantization is None else engine.loaded.quantization.describe(),
        "kv_cache": str(engine.runner.kv_caches[0][0].dtype).removeprefix("torch."),
        "kv_scales": None if engine.kv_scales is None else engine.kv_scales.source,
        "identical_outputs": sum(a == b for a, b in zip(got, expected)),
        "mean_matching_prefix_tokens": statistics.mean(matching_prefix),
        "token_agreement_by_position": sum(x == y for a, b in zip(got, expected) for x, y in zip(a, b))
        / (len(prompts) * new_tokens),
        "mean_abs_logprob_delta_on_reference_tokens": delta.mean().item(),
        "p99_abs_logprob_delta": delta.quantile(0.99).item(),
    }


def reference_run(reference: EngineCore, prompt_count: int | None, new_tokens: int
                  ) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """The reference's side of the comparison: the prompts' token ids, its greedy tokens for each, and the log-probs
    of those tokens under it."""
    prompts = [reference.tokenizer.encode(text) for text in prompt_texts(prompt_count)]
    expected, _ = greedy(reference, prompts, new_tokens)
    return prompts, expected, [sequence_logprobs(reference, p + e)[len(p) - 1:] for p, e in zip(prompts, expected)]


def measure(make_engine: Callable[[str | None, str], EngineCore], model_label: str, prompt_count: int | None = None,
            new_tokens: int = NEW_TOKENS) -> dict[str, Any]:
    """The whole comparison. make_engine(quantization, kv_cache_dtype) builds an engine on the model; the
    reference is make_engine(None, "auto"). Each engine is dropped before the next is built."""
    reference = make_engine(None, "auto")
    prompts, expected, reference_logprobs = reference_run(reference, prompt_count, new_tokens)
    result: dict[str, Any] = {"model": model_label, "reference_dtype": str(reference.loaded.dtype).removeprefix(
        "torch."), "device": str(reference.loaded.device), "prompts": len(prompts), "new_tokens": new_tokens}
    del reference
    _release()
    for label, kv_dtype in VARIANTS:
        quantised = make_engine("fp8", kv_dtype)
        got, _ = greedy(quantised, prompts, new_tokens)
        result[label] = agreement(quantised, prompts, got, expected, reference_logprobs, new_tokens)
        del quantised
        _release()
    return result


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
