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
- Widths: every element is `dtype_bytes` wide, or with FP8 weights the decoder's linear weights take 1 byte each
  (their per-channel or block scales add `scales_per_row` float32 values per output row) and with an FP8 KV
  cache each K/V element takes 1 byte: pass a `ByteWidths` where an int width is taken. In a mixture of experts
  the FP8 linears are attention, dense MLPs and shared experts; the routed experts have widths of their own (an
  FP8 checkpoint's and `--quantization fp8`'s are e4m3, with scales per row or per 128-column group).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from metronome.server.models.moe_config import expected_distinct_experts


@dataclass(frozen=True)
class ByteWidths:
    """Bytes per element of what a step reads: the model dtype (embeddings, norms, LM head), the decoder's
    linear weights, and the KV cache; plus float32 weight scales per output row of each linear layer."""
    dtype: int
    linear: int
    kv: int
    scales_per_row: float = 0.0
    experts: int | None = None  # an MoE's routed expert weights; None: the model dtype
    expert_scales_per_row: float = 0.0

    @classmethod
    def of(cls, widths: int | ByteWidths) -> ByteWidths:
        return widths if isinstance(widths, ByteWidths) else cls(widths, widths, widths)


def linear_rows_per_layer(config: Any) -> int:
    """Output rows of a layer's linear weights (qkv, o, gate_up, down): where per-row scales are stored."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return q + 2 * kv + config.hidden_size + 2 * config.intermediate_size + config.hidden_size


def fp8_linear_params_and_rows(config: Any) -> tuple[int, int]:
    """(weights, output rows) of the linears an FP8 model runs W8A8, over all layers: every layer's attention,
    the dense MLPs, and a sparse layer's shared expert (not its router, its shared-expert gate or its routed
    experts)."""
    layers, h = config.num_hidden_layers, config.hidden_size
    dense_mlp, dense_rows = 3 * h * config.intermediate_size, 2 * config.intermediate_size + h
    attention = linear_params_per_layer(config) - dense_mlp
    attention_rows = linear_rows_per_layer(config) - dense_rows
    moe = getattr(config, "moe", None)
    sparse = config.num_moe_layers if moe is not None else 0
    shared = moe.shared_expert_intermediate_size if moe is not None else 0
    params = layers * attention + (layers - sparse) * dense_mlp + sparse * 3 * h * shared
    rows = layers * attention_rows + (layers - sparse) * dense_rows + (sparse * (2 * shared + h) if shared else 0)
    return params, rows


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


def weights_read_per_decode_step(config: Any, dtype_bytes: int | ByteWidths, batch: float | None = None) -> int:
    """Bytes of weights a decode step of `batch` sequences must read: all parameters but the gathered input
    embedding table, and of an MoE's routed experts only those its tokens pick under uniform routing (batch None:
    every expert, which a large batch reads anyway)."""
    params = config.num_parameters()
    if not config.tie_word_embeddings:
        params -= embedding_params(config)
    moe = getattr(config, "moe", None)
    experts = 0.0  # routed expert parameters read
    if moe is not None:
        read = moe.num_experts if batch is None else expected_distinct_experts(moe.num_experts, moe.top_k, batch)
        experts = config.num_moe_layers * read * moe.expert_parameters(config.hidden_size)
        params -= round(config.num_moe_layers * moe.num_experts * moe.expert_parameters(config.hidden_size))
    widths = ByteWidths.of(dtype_bytes)
    total = (params + experts) * widths.dtype
    if widths.linear != widths.dtype or widths.scales_per_row:
        linear, rows = fp8_linear_params_and_rows(config)
        total += linear * (widths.linear - widths.dtype) + rows * widths.scales_per_row * 4
    if moe is not None and widths.experts is not None:
        expert_rows = experts / moe.expert_parameters(config.hidden_size) * (
            2 * moe.intermediate_size + config.hidden_size)
        total += experts * (widths.experts - widths.dtype) + expert_rows * widths.expert_scales_per_row * 4
    return round(total)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    return getattr(config, "layer_windows", None) or (None,) * config.num_hidden_layers


def kv_bytes_per_token(config: Any, dtype_bytes: int | ByteWidths) -> int:
    """KV bytes of one token in every layer (what a context within every window costs per token)."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * ByteWidths.of(dtype_bytes).kv


def effective_kv_tokens(config: Any, context_len: int) -> float:
    """The context a decode reads, in tokens of every layer: kv_bytes_per_token x this = kv_bytes_read."""
    windows = layer_windows(config)
    return sum(context_len if w is None else min(w, context_len) for w in windows) / len(windows)


def kv_bytes_read(config: Any, dtype_bytes: int | ByteWidths, context_len: int) -> int:
    """KV bytes one decode reads at this context: each layer its window's worth, or all of it."""
    per_layer_token = 2 * config.num_key_value_heads * config.head_dim * ByteWidths.of(dtype_bytes).kv
    return per_layer_token * sum(context_len if w is None else min(w, context_len) for w in layer_windows(config))


def decode_floor_bytes(config: Any, dtype_bytes: int | ByteWidths, context_lens: Iterable[int]) -> int:
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
