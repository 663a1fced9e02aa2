"""GGUF files written as llama.cpp's converter writes them, for the loader tests: the header every decoder carries,
tensors named by gguf's own map, and the check that the loaded file computes what the transformers model does."""
from __future__ import annotations

from pathlib import Path

import torch
from family_models import VOCAB
from test_model_exact import PagedCache

from metronome.kernels import get_backend
from metronome.server.models.gguf_loader import gguf_config, gguf_metadata, gguf_weights, open_gguf
from metronome.server.models.loader import build_empty_model


def llama_cpp_permute(weight, heads: int):
    """What llama.cpp's convert_hf_to_gguf does to the Q/K rows of llama-architecture models (pairs of adjacent rows
    per head, for its rope); the loader's unpermute_rows inverts it. A numpy array or a torch tensor."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def decoder_writer(path: Path, config, arch: str):
    """A GGUFWriter with the decoder's shape in its header, and gguf's tensor-name map for `arch`."""
    import gguf

    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    return writer, gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_gguf(path: Path):
    """(our config, the float32 CPU model loaded from the file)."""
    reader = open_gguf(path)
    ours = gguf_config(reader, gguf_metadata(reader))
    model = build_empty_model(ours, get_backend("torch"), torch.device("cpu"), torch.float32)
    model.load_weights(gguf_weights(reader, ours))
    return ours, model


def assert_computes_as(model, ours, hf_model, tokens: int, seed: int) -> None:
    """One prefill of `tokens` random ids: our logits equal the transformers model's."""
    ids = torch.randint(3, VOCAB, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    cache = PagedCache(ours, 1, len(ids))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache.kv, cache.metadata([0], [len(ids)]))
        expected = hf_model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=0, atol=1e-4)
