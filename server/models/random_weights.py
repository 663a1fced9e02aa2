"""Random weights with a real model's shapes (`random:<preset>`): N(0, 0.02), residual outputs scaled down by
sqrt(2·layers) so the residual stream and the logits stay in a sane range at any depth, norms at a scale of one
(weight 1, or 0 where the norm scales by 1 + weight).
Used by the loader for the whole model and by parallel_model.py for the full tensors it shards."""
from __future__ import annotations

import math

import torch

INIT_STD = 0.02


def norm_fill(config) -> float:
    """The weight of a random model's norms: a scale of one."""
    return 0.0 if config.norm_plus_one else 1.0


def random_init_std(name: str, num_layers: int) -> float | None:
    """The standard deviation of a random parameter; None for norms (filled with norm_fill)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return INIT_STD / math.sqrt(2 * num_layers)
    return INIT_STD


def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic (per seed and device) weights, in parameter order from one generator."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = random_init_std(name, model.config.num_hidden_layers)
            if std is None:
                param.fill_(norm_fill(model.config))
            else:
                param.normal_(0.0, std, generator=generator)
