"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's block — QK-norm, no q/k/v bias — with the expert block as
its MLP: softmax over all experts in float32, top-k, renormalised when `norm_topk_prob`, the weights cast to the
model dtype. Layers in `mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense MLP. Checkpoint names:
`mlp.gate.weight`, `mlp.experts.N.{gate,up,down}_proj.weight` (or transformers 5's stacked `mlp.experts.*`)."""
from __future__ import annotations

from metronome.server.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    def __init__(self, config, attention, parts=None):
        if not config.qk_norm:
            raise ValueError("Qwen3-MoE layers normalise q and k per head: config.qk_norm must be set")
        super().__init__(config, attention, parts)
