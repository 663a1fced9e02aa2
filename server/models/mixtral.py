"""Mixtral (8x7B, 8x22B): the Llama block with the expert block as its MLP — softmax over all experts in float32,
top-2, renormalised, the weights kept in float32 (so an expert's output is scaled and rounded once). The Hub files
name the block `block_sparse_moe` and its experts `w1` (gate), `w3` (up), `w2` (down); transformers 5 renames them
`mlp.experts.*`: both load."""
from __future__ import annotations

from metronome.server.models.moe_decoder import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    def checkpoint_name(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")
