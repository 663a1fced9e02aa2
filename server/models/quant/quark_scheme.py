"""AMD Quark's FP8 exports (`quant_method: quark`, written by `quark.torch.export_safetensors`; the `amd/*-FP8-KV`
checkpoints) as an Fp8Scheme. No torch here.

`global_quant_config` gives the `weight` and `input_tensors` specs (`dtype: fp8_e4m3`): Quark's `fp8` scheme is
per-tensor weights with static per-tensor inputs, `ptpc_fp8` per-channel weights (a [N] `weight_scale`) with
dynamic per-token inputs. `exclude` lists fnmatch patterns over full module names (a parent's pattern does not
cover its children). With `export.kv_cache_group` (`*k_proj`, `*v_proj`) the k and v projections' `output_tensors`
are FP8 per tensor and their `output_scale` is the layer's KV-cache scale (Quark stores the larger of the two on
both). Quark quantises the Linear modules it finds, so a mixture of experts' routed experts are FP8 only where the
exporting transformers held them as one Linear an expert (Fp8Scheme.experts_follow_checkpoint).
"""
from __future__ import annotations

import fnmatch
from typing import Any

from metronome.server.models.quant.scheme import (
    Fp8Scheme,
    KVCacheScheme,
    QuantizationConfigError,
    config_object,
)

QUARK_FP8 = "fp8_e4m3"


def from_quark(raw: dict[str, Any]) -> Fp8Scheme:
    where = "quantization_config"
    export = config_object(raw.get("export") or {}, f"{where}.export")
    if export.get("weight_format", "real_quantized") != "real_quantized":
        raise QuantizationConfigError(f"{where}.export.weight_format {export.get('weight_format')!r}: only "
                                      "real_quantized exports (FP8 weights with their scales) are served")
    if raw.get("layer_type_quant_config"):
        raise QuantizationConfigError(f"{where}.layer_type_quant_config: per-layer-type schemes are not served")
    if raw.get("softmax_quant_spec") is not None:
        raise QuantizationConfigError(f"{where}.softmax_quant_spec: FP8 attention is not served")
    _quark_algorithms(raw.get("algo_config"), f"{where}.algo_config")
    weights, activations = _quark_layer(config_object(raw.get("global_quant_config"), f"{where}.global_quant_config"),
                                        f"{where}.global_quant_config")
    kv_patterns = export.get("kv_cache_group") or []
    kv_cache = None
    for table in ("layer_quant_config", "kv_cache_quant_config"):
        for pattern, layer in config_object(raw.get(table) or {}, f"{where}.{table}").items():
            field = f"{where}.{table}.{pattern}"
            layer = config_object(layer, field)
            if _quark_layer(layer, field) != (weights, activations):
                raise QuantizationConfigError(f"{field}: a scheme other than global_quant_config's is not served")
            if layer.get("output_tensors") is not None:
                if pattern not in kv_patterns:
                    raise QuantizationConfigError(f"{field}.output_tensors: output quantisation outside the KV "
                                                  "cache (export.kv_cache_group) is not served")
                _quark_spec(layer["output_tensors"], f"{field}.output_tensors", "per_tensor", static=True)
                kv_cache = KVCacheScheme("tensor")
    excluded = raw.get("exclude") or []
    if not isinstance(excluded, list) or not all(isinstance(p, str) and p for p in excluded):
        raise QuantizationConfigError(f"{where}.exclude must be a list of module names or fnmatch patterns")
    ignore = tuple(f"re:{fnmatch.translate(p)}" for p in excluded)
    return Fp8Scheme("quark", weights, activations, None, ignore, kv_cache)


# Quark's algorithms whose effect the export folds into the stored weights and norms (served as stored); a rotation
# is too unless it rotates activations at run time (online R1, R3, R4), which this server does not do.
QUARK_FOLDED_ALGORITHMS = ("smooth", "autosmoothquant", "awq", "gptq", "gptaq", "qronos", "autoround", "rotation")


def _quark_algorithms(algorithms: Any, field: str) -> None:
    entries = algorithms if isinstance(algorithms, list) else [] if algorithms in (None, {}) else [algorithms]
    for entry in entries:
        name = entry.get("name") if isinstance(entry, dict) else None
        online = isinstance(entry, dict) and any(entry.get(k) for k in ("online_r1_rotation", "r3", "r4"))
        if name not in QUARK_FOLDED_ALGORITHMS or online:
            raise QuantizationConfigError(f"{field}: {name or entry!r}{' with online rotations' if online else ''} "
                                          "changes the model at run time; served are the algorithms an export folds "
                                          f"into its weights ({', '.join(QUARK_FOLDED_ALGORITHMS)})")


def _quark_layer(layer: dict[str, Any], field: str) -> tuple[str, str]:
    """A Quark layer config's (weight granularity, activation scheme)."""
    if layer.get("bias") is not None:
        raise QuantizationConfigError(f"{field}.bias: bias quantisation is not served")
    if layer.get("weight") is None:
        raise QuantizationConfigError(f"{field}.weight: a layer config without FP8 weights is not served")
    if layer.get("input_tensors") is None:
        raise QuantizationConfigError(f"{field}.input_tensors: weight-only FP8 is not served")
    if layer.get("output_tensors") is not None and field.endswith("global_quant_config"):
        raise QuantizationConfigError(f"{field}.output_tensors: output quantisation is not served")
    weight = _quark_spec(layer["weight"], f"{field}.weight", "per_tensor", "per_channel", static=True)
    if weight == "per_channel" and layer["weight"].get("ch_axis", 0) != 0:
        raise QuantizationConfigError(f"{field}.weight.ch_axis {layer['weight'].get('ch_axis')!r}: per-channel "
                                      "weight scales are per output row (ch_axis 0)")
    inputs = layer["input_tensors"]
    qscheme = _quark_spec(inputs, f"{field}.input_tensors", "per_tensor", "per_channel")
    if not inputs.get("is_dynamic"):
        if qscheme != "per_tensor":
            raise QuantizationConfigError(f"{field}.input_tensors: static scales must be per tensor, got {qscheme!r}")
        return ("tensor" if weight == "per_tensor" else "channel"), "static"
    # Dynamic inputs are served per token: per_channel along the token axis is that, and per_tensor gets each
    # row's own scale (at least as accurate, and fused into the kernels that produce the activation).
    return ("tensor" if weight == "per_tensor" else "channel"), "token"


def _quark_spec(spec: Any, field: str, *qschemes: str, static: bool = False) -> str:
    spec = config_object(spec, field)
    if spec.get("dtype") != QUARK_FP8:
        raise QuantizationConfigError(f"{field}.dtype {spec.get('dtype')!r}: only {QUARK_FP8} is served")
    if spec.get("symmetric", True) is not True:
        raise QuantizationConfigError(f"{field}.symmetric: asymmetric FP8 is not served")
    if spec.get("qscheme") not in qschemes:
        raise QuantizationConfigError(f"{field}.qscheme {spec.get('qscheme')!r}: served are {', '.join(qschemes)}")
    if static and spec.get("is_dynamic"):
        raise QuantizationConfigError(f"{field}.is_dynamic: these scales must be stored in the checkpoint")
    return spec["qscheme"]
