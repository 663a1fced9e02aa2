"""Top-k routing: router logits [T, E] → (weights [T, k], expert ids [T, k]).

Each family's order of operations is kept as transformers has it, because the order decides which expert wins a
near-tie and how the weights round:
- softmax scoring (Qwen2/3-MoE, Mixtral): softmax over every expert in float32, top-k of the probabilities, then
  (if `renormalize`) divide by their sum; Qwen casts the weights to the model dtype, Mixtral keeps float32;
- `topk_before_softmax` (gpt-oss): top-k of the logits, then softmax over those k in the model dtype;
- sigmoid scoring (DeepSeek-V3 style): sigmoid per expert; a correction bias steers the choice only; with groups,
  only the `topk_groups` groups with the best two-expert sums are eligible; weights renormalised (+1e-20) and scaled.
Ties go as torch.topk breaks them on the same device: the same op on the same values as transformers.
Only device ops, no host reads: a CUDA graph can capture it.
"""
from __future__ import annotations

import torch

from metronome.server.models.moe_config import MoeSpec


def route(logits: torch.Tensor, spec: MoeSpec, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids int64 [T, k]) from router logits [T, E] (already including a router bias)."""
    if spec.scoring == "sigmoid":
        return _sigmoid_route(logits, spec, correction_bias)
    if spec.topk_before_softmax:
        values, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(values, dim=1, dtype=values.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_in_model_dtype:
        weights = weights.to(logits.dtype)
    return weights, ids


def _sigmoid_route(logits: torch.Tensor, spec: MoeSpec, correction_bias: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if spec.num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, spec.num_groups, experts // spec.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=spec.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids
