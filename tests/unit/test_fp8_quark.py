"""AMD Quark's FP8 checkpoints (`quant_method: quark`): the configs below are the `quantization_config` that
amd-quark 0.13's `export_safetensors` wrote for a tiny Llama quantised with its `fp8` and `ptpc_fp8` schemes and
an FP8 KV cache (data/quark-0.13/). The tensors are written here as that export lays them out — FP8 `weight`, a
0-d (`fp8`) or [N] (`ptpc_fp8`) `weight_scale`, a 0-d static `input_scale` per linear (`fp8`), and the k and v
projections' `output_scale`, the layer's KV-cache scale — and the model must equal the FP8 reference forward
(transformers with dequantised weights and fake-quantised inputs, fp8_checkpoints.py).

amd-quark itself is not in the test environment (it imports datasets, pandas and onnx); run outside it on the same
tiny models, its exports loaded here and gave Quark's own quantised model's logits exactly (docs/server.md).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from family_models import FAMILIES
from fp8_checkpoints import (
    STATIC_INPUT_SCALE,
    dequantize_weight,
    quantize_weight,
    reference_logits,
    write_linears_in_fp8,
)
from safetensors.torch import save_file
from test_loaders import our_prefill_logits, save_hf_model
from test_model_exact import PagedCache

from metronome.server.models import load_model
from metronome.server.models.quant.kv_scales import install_kv_scales
from metronome.server.models.quant.scheme import QuantizationConfigError, scheme_from_config

DATA = Path(__file__).parent / "data" / "quark-0.13"
SCHEMES = {"fp8": ("tensor", "static"), "ptpc_fp8": ("channel", "token")}
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PROMPT = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()
KV_SCALES = (0.0021, 0.0034)  # per layer: Quark stores the larger of k_proj's and v_proj's output scales on both


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def quark_config(scheme: str) -> dict:
    return json.loads((DATA / f"{scheme}.json").read_text())


def write_quark_checkpoint(folder: Path, scheme: str, config: dict | None = None):
    """A tiny Llama saved as Quark's export lays it out; returns (transformers model, dequantised weights)."""
    from transformers import LlamaConfig

    hf_model = save_hf_model(folder, LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    granularity, activations = SCHEMES[scheme]

    def beside_the_weight(module: str) -> dict[str, torch.Tensor]:
        tensors = {"input_scale": torch.tensor(STATIC_INPUT_SCALE)} if activations == "static" else {}
        if module.endswith(("k_proj", "v_proj")):
            tensors["output_scale"] = torch.tensor(KV_SCALES[int(module.split(".")[2])])
        return tensors

    dequantised = write_linears_in_fp8(folder, hf_model, config or quark_config(scheme), granularity,
                                       scale_shape=lambda scale: scale.reshape(-1) if scale.dim() else scale,
                                       extra=beside_the_weight)
    return hf_model, dequantised


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quark_checkpoint_matches_the_fp8_reference(tmp_path, scheme):
    hf_model, dequantised = write_quark_checkpoint(tmp_path, scheme)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    granularity, activations = SCHEMES[scheme]
    assert (loaded.quantization.source, loaded.quantization.weights, loaded.quantization.activations) == \
        ("quark", granularity, activations)
    layer = loaded.model.model.layers[1]
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), dequantised["model.layers.1.mlp.down_proj"])
    assert loaded.model.lm_head.weight.dtype == torch.float32  # `exclude: [lm_head]`
    expected = reference_logits(hf_model, dequantised, activations, PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def test_quark_output_scales_of_the_kv_group_become_the_fp8_cache_scales(tmp_path):
    write_quark_checkpoint(tmp_path, "fp8")
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert loaded.quantization.kv_cache.granularity == "tensor"
    scales = install_kv_scales(loaded)
    assert scales.source == "checkpoint"
    for layer, value in enumerate(KV_SCALES):
        for per_head in (scales.k[layer], scales.v[layer]):
            assert torch.equal(per_head, torch.full((2,), value))
    # Layer 0's K and V do not depend on the cache's dtype: the FP8 cache holds e4m3(x / its checkpoint scale).
    plain = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    caches = [PagedCache(m.config, 1, len(PROMPT), dtype=d) for m, d in ((plain, torch.float32),
                                                                         (loaded, torch.float8_e4m3fn))]
    for model, cache in zip((plain, loaded), caches):
        with torch.inference_mode():
            model.model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache.kv, cache.metadata([0], [len(PROMPT)]))
    for exact, codes in zip(caches[0].kv[0], caches[1].kv[0]):
        written = slice(0, len(PROMPT))
        exact, codes = exact.flatten(0, 1)[written], codes.flatten(0, 1)[written]
        expected = (exact / KV_SCALES[0]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(codes.float(), expected.float())


def test_quark_exclude_patterns_match_full_names_as_fnmatch_does(tmp_path):
    """Quark matches `exclude` with fnmatch over full module names and never expands a pattern to children."""
    config = quark_config("ptpc_fp8")
    config["exclude"] = ["lm_head", "*.layers.1.mlp.down_proj", "*.self_attn"]
    scheme = scheme_from_config(config)
    assert scheme.ignores("model.layers.1.mlp.down_proj") and not scheme.ignores("model.layers.0.mlp.down_proj")
    assert not scheme.ignores("model.layers.0.self_attn.q_proj")  # a parent's pattern leaves its children
    write_quark_checkpoint(tmp_path, "ptpc_fp8", config)
    with pytest.raises(ValueError, match="down_proj"):  # the checkpoint stored it in FP8: it does not fit
        load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")


def _quark_moe(folder: Path, fp8_experts: bool):
    """A tiny Qwen3-MoE as Quark's ptpc_fp8 export writes it: the attention and dense MLP linears FP8 with [N]
    scales, and the routed experts either stacked in float (exported under transformers 5, whose stacked experts
    are no Linear for Quark to quantise: `mlp.experts.gate_up_proj` [E, 2I, H]) or one FP8 Linear an expert
    (exported under transformers 4). Returns transformers' model of the same weights dequantised and the
    dequantised dense linears (reference_logits' hooks fake-quantise their inputs; the experts run W8A16)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_model = save_hf_model(folder, FAMILIES["qwen3_moe"]())
    saved = load_file(str(folder / "model.safetensors"))  # one tensor an expert, as transformers saves them
    tensors = {} if fp8_experts else {n: v for n, v in hf_model.state_dict().items()
                                      if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    dequantised, reference = {}, {}
    for name, value in saved.items():
        module = name.removesuffix(".weight")
        expert = ".experts." in name
        if not (name.endswith("_proj.weight") and module.startswith("model.layers.") and (fp8_experts or not expert)):
            reference[name] = value
            if not expert:
                tensors[name] = value
            continue
        q, scale = quantize_weight(value.float(), "channel")
        tensors[name], tensors[f"{module}.weight_scale"] = q, scale.reshape(-1)
        reference[name] = dequantize_weight(q, scale, "channel")
        if not expert:
            dequantised[module] = reference[name]
    config = quark_config("ptpc_fp8")
    config["exclude"] = ["lm_head", "*mlp.gate"]  # Quark's qwen3_moe template leaves the routers alone
    saved_config = json.loads((folder / "config.json").read_text())
    reference_folder = folder / "dequantised"
    reference_folder.mkdir()
    save_file(reference, str(reference_folder / "model.safetensors"))
    (reference_folder / "config.json").write_text(json.dumps(saved_config))
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**saved_config, "quantization_config": config}))
    theirs = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    return theirs, dequantised


@pytest.mark.parametrize("fp8_experts", [False, True], ids=["stacked-float-experts", "fp8-experts"])
def test_quark_moe_checkpoint_serves_the_experts_as_stored(tmp_path, fp8_experts):
    theirs, dequantised = _quark_moe(tmp_path, fp8_experts)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    moe = loaded.model.model.layers[0].mlp
    assert moe.experts.fp8 is fp8_experts
    assert loaded.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    expected = reference_logits(theirs, dequantised, "token", PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def _edited(scheme: str, edit) -> dict:
    config = copy.deepcopy(quark_config(scheme))
    edit(config)
    return config


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["export"].update(weight_format="fake_quantized"), "export.weight_format"),
    (lambda c: c["global_quant_config"]["weight"].update(dtype="fp8_e5m2"), "global_quant_config.weight.dtype"),
    (lambda c: c["global_quant_config"].update(input_tensors=None), "weight-only"),
    (lambda c: c["global_quant_config"]["weight"].update(qscheme="per_group", group_size=128),
     "weight.qscheme 'per_group'"),
    (lambda c: c["global_quant_config"]["input_tensors"].update(symmetric=False), "asymmetric"),
    (lambda c: c["global_quant_config"]["weight"].update(is_dynamic=True), "weight.is_dynamic"),
    (lambda c: c["layer_quant_config"].update({"*o_proj": c["layer_quant_config"]["*k_proj"]}),
     r"layer_quant_config.\*o_proj.output_tensors"),
    (lambda c: c["layer_quant_config"]["*k_proj"]["input_tensors"].update(qscheme="per_channel", is_dynamic=True),
     r"layer_quant_config.\*k_proj: a scheme other than"),
    (lambda c: c.update(softmax_quant_spec={"dtype": "fp8_e4m3"}), "softmax_quant_spec"),
    (lambda c: c.update(algo_config=[{"name": "svdquant", "svd_rank": 32}]), "'svdquant' changes the model"),
    (lambda c: c.update(algo_config=[{"name": "rotation", "r1": True, "online_r1_rotation": True}]),
     "'rotation' with online rotations"),
    (lambda c: c.update(layer_type_quant_config={"Linear": {}}), "layer_type_quant_config"),
    (lambda c: c.update(exclude="lm_head"), "exclude"),
])
def test_quark_configs_this_server_cannot_run_are_refused_with_the_field(edit, message):
    with pytest.raises(QuantizationConfigError, match=message):
        scheme_from_config(_edited("fp8", edit))


def test_algorithms_the_export_folds_into_its_weights_are_served_as_stored():
    for algorithms in ([{"name": "awq", "scaling_layers": []}, {"name": "gptq"}], {"name": "smooth", "alpha": 0.5},
                       [{"name": "rotation", "r1": True, "online_r1_rotation": False, "r3": False}]):
        config = {**quark_config("fp8"), "algo_config": algorithms}
        assert scheme_from_config(config).source == "quark"


def test_a_dynamic_per_tensor_input_is_served_per_token():
    config = _edited("fp8", lambda c: c["global_quant_config"]["input_tensors"].update(is_dynamic=True))
    for layer in (*config["layer_quant_config"].values(), *config["kv_cache_quant_config"].values()):
        layer["input_tensors"]["is_dynamic"] = True
    assert (scheme_from_config(config).weights, scheme_from_config(config).activations) == ("tensor", "token")
