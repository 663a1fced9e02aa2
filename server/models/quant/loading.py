"""Loading an FP8 model: the hooks `load_model` calls.

    prepare_model(model, config, scheme)     # on the meta device: decoder linears → Fp8Linear, an FP8
                                             # checkpoint's routed experts → FP8 storage
    load_quantized(model, config, scheme, weights)   # route FP8 tensors and scales, the rest to load_weights

Routing: a checkpoint tensor `<module>.<suffix>` whose module is (a shard of) an Fp8Linear goes to it — `weight`,
`weight_scale` / `weight_scale_inv` (the same thing under the block layout's name; torchao's flattened tensor
names them `_weight_qdata` and `_weight_scale`), `input_scale` /
`activation_scale` (transformers' name for it), `input_scale_ub` (an FBGEMM export's activation bound, checked
against the config's). KV-cache scales (`self_attn.k_scale` / `v_scale`, the older
`k_proj.output_scale` / `v_proj.output_scale`, or ModelOpt's `k_proj.k_scale` / `v_proj.v_scale`) are collected into
`kv_scales`. Everything else (norms, embeddings, biases, the LM head) goes to the model's own loader; an FP8 tensor
that reaches it would be read without its scale, so that is an error instead — except a mixture of experts'
routed experts, whose weights and scales the MoE block loads itself (moe.py).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from metronome.server.models.config import ModelConfig
from metronome.server.models.quant import fp8
from metronome.server.models.quant.fp8_linear import Fp8Linear
from metronome.server.models.quant.model_pass import (
    fp8_layers,
    fuse_activation_quant,
    quantize_loaded_experts,
    store_fp8_experts,
    swap_linears,
)
from metronome.server.models.quant.scheme import Fp8Scheme

log = logging.getLogger(__name__)

TENSOR_KINDS = {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_inv": "weight_scale",
                "input_scale": "input_scale", "activation_scale": "input_scale", "input_scale_ub": "input_scale_ub",
                # torchao's Float8Tensor, flattened into safetensors by transformers
                "_weight_qdata": "weight", "_weight_scale": "weight_scale"}
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # the MoE block's own: FP8 weight and scale pairs
KV_SCALE_NAMES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.k_proj.output_scale",
                  "self_attn.v_proj.output_scale", "self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")


def prepare_model(model: nn.Module, config: ModelConfig, scheme: Fp8Scheme) -> None:
    swapped = swap_linears(model, config, scheme)
    if scheme.prequantized:
        swapped += store_fp8_experts(model, scheme)
    if swapped == 0:
        log.warning("quantization %s covers none of the decoder's linear layers", scheme.describe())


class Fp8Router:
    """Routes checkpoint tensors to the model's Fp8Linear shards (see the module doc)."""

    def __init__(self, model: nn.Module):
        self.layers = [layer for _, layer in fp8_layers(model)]
        self.routes: dict[str, tuple[Fp8Linear, int | None]] = {}
        for name, layer in fp8_layers(model):
            self.routes[name] = (layer, None)  # a checkpoint that stores the fused matrix itself
            if len(layer.checkpoint_names) > 1:
                for shard, checkpoint_name in enumerate(layer.checkpoint_names):
                    self.routes[checkpoint_name] = (layer, shard)
            elif layer.checkpoint_names:  # a layer inside another module that the checkpoint names (tensor parallel)
                self.routes[layer.checkpoint_names[0]] = (layer, None)
        self.kv_scales: dict[str, torch.Tensor] = {}

    def route(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if _ROUTED_EXPERT.search(name):
                yield name, tensor
                continue
            module, _, suffix = name.rpartition(".")
            kind = TENSOR_KINDS.get(suffix)
            target = self.routes.get(module) if kind is not None else None
            if target is not None:
                layer, shard = target
                try:
                    layer.load(kind, shard, tensor)
                except ValueError as error:
                    raise ValueError(f"checkpoint tensor {name!r} {error}") from None
                continue
            if name.endswith(KV_SCALE_NAMES):
                self.kv_scales[name] = tensor.float()
                continue
            if tensor.dtype == fp8.FP8_DTYPE or kind not in (None, "weight"):
                what = "is FP8" if tensor.dtype == fp8.FP8_DTYPE else "is an FP8 scale"
                raise ValueError(f"checkpoint tensor {name!r} {what} but quantization_config leaves its layer "
                                 "unquantised (or this model has no such FP8 layer)")
            yield name, tensor

    def finish(self, gemm: str = "auto") -> None:
        for layer in self.layers:
            layer.finalize(gemm)


def load_quantized(model: nn.Module, config: ModelConfig, scheme: Fp8Scheme,
                   weights: Iterable[tuple[str, torch.Tensor]], gemm: str = "auto") -> None:
    """Load every tensor (FP8 shards through the router, the rest through model.load_weights), finalize the
    FP8 layers (`gemm`: their CUDA GEMM choice), then fuse activation quantisation into their producers. On the
    fly, a mixture of experts' routed experts are quantised per row once loaded."""
    router = Fp8Router(model)
    model.load_weights(router.route(weights))
    router.finish(gemm)
    if not scheme.prequantized:
        quantize_loaded_experts(model)
    fuse_activation_quant(model, config)
    model.fp8_kv_scales = router.kv_scales
    if router.kv_scales:
        log.info("checkpoint carries %d KV-cache scales", len(router.kv_scales))
