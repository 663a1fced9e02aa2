"""The Llama block (Llama 2/3, Mistral, Qwen2): x + attention(norm(x)), then x + MLP(norm(x)).

The layer is split around its attention so that everything between two attentions is one captured piece
(decoder.py): `begin` (residual add, norm, qkv, rope, K/V write) and `finish` (o_proj, residual add, norm, MLP).
The residual add of each half is delayed to the next norm, which fuses it on CUDA; the order of operations is
transformers' (add, then norm), so the torch path stays exact. Qwen3 (qwen3.py) and Phi-3 (phi3.py) are this
block too, with their own attention options and checkpoint names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from metronome.server.models.attention import Attention, KVCache
from metronome.server.models.config import ModelConfig
from metronome.server.models.decoder import DecoderForCausalLM
from metronome.server.models.layers import ModelParts, RMSNorm
from metronome.server.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend


class PreNormDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, attention: AttentionBackend, parts: ModelParts):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one,
                                       config.norm_float_scale)
        self.self_attn = Attention(config, index, attention, parts.linear)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one,
                                                config.norm_float_scale)
        self.mlp = parts.mlp(config, index, parts.linear)

    def begin(self, delta: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, fused: bool,
              q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + delta (the previous layer's MLP output; None at layer 0) → (q, residual)."""
        x, residual = self.input_layernorm.add_forward(delta, residual, fused)
        return self.self_attn.project_and_cache(x, positions, slot_mapping, rotary, kv_cache, fused, q_out), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, fused: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, H, D] → (MLP output, residual after the attention)."""
        o = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        x, residual = self.post_attention_layernorm.add_forward(o, residual, fused)
        return self.mlp(x, fused), residual


class LlamaForCausalLM(DecoderForCausalLM):
    layer_class = PreNormDecoderLayer
