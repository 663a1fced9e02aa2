"""The token ids a benchmark's prompts may use: from an in-process engine's vocabulary, or a fixed range.

(The in-process engine itself is built from the shared engine flags: engine/flags.py.) No torch import.
"""
from __future__ import annotations

from typing import Any

from metronome.server.bench.load.workloads import TokenSampler

# Without a vocabulary to look at (a server over HTTP), prompts use ids 300..499: ordinary tokens in every
# preset and in the Llama/Mistral/Qwen/SmolLM2 vocabularies (byte-fallback and special ids sit below or far above).
DEFAULT_HTTP_TOKEN_RANGE = (300, 500)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Every id a tokenizer treats as special: eos, bos, and the HF tokenizer's special set."""
    ids: set[int] = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            ids.add(value)
    ids.update(getattr(tokenizer, "_special_ids", ()) or ())
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None:
        ids.update(getattr(hf, "all_special_ids", ()) or ())
        # Added tokens (chat markers and the like) live above the base vocabulary; avoid them too.
        ids.update(getattr(hf, "added_tokens_decoder", {}) or {})
    return frozenset(i for i in ids if isinstance(i, int))


def sampler_for_engine(core: Any) -> TokenSampler:
    vocab = core.loaded.config.vocab_size
    tokenizer = core.tokenizer
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None and getattr(hf, "vocab_size", None):
        vocab = min(vocab, hf.vocab_size)
    return TokenSampler(vocab_size=vocab, excluded=special_token_ids(tokenizer))


def sampler_for_range(low: int, high: int) -> TokenSampler:
    return TokenSampler(vocab_size=high, low=low)
