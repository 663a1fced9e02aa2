"""torchao's FP8 checkpoints (`quant_method: torchao`: transformers' TorchAoConfig saved as safetensors) as an
Fp8Scheme. No torch here.

Served: `Float8DynamicActivationFloat8WeightConfig` — granularity `PerRow` is per-channel weights ([N, 1]) with
dynamic per-token activations, `PerTensor` one weight scale ([1, 1]) with dynamic activations (torchao: one scale
for the whole batch; served per token, as every dynamic layout is); `activation_value_ub` bounds each token's amax
as FBGEMM's bound does. Tensors are torchao's Float8Tensor flattened: `<module>._weight_qdata` (e4m3) and
`<module>._weight_scale` (loading.py routes them). transformers serialises the config as
{"_type": class name, "_data": fields}, under `quant_type.default`.
"""
from __future__ import annotations

from math import inf
from typing import Any

from metronome.server.models.quant.scheme import Fp8Scheme, QuantizationConfigError, config_object, not_converted

TORCHAO_FP8 = "Float8DynamicActivationFloat8WeightConfig"
TORCHAO_GRANULARITIES = {"PerRow": "channel", "PerTensor": "tensor"}


def from_torchao(raw: dict[str, Any]) -> Fp8Scheme:
    where = "quantization_config.quant_type"
    quant_type = raw.get("quant_type")
    if isinstance(quant_type, dict) and "_type" not in quant_type:
        if set(quant_type) != {"default"}:
            raise QuantizationConfigError(f"{where}: per-module torchao configs ({', '.join(map(str, quant_type))}) "
                                          "are not served; one `default` config is")
        quant_type, where = quant_type["default"], f"{where}.default"
    config = config_object(quant_type, where)
    if config.get("_type") != TORCHAO_FP8:
        raise QuantizationConfigError(f"{where}._type {config.get('_type')!r}: of torchao's configs only "
                                      f"{TORCHAO_FP8} (FP8 weights and dynamic FP8 activations) is served")
    data = config_object(config.get("_data"), f"{where}._data")
    for field in ("activation_dtype", "weight_dtype"):
        dtype = _torchao_value(data.get(field, "float8_e4m3fn"))
        if dtype != "float8_e4m3fn":
            raise QuantizationConfigError(f"{where}._data.{field} {dtype!r}: only float8_e4m3fn is served")
    if data.get("activation_value_lb") is not None:
        raise QuantizationConfigError(f"{where}._data.activation_value_lb: a lower bound on activation scales is "
                                      "not served")
    granularity = data.get("granularity") or {"_type": "PerTensor"}
    granularity = granularity if isinstance(granularity, list) else [granularity, granularity]
    kinds = {g.get("_type") if isinstance(g, dict) else g for g in granularity}
    if len(granularity) != 2 or len(kinds) != 1 or not kinds <= set(TORCHAO_GRANULARITIES):
        raise QuantizationConfigError(f"{where}._data.granularity {granularity!r}: served are PerRow and PerTensor, "
                                      "the same for activations and weights")
    weights = TORCHAO_GRANULARITIES[kinds.pop()]
    if raw.get("include_input_output_embeddings"):
        raise QuantizationConfigError("quantization_config.include_input_output_embeddings: the embeddings and the "
                                      "LM head are served in the model dtype")
    bound = data.get("activation_value_ub")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not 0 < bound < inf):
        raise QuantizationConfigError(f"{where}._data.activation_value_ub must be a positive number, got {bound!r}")
    return Fp8Scheme("torchao", weights, "token", None, not_converted(raw) + ("lm_head",),
                     activation_ub=None if bound is None else float(bound))


def _torchao_value(value: Any) -> Any:
    """A serialised torchao field's value: {"_type": ..., "_data": value} or the plain value."""
    return value.get("_data") if isinstance(value, dict) else value
