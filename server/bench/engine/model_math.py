"""Bytes and FLOPs of a decoder (any family of server/models): the physical floors the engine benchmark compares
against. Pure.

- A decode step reads every weight once (the input embedding table is only gathered, B rows; when tied, the
  table is read whole as the LM head) plus, per sequence and layer, the KV of the context tokens that layer's
  attention sees: all of them, or the last `window` on a sliding-window layer (Gemma 3: 5 of 6 layers). A mixture
  of experts reads, in each sparse layer, only the experts its B tokens picked: under uniform routing
  E·(1 - (1 - k/E)^B) of the E (k for one token, all of them for a large batch), plus everything else.
- Prefill of a prompt of L tokens: 2 FLOPs per active linear weight per token (an MoE token runs its k experts
  and the router), attention 4·heads·head_dim per (query, key) pair — L(L+1)/2 pairs on a full layer, fewer on a
  window layer — and the LM head only for the sampled (last) token. head_dim is the config's (256 for Gemma 3,
  not hidden / heads).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from metronome.server.models.moe_config import expected_distinct_experts


def embedding_params(config: Any) -> int:
    return config.vocab_size * config.hidden_size


def linear_params_per_layer(config: Any) -> int:
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size


def active_linear_params(config: Any) -> int:
    """Linear weights one token multiplies through, over all layers: each dense layer's, and in each sparse layer
    the attention, the router, its k experts and any shared expert."""
    moe = getattr(config, "moe", None)
    if moe is None:
        return config.num_hidden_layers * linear_params_per_layer(config)
    h = config.hidden_size
    dense_mlp = 3 * h * config.intermediate_size
    attention = linear_params_per_layer(config) - dense_mlp
    sparse_mlp = h * moe.num_experts + moe.top_k * 3 * h * moe.intermediate_size \
        + 3 * h * moe.shared_expert_intermediate_size
    sparse = config.num_moe_layers
    return config.num_hidden_layers * attention + sparse * sparse_mlp + (config.num_hidden_layers - sparse) * dense_mlp


def weights_read_per_decode_step(config: Any, dtype_bytes: int, batch: float | None = None) -> int:
    """Bytes of weights a decode step of `batch` sequences must read: all parameters but the gathered input
    embedding table, and of an MoE's routed experts only those its tokens pick under uniform routing (batch None:
    every expert, which a large batch reads anyway)."""
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        params -= embedding_params(config)
    moe = getattr(config, "moe", None)
    if moe is not None and batch is not None:
        unread = moe.num_experts - expected_distinct_experts(moe.num_experts, moe.top_k, batch)
        params -= round(config.num_moe_layers * unread * moe.expert_parameters(config.hidden_size))
    return params * dtype_bytes


def layer_windows(config: Any) -> tuple[int | None, ...]:
    return getattr(config, "layer_windows", None) or (None,) * config.num_hidden_layers


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """KV bytes of one token in every layer (what a context within every window costs per token)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def effective_kv_tokens(config: Any, context_len: int) -> float:
    """The context a decode reads, in tokens of every layer: kv_bytes_per_token x this = kv_bytes_read."""
    windows = layer_windows(config)
    return sum(context_len if w is None else min(w, context_len) for w in windows) / len(windows)


def kv_bytes_read(config: Any, dtype_bytes: int, context_len: int) -> int:
    """KV bytes one decode reads at this context: each layer its window's worth, or all of it."""
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * dtype_bytes
    return per_layer_token * sum(context_len if w is None else min(w, context_len) for w in layer_windows(config))


def decode_floor_bytes(config: Any, dtype_bytes: int, context_lens: Iterable[int]) -> int:
    """A decode step of one sequence per context length: the weights it reads plus each sequence's KV."""
    lens = list(context_lens)
    return weights_read_per_decode_step(config, dtype_bytes, len(lens)) + sum(
        kv_bytes_read(config, dtype_bytes, n) for n in lens)


def decode_floor_tokens_per_s(weight_bytes: int, kv_bytes_per_token: int, mean_batch: float, mean_kv_tokens: float,
                              bandwidth: float) -> float:
    """Decode tokens/s if each step took only the time to move its bytes: the weights once plus the KV it reads.
    With per-step means this equals Σ tokens ÷ Σ per-step floor times over the same steps."""
    return mean_batch * bandwidth / (weight_bytes + kv_bytes_per_token * mean_kv_tokens)


def prefill_flops(config: Any, prompt_lens: Iterable[int]) -> float:
    """FLOPs to prefill these prompts from scratch (one sampled token each)."""
    linear = active_linear_params(config)
    attn_per_pair = 4 * config.num_attention_heads * config.head_dim  # per layer
    lm_head = 2 * config.vocab_size * config.hidden_size
    total = 0.0
    for length in prompt_lens:
        pairs = sum(_attended_pairs(length, w) for w in layer_windows(config))
        total += 2.0 * linear * length + attn_per_pair * pairs + lm_head
    return total


def _attended_pairs(length: int, window: int | None) -> float:
    """(query, key) pairs of causal attention over a prompt: query i sees min(i + 1, window) keys."""
    if window is None or window >= length:
        return length * (length + 1) / 2
    return window * (window + 1) / 2 + (length - window) * window
