"""The modules of a tensor-parallel model that communicate: row-parallel linears (o_proj, down_proj), in the model
dtype or FP8, the row-parallel expert block, and the vocabulary-parallel embedding. (Column-parallel q/k/v and
gate/up need no communication: see parallel.py.)"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metronome.server.models.moe import SparseMoeBlock
from metronome.server.models.parallel import TPContext
from metronome.server.models.quant.activation import Fp8Activation
from metronome.server.models.quant.fp8_linear import Fp8Linear
from metronome.server.models.quant.scheme import Fp8Scheme


class RowParallelLinear(nn.Module):
    """y = sum over ranks (x_rank @ W_rank^T) + b: this rank holds the columns of W that match its slice of the
    input; the bias is whole on every rank and added once, after the all-reduce."""

    def __init__(self, in_features_per_rank: int, out_features: int, bias: bool, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def fp8_replacement(self, scheme: Fp8Scheme, checkpoint_name: str) -> Fp8RowParallelLinear:
        """This layer with FP8 weights (quant/model_pass.swap_linears calls it before the weights load)."""
        return Fp8RowParallelLinear(self, scheme, checkpoint_name)


class Fp8RowParallelLinear(nn.Module):
    """A row-parallel linear over FP8 weights: this rank's columns are an Fp8Linear (`local`) that takes the
    checkpoint's tensors under this module's name and quantises this rank's slice of the input; the bias, whole
    on every rank, is added once after the all-reduce, as in RowParallelLinear."""

    def __init__(self, row: RowParallelLinear, scheme: Fp8Scheme, checkpoint_name: str):
        super().__init__()
        self.tp = row.tp
        out_features, in_features_per_rank = row.weight.shape
        self.local = Fp8Linear(in_features_per_rank, out_features, bias=False, scheme=scheme,
                               shard_sizes=(out_features,), dtype=row.weight.dtype, device=row.weight.device,
                               checkpoint_names=(checkpoint_name,))
        self.bias = row.bias

    @property
    def activation_quant(self):
        return self.local.activation_quant

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        out = self.tp.all_reduce(self.local(x))
        return out if self.bias is None else out + self.bias


class RowParallelMoeBlock(SparseMoeBlock):
    """An expert block whose routed experts and shared expert hold this rank's slice of every MLP (built at the
    per-rank expert width): their outputs are partial sums, added up over the ranks once, after the block. The
    router is whole on every rank, so every rank routes a token to the same experts. An expert's down bias (gpt-oss)
    is rank 0's alone, the other ranks' zeros (parallel.shard_for), so the sum adds it once."""

    tp: TPContext

    @classmethod
    def adopt(cls, block: SparseMoeBlock, tp: TPContext) -> None:
        """Turn a block built at the per-rank size into this class in place (its parameters and names stay)."""
        block.__class__ = cls
        block.tp = tp

    def run(self, x: torch.Tensor, backend: str) -> torch.Tensor:
        return self.tp.all_reduce(super().run(x, backend))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding; other ids embed to zero here and the all-reduce fills them
    in from the rank that owns them (each sum has exactly one non-zero term, so it is exact)."""

    def __init__(self, rows: int, hidden_size: int, start: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.start = start
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))
