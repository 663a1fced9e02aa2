"""YaRN rope scaling (gpt-oss; DeepSeek-style `mscale`): per-frequency blend of the original frequencies
(extrapolation, for the fast-rotating dimensions) and the frequencies slowed by `factor` (interpolation, for the
slow ones), with a linear ramp between the two correction dimensions, and an attention factor that multiplies cos
and sin.

Computed on the CPU in float32 with transformers' operations in its order, so the frequencies are bit-identical.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor cos and sin are multiplied by: given, or from `factor` (and `mscale`/`mscale_all_dim`)."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies. `scaling` holds factor and original_max_position_embeddings,
    optionally beta_fast (32), beta_slow (1) and truncate (True: round the correction range outwards)."""
    dim = head_dim
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero

    # On the CPU explicitly: models are built under a meta-device context, and these are plain attributes.
    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
