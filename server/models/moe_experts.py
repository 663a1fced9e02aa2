"""The routed experts in torch: the exact reference (a loop over experts) and a grouped-matmul path.

Weights are stacked per block: gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I], and for gpt-oss the
biases gate_up_bias [E, 2I] and down_bias [E, H]. A token's output is the sum over its k experts of
weight * down(act(gate_up(x))).

- `experts_reference`: the oracle and the CPU path. Each expert runs over the tokens routed to it, in ascending
  expert order, with transformers' ops in transformers' order (projection, then bias; scaled by the routing
  weight in that weight's dtype; summed into the output with index_add_), so float32 and bf16 results match it.
  It reads the routing on the host (which experts were hit): not for CUDA graphs.
- `experts_grouped_mm`: pairs (token, expert) sorted by expert and both projections done by one grouped GEMM
  each (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` where only that exists); no host reads, fixed
  shapes per token count, so a CUDA graph can capture it. On CUDA it needs bf16 (and SM80+).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from metronome.server.models.moe_config import MoeSpec


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I]
    down_bias: torch.Tensor | None = None  # [E, H]


def activate(gate_up: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """[..., 2I] (gate columns, then up) → [..., I], op by op as transformers rounds them."""
    gate, up = gate_up.chunk(2, dim=-1)
    if spec.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(min=None, max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    glu = gate * torch.sigmoid(gate * spec.swiglu_alpha)
    return (up + 1) * glu


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T, then + bias as a separate op (gpt-oss adds its bias after the matmul's rounding)."""
    out = F.linear(x, weight)
    return out if bias is None else out + bias


def experts_reference(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      spec: MoeSpec) -> torch.Tensor:
    """x [T, H] → [T, H]: for each expert that any token picked, in ascending order, its tokens' outputs."""
    out = torch.zeros_like(x)
    num_experts = weights.gate_up.shape[0]
    hits = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    hits.scatter_add_(0, topk_ids.reshape(-1), torch.ones_like(topk_ids.reshape(-1)))
    for expert in hits.nonzero().flatten().tolist():
        slots, tokens = torch.where(topk_ids.T == expert)  # transformers' row order: by slot, then token
        gate_up = _project(x[tokens], weights.gate_up[expert],
                           None if weights.gate_up_bias is None else weights.gate_up_bias[expert])
        y = _project(activate(gate_up, spec), weights.down[expert],
                     None if weights.down_bias is None else weights.down_bias[expert])
        y = y * topk_weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [S, K] (rows grouped by expert, group g ending at offsets[g]) times b [E, K, N] → [S, N]."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(a, b, offs=offsets)
    return torch._grouped_mm(a, b, offs=offsets)


def experts_grouped_mm(x: torch.Tensor, weights: ExpertWeights, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """x [T, H] → [T, H] with one grouped GEMM per projection over the (token, expert) pairs sorted by expert."""
    tokens, top_k = topk_ids.shape
    num_experts = weights.gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)  # pair p = token * k + slot, grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up = _grouped_mm(x[order // top_k], weights.gate_up.transpose(1, 2), offsets)
    if weights.gate_up_bias is not None:
        gate_up = gate_up + weights.gate_up_bias[sorted_ids]
    y = _grouped_mm(activate(gate_up, spec), weights.down.transpose(1, 2), offsets)
    if weights.down_bias is not None:
        y = y + weights.down_bias[sorted_ids]
    y = (y * topk_weights.reshape(-1)[order, None]).to(x.dtype)
    per_pair = torch.empty_like(y)
    per_pair[order] = y
    return per_pair.view(tokens, top_k, -1).sum(dim=1)
