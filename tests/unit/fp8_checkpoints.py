"""Tiny FP8 checkpoints in each layout vLLM serves, written with safetensors from a transformers model, and the
FP8 reference forward they are checked against.

The reference is transformers' own model with every quantised linear's weight replaced by its dequantised
checkpoint value and its input fake-quantised (quantise, then dequantise) the way the layout says — so it is the
FP8 math done by an independent forward (transformers'), and our loader, shard fusion and emulated GEMM must
reproduce it to float32 rounding.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from metronome.server.models.quant import fp8

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
STATIC_INPUT_SCALE = 0.02  # a calibrated per-tensor input scale stands in: any fixed value exercises the path

LAYOUTS = {
    # name: (quantization_config, weight granularity, scale tensor name, input scale name, activation)
    "fp8-static": ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "weight_scale",
                   "input_scale", "static"),
    "fp8-dynamic": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None},
                    "tensor", "weight_scale_inv", None, "token"),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [32, 32]}, "block", "weight_scale_inv", None, "group"),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                    "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                              "symmetric": True, "dynamic": True}}}},
                   "channel", "weight_scale", None, "token"),
    # Meta's FP8 releases: per-channel weights, per-token activations whose amax is bounded (a bound this low
    # clips most tokens of the tiny model, so the bound is exercised in every layer)
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1.0, "modules_to_not_convert": ["lm_head"]},
               "channel", "weight_scale", None, "token-ub"),
}
BLOCK = (32, 32)
FBGEMM_UB = 1.0


def quantize_weight(weight: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale as the checkpoint stores it)."""
    if granularity == "tensor":
        q, scale = fp8.quantize_per_tensor(weight)
        return q, scale  # 0-d, as AutoFP8 writes it
    if granularity == "channel":
        q, scale = fp8.quantize_per_channel(weight)
        return q, scale[:, None]  # [N, 1], as compressed-tensors writes it
    return fp8.quantize_per_block(weight, BLOCK)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, granularity: str) -> torch.Tensor:
    if granularity == "block":
        return fp8.dequantize(q, fp8.expand_blocks(scale, tuple(q.shape), BLOCK))
    return fp8.dequantize(q, scale)


def write_fp8_checkpoint(folder: Path, hf_model, layout: str) -> dict[str, torch.Tensor]:
    """Save hf_model (a saved transformers folder already) in `layout`: decoder linears as FP8 with scales.
    Returns the dequantised weight of every quantised linear by checkpoint module name."""
    quant_config, granularity, scale_name, input_name, _ = LAYOUTS[layout]
    extra = None if input_name is None else (lambda module: {input_name: torch.tensor(STATIC_INPUT_SCALE)})
    return write_linears_in_fp8(folder, hf_model, quant_config, granularity, scale_name=scale_name, extra=extra)


def write_linears_in_fp8(folder: Path, hf_model, quant_config: dict, granularity: str, *, weight_name: str = "weight",
                         scale_name: str = "weight_scale",
                         scale_shape: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         extra: Callable[[str], dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
    """hf_model's state (a saved transformers folder already) rewritten with its decoder linears in FP8, under a
    tool's names: `<module>.<weight_name>` codes, `<module>.<scale_name>` (reshaped by `scale_shape`, else as
    quantize_weight gives it) and `extra(module)`'s tensors; `quant_config` becomes config.json's
    quantization_config. Returns the dequantised weight of every quantised linear by checkpoint module name."""
    tensors: dict[str, torch.Tensor] = {}
    dequantised: dict[str, torch.Tensor] = {}
    tied = hf_model.config.tie_word_embeddings
    for name, value in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # the embedding, shared
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.startswith("model.layers.") and module.endswith(LINEARS):
            q, scale = quantize_weight(value.float(), granularity)
            tensors[f"{module}.{weight_name}"] = q
            tensors[f"{module}.{scale_name}"] = scale if scale_shape is None else scale_shape(scale)
            tensors.update((f"{module}.{key}", tensor) for key, tensor in (extra(module) if extra else {}).items())
            dequantised[module] = dequantize_weight(q, scale, granularity)
        else:
            tensors[name] = value.contiguous()
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant_config
    (folder / "config.json").write_text(json.dumps(config))
    return dequantised


def fake_quant(x: torch.Tensor, activation: str) -> torch.Tensor:
    """Quantise then dequantise an activation [..., K] as the layout's FP8 GEMM sees it."""
    flat = x.reshape(-1, x.shape[-1]).float()
    if activation == "static":
        q, scale = fp8.quantize_per_tensor(flat, torch.tensor(STATIC_INPUT_SCALE))
        out = fp8.dequantize(q, scale)
    elif activation == "group":
        q, scale = fp8.quantize_per_group(flat, BLOCK[1])
        out = fp8.dequantize(q, fp8.expand_groups(scale, flat.shape[-1], BLOCK[1]))
    else:
        q, scale = fp8.quantize_per_token(flat, FBGEMM_UB if activation == "token-ub" else None)
        out = fp8.dequantize(q, scale)
    return out.to(x.dtype).reshape(x.shape)


def reference_logits(hf_model, dequantised: dict[str, torch.Tensor], activation: str | Callable,
                     ids: list[int]) -> torch.Tensor:
    """transformers' forward with dequantised FP8 weights and fake-quantised linear inputs (`activation`: a
    layout's activation scheme, or the fake-quantising function itself)."""
    quantize = activation if callable(activation) else lambda x: fake_quant(x, activation)
    hooks = []
    with torch.no_grad():
        for module_name, weight in dequantised.items():
            module = hf_model.get_submodule(module_name)
            module.weight.copy_(weight)
            hooks.append(module.register_forward_pre_hook(lambda _m, args: (quantize(args[0]),)))
        try:
            return hf_model(torch.tensor([ids])).logits[0].float()
        finally:
            for hook in hooks:
                hook.remove()
