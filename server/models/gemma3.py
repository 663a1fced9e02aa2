"""Gemma 3 (text): the "sandwich" block, four norms per layer —
    x = x + post_attention_norm(attention(input_norm(x)))
    x = x + post_feedforward_norm(GeGLU(pre_feedforward_norm(x)))
— with RMSNorm scaling by (1 + w) in float32, QK-norm, GELU-tanh gating, embeddings times sqrt(hidden) in the
model dtype, attention scaled by query_pre_attn_scalar ** -0.5, and interleaved sliding-window (local) and
global layers with a rope base each (config.layer_types, config.rope_local_theta).

Split around its attention like every block (decoder.py): `begin` adds the previous layer's (post-normed) MLP
output to the residual, norms, projects and caches; `finish` norms the attention output, adds it, norms, runs
the MLP and its post-norm. The multimodal checkpoint's text weights (`language_model.*`) load; its vision tower
is skipped.
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

_MULTIMODAL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class SandwichDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, attention: AttentionBackend, parts: ModelParts):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, plus_one=True)
        self.self_attn = Attention(config, index, attention, parts.linear)
        self.post_attention_layernorm = RMSNorm(hidden, eps, plus_one=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, plus_one=True)
        self.mlp = parts.mlp(config, index, parts.linear)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, plus_one=True)

    def begin(self, delta: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, fused: bool,
              q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + delta (the previous layer's post-normed MLP output; None at layer 0) → (q, residual)."""
        x, residual = self.input_layernorm.add_forward(delta, residual, fused)
        return self.self_attn.project_and_cache(x, positions, slot_mapping, rotary, kv_cache, fused, q_out), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, fused: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, H, D] → (post-normed MLP output, residual after the attention)."""
        o = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        o = self.post_attention_layernorm.norm(o, fused)
        x, residual = self.pre_feedforward_layernorm.add_forward(o, residual, fused)
        return self.post_feedforward_layernorm.norm(self.mlp(x, fused), fused), residual


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = SandwichDecoderLayer

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, ours in _MULTIMODAL_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name
