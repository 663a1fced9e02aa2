"""compressed-tensors FP8 checkpoints (what llm-compressor saves) of the families other than Llama, loaded by
Metronome and compared with transformers loading the same folder (its compressed-tensors path: FP8 weights,
fake-quantised activations; routed experts dequantised), as test_fp8_ecosystem.py does for a tiny Llama.

What llm-compressor 0.14 writes for these families, and what the checkpoints here reproduce:
- dense families: every decoder Linear with `weight` (e4m3) and `weight_scale`, plus `input_scale` for the static
  FP8 scheme; Phi-3's fused `qkv_proj` / `gate_up_proj` quantised as one matrix (one scale for all its rows).
- mixtures of experts: llm-compressor unfuses transformers' stacked experts into one Linear per expert and
  projection before quantising, so the routed experts are stored one FP8 tensor per expert with their scales
  (`input_scale` too, for the static scheme), in the names transformers saves them under; the routers and
  Qwen2-MoE's `shared_expert_gate` stay unquantised, named in `ignore` as its examples do (a recipe that does not
  name the gate quantises it: served in FP8 then). For Mixtral, 0.14 with
  transformers 5 writes `block_sparse_moe.experts.N.gate_proj` / `up_proj` / `down_proj`, not the w1 / w3 / w2 of
  the original checkpoints (transformers itself cannot load those back).
- `kv_cache_scheme` (FP8, per tensor or per attention head): `self_attn.k_scale` / `v_scale`, shaped [kv heads,
  1, 1] per head. compressed-tensors 0.20 finds no attention module in transformers 5.25 (it looks for a
  `past_key_values` argument, now `cache`), so the scales are written here as it would store them.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from family_models import FAMILIES, save_hf_model
from safetensors.torch import load_file, save_file
from test_fp8_ecosystem import PROMPTS, _compressed_tensors_checkpoint, _observe_weight, assert_matches_transformers
from test_loaders import our_prefill_logits
from transformers import AutoModelForCausalLM

from metronome.server.models import load_model
from metronome.server.models.quant.fp8_linear import Fp8Linear

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
# llm-compressor's MoE recipes leave the routers and the shared-expert gate unquantised
MOE_IGNORE = ("lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$")
# FP8_BLOCK: transformers fake-quantises activations in groups of 128 only over whole groups, so every dense
# linear's input is 128 or 256 wide (the routed experts run dequantised, any size)
WIDE = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def _config(family: str, wide: bool):
    config = FAMILIES[family]()
    for key, value in (WIDE if wide else {}).items():
        setattr(config, key, value)
    return config


def _quantize_experts(folder, preset: str) -> int:
    """The routed experts of a saved MoE checkpoint quantised by `preset` as llm-compressor stores them: each
    expert's projection through compressed-tensors' scale computation and its float-quantized compressor.
    Returns how many expert weights were quantised."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    tensors = load_file(str(folder / "model.safetensors"))
    experts = [name for name in tensors if EXPERT_WEIGHT.search(name)]
    for name in experts:
        module = name.removesuffix(".weight")
        weight = tensors.pop(name).float()
        scale, zero_point = calculate_qparams(*_observe_weight(weight, scheme.weights), scheme.weights)
        compressed = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point},
                                         scheme)
        tensors[name], tensors[f"{module}.weight_scale"] = compressed["weight"], compressed["weight_scale"]
        if not scheme.input_activations.dynamic:  # calibrated in llm-compressor; served W8A16, so never read
            tensors[f"{module}.input_scale"] = torch.tensor([0.01])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return len(experts)


def _checkpoint(folder, family: str, preset: str):
    """A tiny `family` model saved by compressed-tensors' `preset`; returns transformers' model of the folder."""
    model = save_hf_model(folder, _config(family, wide=preset == "FP8_BLOCK"))
    moe = any(".experts." in name for name in load_file(str(folder / "model.safetensors")))
    _compressed_tensors_checkpoint(folder, preset, model=model, ignore=MOE_IGNORE if moe else ("lm_head",))
    if moe:
        assert _quantize_experts(folder, preset) > 0
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "float-quantized")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family, preset, weights, activations", [
    ("qwen3", "FP8_DYNAMIC", "channel", "token"), ("qwen3", "FP8_BLOCK", "block", "group"),
    ("gemma3", "FP8", "tensor", "static"), ("gemma3", "FP8_BLOCK", "block", "group"),
    ("phi3", "FP8", "tensor", "static"), ("mistral", "FP8_DYNAMIC", "channel", "token")])
def test_dense_family_checkpoint_matches_transformers(tmp_path, family, preset, weights, activations):
    theirs = _checkpoint(tmp_path, family, preset)
    ours = assert_matches_transformers(tmp_path, theirs, weights, activations)
    layer = ours.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    if family == "phi3":  # stored fused: one per-tensor weight scale for the whole fused matrix, not per shard
        assert layer.self_attn.qkv_proj.weight_scale.unique().numel() == 1


@pytest.mark.parametrize("family, preset, weights, activations", [
    ("qwen3_moe", "FP8_DYNAMIC", "channel", "token"), ("qwen3_moe", "FP8_BLOCK", "block", "group"),
    ("qwen2_moe", "FP8", "tensor", "static")])
def test_moe_checkpoint_matches_transformers(tmp_path, family, preset, weights, activations):
    """Attention, dense MLPs and the shared expert run W8A8 in both; the routed experts run on unquantised
    activations in both (transformers dequantises stacked experts on load), their input scales unused."""
    theirs = _checkpoint(tmp_path, family, preset)
    ours = assert_matches_transformers(tmp_path, theirs, weights, activations)
    block = next(layer.mlp for layer in ours.model.model.layers if hasattr(layer.mlp, "experts"))
    assert block.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    if family == "qwen2_moe":  # llm-compressor's Qwen2-MoE exports: an FP8 shared expert, its gate unquantised
        assert isinstance(block.shared_expert.gate_up_proj, Fp8Linear)
        assert type(block.shared_expert_gate) is torch.nn.Linear


def test_an_fp8_shared_expert_gate_is_served_in_fp8(tmp_path):
    """A Qwen2-MoE recipe that ignores only the routers (`re:.*mlp.gate$`) quantises the [1, hidden]
    shared_expert_gate too: served as the FP8 linear it is, logits equal to transformers'. (The static scheme:
    compressed-tensors quantises a 2-D input with one scale even when asked for one per token, and the gate's input
    is 2-D in transformers' Qwen2-MoE, so the dynamic schemes' references differ by that.)"""
    model = save_hf_model(tmp_path, _config("qwen2_moe", wide=False))
    _compressed_tensors_checkpoint(tmp_path, "FP8", model=model, ignore=("lm_head", "re:.*mlp.gate$"))
    _quantize_experts(tmp_path, "FP8")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = assert_matches_transformers(tmp_path, theirs, "tensor", "static")
    block = next(layer.mlp for layer in ours.model.model.layers if hasattr(layer.mlp, "experts"))
    assert isinstance(block.shared_expert_gate, Fp8Linear)


def test_mixtral_experts_under_llm_compressor_names_load_as_under_the_original_names(tmp_path):
    """llm-compressor 0.14 on transformers 5 saves Mixtral's experts as block_sparse_moe.experts.N.gate_proj /
    up_proj / down_proj where the original checkpoints (and transformers' own save) say w1 / w3 / w2:
    transformers matches the original names (the reference here), Metronome must read both the same."""
    theirs = _checkpoint(tmp_path, "mixtral", "FP8_DYNAMIC")
    original = assert_matches_transformers(tmp_path, theirs, "channel", "token")
    renames = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
    tensors = {}
    for name, value in load_file(str(tmp_path / "model.safetensors")).items():
        for old, new in renames.items():
            name = name.replace(old, new) if ".experts." in name else name
        tensors[name] = value
    assert "model.layers.0.block_sparse_moe.experts.3.up_proj.weight_scale" in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    renamed = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    for prompt in PROMPTS:
        torch.testing.assert_close(our_prefill_logits(renamed, prompt), our_prefill_logits(original, prompt),
                                   rtol=0, atol=0)


def test_kv_cache_scheme_per_head_scales_fill_the_fp8_cache(tmp_path):
    """kv_cache_scheme per attention head on Qwen3 (K normed, then roped, before it is cached): the [kv heads, 1,
    1] scales become the cache's, and prefill through the FP8 cache equals transformers with K and V
    fake-quantised by compressed-tensors as they enter its cache (what its QuantizedKVCache does)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from test_model_exact import PagedCache
    from transformers import DynamicCache

    from metronome.server.models.quant.kv_scales import install_kv_scales

    theirs = _checkpoint(tmp_path, "qwen3", "FP8")
    args = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", symmetric=True, dynamic=False)
    amax: dict[tuple[str, int], torch.Tensor] = {}

    def forward(ids: list[int], quantise: bool) -> torch.Tensor:
        cache = DynamicCache(config=theirs.config)
        update = cache.update

        def observed(key, value, layer, *rest, **kwargs):
            states = {"k": key, "v": value}
            for kind, x in states.items():  # [batch, kv heads, tokens, head dim]
                if quantise:
                    states[kind] = fake_quantize(x, *scales[kind, layer], args)
                else:
                    seen = x.abs().amax(dim=(0, 2, 3)).reshape(-1, 1, 1)
                    amax[kind, layer] = torch.maximum(amax.get((kind, layer), seen), seen)
            return update(states["k"], states["v"], layer, *rest, **kwargs)

        cache.update = observed
        with torch.inference_mode():
            return theirs(torch.tensor([ids]), cache=cache, use_cache=True).logits[0].float()

    unquantised = [forward(prompt, quantise=False) for prompt in PROMPTS]  # calibration: K and V amax per head
    scales = {key: calculate_qparams(-value, value, args) for key, value in amax.items()}
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for (kind, layer), (scale, _) in scales.items():
        tensors[f"model.layers.{layer}.self_attn.{kind}_scale"] = scale
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = json.loads(args.model_dump_json())
    (tmp_path / "config.json").write_text(json.dumps(config))

    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert ours.quantization.kv_cache.granularity == "head"
    installed = install_kv_scales(ours)
    assert installed.source == "checkpoint"
    assert torch.equal(installed.k[1], scales["k", 1][0].reshape(-1).float())
    for prompt, float_cache in zip(PROMPTS, unquantised):
        cache = PagedCache(ours.config, 1, len(prompt), dtype=torch.float8_e4m3fn)
        with torch.inference_mode():
            hidden = ours.model(torch.tensor(prompt), torch.arange(len(prompt)), cache.kv,
                                cache.metadata([0], [len(prompt)]))
            logits = ours.model.compute_logits(hidden)
        torch.testing.assert_close(logits, forward(prompt, quantise=True), rtol=0, atol=1e-5)
        assert (logits - float_cache).abs().max() > 1e-3  # the e4m3 cache shows in the logits
