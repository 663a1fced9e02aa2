"""gpt-oss (20b, 120b): the pre-norm block with
- attention: biases on q, k, v and o; a learned sink logit per head in every softmax denominator
  (`self_attn.sinks`); sliding-window (128) and full layers alternating (`layer_types`); YaRN rope;
- RMSNorm scaling by its weight in float32 before the cast (config.norm_float_scale);
- the expert block as MLP: the router (with a bias) picks the top-k logits, softmax over those k in the model
  dtype; experts with biases and the clamped SwiGLU, (clamp(up, ±7) + 1) · gate · sigmoid(1.702 · gate) with
  gate ≤ 7. The checkpoint stores gate and up interleaved in [E, H, 2I] (bf16) or as MXFP4 `_blocks` + `_scales`
  pairs, both loaded into the stacked layout (moe.py, mxfp4.py)."""
from __future__ import annotations

from metronome.server.models.moe_decoder import MoeForCausalLM


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, config, attention, parts=None):
        if not config.attention_sinks:
            raise ValueError("gpt-oss attention has learned sinks: config.attention_sinks must be set")
        super().__init__(config, attention, parts)
