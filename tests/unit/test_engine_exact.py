"""Greedy exactness of the engine on SmolLM2-135M (fp32, CPU): the same token ids for any chunk size (1, 7, 64,
512, unchunked), block size (16, 256), with prefix caching on (cold and warm) and off, and concurrent vs one
prompt at a time.

Floating-point summation order changes with batch shape, so a divergence is accepted only where the reference's
top-2 logits at that position are within 1e-4 of each other (a near tie); the test then reports it.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from metronome.contract.config import SchedulerConfig
from metronome.kernels.metadata import AttentionMetadata
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams

NEW_TOKENS = 32
TIE = 1e-4
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and show your reasoning when asked. Keep a "
          "friendly tone, avoid jargon, and say so when you are not sure about something. When a question involves "
          "numbers, check your arithmetic twice before you answer, and give units wherever they apply. ")
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman named Tomas. Every morning "
         "he rowed out before dawn, and every evening he returned with a story. One day he came back with no fish at "
         "all, only a glass bottle holding a rolled-up map. The villagers gathered around him as he unrolled it on "
         "the table of the inn. The map showed the coast they knew, every cove and cliff, but far to the west it "
         "marked an island none of them had ever heard of, drawn in faded red ink with a small star at its centre. "
         "The innkeeper said it was a joke; the schoolteacher said it was a copy of an old chart; the children said "
         "nothing and simply stared. That night Tomas could not sleep, and before the sun rose he")
CODE = ('def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""\n    if n < 2:\n'
        "        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n        a, b = b, a + b\n    return b\n\n\n"
        "def test_fibonacci():\n    assert [fibonacci(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]\n\n\n"
        "def lucas(n):\n")
# Together more than 512 tokens, so that chunk 512 splits the batch's prefill while "unchunked" does not.
PROMPTS = [
    "The capital of France is",
    CODE,
    SYSTEM + "Question: why is the sky blue during the day but red at sunset?",
    SYSTEM + "Question: what is 17 times 23? Explain step by step.",
    "1, 1, 2, 3, 5, 8, 13,",
    "Translate to German: The weather is nice today, and we are going to the lake with our friends. ->",
    "Les étoiles brillent — naïve café, 東京, emoji 🙂. Décris cette scène en une phrase :",
    STORY,
]


@pytest.fixture(scope="module")
def loaded():
    from metronome.server.models import load_model

    torch.manual_seed(0)
    return load_model(None, dtype="float32", device="cpu", attention_backend="torch")


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    assert sum(len(i) for i in ids) > 512 and max(len(i) for i in ids) < 256
    return ids


def make_engine(loaded, chunk: int, block_size: int = 16, prefix: bool = True, max_num_seqs: int = 256):
    config = EngineConfig(device="cpu", block_size=block_size, num_kv_blocks=(8 * 300 * 2) // block_size + 8,
                          enable_prefix_caching=prefix)
    return EngineCore(loaded, config, SchedulerConfig(chunk_size=chunk, queue_policy="fcfs",
                                                      max_num_seqs=max_num_seqs))


@pytest.fixture(scope="module")
def reference(loaded, prompt_ids):
    """Unchunked, block 16, prefix caching on (cold), all prompts in one batch."""
    engine = make_engine(loaded, chunk=100_000)
    results = engine.generate(prompt_ids, GREEDY)
    engine.check_no_leaks()
    return engine, [r.token_ids for r in results]


def full_forward_logits(loaded, tokens: list[int]) -> torch.Tensor:
    """Logits after `tokens`, one sequence, one unchunked pass over a fresh cache."""
    cfg = loaded.config
    bs, n = 16, len(tokens)
    blocks = -(-n // bs)
    caches = [(torch.zeros(blocks, bs, cfg.num_key_value_heads, cfg.head_dim),
               torch.zeros(blocks, bs, cfg.num_key_value_heads, cfg.head_dim)) for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32).unsqueeze(0),
        slot_mapping=torch.arange(n, dtype=torch.int64), max_seqlen_q=n, max_seqlen_k=n,
        q_lens_host=[n], seq_lens_host=[n])
    with torch.inference_mode():
        hidden = loaded.model.forward(torch.tensor(tokens), torch.arange(n), caches, meta)
        return loaded.model.compute_logits(hidden[-1:])[0]


def assert_same_greedy(loaded, prompt_ids, expected, got, label):
    for prompt, want, have in zip(prompt_ids, expected, got):
        if want == have:
            continue
        i = next((k for k, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        top2 = full_forward_logits(loaded, prompt + want[:i]).topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE, f"{label}: output diverges at token {i} ({want[i]} vs {have[i]}) with top-2 gap {gap:.3g}"
        warnings.warn(f"{label}: accepted divergence at token {i}: top-2 logits within {gap:.2g} (< {TIE})",
                      stacklevel=2)


def test_reference_is_sane(loaded, prompt_ids, reference):
    _, outputs = reference
    assert all(len(o) == NEW_TOKENS for o in outputs)
    assert "Paris" in loaded.tokenizer.decode(outputs[0])


def test_warm_prefix_cache_gives_the_same_output(loaded, prompt_ids, reference):
    engine, expected = reference
    ids = [engine.add_request(p, GREEDY) for p in prompt_ids]
    seqs = [engine._seqs[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert all(s.num_cached_tokens > 0 for s, p in zip(seqs, prompt_ids) if len(p) > 16)
    assert_same_greedy(loaded, prompt_ids, expected, [s.output_token_ids for s in seqs], "warm prefix cache")
    engine.check_no_leaks()


@pytest.mark.parametrize("chunk,block_size,prefix,subset", [
    (512, 256, False, None),
    (64, 16, False, None),
    (7, 256, True, [0, 4, 5, 6]),  # shorter prompts keep the number of steps in check
    (1, 16, True, [0, 4]),
])
def test_chunking_block_size_and_prefix_caching_do_not_change_output(loaded, prompt_ids, reference, chunk,
                                                                      block_size, prefix, subset):
    _, expected = reference
    chosen = subset if subset is not None else list(range(len(prompt_ids)))
    engine = make_engine(loaded, chunk=chunk, block_size=block_size, prefix=prefix)
    results = engine.generate([prompt_ids[i] for i in chosen], GREEDY)
    assert_same_greedy(loaded, [prompt_ids[i] for i in chosen], [expected[i] for i in chosen],
                       [r.token_ids for r in results], f"chunk {chunk}, block {block_size}, prefix {prefix}")
    engine.check_no_leaks()


def test_one_prompt_at_a_time_equals_concurrent(loaded, prompt_ids, reference):
    _, expected = reference
    chosen = [0, 7]
    engine = make_engine(loaded, chunk=64, max_num_seqs=1)
    results = engine.generate([prompt_ids[i] for i in chosen], GREEDY)
    assert_same_greedy(loaded, [prompt_ids[i] for i in chosen], [expected[i] for i in chosen],
                       [r.token_ids for r in results], "one at a time")
