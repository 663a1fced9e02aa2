"""The attention block every family shares: fused qkv projection, optional per-head QK-norm, rope, K/V written
to the paged cache, attention through a `metronome.kernels` backend, o_proj.

The per-layer options are the layer's own constants, given to the kernels as parameters of the attention call:
its sliding window (None: full causal attention), its scale, its logit softcap, its learned sinks (gpt-oss:
`self_attn.sinks`, one logit per head in the softmax denominator), and with an FP8 KV cache its per-kv-head K and
V scales (`kv_scales`, set by the engine). On CUDA the QK-norm, rope and
K/V write are one fused Triton kernel; elsewhere torch ops in transformers' order.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.models.config import ModelConfig
from metronome.server.models.layers import RMSNorm
from metronome.server.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, n_kv_heads, head_dim]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, attention: AttentionBackend,
                 linear: Callable[..., nn.Module] = nn.Linear):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.attention_scale
        self.window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_plus_one)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_plus_one)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        self.attention = attention
        self.kv_scales: dict[str, torch.Tensor] = {}  # an FP8 KV cache's k_scale / v_scale [n_kv_heads] (engine-set)

    def project_and_cache(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          rotary: RotaryEmbedding, kv_cache: KVCache, fused: bool,
                          q_out: torch.Tensor | None = None) -> torch.Tensor:
        """qkv projection, QK-norm and rope; K/V written to the cache. Returns q [T, H, D] (in q_out if given)."""
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if fused:
            from metronome.kernels.triton_fused import rope_write_kv
            cos, sin = rotary.tables(qkv.device, qkv.dtype)
            norm = None
            if self.q_norm is not None:
                norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.plus_one)
            return rope_write_kv(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, self.num_heads,
                                 self.num_kv_heads, q_out, qk_norm=norm, **self.kv_scales)
        tokens = x.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.contiguous().view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        self.attention.write_kv(k, v, k_cache, v_cache, slot_mapping, **self.kv_scales)
        if q_out is None:
            return q
        q_out.copy_(q)
        return q_out

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H, D] attention of q over the cache (the one launch a captured piece leaves out)."""
        if self.sinks is None:
            return self.attention.attention(q, kv_cache[0], kv_cache[1], meta, self.scale, out=out,
                                            window=self.window, softcap=self.softcap, **self.kv_scales)
        return self.attention.attention(q, kv_cache[0], kv_cache[1], meta, self.scale, out=out, window=self.window,
                                        softcap=self.softcap, sinks=self.sinks, **self.kv_scales)
