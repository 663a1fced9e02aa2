"""Qwen3-MoE (qwen3moe) and Mixtral (a llama file with experts) from GGUF files written as llama.cpp's converter
writes them: the router as `ffn_gate_inp`, the experts stacked per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`, [E, out, in]), Mixtral's Q/K rows permuted, float32 tensors. The loaded model computes what the
original transformers model computes. (gpt-oss GGUF files are not read.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_models import FAMILIES, save_hf_model
from gguf_files import assert_computes_as, decoder_writer, finish, llama_cpp_permute, load_gguf

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def write_moe_gguf(path: Path, hf_model, family: str) -> None:
    config, arch = hf_model.config, GGUF_ARCH[family]
    writer, names = decoder_writer(path, config, arch)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    inter = config.moe_intermediate_size if family == "qwen3_moe" else config.intermediate_size
    if family == "qwen3_moe":
        writer.add_expert_feed_forward_length(inter)
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float()
        base, suffix = name.rsplit(".", 1) if not name.endswith(("gate_up_proj", "down_proj")) else (name, "weight")
        if base.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up
            layer = base.split(".")[2]
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", array[:, :inter].contiguous().numpy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", array[:, inter:].contiguous().numpy())
            continue
        if arch == "llama" and base.endswith("self_attn.q_proj"):
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array.contiguous().numpy())
    finish(writer)


@pytest.mark.parametrize("family", sorted(GGUF_ARCH))
def test_moe_gguf_computes_what_transformers_computes(family, tmp_path):
    torch.set_num_threads(1)
    config = FAMILIES[family]()
    if family == "mixtral":  # a llama GGUF carries no sliding window (Mixtral's own config has none either)
        config.sliding_window = None
    if family == "qwen3_moe":  # llama.cpp's qwen3moe has no dense layers
        config.mlp_only_layers = []
    hf_model = save_hf_model(tmp_path / "hf", config)
    path = tmp_path / f"{family}.gguf"
    write_moe_gguf(path, hf_model, family)
    ours, model = load_gguf(path)
    assert ours.architecture == family and ours.moe is not None
    assert ours.moe_layers is None  # every layer has its router tensor
    if family == "qwen3_moe":  # llama.cpp renormalises Qwen3-MoE's top-k (the tiny config does too)
        assert ours.moe.renormalize and ours.qk_norm
    assert_computes_as(model, ours, hf_model, tokens=40, seed=2)
