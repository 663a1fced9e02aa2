"""Qwen3-MoE (qwen3moe) and Mixtral (a llama file with experts) from GGUF files written as llama.cpp's converter
writes them: the router as `ffn_gate_inp`, the experts stacked per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`, [E, out, in]), Mixtral's Q/K rows permuted, float32 tensors. The loaded model computes what the
original transformers model computes. (gpt-oss GGUF files are not read.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_models import FAMILIES, VOCAB, save_hf_model
from test_model_exact import PagedCache

from metronome.kernels import get_backend
from metronome.server.models.gguf_loader import gguf_config, gguf_metadata, gguf_weights, open_gguf
from metronome.server.models.loader import build_empty_model

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order for llama files (pairs of adjacent rows per head), the inverse of the loader's."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_moe_gguf(path: Path, hf_model, family: str) -> None:
    import gguf

    config, arch = hf_model.config, GGUF_ARCH[family]
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    inter = config.moe_intermediate_size if family == "qwen3_moe" else config.intermediate_size
    writer.add_feed_forward_length(config.intermediate_size)
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
            array = _permute(array, config.num_attention_heads)
        elif arch == "llama" and base.endswith("self_attn.k_proj"):
            array = _permute(array, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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
    reader = open_gguf(path)
    ours = gguf_config(reader, gguf_metadata(reader))
    assert ours.architecture == family and ours.moe is not None
    assert ours.moe_layers is None  # every layer has its router tensor
    if family == "qwen3_moe":  # llama.cpp renormalises Qwen3-MoE's top-k (the tiny config does too)
        assert ours.moe.renormalize and ours.qk_norm
    model = build_empty_model(ours, get_backend("torch"), torch.device("cpu"), torch.float32)
    model.load_weights(gguf_weights(reader, ours))
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = PagedCache(ours, 1, len(ids))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
        expected = hf_model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=0, atol=1e-4)
