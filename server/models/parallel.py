"""Tensor parallelism for the Llama family: the process group a rank belongs to, and which part of every
transformers-named weight each rank owns.

The Megatron split, one process per GPU:
- q/k/v and gate/up are column-parallel: each rank computes its own attention heads and its slice of the MLP
  from the full hidden state, with no communication. In this model they stay plain `nn.Linear` modules, built at
  the per-rank size; the column split is done at load time by `shard_for` (rows of q_proj, k_proj, ...).
- o_proj and down_proj are row-parallel: each rank multiplies its slice of their input, and one all-reduce
  sums the partial results (parallel_layers.RowParallelLinear).
- The embedding and the LM head split the vocabulary (padded to a multiple of the world size): ids outside a
  rank's rows embed to zero before the all-reduce; logits are all-gathered over the vocabulary shards.

KV heads: with more KV heads than ranks each rank keeps n_kv / tp of them; with more ranks than KV heads (a
multiple of them) each KV head is replicated on tp / n_kv ranks, which is exact because a rank's query heads then
all belong to that one KV head's group. Anything else is an InvalidRequestError naming the head counts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from metronome.contract.errors import InvalidRequestError
from metronome.server.models.config import ModelConfig

# The Llama block with no per-head norms: what the shard plan and the row-parallel modules below cover.
TENSOR_PARALLEL_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class TPContext:
    """This process's place in a tensor-parallel group (torch.distributed must already be initialised)."""

    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None = the default group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank → [..., world_size * n], rank-major (rank 0's columns first)."""
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class ShardPlan:
    """Per-rank sizes of a model split `world_size` ways."""

    world_size: int
    head_dim: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank
    kv_replicas: int  # ranks holding the same KV head (1 = KV heads are split, not replicated)
    intermediate_size: int  # MLP width per rank
    vocab_size: int  # the real vocabulary (unpadded)
    vocab_per_rank: int  # rows of the embedding / LM head per rank (the last rank may hold padding)


def plan_shards(config: ModelConfig, world_size: int) -> ShardPlan:
    """How `config` splits over `world_size` ranks; InvalidRequestError when it cannot be split that way."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be a positive integer, got {world_size!r}",
                                  param="tensor_parallel_size")
    if world_size > 1 and config.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        raise InvalidRequestError(f"tensor parallelism serves {', '.join(TENSOR_PARALLEL_ARCHITECTURES)}; "
                                  f"{config.architecture} runs with tensor_parallel_size 1",
                                  param="tensor_parallel_size")
    if world_size > 1 and len(set(config.layer_windows)) > 1:
        raise InvalidRequestError("tensor parallelism needs every layer to share one KV block table; this model "
                                  "mixes sliding-window and full layers: use tensor_parallel_size 1",
                                  param="tensor_parallel_size")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise InvalidRequestError(
            f"tensor_parallel_size {world_size} does not divide the model's {heads} attention heads "
            f"(valid sizes: {_divisors_text(heads, kv_heads, config.intermediate_size)})",
            param="tensor_parallel_size")
    if kv_heads % world_size and world_size % kv_heads:
        raise InvalidRequestError(
            f"tensor_parallel_size {world_size} neither divides nor is a multiple of the model's {kv_heads} "
            f"KV heads (valid sizes: {_divisors_text(heads, kv_heads, config.intermediate_size)})",
            param="tensor_parallel_size")
    if config.intermediate_size % world_size:
        raise InvalidRequestError(
            f"tensor_parallel_size {world_size} does not divide the MLP width {config.intermediate_size}",
            param="tensor_parallel_size")
    replicas = max(1, world_size // kv_heads)
    return ShardPlan(
        world_size=world_size, head_dim=config.head_dim, num_heads=heads // world_size,
        num_kv_heads=max(1, kv_heads // world_size), kv_replicas=replicas,
        intermediate_size=config.intermediate_size // world_size, vocab_size=config.vocab_size,
        vocab_per_rank=math.ceil(config.vocab_size / world_size),
    )


def _divisors_text(heads: int, kv_heads: int, intermediate: int) -> str:
    valid = [n for n in range(1, heads + 1)
             if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and intermediate % n == 0]
    return ", ".join(map(str, valid))


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The shape one rank builds: its heads, its MLP slice, its vocabulary rows (head_dim stays explicit)."""
    return replace(config, num_attention_heads=plan.num_heads, num_key_value_heads=plan.num_kv_heads,
                   intermediate_size=plan.intermediate_size, vocab_size=plan.vocab_per_rank)


# ---- which rows / columns a rank owns (start, length) in the full tensor ----------------------------------------

def q_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    size = plan.num_heads * plan.head_dim
    return rank * size, size


def kv_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    size = plan.num_kv_heads * plan.head_dim
    first_head = (rank // plan.kv_replicas) * plan.num_kv_heads
    return first_head * plan.head_dim, size


def intermediate_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    return rank * plan.intermediate_size, plan.intermediate_size


def vocab_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    """The real vocabulary rows of `rank`: (start, length); length may be short (or 0) on the last ranks."""
    start = rank * plan.vocab_per_rank
    return start, max(0, min(plan.vocab_size, start + plan.vocab_per_rank) - start)


# transformers name suffix → (dimension, which rows); o_proj / down_proj weights are split along columns.
_SPLITS = {
    "self_attn.q_proj.weight": (0, q_rows), "self_attn.q_proj.bias": (0, q_rows),
    "self_attn.k_proj.weight": (0, kv_rows), "self_attn.k_proj.bias": (0, kv_rows),
    "self_attn.v_proj.weight": (0, kv_rows), "self_attn.v_proj.bias": (0, kv_rows),
    "self_attn.o_proj.weight": (1, q_rows),
    "mlp.gate_proj.weight": (0, intermediate_rows), "mlp.gate_proj.bias": (0, intermediate_rows),
    "mlp.up_proj.weight": (0, intermediate_rows), "mlp.up_proj.bias": (0, intermediate_rows),
    "mlp.down_proj.weight": (1, intermediate_rows),
}
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def shard_for(name: str, tensor: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """This rank's part of a full transformers-named tensor (a view where possible; vocabulary tensors are
    zero-padded to vocab_per_rank rows). Everything not split (norms, row-parallel biases, rope factors) is
    returned whole."""
    if name in _VOCAB_TENSORS:
        start, length = vocab_rows(plan, rank)
        part = tensor.narrow(0, start, length)
        if length == plan.vocab_per_rank:
            return part
        padded = tensor.new_zeros((plan.vocab_per_rank, *tensor.shape[1:]))
        padded[:length].copy_(part)
        return padded
    for suffix, (dim, rows) in _SPLITS.items():
        if name.endswith("." + suffix):
            start, length = rows(plan, rank)
            if start + length > tensor.shape[dim]:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, too small for "
                                 f"rank {rank} of {plan.world_size}")
            return tensor.narrow(dim, start, length)
    return tensor
