"""The mixture-of-experts families over the shared decoder: the pre-norm block (llama.py) whose MLP is the expert
block (moe.py) on the layers the config names (`config.moe_layers`; a dense gated MLP elsewhere).

What the families share here: building each layer's MLP, loading the expert tensors of any checkpoint layout into
the stacked parameters (the blocks read them, moe.SparseMoeBlock.load_tensor), the experts' backend for the whole
model (`set_moe_backend`), and compiling the fused kernels' tile classes before serving (`warm_up_kernels`). The
families themselves (qwen3_moe.py, qwen2_moe.py, mixtral.py, gpt_oss.py) only say how they differ.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from metronome.server.models.config import ModelConfig
from metronome.server.models.layers import ModelParts, dense_mlp
from metronome.server.models.llama import LlamaForCausalLM
from metronome.server.models.moe import MOE_BACKENDS, SparseMoeBlock

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend

_LAYER_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(.+)")
_STACKED_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj|gate_up_scale|down_scale)")


def moe_or_dense_mlp(config: ModelConfig, layer: int, linear) -> torch.nn.Module:
    if config.is_moe_layer(layer):
        return SparseMoeBlock(config.hidden_size, config.moe)
    return dense_mlp(config, layer, linear)


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, attention: AttentionBackend, parts: ModelParts | None = None):
        if config.moe is None:
            raise ValueError(f"architecture {config.architecture!r} needs config.moe")
        super().__init__(config, attention, replace(parts or ModelParts(), mlp=moe_or_dense_mlp))

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    def set_moe_backend(self, backend: str) -> None:
        """The routed experts' backend for every layer: one of moe.MOE_BACKENDS (auto: triton on CUDA)."""
        if backend not in MOE_BACKENDS:
            raise ValueError(f"unknown MoE backend {backend!r}; choose one of {', '.join(MOE_BACKENDS)}")
        for block in self.moe_blocks().values():
            block.backend = backend

    @property
    def moe_backend(self) -> str:
        return next(iter(self.moe_blocks().values())).backend

    def graph_capture_problem(self, device: torch.device) -> str | None:
        """Why a CUDA graph cannot capture this model's forward on `device`, or None."""
        backend = self.moe_backend
        if backend == "reference" or (backend == "auto" and not self.use_fused(device)):
            return "the MoE reference backend reads each step's routing on the host (choose triton or grouped_mm)"
        return None

    # ---- weights -------------------------------------------------------------------------------------------

    def load_own_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int]] | None:
        found = _LAYER_MLP.fullmatch(name)
        if found is None:
            return None
        layer, rest = int(found.group(1)), found.group(2)
        block = self.moe_blocks().get(layer)
        if block is None:
            return None
        prefix = f"model.layers.{layer}.mlp."
        return [(prefix + target, shard) for target, shard in block.load_tensor(rest, tensor)]

    def load_weights(self, weights) -> None:
        try:
            super().load_weights(weights)
        except ValueError:
            self._refuse_unpaired_mxfp4()  # the more telling reason for the missing experts
            raise
        self._refuse_unpaired_mxfp4()

    def _refuse_unpaired_mxfp4(self) -> None:
        pending = [f"model.layers.{i}.mlp.experts.{part}" for i, block in self.moe_blocks().items()
                   for part in block.pending()]
        if pending:
            raise ValueError(f"checkpoint holds MXFP4 halves without their other half, e.g. {pending[:2]}")

    def shard_tensor_name(self, name: str, shard: int) -> str:
        """A stacked expert parameter's shard as one expert's tensor: experts.gate_up_scale shard 11 is expert 5's
        up_proj.weight_scale (Qwen's names; Mixtral's w1/w3/w2 load the same)."""
        found = _STACKED_EXPERT.fullmatch(name)
        if found is None or shard < 0:
            return name
        prefix, param = found.group(1), found.group(2)
        expert, projection = (shard // 2, ("gate_proj", "up_proj")[shard % 2]) if param.startswith("gate_up") \
            else (shard, "down_proj")
        return f"{prefix}.{expert}.{projection}.{'weight_scale' if param.endswith('scale') else 'weight'}"

    def _expected_shards(self) -> dict[str, list[int]]:
        expected = {name: shards for name, shards in super()._expected_shards().items()
                    if not _is_block_parameter(name, self.moe_blocks())}
        for layer, block in self.moe_blocks().items():
            for target, shard in block.expected_shards():
                expected.setdefault(f"model.layers.{layer}.mlp.{target}", []).append(shard)
        return expected

    # ---- kernels -------------------------------------------------------------------------------------------

    def warm_up_kernels(self, device: torch.device) -> int:
        """Run the fused experts once per tile class (kernels/triton_moe.py) on the first MoE block, so that
        Triton compiles every variant a step can launch before serving. Returns the launches made."""
        blocks = self.moe_blocks()
        block = blocks[min(blocks)]
        uses_triton = block.backend == "triton" or (block.backend == "auto" and self.use_fused(device))
        if device.type != "cuda" or not uses_triton:
            return 0
        from metronome.kernels.triton_moe import representative_token_counts

        spec = self.config.moe
        dtype = block.experts.dtype
        generator = torch.Generator(device=device).manual_seed(0)
        launches = 0
        for tokens in representative_token_counts(spec.top_k, spec.num_experts):
            x = torch.zeros(tokens, self.config.hidden_size, dtype=dtype, device=device)
            ids = torch.rand(tokens, spec.num_experts, generator=generator, device=device).topk(spec.top_k).indices
            weights = torch.full(ids.shape, 1.0 / spec.top_k, dtype=dtype, device=device)
            block.routed(x, weights, ids, "triton")
            launches += 1
        return launches


def _is_block_parameter(name: str, blocks: dict[int, SparseMoeBlock]) -> bool:
    found = _LAYER_MLP.fullmatch(name)
    return found is not None and int(found.group(1)) in blocks
