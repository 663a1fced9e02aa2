"""The MoE families as whole models, beyond test_family_exact.py (which runs Qwen3-MoE, Qwen2-MoE, Mixtral and
gpt-oss against transformers on the engine):

- a gpt-oss checkpoint with MXFP4-packed experts (`_blocks` + `_scales`, as the Hub ships gpt-oss) gives
  transformers' logits for the same (dequantised) weights;
- the experts' backends agree on the CPU (grouped_mm vs the reference loop: same greedy tokens);
- config.json readers: which layers are sparse, windows, sinks, YaRN, the norm style; bad configs are refused;
- the engine flag: a backend that cannot run on the device is refused naming the flag, and the reference backend
  keeps CUDA graphs off.
"""
from __future__ import annotations

import json

import pytest
import torch
from family_models import FAMILIES, VOCAB, save_hf_model
from test_model_exact import PagedCache

from metronome.contract.config import SchedulerConfig
from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.config import EngineConfig
from metronome.server.engine.engine import EngineCore
from metronome.server.engine.sampling import SamplingParams
from metronome.server.models import load_model
from metronome.server.models.config import ModelConfig, UnsupportedModelError
from metronome.server.models.hf_config import config_from_hf_dict
from metronome.server.models.moe_config import MoeSpec
from metronome.server.models.presets import preset_config

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    cache = PagedCache(loaded.config, 1, len(ids))
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
        return loaded.model.compute_logits(hidden)


def test_gpt_oss_with_mxfp4_experts_matches_transformers(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = save_hf_model(tmp_path, FAMILIES["gpt_oss"]())
    config = hf_model.config
    experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    generator = torch.Generator().manual_seed(11)
    packed = {}
    for proj, rows, columns in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        for layer in range(config.num_hidden_layers):
            blocks = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator,
                                   dtype=torch.uint8)
            scales = torch.randint(118, 124, (experts, rows, columns // 32), generator=generator, dtype=torch.uint8)
            packed[(layer, proj)] = (blocks, scales)
            with torch.no_grad():  # transformers' model holds the dequantised [E, in, out] weights
                getattr(hf_model.model.layers[layer].mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    tensors = load_file(tmp_path / "model.safetensors")
    for (layer, proj), (blocks, scales) in packed.items():
        name = f"model.layers.{layer}.mlp.experts.{proj}"
        del tensors[name]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch")
    ids = torch.randint(3, VOCAB, (40,), generator=generator).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_logits(ours, ids), expected, rtol=0, atol=1e-4)


def test_an_mxfp4_half_without_its_pair_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_model(tmp_path, FAMILIES["gpt_oss"]())
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    shape = tensors.pop(name).shape  # [E, I, H]: rows of the packed layout are H, blocks of 32 over I
    tensors[f"{name}_blocks"] = torch.zeros(shape[0], shape[2], shape[1] // 32, 16, dtype=torch.uint8)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="MXFP4 halves without their other half"):
        load_model(f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch")


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_grouped_mm_and_reference_backends_give_the_same_greedy_tokens(preset):
    from metronome.server.models.moe_experts import grouped_mm_available

    if not grouped_mm_available():
        pytest.skip("this torch has no grouped_mm")
    prompts = [list(range(3, 40)), [7, 8, 9], list(range(50, 120))]
    tokens = {}
    for backend in ("reference", "grouped_mm"):
        loaded = load_model(f"random:{preset}", dtype="float32", device="cpu", attention_backend="torch", seed=2)
        core = EngineCore(loaded, EngineConfig(device="cpu", block_size=16, num_kv_blocks=64, moe_backend=backend),
                          SchedulerConfig(chunk_size=32, queue_policy="fcfs"))
        assert loaded.model.moe_backend == backend
        results = core.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        tokens[backend] = [r.token_ids for r in results]
    assert tokens["reference"] == tokens["grouped_mm"]


def test_moe_backend_flag_is_checked_against_the_device():
    loaded = load_model("random:tiny-qwen3-moe", dtype="float32", device="cpu", attention_backend="torch")
    with pytest.raises(InvalidRequestError, match="moe_backend must be one of") as bad:
        EngineCore(loaded, EngineConfig(device="cpu", moe_backend="cutlass"), SchedulerConfig())
    assert bad.value.param == "moe_backend"
    with pytest.raises(InvalidRequestError, match="'triton' runs on CUDA") as wrong_device:
        EngineCore(loaded, EngineConfig(device="cpu", num_kv_blocks=16, moe_backend="triton"), SchedulerConfig())
    assert wrong_device.value.param == "moe_backend"
    model = loaded.model
    model.set_moe_backend("reference")
    assert "reads each step's routing on the host" in model.graph_capture_problem(torch.device("cuda"))
    model.set_moe_backend("grouped_mm")
    assert model.graph_capture_problem(torch.device("cuda")) is None


def test_tensor_parallelism_splits_gpt_oss_experts_in_whole_mxfp4_blocks():
    from metronome.server.models.parallel import plan_shards

    gpt_oss = preset_config("gpt-oss-20b")  # experts 2,880 columns wide: 1,440 a rank at 2 (45 blocks), 720 at 4
    assert plan_shards(gpt_oss, 2).expert_size == 1440
    with pytest.raises(InvalidRequestError, match="720 of an expert's 2880 columns: not whole MXFP4 blocks of 32"
                       ) as refused:
        plan_shards(gpt_oss, 4)
    assert refused.value.param == "tensor_parallel_size"
    mixtral = preset_config("tiny-mixtral")
    assert plan_shards(mixtral, 2).expert_size == mixtral.moe.intermediate_size // 2


# ---- config.json ------------------------------------------------------------------------------------------------

def test_moe_configs_read_from_transformers_config_classes():
    qwen3 = config_from_hf_dict(FAMILIES["qwen3_moe"]().to_dict())
    assert qwen3.architecture == "qwen3_moe" and qwen3.qk_norm and qwen3.moe_layers == (0, 2)
    assert [qwen3.is_moe_layer(i) for i in range(3)] == [True, False, True]
    qwen2 = config_from_hf_dict(FAMILIES["qwen2_moe"]().to_dict())
    assert qwen2.moe_layers == (1,) and qwen2.moe.has_shared_expert and qwen2.attention_bias
    assert not qwen2.attention_output_bias and qwen2.moe.top_k == 3 and not qwen2.moe.renormalize
    mixtral = config_from_hf_dict(FAMILIES["mixtral"]().to_dict())
    assert mixtral.moe_layers is None and mixtral.num_moe_layers == 3 and mixtral.sliding_window == 20
    oss = config_from_hf_dict(FAMILIES["gpt_oss"]().to_dict())
    assert oss.attention_sinks and oss.norm_float_scale and oss.attention_bias and oss.attention_output_bias
    assert oss.layer_windows == (20, None, 20) and oss.rope_scaling["rope_type"] == "yarn"
    assert oss.moe.activation == "swiglu_clamped" and oss.moe.checkpoint_layout == "interleaved_transposed"


def test_presets_have_the_real_models_parameter_counts():
    # Published totals: Qwen3-30B-A3B 30.5B, gpt-oss-20b 20.9B, Mixtral-8x7B 46.7B.
    for name, billions in (("qwen3-30b-a3b", 30.5), ("gpt-oss-20b", 20.9), ("mixtral-8x7b", 46.7)):
        assert preset_config(name).num_parameters() / 1e9 == pytest.approx(billions, abs=0.1), name


def test_bad_moe_configs_are_refused():
    fields = {k: v for k, v in preset_config("tiny-mixtral").__dict__.items() if k != "notes"}
    with pytest.raises(UnsupportedModelError, match="needs its MoE block"):
        ModelConfig(**{**fields, "moe": None})
    with pytest.raises(UnsupportedModelError, match="not layers of"):
        ModelConfig(**{**fields, "moe_layers": (0, 7)})
    with pytest.raises(UnsupportedModelError, match="no MoE block"):
        ModelConfig(**{**fields, "architecture": "llama", "moe": None, "moe_layers": (0,)})
    raw = FAMILIES["qwen3_moe"]().to_dict()
    raw["num_experts_per_tok"] = 99
    with pytest.raises(UnsupportedModelError, match="top_k"):
        config_from_hf_dict(raw)
    assert MoeSpec(num_experts=8, top_k=2, intermediate_size=4).block_parameters(16) == 8 * 16 + 8 * 3 * 16 * 4


def test_a_saved_moe_folder_round_trips_its_config(tmp_path):
    save_hf_model(tmp_path, FAMILIES["qwen3_moe"]())
    raw = json.loads((tmp_path / "config.json").read_text())
    loaded = load_model(f"hf-dir:{tmp_path}", dtype="float32", device="cpu", attention_backend="torch")
    assert loaded.config.moe.num_experts == raw.get("num_experts", raw.get("num_local_experts"))
    assert loaded.config.num_parameters() == sum(p.numel() for p in loaded.model.parameters())
