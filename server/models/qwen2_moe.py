"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's block — bias on q/k/v, none on o_proj — with the expert block
as its MLP, plus a shared expert every token runs, scaled by sigmoid of its own linear gate
(`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`). Routing as Qwen3-MoE's."""
from __future__ import annotations

from metronome.server.models.moe_decoder import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    pass
