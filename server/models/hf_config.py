"""A Hugging Face `config.json` (+ `generation_config.json`) → ModelConfig, one small reader per family.

Reads both the classic keys (`rope_theta`, `rope_scaling`, `rope_local_base_freq`) and transformers 5's
`rope_parameters` (flat, or per layer type for Gemma 3). Sliding windows are read as the model defines them
(Mistral and Phi-3: every layer; Qwen2/Qwen3: layers from `max_window_layers` on when `use_sliding_window`;
Gemma 3: `layer_types` or every `sliding_window_pattern`-th layer global; gpt-oss: `layer_types`) and never cap
the context. The mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss) add their expert block
(moe_config.moe_spec_from_hf) and which layers carry it.
"""
from __future__ import annotations

import math
from typing import Any

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    UnsupportedModelError,
)

HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "phi3", "qwen2_moe", "qwen3_moe",
                  "mixtral", "gpt_oss")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def normalize_rope_scaling(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """Bring the rope_scaling / rope_parameters dict of any transformers version to one form (None = plain)."""
    if not raw:
        return None
    scaling = {k: v for k, v in raw.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = raw.get("rope_type") or raw.get("type") or "default"
    if scaling["rope_type"] == "su":  # Phi-3's first name for longrope
        scaling["rope_type"] = "longrope"
    if scaling["rope_type"] == "default":
        return None
    return scaling


def _eos_tuple(*values: Any) -> tuple[int, ...]:
    """Merge eos ids given as int, list or None, keeping first-seen order."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item >= 0 and item not in ids:
                ids.append(item)
    return tuple(ids)


def config_from_hf_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """A Hugging Face `config.json` (+ optional `generation_config.json`) → ModelConfig."""
    model_type = raw.get("model_type")
    if model_type == "gemma3":  # the multimodal checkpoint: its text model is served, the vision tower skipped
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelNotFoundError("a gemma3 config.json needs a text_config object")
        raw = {**text, "model_type": "gemma3_text",
               "tie_word_embeddings": text.get("tie_word_embeddings", raw.get("tie_word_embeddings", True)),
               "eos_token_id": text.get("eos_token_id", raw.get("eos_token_id"))}
        model_type = "gemma3_text"
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {', '.join(HF_MODEL_TYPES)}")
    try:
        fields = _common_fields(raw, generation or {})
        fields.update(_FAMILY_READERS[model_type](raw, fields))
        return ModelConfig(**fields)
    except KeyError as missing:
        raise ModelNotFoundError(f"config.json lacks the field {missing.args[0]!r}") from None
    except (TypeError, ValueError) as bad:
        if isinstance(bad, ModelNotFoundError):
            raise
        raise ModelNotFoundError(f"config.json has a malformed field: {bad}") from None


def _common_fields(raw: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    act_name = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act_name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported hidden_act {act_name!r}; supported: {', '.join(_ACTIVATIONS)}")
    rope_params = raw.get("rope_parameters") or {}
    return dict(
        architecture=raw["model_type"],
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_scaling=normalize_rope_scaling(raw.get("rope_scaling") or rope_params),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        attention_output_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=_ACTIVATIONS[act_name],
        bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
        eos_token_ids=_eos_tuple(generation.get("eos_token_id"), raw.get("eos_token_id")),
    )


def _window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    return int(window) if window else None


def _qwen_windows(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3 carry a window but use it only with use_sliding_window, on layers >= max_window_layers."""
    window = _window(raw) if raw.get("use_sliding_window", False) else None
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        SLIDING_ATTENTION if i >= int(raw.get("max_window_layers", layers)) else FULL_ATTENTION
        for i in range(layers)]
    return {"sliding_window": window, "layer_types": tuple(types)}


def _llama(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {}


def _mistral(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": _window(raw)}  # every layer, when set


def _qwen2(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, "attention_output_bias": False, **_qwen_windows(raw)}


def _qwen3(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, **_qwen_windows(raw)}


def _phi3(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    rope_params = raw.get("rope_parameters") or {}
    scaling = fields["rope_scaling"]
    if scaling is not None and scaling["rope_type"] == "longrope":
        scaling.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    partial = rope_params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return {"sliding_window": _window(raw), "partial_rotary_factor": float(partial)}


def _gemma3(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)]
    rope_params = raw.get("rope_parameters") or {}
    if FULL_ATTENTION in rope_params:  # transformers 5: one rope per layer type
        full, local = rope_params[FULL_ATTENTION] or {}, rope_params.get(SLIDING_ATTENTION) or {}
        global_theta = float(full.get("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", 10_000.0))
        if normalize_rope_scaling(local) is not None:
            raise UnsupportedModelError("rope scaling on Gemma 3's sliding layers is not supported")
        scaling = normalize_rope_scaling(full)
    else:
        global_theta = float(raw.get("rope_theta", 1_000_000.0))
        local_theta = float(raw.get("rope_local_base_freq", 10_000.0))
        scaling = normalize_rope_scaling(raw.get("rope_scaling"))
    return {
        "architecture": "gemma3",
        "rope_theta": global_theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
        "sliding_window": _window(raw),
        "layer_types": tuple(types),
        "qk_norm": True,
        "norm_plus_one": True,
        "sandwich_norm": True,
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True)),
        "embedding_scale": math.sqrt(fields["hidden_size"]),
        "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
        # Gemma 3 replaced attention soft-capping by QK-norm: its config may still carry the field, which its
        # reference implementation does not apply. Only the final logits are capped.
        "final_logit_softcapping": _optional_float(raw.get("final_logit_softcapping")),
        "notes": (("attn_logit_softcapping is not applied by Gemma 3",)
                  if raw.get("attn_logit_softcapping") is not None else ()),
    }


def _moe(raw: dict[str, Any]) -> dict[str, Any]:
    from metronome.server.models.moe_config import moe_layer_indices, moe_spec_from_hf

    layers = int(raw["num_hidden_layers"])
    sparse = moe_layer_indices(raw, layers)
    return {"moe": moe_spec_from_hf(raw), "moe_layers": None if len(sparse) == layers else sparse}


def _qwen2_moe(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("qkv_bias", True))  # Qwen2-MoE: biases on q/k/v, none on o_proj
    return {"attention_bias": bias, "attention_output_bias": False, **_qwen_windows(raw), **_moe(raw)}


def _qwen3_moe(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, **_qwen_windows(raw), **_moe(raw)}


def _mixtral(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": _window(raw), **_moe(raw)}


def _gpt_oss(raw: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)]
    return {"sliding_window": _window(raw), "layer_types": tuple(types), "attention_sinks": True,
            "norm_float_scale": True, **_moe(raw)}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


_FAMILY_READERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3_text": _gemma3,
                   "phi3": _phi3, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
                   "gpt_oss": _gpt_oss}
