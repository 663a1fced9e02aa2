"""The operator's step model (a + b·tokens, + m for mixed steps) on step times shaped like an MoE server's.

An MoE step differs from a dense one in two ways the fit must survive: the weights it reads grow with the distinct
experts its tokens pick (E·(1 - (1 - k/E)^T): steep for a few decodes, flat once every expert is read), and a
prefill token is cheap (only the active experts compute) next to a decode token's KV read. The step times here
come from a cost model of Qwen3-30B-A3B on an H200 (weights and KV streamed at 80 % of 4.2 TB/s, matmuls at 60 %
of 700 TFLOP/s, the smaller of the two a third hidden behind the larger, launches and a mixed-step extra), with
2 % noise, as the operator sees one window: the decode batch wandering ±15 % around its mean, chunks filled 50-100 %.
The fit must be accepted by the controller's gate and predict a full-chunk step within 10 % over the chunk sizes
one decision can move to (the controller steps a chunk up ×2 or down ÷4 at most), as it does for a dense model.

What it does not do (and need not, one step at a time): extrapolate far across the knee where an MoE step turns
from reading weights to computing, at ~1,300 tokens per step on this model (~200 for a dense 8B). A window whose
steps straddle the knee, or lie below it, underestimates steps past it: fitted at chunk 512 with 8 decodes, a
2,048-token chunk by ~25 %; at chunk 2,048 with 64 decodes (chunks filled 1,024-2,048), the ×2 step to 4,096 by
~24 %; from above the knee (chunk 4,096) it overestimates a 1,024-token chunk by ~16 % (the safe side). The next
window's fit, at the new chunk, sees that chunk's slope, and the controller steps back (÷4 at most).
"""
from __future__ import annotations

import random

import pytest

from metronome.operator.tuning.step_model import fit_problem, fit_step_time, largest_chunk_within
from metronome.server.models.moe_config import expected_distinct_experts

BANDWIDTH, MATMUL = 4.2e12 * 0.8, 7.0e14 * 0.6
# Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query / 4 kv heads of 128, 128 experts of 768, top-8, vocab 151,936.
LAYERS, HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE, VOCAB = 48, 2048, 128, 8, 768, 151936
ATTENTION_PARAMS = LAYERS * (HIDDEN * (4096 + 2 * 512) + 4096 * HIDDEN) + VOCAB * HIDDEN
EXPERT_PARAMS = 3 * HIDDEN * EXPERT_SIZE
KV_BYTES_PER_TOKEN = 2 * LAYERS * 4 * 128 * 2
CONTEXT = 2000


def moe_step_seconds(decodes: float, prefill: float) -> float:
    tokens = decodes + prefill
    weights = 2 * (ATTENTION_PARAMS + LAYERS * expected_distinct_experts(EXPERTS, TOP_K, tokens) * EXPERT_PARAMS)
    memory = (weights + KV_BYTES_PER_TOKEN * CONTEXT * decodes) / BANDWIDTH
    compute = 2 * (ATTENTION_PARAMS + LAYERS * TOP_K * EXPERT_PARAMS) * tokens / MATMUL
    return max(memory, compute) + min(memory, compute) / 3 + 0.002 + (0.001 if prefill else 0.0)


def window(mean_decodes: float, chunk: int, seed: int) -> tuple[list[float], list[float], list[bool]]:
    rng = random.Random(seed)
    tokens, seconds, mixed = [], [], []
    for _ in range(12):
        decodes = mean_decodes * rng.uniform(0.85, 1.15)
        prefill = chunk * rng.uniform(0.5, 1.0)
        for carried, is_mixed in ((0.0, False), (prefill, True)):
            tokens.append(decodes + carried)
            seconds.append(moe_step_seconds(decodes, carried) * rng.gauss(1.0, 0.02))
            mixed.append(is_mixed)
    return tokens, seconds, mixed


@pytest.mark.parametrize("mean_decodes,chunk", [(8, 512), (16, 512), (64, 512), (128, 1024)])
def test_the_step_model_fits_moe_shaped_steps(mean_decodes, chunk):
    tokens, seconds, mixed = window(mean_decodes, chunk, seed=mean_decodes + chunk)
    fit = fit_step_time(tokens, seconds, mixed=mixed)
    assert fit_problem(fit, min_points=5, min_r2=0.8, min_token_spread=0.05) is None, fit.describe()
    reachable = (chunk // 4, chunk // 2, chunk, 2 * chunk)
    for other in reachable:
        truth = moe_step_seconds(mean_decodes, other)
        assert fit.step_seconds(mean_decodes + other) == pytest.approx(truth, rel=0.1), (other, fit.describe())
    # the chunk it would pick for a budget (within one decision's reach) keeps the true step within 10 % of it
    for target in reachable:
        budget = moe_step_seconds(mean_decodes, target)
        picked = min(largest_chunk_within(fit, mean_decodes, 1.0, budget, granularity=16) or 0, 2 * chunk)
        assert picked >= 16 and moe_step_seconds(mean_decodes, picked) <= 1.1 * budget, (target, picked)


def test_few_decodes_read_few_experts_and_the_mixed_extra_absorbs_it():
    """At 8 decodes a decode step reads ~52 of 128 experts per layer, a mixed step all of them: the fitted mixed
    extra carries that jump, so the per-token slope stays the prefill tokens' compute."""
    assert expected_distinct_experts(EXPERTS, TOP_K, 8) == pytest.approx(51.6, abs=0.1)
    tokens, seconds, mixed = window(8, 512, seed=3)
    fit = fit_step_time(tokens, seconds, mixed=mixed)
    assert fit.kinds == "decode+mixed" and fit.mixed_extra_s > 0.004
    per_prefill_token = moe_step_seconds(8, 1024) - moe_step_seconds(8, 1023)
    assert fit.slope_s_per_token == pytest.approx(per_prefill_token, rel=0.3)
