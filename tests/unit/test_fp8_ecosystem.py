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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def _compressed_tensors_checkpoint(folder, preset: str, targets: tuple[str, ...] = ("Linear",)) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _tiny_llama(128, 256)  # transformers runs activation groups of 128 only on whole groups
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, list(targets))}, ignore=["lm_head"]))
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
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (ours.quantization.weights, ours.quantization.activations) == (weights, activations)
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = theirs(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(our_prefill_logits(ours, prompt), expected, rtol=0, atol=1e-5)


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
