"""Qwen3, Gemma 3 and Phi-3 from GGUF files written as llama.cpp's converter writes them (gguf's own tensor-name
map; Gemma's norms stored as 1 + w; Phi-3's fused qkv / gate-up and its LongRoPE factors as tensors; float32
tensors): the loaded model computes what the original transformers model computes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_models import FAMILIES
from gguf_files import assert_computes_as, decoder_writer, finish, load_gguf

GGUF_ARCH = {"qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}


def write_llama_cpp_gguf(path: Path, hf_model, arch: str) -> None:
    config = hf_model.config
    writer, names = decoder_writer(path, config, arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).numpy())
        writer.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).numpy())
    for name, tensor in hf_model.state_dict().items():
        array = tensor.detach().float().numpy().copy()
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        if arch == "gemma3" and base.endswith("norm"):
            array = array + 1  # llama.cpp's Gemma convention
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    finish(writer)


@pytest.mark.parametrize("family", sorted(GGUF_ARCH))
def test_llama_cpp_gguf_of_each_family_matches_transformers(tmp_path, family):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    config = FAMILIES[family]()
    if family == "gemma3":  # GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5
        config.query_pre_attn_scalar = config.head_dim
    if family == "qwen3":  # llama.cpp's qwen3 has no sliding layers
        config.use_sliding_window, config.sliding_window = False, None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    hf_model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    path = tmp_path / f"{family}.gguf"
    write_llama_cpp_gguf(path, hf_model, GGUF_ARCH[family])

    ours, model = load_gguf(path)
    windows = tuple(config.sliding_window if t == "sliding_attention" else None for t in config.layer_types) \
        if family == "gemma3" else (config.sliding_window,) * config.num_hidden_layers
    assert ours.architecture == family and ours.layer_windows == windows
    assert_computes_as(model, ours, hf_model, tokens=50, seed=4)
