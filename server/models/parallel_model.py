"""One rank's shard of a tensor-parallel model of any family: the family's own class built at the per-rank size
(parallel.local_config), with the communicating modules swapped in, and each full tensor cut down to this rank's
part before it loads (`local_tensors`). At tensor_parallel_size 1 none of this is used: the model is the family's,
unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache
from typing import TYPE_CHECKING

import torch

from metronome.server.models.config import ModelConfig
from metronome.server.models.families import model_class
from metronome.server.models.moe import SparseMoeBlock
from metronome.server.models.parallel import TPContext, local_config, plan_shards, shard_for, vocab_rows
from metronome.server.models.parallel_layers import RowParallelLinear, RowParallelMoeBlock, VocabParallelEmbedding
from metronome.server.models.random_weights import norm_fill, random_init_std

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend
    from metronome.server.models.quant.scheme import Fp8Scheme


class TensorParallel:
    """Mixed in before a family's class (`tensor_parallel_class`): builds the family at this rank's size, then
    makes o_proj and the MLP's down projection row-parallel (an expert block: its experts' and shared expert's
    partial sums all-reduced once), the embedding vocabulary-parallel, and the logits whole on every rank."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend, tp: TPContext):
        plan = plan_shards(config, tp.world_size)
        super().__init__(local_config(config, plan), attention)
        self.full_config = config
        self.plan = plan
        self.tp = tp
        hidden = config.hidden_size
        self.model.embed_tokens = VocabParallelEmbedding(plan.vocab_per_rank, hidden,
                                                         vocab_rows(plan, tp.rank)[0], tp)
        for layer in self.model.layers:
            layer.self_attn.o_proj = RowParallelLinear(plan.num_heads * plan.head_dim, hidden,
                                                       config.attention_output_bias, tp)
            if isinstance(layer.mlp, SparseMoeBlock):
                RowParallelMoeBlock.adopt(layer.mlp, tp)
            else:
                layer.mlp.down_proj = RowParallelLinear(plan.intermediate_size, hidden, config.mlp_bias, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every rank gets the full float32 [N, vocab] logits (its shard's columns all-gathered)."""
        local = super().compute_logits(hidden)
        return self.tp.all_gather_last_dim(local)[:, : self.plan.vocab_size]

    def local_tensors(self, weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full transformers-named tensors in (CPU or device), this rank's part of each out (views where possible):
        what load_weights, or the FP8 loader, then copies to the device. `block`: an FP8 checkpoint's weight-scale
        block, if its scales are block grids."""
        rank, plan = self.tp.rank, self.plan
        for name, tensor in weights:
            ours = self.checkpoint_name(name)  # a family's own name for it (None: not part of the model)
            yield name, tensor if ours is None else shard_for(ours, tensor, plan, rank, block)


@cache
def tensor_parallel_class(family: type) -> type:
    """A family's model class with TensorParallel mixed in: TensorParallelQwen3MoeForCausalLM, ..."""
    return type(f"TensorParallel{family.__name__}", (TensorParallel, family), {})


def build_empty_tp_model(config: ModelConfig, attention: AttentionBackend, device: torch.device,
                         dtype: torch.dtype, tp: TPContext, quantization: Fp8Scheme | None = None
                         ) -> TensorParallel:
    """Like loader.build_empty_model: per-rank weights allocated once, on the device, uninitialised; with
    `quantization`, the decoder's linears (row-parallel ones included) are FP8 ones of the per-rank size."""
    with torch.device("meta"):
        model = tensor_parallel_class(model_class(config))(config, attention, tp)
    model = model.to(dtype)
    if quantization is not None:
        from metronome.server.models.quant.loading import prepare_model

        prepare_model(model, model.config, quantization)
    model = model.to_empty(device=device)
    model.requires_grad_(False)
    return model.eval()


_UNFUSE = {".self_attn.qkv_proj.": (".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."),
           ".mlp.gate_up_proj.": (".mlp.gate_proj.", ".mlp.up_proj.")}


def random_full_weights(config: ModelConfig, seed: int, device: torch.device,
                        dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The exact weights `random_weights.init_random_weights` gives the whole model (same generator, same
    order, same device and dtype), produced one full tensor at a time under transformers' names, so every rank
    can keep its shard of the very model tensor_parallel_size 1 would run."""
    from metronome.server.models.families import build_model

    with torch.device("meta"):
        full = build_model(config, attention=None)  # any family: the FP8 path loads random weights this way too
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, meta_param in full.named_parameters():
        values = torch.empty(meta_param.shape, dtype=dtype, device=device)
        std = random_init_std(name, config.num_hidden_layers)
        if std is None:
            values.fill_(norm_fill(config))
        else:
            values.normal_(0.0, std, generator=generator)
        yield from _unfused(name, _checkpoint_form(name, values, config), config)


def _checkpoint_form(name: str, values: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An MoE block's stacked experts as its family's checkpoints lay them out (gpt-oss's differ from ours)."""
    if config.moe is None or ".mlp.experts." not in name:
        return values
    from metronome.server.models.moe import checkpoint_form

    return checkpoint_form(name[name.index(".mlp.") + len(".mlp."):], values, config.moe)


def _unfused(name: str, values: torch.Tensor, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for fused, parts in _UNFUSE.items():
        if fused in name:
            sizes = ([config.q_size, config.kv_size, config.kv_size] if "qkv" in fused
                     else [values.shape[0] // 2, values.shape[0] // 2])
            for part, piece in zip(parts, values.split(sizes, dim=0)):
                yield name.replace(fused, part), piece
            return
    yield name, values
