"""FP8 checkpoints of mixtures of experts: every decoder linear and every routed expert stored as e4m3 with its
scales, the experts one tensor per expert and projection as the Hub's FP8 MoE checkpoints store them. The routed
experts stay FP8 and run on unquantised activations (W8A16); attention, dense MLPs and shared experts run FP8
W8A8. The reference is transformers' forward with every weight dequantised and the inputs of the
W8A8 linears fake-quantised (fp8_checkpoints.py), so our loader, the expert routing of scales and the emulated
GEMMs must reproduce it to float32 rounding."""
from __future__ import annotations

import json

import pytest
import torch
from family_models import FAMILIES, ROUTER_WEIGHTS, save_hf_model
from fp8_checkpoints import LAYOUTS, STATIC_INPUT_SCALE, dequantize_weight, fake_quant, quantize_weight
from safetensors.torch import load_file, save_file
from test_loaders import our_prefill_logits

from metronome.server.models import load_model
from metronome.server.models.quant.fp8_linear import Fp8Linear

PROMPT = torch.randint(3, 320, (21,), generator=torch.Generator().manual_seed(4)).tolist()
UNQUANTISED = (*ROUTER_WEIGHTS, "shared_expert_gate.weight", "block_sparse_moe.gate.weight")
ROLES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _expert(name: str) -> tuple[str, int, str]:
    """A per-expert checkpoint name → (transformers' stacked experts prefix, expert, gate | up | down); Mixtral's
    checkpoints keep their 2023 names (block_sparse_moe, w1/w3/w2)."""
    prefix, expert, projection, _ = name.rsplit(".", 3)
    return prefix.rsplit(".", 1)[0].replace("block_sparse_moe", "mlp"), int(expert), ROLES[projection]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _per_expert(name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' stacked experts ([E, 2I, H] gate rows then up, [E, H, I]) as one tensor per expert."""
    prefix = name.rsplit(".", 1)[0]  # ...mlp.experts
    if name.endswith("gate_up_proj"):
        gate, up = value.chunk(2, dim=1)
        return {**{f"{prefix}.{e}.gate_proj.weight": gate[e] for e in range(len(value))},
                **{f"{prefix}.{e}.up_proj.weight": up[e] for e in range(len(value))}}
    return {f"{prefix}.{e}.down_proj.weight": value[e] for e in range(len(value))}


def _write_fp8_moe(folder, hf_model, layout: str, experts: bool = True, ignore: tuple[str, ...] = ()
                   ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The checkpoint in `layout` (the routed experts in FP8 too unless `experts` is false; `ignore` added to the
    config's ignore list); returns the dequantised weight by checkpoint tensor name, and the names of the linears
    that run W8A8 (their inputs are fake-quantised in the reference)."""
    quant_config, granularity, scale_name, input_name, _ = LAYOUTS[layout]
    state = {}
    for name, value in load_file(str(folder / "model.safetensors")).items():
        state.update(_per_expert(name, value) if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                     else {name: value})
    tensors, dequantised, w8a8 = {}, {}, set()
    for name, value in state.items():
        linear = (name.startswith("model.layers.") and name.endswith(".weight") and value.dim() == 2
                  and not name.endswith(UNQUANTISED) and (experts or ".experts." not in name))
        if not linear:
            tensors[name] = value.contiguous()
            continue
        module = name.removesuffix(".weight")
        q, scale = quantize_weight(value.float(), granularity)
        tensors[name], tensors[f"{module}.{scale_name}"] = q, scale
        if input_name is not None:
            tensors[f"{module}.{input_name}"] = torch.tensor(STATIC_INPUT_SCALE)
        dequantised[name] = dequantize_weight(q, scale, granularity)
        if ".experts." not in name:
            w8a8.add(module)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**quant_config, "ignore": [*quant_config.get("ignore", []), *ignore]}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantised, w8a8


def _reference_logits(hf_model, dequantised: dict[str, torch.Tensor], w8a8: set[str], activation: str):
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, weight in dequantised.items():
            if ".experts." in name:  # back into transformers' stacked experts
                prefix, expert, role = _expert(name)
                rows = params[f"{prefix}.experts.{'down_proj' if role == 'down' else 'gate_up_proj'}"][expert]
                if role != "down":
                    rows = rows.chunk(2, dim=0)[role == "up"]
                rows.copy_(weight)
            else:
                params[name].copy_(weight)
    hooks = [hf_model.get_submodule(module).register_forward_pre_hook(
        lambda _m, args: (fake_quant(args[0], activation),)) for module in w8a8]
    try:
        with torch.inference_mode():
            return hf_model(torch.tensor([PROMPT])).logits[0].float()
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("family, layout", [
    ("qwen3_moe", "fp8-block"), ("qwen3_moe", "ct-channel"), ("qwen2_moe", "fp8-static"), ("mixtral", "fp8-block")])
def test_fp8_moe_checkpoint_matches_its_reference(tmp_path, family, layout):
    hf_model = save_hf_model(tmp_path, FAMILIES[family]())
    dequantised, w8a8 = _write_fp8_moe(tmp_path, hf_model, layout)
    expert_up = next(name for name in dequantised if ".experts.3." in name and _expert(name)[2] == "up")
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    model = loaded.model.model
    moe_layer = next(layer for layer in model.layers if hasattr(layer.mlp, "experts"))
    assert isinstance(moe_layer.self_attn.qkv_proj, Fp8Linear)
    assert moe_layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    layer_index = int(expert_up.split(".")[2])
    stored = model.layers[layer_index].mlp.experts.weights().gate_up[3].chunk(2, dim=0)[1]
    assert torch.equal(stored, dequantised[expert_up])
    if family == "qwen2_moe":  # the shared expert is W8A8, its gate stays in the model dtype
        block = model.layers[layer_index].mlp
        assert isinstance(block.shared_expert.gate_up_proj, Fp8Linear)
        assert type(block.shared_expert_gate) is torch.nn.Linear
    expected = _reference_logits(hf_model, dequantised, w8a8, LAYOUTS[layout][4])
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=1e-5)


def test_experts_the_checkpoint_leaves_unquantised_load_in_the_model_dtype(tmp_path):
    hf_model = save_hf_model(tmp_path, FAMILIES["qwen3_moe"]())
    dequantised, w8a8 = _write_fp8_moe(tmp_path, hf_model, "ct-channel", experts=False, ignore=("re:.*experts.*",))
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")
    experts = loaded.model.model.layers[0].mlp.experts
    assert not experts.fp8 and experts.gate_up_proj.dtype == torch.float32
    expected = _reference_logits(hf_model, dequantised, w8a8, "token")
    torch.testing.assert_close(our_prefill_logits(loaded, PROMPT), expected, rtol=0, atol=1e-5)


def test_fp8_experts_the_config_leaves_out_are_refused(tmp_path):
    from metronome.contract.errors import ModelNotFoundError

    hf_model = save_hf_model(tmp_path, FAMILIES["qwen3_moe"]())
    _write_fp8_moe(tmp_path, hf_model, "ct-channel", ignore=("re:.*experts.*",))
    with pytest.raises(ModelNotFoundError, match=r"experts\.\d+\.\w+_proj\.weight' is torch\.float8_e4m3fn, but "
                                                 r"this model's experts are not FP8"):
        load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")


def test_a_checkpoint_missing_an_expert_scale_is_refused_naming_it(tmp_path):
    hf_model = save_hf_model(tmp_path, FAMILIES["qwen3_moe"]())
    _write_fp8_moe(tmp_path, hf_model, "fp8-block")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    from metronome.contract.errors import ModelNotFoundError

    missing = r"lacks 1 tensors, e\.g\. \['model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight_scale'"
    with pytest.raises(ModelNotFoundError, match=missing):
        load_model(f"hf-dir:{tmp_path}", dtype="float32", attention_backend="torch")


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-gpt-oss"])  # gpt-oss: transposed, interleaved experts
def test_fp8_on_the_fly_quantises_a_moe_s_linears_and_its_experts_per_row(preset):
    bf16 = load_model(f"random:{preset}", attention_backend="torch", dtype="float32")
    fp8 = load_model(f"random:{preset}", attention_backend="torch", dtype="float32", quantization="fp8")
    layer = fp8.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear)
    experts, original = layer.mlp.experts, bf16.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_scale.shape[-1] == 1
    for ours, theirs in ((experts.weights().gate_up, original.gate_up_proj), (experts.weights().down,
                                                                            original.down_proj)):
        assert ours.dtype == theirs.dtype and not torch.equal(ours, theirs)
        # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself, or of its row's scale near zero
        row_scale = theirs.abs().amax(dim=-1, keepdim=True) / 448
        assert ((ours - theirs).abs() <= theirs.abs() / 16 + row_scale).all()
    ours, theirs = our_prefill_logits(fp8, PROMPT), our_prefill_logits(bf16, PROMPT)
    assert ours.isfinite().all() and not torch.equal(ours, theirs)
    assert (ours - theirs).abs().mean() < 0.1 * theirs.abs().mean()
