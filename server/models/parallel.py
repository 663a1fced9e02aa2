"""Tensor parallelism: the process group a rank belongs to, and which part of every
transformers-named weight each rank owns. Every family splits: each layer is an attention with o_proj and an MLP
with down_proj or an expert block (QK-norm weights are one per head_dim, shared by every head, and Gemma 3's four
norms act on whole hidden states, so each rank keeps them whole).

The Megatron split, one process per GPU:
- q/k/v and gate/up are column-parallel: each rank computes its own attention heads and its slice of the MLP
  from the full hidden state, with no communication. In this model they stay plain `nn.Linear` modules, built at
  the per-rank size; the column split is done at load time by `shard_for` (rows of q_proj, k_proj, ...).
- o_proj and down_proj are row-parallel: each rank multiplies its slice of their input, and one all-reduce
  sums the partial results (parallel_layers.RowParallelLinear).
- The embedding and the LM head split the vocabulary (padded to a multiple of the world size): ids outside a
  rank's rows embed to zero before the all-reduce; logits are all-gathered over the vocabulary shards.
- FP8 checkpoints split their scales with their weights: a per-row weight scale with the rows it scales, a
  block grid in whole blocks, a per-tensor or static input scale whole; each rank quantises its own slice of a
  row-parallel input (per token, as vLLM's ranks do: a token's scale then comes from its slice alone). An FP8 KV
  cache's per-head scales go with their heads.

KV heads: with more KV heads than ranks each rank keeps n_kv / tp of them; with more ranks than KV heads (a
multiple of them) each KV head is replicated on tp / n_kv ranks, which is exact because a rank's query heads then
all belong to that one KV head's group. Anything else is an InvalidRequestError naming the head counts.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

import torch

from metronome.contract.errors import InvalidRequestError
from metronome.server.models.config import ModelConfig

MXFP4_BLOCK = 32  # input columns per MXFP4 scale (gpt-oss's experts): a rank's columns are whole blocks


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
    expert_size: int = 0  # one routed expert's MLP width per rank (0: no experts)
    shared_expert_size: int = 0  # the shared expert's MLP width per rank (0: none)
    experts_interleaved: bool = False  # stacked experts stored as gpt-oss stores them: [E, H, 2I], gate/up alternating

    @property
    def total_kv_heads(self) -> int:
        """The model's KV heads (each kept by kv_replicas ranks)."""
        return self.num_kv_heads * self.world_size // self.kv_replicas


def plan_shards(config: ModelConfig, world_size: int) -> ShardPlan:
    """How `config` splits over `world_size` ranks; InvalidRequestError when it cannot be split that way."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be a positive integer, got {world_size!r}",
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
    moe = config.moe
    expert, shared = (moe.intermediate_size, moe.shared_expert_intermediate_size) if moe is not None else (0, 0)
    for what, width in (("an expert's MLP width", expert), ("the shared expert's MLP width", shared)):
        if width % world_size:
            raise InvalidRequestError(f"tensor_parallel_size {world_size} does not divide {what} {width}",
                                      param="tensor_parallel_size")
    interleaved = moe is not None and moe.checkpoint_layout == "interleaved_transposed"
    if interleaved and (expert // world_size) % MXFP4_BLOCK:
        raise InvalidRequestError(f"tensor_parallel_size {world_size} gives each rank {expert // world_size} of an "
                                  f"expert's {expert} columns: not whole MXFP4 blocks of {MXFP4_BLOCK}",
                                  param="tensor_parallel_size")
    replicas = max(1, world_size // kv_heads)
    return ShardPlan(
        world_size=world_size, head_dim=config.head_dim, num_heads=heads // world_size,
        num_kv_heads=max(1, kv_heads // world_size), kv_replicas=replicas,
        intermediate_size=config.intermediate_size // world_size, vocab_size=config.vocab_size,
        vocab_per_rank=math.ceil(config.vocab_size / world_size), expert_size=expert // world_size,
        shared_expert_size=shared // world_size, experts_interleaved=interleaved,
    )


def _divisors_text(heads: int, kv_heads: int, intermediate: int) -> str:
    valid = [n for n in range(1, heads + 1)
             if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0) and intermediate % n == 0]
    return ", ".join(map(str, valid))


def local_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The shape one rank builds: its heads, its MLP slices (dense, each expert's, the shared expert's), its
    vocabulary rows (head_dim stays explicit)."""
    moe = config.moe
    if moe is not None:
        moe = replace(moe, intermediate_size=plan.expert_size, shared_expert_intermediate_size=plan.shared_expert_size)
    return replace(config, num_attention_heads=plan.num_heads, num_key_value_heads=plan.num_kv_heads,
                   intermediate_size=plan.intermediate_size, vocab_size=plan.vocab_per_rank, moe=moe)


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


def expert_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    return rank * plan.expert_size, plan.expert_size


def shared_expert_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    return rank * plan.shared_expert_size, plan.shared_expert_size


def vocab_rows(plan: ShardPlan, rank: int) -> tuple[int, int]:
    """The real vocabulary rows of `rank`: (start, length); length may be short (or 0) on the last ranks."""
    start = rank * plan.vocab_per_rank
    return start, max(0, min(plan.vocab_size, start + plan.vocab_per_rank) - start)


# The decoder's linears: column-parallel modules split their output rows (weight, bias and a per-row or block
# weight scale alike), row-parallel ones their input columns (weight, block scales; bias and per-row scales stay
# whole, as each rank's partial sum has every output row).
_COLUMN_PARALLEL = {"self_attn.q_proj": q_rows, "self_attn.k_proj": kv_rows, "self_attn.v_proj": kv_rows,
                    "mlp.gate_proj": intermediate_rows, "mlp.up_proj": intermediate_rows,
                    "mlp.shared_expert.gate_proj": shared_expert_rows, "mlp.shared_expert.up_proj": shared_expert_rows}
_ROW_PARALLEL = {"self_attn.o_proj": q_rows, "mlp.down_proj": intermediate_rows,
                 "mlp.shared_expert.down_proj": shared_expert_rows}
# An expert block splits every expert's MLP as a dense MLP is split: one expert a tensor (Qwen's names, Mixtral's
# w1 / w3 / w2), stacked [E, 2I, H] gate rows then up rows and [E, H, I] (ours, transformers 5's), or stacked per
# projection [E, I, H] / [E, H, I] (GGUF's). The block's output is all-reduced once (parallel_layers).
_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(gate_proj|up_proj|w1|w3|down_proj|w2)$")
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj|gate_proj\.weight|up_proj\.weight|"
                              r"down_proj\.weight|gate_up_proj_bias|down_proj_bias|gate_up_proj_blocks|"
                              r"gate_up_proj_scales|down_proj_blocks|down_proj_scales)$")
_SINKS = re.compile(r"\.self_attn\.sinks$")  # gpt-oss: a logit per query head
# Phi-3's checkpoints hold q/k/v and gate/up fused: a rank takes its rows of each part
_FUSED = re.compile(r"\.(self_attn\.qkv_proj|mlp\.gate_up_proj)$")
_WEIGHTS = ("weight", "_weight_qdata")  # torchao's FP8 tensor, flattened by transformers, names its codes so
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv", "_weight_scale")
# An FP8 KV cache's scales in a checkpoint: one per layer (kept whole) or one per kv head (cut to the rank's heads)
_KV_SCALE = re.compile(r"\.self_attn\.(?:[kv]_scale|[kv]_proj\.output_scale|[kv]_proj\.[kv]_scale)$")
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def shard_for(name: str, tensor: torch.Tensor, plan: ShardPlan, rank: int,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """This rank's part of a full transformers-named tensor (a view where possible; vocabulary tensors are
    zero-padded to vocab_per_rank rows). Everything not split (norms, row-parallel biases, rope factors, static
    input scales) is returned whole. `block`: an FP8 checkpoint's weight-scale block (rows, columns), whose scale
    grids are cut in whole blocks (check_block_split says beforehand whether they can be)."""
    if name in _VOCAB_TENSORS:
        start, length = vocab_rows(plan, rank)
        part = tensor.narrow(0, start, length)
        if length == plan.vocab_per_rank:
            return part
        padded = tensor.new_zeros((plan.vocab_per_rank, *tensor.shape[1:]))
        padded[:length].copy_(part)
        return padded
    if _KV_SCALE.search(name):
        return _kv_heads_of(name, tensor, plan, rank)
    if _SINKS.search(name):
        start, length = q_rows(plan, rank)
        return _narrow(name, tensor, 0, start // plan.head_dim, length // plan.head_dim)
    stacked = _STACKED_EXPERTS.search(name)
    if stacked:
        if plan.experts_interleaved:
            return _interleaved_experts_of(name, stacked.group(1), tensor, rank, *expert_rows(plan, rank))
        return _stacked_experts_of(name, stacked.group(1), tensor, *expert_rows(plan, rank))
    module, _, kind = name.rpartition(".")
    fused = _FUSED.search(module)
    if fused:
        return _fused_part(name, kind, tensor, plan, rank, fused.group(1) == "self_attn.qkv_proj", block)
    expert = _EXPERT.search(module)
    if expert:
        column = expert.group(1) in ("gate_proj", "up_proj", "w1", "w3")
        return _linear_part(name, kind, tensor, column, expert_rows(plan, rank), block)
    for suffix, rows in _COLUMN_PARALLEL.items():
        if module.endswith("." + suffix):
            return _linear_part(name, kind, tensor, True, rows(plan, rank), block)
    for suffix, columns in _ROW_PARALLEL.items():
        if module.endswith("." + suffix):
            return _linear_part(name, kind, tensor, False, columns(plan, rank), block)
    return tensor


def _linear_part(name: str, kind: str, tensor: torch.Tensor, column: bool, span: tuple[int, int],
                 block: tuple[int, int] | None) -> torch.Tensor:
    """A linear layer's tensor `kind` cut to the rank's `span` of its rows (column-parallel) or of its input
    columns (row-parallel)."""
    if column:
        if kind in _WEIGHTS or kind == "bias":
            return _narrow(name, tensor, 0, *span)
        if kind in _WEIGHT_SCALES and tensor.numel() > 1:
            return _narrow_scale(name, tensor, 0, *span, block and block[0])
        return tensor
    if kind in _WEIGHTS:
        return _narrow(name, tensor, 1, *span)
    if kind in _WEIGHT_SCALES and block is not None and tensor.dim() == 2:
        return _narrow_scale(name, tensor, 1, *span, block[1])
    return tensor


def _fused_part(name: str, kind: str, tensor: torch.Tensor, plan: ShardPlan, rank: int, qkv: bool,
                block: tuple[int, int] | None) -> torch.Tensor:
    """A rank's rows of a fused [q; k; v] or [gate; up] tensor (weight, bias, per-row or block scale): its rows of
    each part, in order (a copy). A per-tensor scale stays whole."""
    if kind not in _WEIGHTS and kind != "bias" and not (kind in _WEIGHT_SCALES and tensor.numel() > 1):
        return tensor
    if qkv:
        kv = plan.total_kv_heads * plan.head_dim
        sizes = (plan.num_heads * plan.head_dim * plan.world_size, kv, kv)
        spans = (q_rows(plan, rank), kv_rows(plan, rank), kv_rows(plan, rank))
    else:
        sizes = (plan.intermediate_size * plan.world_size,) * 2
        spans = (intermediate_rows(plan, rank),) * 2
    grid_rows = block[0] if kind in _WEIGHT_SCALES and block else None  # a block grid's rows are blocks of rows
    parts, offset = [], 0
    for size, (start, length) in zip(sizes, spans):
        parts.append(_narrow_scale(name, tensor, 0, offset + start, length, grid_rows))
        offset += size
    return torch.cat(parts)


def _stacked_experts_of(name: str, what: str, tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Every expert's part of a stacked expert tensor: [E, 2I, H] (gate rows, then up rows: both halves cut, a
    copy), [E, I, H] (one projection's rows) or [E, H, I] (a down projection's columns)."""
    if what.startswith("down_proj"):
        return _narrow(name, tensor, 2, start, length)
    if what == "gate_up_proj":
        half = tensor.shape[1] // 2
        return torch.cat([_narrow(name, tensor, 1, start, length), _narrow(name, tensor, 1, half + start, length)],
                         dim=1)
    return _narrow(name, tensor, 1, start, length)


def _narrow(name: str, tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    if start + length > tensor.shape[dim]:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, too small for a "
                         f"tensor-parallel shard at {start}..{start + length} of dimension {dim}")
    return tensor.narrow(dim, start, length)


def _narrow_scale(name: str, tensor: torch.Tensor, dim: int, start: int, length: int,
                  block: int | None) -> torch.Tensor:
    """A tensor's rows (or columns) start..start + length: as they are, or, with `block`, a block grid's whole
    blocks of them."""
    if not block:
        return _narrow(name, tensor, dim, start, length)
    if start % block or length % block:
        raise ValueError(f"checkpoint tensor {name!r}: a tensor-parallel shard at {start}..{start + length} cuts "
                         f"its {block}-wide scale blocks")
    return _narrow(name, tensor, dim, start // block, length // block)


def _kv_heads_of(name: str, tensor: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    total = plan.total_kv_heads
    if tensor.numel() != total or total == 1:
        return tensor  # one scale for the layer (kv_scales.from_checkpoint refuses any other shape)
    first = kv_rows(plan, rank)[0] // plan.head_dim
    return tensor.reshape(total).narrow(0, first, plan.num_kv_heads)


def _interleaved_experts_of(name: str, what: str, tensor: torch.Tensor, rank: int, start: int, length: int
                            ) -> torch.Tensor:
    """Every expert's part of gpt-oss's stacked experts: gate_up [E, H, 2I] and its bias [E, 2I] with gate and up
    alternating (a rank's columns are one contiguous run of 2 x length), down [E, I, H], the MXFP4 pairs (rows are
    output features: gate_up [E, 2I, H/32, 16], down [E, H, I/32, 16], scales without the last axis). The down
    bias is rank 0's alone (zeros elsewhere): the all-reduce after the block then adds it once."""
    if what == "down_proj_bias":
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if what in ("down_proj_blocks", "down_proj_scales"):
        return _narrow(name, tensor, 2, start // MXFP4_BLOCK, length // MXFP4_BLOCK)
    if what == "down_proj":
        return _narrow(name, tensor, 1, start, length)
    dim = {"gate_up_proj": 2, "gate_up_proj_bias": 1}.get(what, 1)  # the MXFP4 pair's rows: dim 1
    return _narrow(name, tensor, dim, 2 * start, 2 * length)


def check_block_split(plan: ShardPlan, block: tuple[int, int]) -> None:
    """InvalidRequestError unless every rank's rows and columns of the split linears are whole weight-scale
    blocks (a block scale cannot be shared by two ranks)."""
    rows, columns = block
    q, kv, mlp = plan.num_heads * plan.head_dim, plan.num_kv_heads * plan.head_dim, plan.intermediate_size
    widths = [("q rows", q, rows), ("kv rows", kv, rows), ("MLP rows", mlp, rows), ("o_proj columns", q, columns),
              ("down_proj columns", mlp, columns)]
    for what, size in (("expert", plan.expert_size), ("shared expert", plan.shared_expert_size)):
        if size:
            widths += [(f"{what} rows", size, rows), (f"{what} down_proj columns", size, columns)]
    cut = [f"{what} {size}" for what, size, unit in widths if size % unit]
    if cut:
        raise InvalidRequestError(
            f"tensor_parallel_size {plan.world_size} gives each rank {', '.join(cut)}: not whole {rows}x{columns} "
            "blocks of the checkpoint's weight scales", param="tensor_parallel_size")
