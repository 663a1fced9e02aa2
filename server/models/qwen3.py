"""Qwen3 (dense): the Llama block with QK-norm — each head of q and k is RMS-normalised (its own weight over
head_dim) before rope — and no bias on q/k/v. The norm is the shared attention's `qk_norm` option; on CUDA it
runs inside the fused rope + K/V-write kernel. Checkpoint names: `self_attn.q_norm`, `self_attn.k_norm`."""
from __future__ import annotations

from metronome.server.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, attention, parts=None):
        if not config.qk_norm:
            raise ValueError("Qwen3 layers normalise q and k per head: config.qk_norm must be set")
        super().__init__(config, attention, parts)
