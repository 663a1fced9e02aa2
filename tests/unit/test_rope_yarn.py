"""YaRN frequencies and attention factor against transformers' own computation (bit for bit)."""
from __future__ import annotations

import pytest
import torch

from metronome.server.models.rope_yarn import yarn_attention_factor, yarn_inv_freq

CASES = [
    # gpt-oss-20b's rope (truncate off), a default-truncating YaRN, one with mscale (DeepSeek style), a tiny head
    dict(head_dim=64, rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),
    dict(head_dim=128, rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32768),
    dict(head_dim=64, rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096),
    dict(head_dim=16, rope_theta=10000.0, factor=2.0, original_max_position_embeddings=64, truncate=False),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_yarn_matches_transformers(case):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {k: v for k, v in case.items() if k not in ("head_dim", "rope_theta")}
    config = GptOssConfig(hidden_size=case["head_dim"] * 4, num_attention_heads=4, head_dim=case["head_dim"],
                          max_position_embeddings=131072,
                          rope_parameters={"rope_type": "yarn", "rope_theta": case["rope_theta"], **scaling})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = yarn_inv_freq(case["head_dim"], case["rope_theta"], scaling)
    assert ours.dtype == torch.float32 and torch.equal(ours, inv_freq)
    assert yarn_attention_factor(scaling) == factor
    assert yarn_attention_factor({**scaling, "attention_factor": 0.5}) == 0.5
