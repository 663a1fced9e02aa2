"""Phi-3 / Phi-4 (dense): the Llama block, with q/k/v and gate/up already fused in the checkpoint (`qkv_proj`,
`gate_up_proj`: loaded whole), LongRoPE scaling with short and long factor sets and its attention factor
(rope.py; a sequence past the original context is computed with the long factors, recomputed when a generation
crosses it: scheduler.py), and partial rotary where the config asks (Phi-4-mini turns 3/4 of each head)."""
from __future__ import annotations

from metronome.server.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
