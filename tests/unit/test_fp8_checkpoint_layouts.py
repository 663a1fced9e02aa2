"""Loading each FP8 checkpoint layout (tiny checkpoints written with safetensors, fp8_checkpoints.py): the FP8
codes and scales land in the right shard of the fused layers, and the model's logits equal the FP8 reference
forward (transformers with dequantised weights and fake-quantised inputs) to float32 rounding. Plus
`--quantization fp8` on the fly, and the errors a checkpoint that does not fit gets."""
from __future__ import annotations

import json

import pytest
import torch
from fp8_checkpoints import FBGEMM_UB, LAYOUTS, write_fp8_checkpoint
from fp8_checkpoints import reference_logits as fp8_reference_logits
from test_loaders import our_prefill_logits, save_hf_model

from metronome.contract.errors import InvalidRequestError, ModelNotFoundError
from metronome.server.models import load_model
from metronome.server.models.quant import fp8
from metronome.server.models.quant.fp8_linear import Fp8Linear

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
PROMPT = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(3)).tolist()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _llama(folder, **overrides):
    from transformers import LlamaConfig

    return save_hf_model(folder, LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=False, bos_token_id=1,
                                             eos_token_id=2))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_loads_into_fused_fp8_layers_and_matches_the_fp8_reference(tmp_path, layout):
    hf_model = _llama(tmp_path)
    dequantised = write_fp8_checkpoint(tmp_path, hf_model, layout)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert loaded.quantization is not None and loaded.quantization.prequantized
    layer = loaded.model.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == torch.float8_e4m3fn
    assert loaded.model.lm_head.weight.dtype == torch.float32  # the LM head and embeddings stay unquantised
    prefix = "model.layers.1."
    expected_qkv = torch.cat([dequantised[prefix + f"self_attn.{p}_proj"] for p in "qkv"])
    expected_gate_up = torch.cat([dequantised[prefix + f"mlp.{p}_proj"] for p in ("gate", "up")])
    assert torch.equal(qkv.dequantized_weight(), expected_qkv)
    assert torch.equal(gate_up.dequantized_weight(), expected_gate_up)
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), dequantised[prefix + "mlp.down_proj"])
    granularity, activation = LAYOUTS[layout][1], LAYOUTS[layout][4]
    if granularity == "tensor":  # fused shards keep their own scales (spread over their rows); o_proj has one
        assert qkv.granularity == "channel" and layer.self_attn.o_proj.weight_scale.dim() == 0
    if activation == "static":
        assert qkv.activation_quant.static_scale.item() == pytest.approx(0.02)

    expected = fp8_reference_logits(hf_model, dequantised, activation, PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def fbgemm_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """FBGEMM's quantize_fp8_per_row as written there (bounded row max, multiply by 448 / max, scale stored as
    its reciprocal), quantised then dequantised: independent of our fp8 module."""
    flat = x.reshape(-1, x.shape[-1]).float()
    row_max = flat.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12, max=FBGEMM_UB)
    scale = 448.0 / row_max
    q = (flat * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * (1.0 / scale)).to(x.dtype).reshape(x.shape)


def test_fbgemm_checkpoint_bounds_each_tokens_amax_as_fbgemm_does(tmp_path):
    hf_model = _llama(tmp_path)
    dequantised = write_fp8_checkpoint(tmp_path, hf_model, "fbgemm")
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (loaded.quantization.source, loaded.quantization.activation_ub) == ("fbgemm_fp8", FBGEMM_UB)
    ours = our_prefill_logits(loaded, PROMPT)
    fbgemm = fp8_reference_logits(hf_model, dequantised, fbgemm_fake_quant, PROMPT)
    unbounded = fp8_reference_logits(hf_model, dequantised, "token", PROMPT)
    # FBGEMM multiplies by 448 / max where we divide by max / 448: one float32 rounding apart (9e-8 here, on
    # logits of magnitude 0.6), where leaving the bound out moves them by 0.22
    torch.testing.assert_close(ours, fbgemm, rtol=0, atol=1e-4)
    assert (ours - unbounded).abs().max().item() > 0.05

    # An export that stores the bound beside the weights must agree with the config's.
    _mutate_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.mlp.down_proj.input_scale_ub":
                                                     torch.tensor([FBGEMM_UB])}))
    load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    _mutate_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.mlp.down_proj.input_scale_ub":
                                                     torch.tensor([1200.0])}))
    with pytest.raises(ModelNotFoundError, match="down_proj.input_scale_ub.*differs from quantization_config"
                                                 ".activation_scale_ub"):
        load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")


def test_an_fp8_checkpoint_from_a_hub_loads_as_fp8(tmp_path, monkeypatch):
    from metronome_testing.hub_server import FakeHub

    folder = tmp_path / "repo"
    folder.mkdir()
    write_fp8_checkpoint(folder, _llama(folder), "ct-channel")
    with FakeHub() as hub:
        hub.add_folder("test-org/tiny-llama-fp8", folder)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("METRONOME_MODEL_CACHE", str(tmp_path / "cache"))
        fetched = load_model("hf://test-org/tiny-llama-fp8", dtype="float32", attention_backend="torch")
    local = load_model(f"hf-dir:{folder}", dtype="float32", attention_backend="torch")
    assert fetched.quantization == local.quantization and fetched.quantization.weights == "channel"
    torch.testing.assert_close(our_prefill_logits(fetched, PROMPT), our_prefill_logits(local, PROMPT), rtol=0, atol=0)


def test_older_compressed_tensors_config_key_is_read(tmp_path):
    hf_model = _llama(tmp_path)
    write_fp8_checkpoint(tmp_path, hf_model, "ct-channel")
    config = json.loads((tmp_path / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    del config["compression_config"]["quant_method"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    assert (loaded.quantization.source, loaded.quantization.weights) == ("compressed-tensors", "channel")


def test_qkv_bias_loads_beside_fp8_weights(tmp_path):
    from transformers import Qwen2Config

    hf_model = save_hf_model(tmp_path, Qwen2Config(**TINY, tie_word_embeddings=True, bos_token_id=1,
                                                   eos_token_id=2))
    dequantised = write_fp8_checkpoint(tmp_path, hf_model, "ct-channel")
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    hf_bias = torch.cat([hf_model.get_submodule(f"model.layers.0.self_attn.{p}_proj").bias for p in "qkv"])
    assert torch.equal(qkv.bias, hf_bias)
    expected = fp8_reference_logits(hf_model, dequantised, "token", PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def test_quantization_fp8_quantises_a_float_model_on_load(tmp_path):
    hf_model = _llama(tmp_path)
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch", quantization="fp8")
    assert loaded.quantization.source == "online"
    dequantised = {}
    for name, module in hf_model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            q, scale = fp8.quantize_per_channel(module.weight.detach())
            dequantised[name] = fp8.dequantize(q, scale[:, None])
    fp8_layers = [m for m in loaded.model.modules() if isinstance(m, Fp8Linear)]
    assert len(fp8_layers) == 4 * TINY["num_hidden_layers"]
    expected = fp8_reference_logits(hf_model, dequantised, "token", PROMPT)
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=2e-5)


def test_random_preset_quantised_is_the_random_model_in_fp8():
    plain = load_model("random:tiny", dtype="float32", attention_backend="torch", seed=4)
    quantised = load_model("random:tiny", dtype="float32", attention_backend="torch", seed=4, quantization="fp8")
    for ours, theirs in zip(quantised.model.model.layers, plain.model.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            weight = theirs.get_submodule(name).weight
            got = ours.get_submodule(name).dequantized_weight()
            # e4m3 keeps 3 mantissa bits: within half a step (2^-4 relative) of each weight, or of the row's scale
            bound = torch.maximum(weight.abs() * 2 ** -4, weight.abs().amax(dim=1, keepdim=True) * 2 ** -9)
            assert ((got - weight).abs() <= bound * 1.0001).all(), name
    assert torch.equal(quantised.model.model.embed_tokens.weight, plain.model.model.embed_tokens.weight)


def _mutate_checkpoint(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_checkpoints_that_do_not_fit_are_refused_by_name(tmp_path):
    hf_model = _llama(tmp_path)
    write_fp8_checkpoint(tmp_path, hf_model, "fp8-static")
    spec = f"hf-dir:{tmp_path}"

    _mutate_checkpoint(tmp_path, lambda t: t.pop("model.layers.0.self_attn.k_proj.input_scale"))
    with pytest.raises(ModelNotFoundError, match="input_scale of model.layers.0.self_attn.k_proj"):
        load_model(spec, attention_backend="torch")

    write_fp8_checkpoint(tmp_path, hf_model, "fp8-static")
    _mutate_checkpoint(tmp_path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale": torch.ones(3)}))
    with pytest.raises(ModelNotFoundError, match="'model.layers.0.mlp.up_proj.weight_scale'.*one value"):
        load_model(spec, attention_backend="torch")

    write_fp8_checkpoint(tmp_path, hf_model, "fp8-static")
    _mutate_checkpoint(tmp_path, lambda t: t.update(
        {"model.layers.1.mlp.down_proj.weight": t["model.layers.1.mlp.down_proj.weight"].float()}))
    with pytest.raises(ModelNotFoundError, match="down_proj.weight.*expected float8_e4m3fn"):
        load_model(spec, attention_backend="torch")

    write_fp8_checkpoint(tmp_path, hf_model, "fp8-static")  # the config leaves a layer unquantised that is FP8
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head", "model.layers.0.mlp.down_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError, match="'model.layers.0.mlp.down_proj.*' is (FP8|an FP8 scale) but "
                                                 ".* leaves its layer unquantised"):
        load_model(spec, attention_backend="torch")

    config["quantization_config"]["ignored_layers"] = ["model.layers.0.self_attn.k_proj"]  # half of a fused qkv
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError, match="some of .*k_proj.* but not all"):
        load_model(spec, attention_backend="torch")

    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError, match="unsupported quantization_config.quant_method 'gptq'"):
        load_model(spec, attention_backend="torch")


def test_bad_quantization_requests_are_refused(monkeypatch):
    with pytest.raises(InvalidRequestError, match="unknown quantization 'int8'") as error:
        load_model("random:tiny", attention_backend="torch", quantization="int8")
    assert error.value.param == "quantization"
    monkeypatch.setenv("METRONOME_FP8_GEMM", "cublas")
    with pytest.raises(InvalidRequestError, match="METRONOME_FP8_GEMM='cublas'"):
        load_model("random:tiny", attention_backend="torch", quantization="fp8")


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "phi3"])
def test_every_family_quantises_on_the_fly(tmp_path, family):
    """--quantization fp8 on the other families (QK-norm, Gemma's norms and GELU, Phi-3's fused checkpoint
    tensors): their decoder linears in FP8, the logits those of transformers with the same FP8 weights and
    fake-quantised inputs; in a prompt shorter than the families' sliding windows."""
    from family_models import FAMILIES
    from family_models import save_hf_model as save_family_model

    hf_model = save_family_model(tmp_path, FAMILIES[family]())
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch", quantization="fp8")
    dequantised = {}
    for name, module in hf_model.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            q, scale = fp8.quantize_per_channel(module.weight.detach())
            dequantised[name] = fp8.dequantize(q, scale[:, None])
    assert sum(isinstance(m, Fp8Linear) for m in loaded.model.modules()) == 4 * len(hf_model.model.layers)
    prompt = PROMPT[:16]
    expected = fp8_reference_logits(hf_model, dequantised, "token", prompt)
    torch.testing.assert_close(our_prefill_logits(loaded, prompt), expected, rtol=0, atol=5e-5)
