"""Reading FP8 schemes from config.json `quantization_config` (the layouts vLLM serves) and `--quantization fp8`;
every scheme this server cannot run is refused with the field it comes from."""
from __future__ import annotations

import pytest

from metronome.contract.errors import InvalidRequestError
from metronome.server.models.quant.scheme import (
    Fp8Scheme,
    QuantizationConfigError,
    online_scheme,
    resolve_scheme,
    scheme_from_config,
)


def _ct(weights: dict, inputs: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                                **weights},
             "input_activations": None if inputs is None else {"num_bits": 8, "type": "float", "symmetric": True,
                                                               **inputs},
             "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **extra}


@pytest.mark.parametrize("raw, weights, activations, block", [
    ({"quant_method": "fp8", "activation_scheme": "static"}, "tensor", "static", None),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "tensor", "token", None),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
     "block", "group", (128, 128)),
    (_ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}), "channel", "token", None),
    (_ct({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}), "tensor", "static", None),
    (_ct({"strategy": "block", "block_structure": [128, 128]}, {"strategy": "group", "group_size": 128,
                                                               "dynamic": True}), "block", "group", (128, 128)),
    (_ct({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": True}), "tensor", "token", None),
])
def test_layouts_read_from_quantization_config(raw, weights, activations, block):
    scheme = scheme_from_config(raw)
    assert (scheme.weights, scheme.activations, scheme.block) == (weights, activations, block)
    assert scheme.prequantized
    assert scheme.activation_group == (block[1] if block else None)


def test_ignore_lists_match_checkpoint_module_names():
    ignore = ["lm_head", "re:.*layers\\.1\\.mlp\\..*", "model.layers.0.self_attn.o_proj"]
    scheme = scheme_from_config(_ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}, ignore=ignore))
    assert scheme.ignores("lm_head")
    assert scheme.ignores("model.layers.1.mlp.down_proj")
    assert scheme.ignores("model.layers.0.self_attn.o_proj")
    assert not scheme.ignores("model.layers.0.mlp.down_proj")
    assert not scheme.ignores("model.layers.10.self_attn.o_proj")
    fp8 = scheme_from_config({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.mlp.up_proj"]})
    assert fp8.ignores("model.layers.0.mlp.up_proj") and not fp8.ignores("lm_head")
    assert scheme_from_config({"quant_method": "fp8"}).ignores("lm_head")


def test_targets_choose_the_quantised_linears():
    raw = _ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True})
    raw["config_groups"]["group_0"]["targets"] = ["re:.*mlp\\..*_proj$"]
    scheme = scheme_from_config(raw)
    assert not scheme.ignores("model.layers.3.mlp.down_proj")
    assert scheme.ignores("model.layers.3.self_attn.o_proj")  # no target covers it: stays bf16
    raw["config_groups"]["group_0"]["targets"] = ["Embedding"]
    with pytest.raises(QuantizationConfigError, match="only Linear layers"):
        scheme_from_config(raw)


def test_kv_cache_scheme_is_read():
    raw = _ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True},
              kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                               "symmetric": True})
    assert scheme_from_config(raw).kv_cache.granularity == "tensor"
    raw["kv_cache_scheme"]["strategy"] = "attn_head"
    assert scheme_from_config(raw).kv_cache.granularity == "head"


MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}


def test_modelopt_configs_are_read_in_both_forms():
    """config.json's form (flat, compressed-tensors-like) and hf_quant_config.json's (nested under quantization,
    glob exclusions): the quant_algo decides, not the config_groups written beside it."""
    flat = {"quant_method": "modelopt", "quant_algo": "FP8", "producer": MODELOPT_PRODUCER,
            "ignore": ["lm_head", "model.embed_tokens"],
            "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": False},
                                          "targets": ["Linear"]}},
            "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    scheme = scheme_from_config(flat)
    assert (scheme.source, scheme.weights, scheme.activations) == ("modelopt", "tensor", "static")
    assert scheme.kv_cache.granularity == "tensor" and scheme.ignores("lm_head")
    nested = {"producer": MODELOPT_PRODUCER,
              "quantization": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN", "kv_cache_quant_algo": None,
                               "exclude_modules": ["lm_head", "model.layers.*.mlp.down_proj", "model.layers.1"]}}
    scheme = scheme_from_config(nested)
    assert (scheme.weights, scheme.activations, scheme.kv_cache) == ("channel", "token", None)
    assert scheme.ignores("model.layers.7.mlp.down_proj") and not scheme.ignores("model.layers.7.mlp.up_proj")
    assert scheme.ignores("model.layers.1.self_attn.q_proj")  # a parent module excludes its linears
    assert not scheme.ignores("model.layers.10.self_attn.q_proj")
    nested["quantization"]["kv_cache_quant_algo"] = "FP8"
    assert scheme_from_config(nested).kv_cache.granularity == "tensor"


def test_requested_fp8_quantises_on_the_fly_and_the_checkpoint_wins():
    assert resolve_scheme(None, None) is None
    assert resolve_scheme(None, "fp8") == online_scheme()
    assert not online_scheme().prequantized
    checkpoint = {"quant_method": "fp8", "activation_scheme": "static"}
    assert resolve_scheme(checkpoint, "fp8").source == "fp8"
    assert resolve_scheme(checkpoint, None).source == "fp8"
    with pytest.raises(InvalidRequestError, match="unknown quantization 'int4'"):
        resolve_scheme(None, "int4")
    assert "per-channel" in online_scheme().describe() and "per-token" in online_scheme().describe()


@pytest.mark.parametrize("raw, message", [
    ("fp8", "must be an object"),
    ({"quant_method": "awq", "bits": 4}, "unsupported quantization_config.quant_method 'awq'"),
    ({"quant_method": "fp8", "activation_scheme": "smooth"}, "activation_scheme"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "needs activation"),
    (_ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True}, format="pack-quantized"), "not FP8"),
    (_ct({"strategy": "group", "group_size": 128}, {"strategy": "token", "dynamic": True}), "weights.strategy"),
    (_ct({"strategy": "channel", "num_bits": 4, "type": "int"}, None), "only FP8"),
    (_ct({"strategy": "channel"}, None), "weight-only"),
    (_ct({"strategy": "channel", "symmetric": False}, {"strategy": "token", "dynamic": True}), "asymmetric"),
    (_ct({"strategy": "channel"}, {"strategy": "token", "dynamic": False}), "static scales must be per tensor"),
    (_ct({"strategy": "channel"}, {"strategy": "group", "group_size": 128, "dynamic": True}), "group_size"),
    (_ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True},
         kv_cache_scheme={"num_bits": 8, "type": "float", "dynamic": True}), "kv_cache_scheme.dynamic"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "no config_groups"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt quant_algo 'NVFP4' is not served"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8_PB_WO"}}, "'FP8_PB_WO' is not served"),
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}},
     "kv_cache_quant_algo 'NVFP4'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": "NVFP4"}, "kv_cache_scheme"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "ignore": "lm_head"}, "must be a list"),
])
def test_unservable_schemes_are_refused_with_the_field(raw, message):
    with pytest.raises(QuantizationConfigError, match=message):
        scheme_from_config(raw)


def test_mixed_config_groups_are_refused():
    raw = _ct({"strategy": "channel"}, {"strategy": "token", "dynamic": True})
    other = _ct({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False})["config_groups"]["group_0"]
    raw["config_groups"]["group_1"] = other
    with pytest.raises(QuantizationConfigError, match="different FP8 schemes"):
        scheme_from_config(raw)


def test_scheme_invariants():
    with pytest.raises(QuantizationConfigError, match="block size"):
        Fp8Scheme("fp8", "block", "group")
    with pytest.raises(QuantizationConfigError, match="per-group"):
        Fp8Scheme("fp8", "channel", "group")
    with pytest.raises(QuantizationConfigError, match="granularity"):
        Fp8Scheme("fp8", "row", "token")


def test_fbgemm_fp8_reads_per_channel_weights_and_bounded_per_token_activations():
    scheme = scheme_from_config({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                 "modules_to_not_convert": ["lm_head", "model.layers.0.mlp"]})
    assert (scheme.source, scheme.weights, scheme.activations, scheme.activation_ub) == (
        "fbgemm_fp8", "channel", "token", 1200.0)
    assert scheme.ignores("model.layers.0.mlp.down_proj") and not scheme.ignores("model.layers.0.self_attn.q_proj")
    assert "amax bounded by 1200" in scheme.describe()
    assert scheme_from_config({"quant_method": "fbgemm_fp8"}).activation_ub == 1200.0  # transformers' default
    for bad in (0, -1.0, "1200", True, float("inf")):
        with pytest.raises(QuantizationConfigError, match="activation_scale_ub must be a positive number"):
            scheme_from_config({"quant_method": "fbgemm_fp8", "activation_scale_ub": bad})
    with pytest.raises(QuantizationConfigError, match="modules_to_not_convert must be a list"):
        scheme_from_config({"quant_method": "fbgemm_fp8", "modules_to_not_convert": "lm_head"})
    with pytest.raises(QuantizationConfigError, match="'layers.\\[' is not a valid pattern"):
        scheme_from_config({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["layers.["]})
    with pytest.raises(QuantizationConfigError, match="for per-token activations"):
        Fp8Scheme("compressed-tensors", "channel", "static", activation_ub=1.0)


MODULE_NAMES = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.11.mlp.up_proj",
                "model.layers.1.self_attn.q_proj", "model.decoder.layers.23.fc1", "model.layers.0.mlp.down_proj",
                "model.layers.2.self_attn.o_proj"]


@pytest.mark.parametrize("keys", [["lm_head"], ["model.layers.1"], ["layers.*.mlp.gate"], ["fc1", "mlp.gate"],
                                  ["model.layers.0.mlp.down_proj", "o_proj"], [r"model\.layers\.(0|2)\..*"]])
def test_modules_to_not_convert_match_as_transformers_matches_them(keys):
    from transformers.quantizers.quantizers_utils import should_convert_module

    for method in ("fbgemm_fp8", "fp8"):
        scheme = scheme_from_config({"quant_method": method, "modules_to_not_convert": keys})
        assert [scheme.ignores(name) for name in MODULE_NAMES] == [
            not should_convert_module(name, keys) for name in MODULE_NAMES], (method, keys)
