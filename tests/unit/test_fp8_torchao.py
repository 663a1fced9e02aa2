"""torchao FP8 checkpoints (`quant_method: torchao`, transformers' TorchAoConfig saved as safetensors): the configs
below are the `quantization_config` transformers 5.25 wrote for a tiny Llama quantised by torchao 0.18's
Float8DynamicActivationFloat8WeightConfig with PerRow and with PerTensor granularity (data/torchao-0.18/). The
tensors are written here as that save lays them out — torchao's Float8Tensor flattened into
`<module>._weight_qdata` (e4m3) and `<module>._weight_scale` ([N, 1] per row, [1, 1] per tensor) — and the model
must equal the FP8 reference forward (transformers with dequantised weights and fake-quantised inputs).

torchao is not in the test environment (its FP8 path asks for a CUDA GPU of compute capability 8.9 or more even to
quantise); run outside it on the CPU with that check lifted, its PerRow checkpoint loaded here and gave torchao's
own model's logits to 7e-8 (docs/server.md). PerTensor quantises activations with one dynamic scale for the
whole batch; they are served per token, as every dynamic layout is here.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import FBGEMM_UB, reference_logits, write_linears_in_fp8
from test_loaders import our_prefill_logits, save_hf_model

from metronome.server.models import load_model
from metronome.server.models.quant.scheme import QuantizationConfigError, scheme_from_config

DATA = Path(__file__).parent / "data" / "torchao-0.18"
GRANULARITIES = {"per_row": "channel", "per_tensor": "tensor"}
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PROMPT = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def torchao_config(granularity: str) -> dict:
    return json.loads((DATA / f"{granularity}.json").read_text())


def write_torchao_checkpoint(folder: Path, granularity: str, config: dict | None = None):
    from transformers import LlamaConfig

    hf_model = save_hf_model(folder, LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    dequantised = write_linears_in_fp8(folder, hf_model, config or torchao_config(granularity),
                                       GRANULARITIES[granularity], weight_name="_weight_qdata",
                                       scale_name="_weight_scale", scale_shape=lambda scale: scale.reshape(-1, 1))
    return hf_model, dequantised


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_torchao_checkpoint_matches_the_fp8_reference(tmp_path, granularity):
    hf_model, dequantised = write_torchao_checkpoint(tmp_path, granularity)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (loaded.quantization.source, loaded.quantization.weights, loaded.quantization.activations) == \
        ("torchao", GRANULARITIES[granularity], "token")
    layer = loaded.model.model.layers[1]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), dequantised["model.layers.1.mlp.down_proj"])
    assert loaded.model.lm_head.weight.dtype == torch.float32
    expected = reference_logits(hf_model, dequantised, "token", PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def test_torchao_activation_bound_and_modules_to_not_convert(tmp_path):
    """`activation_value_ub` bounds each token's amax before its scale (torchao clamps the row max, as FBGEMM
    does); `modules_to_not_convert` (transformers' rule) leaves a layer in the model dtype."""
    config = torchao_config("per_row")
    config["quant_type"]["default"]["_data"]["activation_value_ub"] = FBGEMM_UB
    hf_model, dequantised = write_torchao_checkpoint(tmp_path, "per_row", config)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert loaded.quantization.activation_ub == FBGEMM_UB
    expected = reference_logits(hf_model, dequantised, "token-ub", PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)

    config["modules_to_not_convert"] = ["model.layers.1.mlp.down_proj"]
    scheme = scheme_from_config(config)
    assert scheme.ignores("model.layers.1.mlp.down_proj") and not scheme.ignores("model.layers.0.mlp.down_proj")
    assert scheme.ignores("lm_head")


def _edited(edit) -> dict:
    config = copy.deepcopy(torchao_config("per_row"))
    edit(config, config["quant_type"]["default"])
    return config


@pytest.mark.parametrize("edit, message", [
    (lambda c, d: d.update(_type="Float8WeightOnlyConfig"), "Float8WeightOnlyConfig"),
    (lambda c, d: d.update(_type="Int4WeightOnlyConfig"), "Int4WeightOnlyConfig"),
    (lambda c, d: c["quant_type"].update({"model.layers.0.mlp.down_proj": d}), "per-module torchao configs"),
    (lambda c, d: d["_data"]["granularity"].__setitem__(1, {"_type": "PerTensor", "_data": {}}), "granularity"),
    (lambda c, d: d["_data"].update(granularity=[{"_type": "PerBlock", "_data": {"block_size": [1, 128]}}] * 2),
     "granularity"),
    (lambda c, d: d["_data"]["weight_dtype"].update(_data="float8_e5m2"), "weight_dtype 'float8_e5m2'"),
    (lambda c, d: d["_data"].update(activation_value_lb=1e-6), "activation_value_lb"),
    (lambda c, d: d["_data"].update(activation_value_ub=-1.0), "activation_value_ub"),
    (lambda c, d: c.update(include_input_output_embeddings=True), "include_input_output_embeddings"),
])
def test_torchao_configs_this_server_cannot_run_are_refused_with_the_field(edit, message):
    with pytest.raises(QuantizationConfigError, match=message):
        scheme_from_config(_edited(edit))
