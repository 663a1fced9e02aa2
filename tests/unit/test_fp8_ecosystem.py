"""FP8 checkpoints made by the ecosystem's own tools on the CPU, loaded by Metronome, against transformers.

- compressed-tensors (the library llm-compressor saves with): its presets FP8_DYNAMIC (per-channel weights,
  dynamic per-token activations), FP8 (per-tensor weights, static input scales from a calibration pass) and
  FP8_BLOCK (128 x 128 weight blocks, per-token groups of 128). Scales come from compressed-tensors'
  `calculate_qparams` over min/max observations (what llm-compressor's observers feed it), compression and the
  config from its `ModelCompressor`. transformers loads the result with its compressed-tensors integration, which
  on the CPU runs the FP8 math itself (FP8 weights, fake-quantised activations): Metronome's logits must equal
  those.
- transformers' FineGrainedFP8 quantiser (`Fp8Quantize`, the op `from_pretrained` runs with a
  FineGrainedFP8Config): a DeepSeek-style `quant_method: fp8` checkpoint with 128 x 128 `weight_scale_inv`.
  transformers can only dequantise it on the CPU, so the reference is that dequantised model with its linear
  inputs fake-quantised per token group by compressed-tensors' quantiser.
- NVIDIA ModelOpt (`nvidia-modelopt`: the tool behind the FP8 checkpoints TensorRT-LLM publishes): its FP8 and
  FP8_PER_CHANNEL_PER_TOKEN recipes calibrated on the CPU and exported with `export_hf_checkpoint`. The reference
  is ModelOpt's own quantised model before export (FP8 weights and inputs fake-quantised in float32).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_loaders import our_prefill_logits, write_tokenizer

from metronome.server.models import load_model

VOCAB = 320
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 23)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _tiny_llama(hidden: int, intermediate: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _observe_weight(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """min/max of a weight at the scheme's granularity, as llm-compressor's min-max observer reports them."""
    if args.strategy == "channel":
        return weight.amin(dim=1, keepdim=True), weight.amax(dim=1, keepdim=True)
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    bn, bk = args.block_structure
    rows, cols = weight.shape
    grid = (-(-rows // bn), -(-cols // bk))
    padded = torch.nn.functional.pad(weight, (0, grid[1] * bk - cols, 0, grid[0] * bn - rows))
    blocks = padded.reshape(grid[0], bn, grid[1], bk)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def _compressed_tensors_checkpoint(folder, preset: str, targets: tuple[str, ...] = ("Linear",), model=None,
                                   ignore: tuple[str, ...] = ("lm_head",)) -> None:
    """`model` (a tiny Llama unless given) quantised by the compressed-tensors `preset` and saved to `folder`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    if model is None:
        model = _tiny_llama(128, 256)  # transformers runs activation groups of 128 only on whole groups
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, list(targets))}, ignore=list(ignore)))
    quantised = {name: m for name, m in model.named_modules() if getattr(m, "quantization_scheme", None)}
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in quantised.items():
        scheme = module.quantization_scheme
        scale, _ = calculate_qparams(*_observe_weight(module.weight.data, scheme.weights), scheme.weights)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if not scheme.input_activations.dynamic:  # calibration: the largest input seen, no quantisation yet
            module.quantization_enabled = False
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, name=name: amax.__setitem__(name, torch.maximum(
                    amax.get(name, torch.zeros(())), args[0].detach().abs().amax()))))
    if hooks:
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1)))
        for hook in hooks:
            hook.remove()
        for name, module in quantised.items():
            if name in amax:
                args = module.quantization_scheme.input_activations
                scale, _ = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1), args)
                module.input_scale.data = scale.to(module.input_scale.dtype).reshape(module.input_scale.shape)
                module.quantization_enabled = True
    for module in quantised.values():
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    write_tokenizer(folder)


@pytest.mark.parametrize("preset, weights, activations", [
    ("FP8_DYNAMIC", "channel", "token"), ("FP8", "tensor", "static"), ("FP8_BLOCK", "block", "group")])
def test_compressed_tensors_checkpoint_matches_transformers(tmp_path, preset, weights, activations):
    from transformers import AutoModelForCausalLM

    _compressed_tensors_checkpoint(tmp_path, preset)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn  # FP8 math, not bf16
    assert_matches_transformers(tmp_path, theirs, weights, activations)


def assert_matches_transformers(folder, theirs, weights: str, activations: str):
    """Metronome loads the checkpoint in `folder` with the scheme (weights, activations) and its prefill logits
    equal transformers' model of the same folder (`theirs`) within 1e-5; returns Metronome's model."""
    ours = load_model(f"hf-dir:{folder}", dtype="float32", attention_backend="torch")
    assert (ours.quantization.weights, ours.quantization.activations) == (weights, activations)
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = theirs(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(our_prefill_logits(ours, prompt), expected, rtol=0, atol=1e-5)
    return ours


def test_compressed_tensors_targets_leave_the_other_linears_in_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    from metronome.server.models.quant.fp8_linear import Fp8Linear

    _compressed_tensors_checkpoint(tmp_path, "FP8_DYNAMIC", targets=("re:.*mlp.*",))
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    layer = ours.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert type(layer.self_attn.qkv_proj) is torch.nn.Linear
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.inference_mode():
        expected = theirs(torch.tensor([PROMPTS[1]])).logits[0].float()
    torch.testing.assert_close(our_prefill_logits(ours, PROMPTS[1]), expected, rtol=0, atol=1e-5)


def test_transformers_finegrained_fp8_checkpoint_matches_its_dequantised_model(tmp_path):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    model = _tiny_llama(256, 384)  # multiples of 128: transformers leaves other shapes unquantised
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    quantize = Fp8Quantize(FineGrainedFP8HfQuantizer(config))
    state = {}
    for name, value in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            state.update(quantize.convert({name: value}))
        else:
            state[name] = value
    assert state["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (3, 2)
    model.config.quantization_config = config.to_dict()
    model.save_pretrained(tmp_path, state_dict=state)
    write_tokenizer(tmp_path)

    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (ours.quantization.source, ours.quantization.block) == ("fp8", (128, 128))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # dequantised on the CPU
    group = QuantizationArgs(num_bits=8, type="float", strategy="group", group_size=128, dynamic=True,
                             symmetric=True)

    def fake_quant_input(module, args):
        x = args[0]
        scale, zero_point = compute_dynamic_scales_and_zp(x, group, module)
        return (fake_quantize(x, scale, zero_point, group),)

    for name, module in theirs.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(fake_quant_input)
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = theirs(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(our_prefill_logits(ours, prompt), expected, rtol=0, atol=1e-5)
    shutil.rmtree(tmp_path)


def _modelopt_checkpoint(folder, recipe: str, kv_cache: bool = False) -> list[torch.Tensor]:
    """A tiny Llama quantised by ModelOpt's `recipe` (calibrated on random tokens) and exported to `folder`;
    returns the quantised model's logits for PROMPTS, computed before export (export turns its weights to FP8)."""
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model = _tiny_llama(64, 128)
    model.config.architectures = ["LlamaForCausalLM"]
    config = copy.deepcopy(getattr(mtq, recipe))
    if kv_cache:
        config["quant_cfg"] += mtq.FP8_KV_CFG["quant_cfg"]
    calibration = torch.randint(3, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
    model = mtq.quantize(model, config, lambda m: m(calibration))
    with torch.inference_mode():
        expected = [model(torch.tensor([prompt])).logits[0].float() for prompt in PROMPTS]
    export_hf_checkpoint(model, export_dir=folder)
    write_tokenizer(folder)
    return expected


@pytest.mark.parametrize("recipe, weights, activations", [
    ("FP8_DEFAULT_CFG", "tensor", "static"), ("FP8_PER_CHANNEL_PER_TOKEN_CFG", "channel", "token")])
def test_modelopt_checkpoint_matches_modelopt(tmp_path, recipe, weights, activations):
    expected = _modelopt_checkpoint(tmp_path, recipe)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (ours.quantization.source, ours.quantization.weights, ours.quantization.activations) == \
        ("modelopt", weights, activations)
    for prompt, logits in zip(PROMPTS, expected):
        torch.testing.assert_close(our_prefill_logits(ours, prompt), logits, rtol=0, atol=1e-5)


def test_modelopt_hf_quant_config_and_kv_scales(tmp_path):
    """An export whose config.json has no quantization_config (ModelOpt's before it wrote one) is read from
    hf_quant_config.json, and its FP8 KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`) become the cache's.
    With the cache in FP8 the logits are ModelOpt's up to where a K or V value lies on an e4m3 rounding boundary:
    ModelOpt quantises x * (448 / amax), the cache x / scale with scale = amax / 448, one float32 rounding apart."""
    from safetensors.torch import load_file
    from test_model_exact import PagedCache

    from metronome.server.models.quant.kv_scales import install_kv_scales

    expected = _modelopt_checkpoint(tmp_path, "FP8_DEFAULT_CFG", kv_cache=True)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert ours.quantization.source == "modelopt" and ours.quantization.kv_cache.granularity == "tensor"
    scales = install_kv_scales(ours)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert scales.source == "checkpoint"
    for layer in range(2):
        for kind, values in (("k", scales.k[layer]), ("v", scales.v[layer])):
            checkpoint = stored[f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale"]
            assert torch.equal(values, checkpoint.float().reshape(1).expand(2))
    for prompt, logits in zip(PROMPTS, expected):
        cache = PagedCache(ours.config, 1, len(prompt), dtype=torch.float8_e4m3fn)
        with torch.inference_mode():
            hidden = ours.model(torch.tensor(prompt), torch.arange(len(prompt)), cache.kv,
                                cache.metadata([0], [len(prompt)]))
            torch.testing.assert_close(ours.model.compute_logits(hidden), logits, rtol=0, atol=2e-2)
