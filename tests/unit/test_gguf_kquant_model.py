"""A Llama GGUF made of K-quants, as llama.cpp's Q2_K … Q6_K mixes store it, loads to the weights and logits
transformers computes from the same file (transformers dequantises with the gguf package's reference).

No small real Llama/Qwen2 K-quant GGUF ships on PyPI, so the blocks are random bytes with finite scales: every
bit pattern of a K-quant block is a valid block, and what is checked is the reading, not the quantiser."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from test_gguf_dequant import HALF_OFFSETS
from test_loaders import our_prefill_logits

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 512, 2, 4, 2, 64, 320
# One tensor kind per type, the way llama.cpp's mixes spread them (embeddings and ffn_down at higher precision).
LAYER_TYPES = {"attn_q": ("Q4_K", HEADS * HEAD_DIM, HIDDEN), "attn_k": ("Q4_K", KV_HEADS * HEAD_DIM, HIDDEN),
               "attn_v": ("Q5_K", KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": ("Q3_K", HIDDEN, HEADS * HEAD_DIM),
               "ffn_gate": ("Q2_K", INTERMEDIATE, HIDDEN), "ffn_up": ("IQ4_XS", INTERMEDIATE, HIDDEN),
               "ffn_down": ("Q6_K", HIDDEN, INTERMEDIATE)}


def random_quantised(rng: np.random.Generator, kind: str, rows: int, cols: int, scale: float) -> np.ndarray:
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[kind]:
        halves = (np.abs(rng.standard_normal(n_blocks)) * scale).astype(np.float16)
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


def write_kquant_llama(path: Path) -> None:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)

    def quantised(name: str, kind: str, rows: int, cols: int, scale: float = 2e-4) -> None:
        raw = random_quantised(rng, kind, rows, cols, scale)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    quantised("token_embd.weight", "Q6_K", VOCAB, HIDDEN, 2e-3)
    quantised("output.weight", "Q8_0", VOCAB, HIDDEN, 2e-3)
    norm("output_norm.weight")
    for layer in range(LAYERS):
        for kind, (qtype, rows, cols) in LAYER_TYPES.items():
            quantised(f"blk.{layer}.{kind}.weight", qtype, rows, cols)
        norm(f"blk.{layer}.attn_norm.weight")
        norm(f"blk.{layer}.ffn_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_kquant_llama_gguf_loads_what_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from metronome.kernels import get_backend
    from metronome.server.models.gguf_loader import gguf_config, gguf_metadata, gguf_weights, open_gguf
    from metronome.server.models.loader import build_empty_model

    path = tmp_path / "kquants.gguf"
    write_kquant_llama(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()

    reader = open_gguf(path)
    config = gguf_config(reader, gguf_metadata(reader))
    weights = dict(gguf_weights(reader, config))
    expected = theirs.state_dict()
    assert set(weights) == set(expected)
    for name, weight in weights.items():  # dequantised and un-permuted exactly as transformers does it
        assert torch.equal(weight.view(torch.int32), expected[name].view(torch.int32)), name

    model = build_empty_model(config, get_backend("torch"), torch.device("cpu"), torch.float32)
    model.load_weights(iter(weights.items()))
    loaded = type("Loaded", (), {"model": model, "config": config})()
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        logits = theirs(torch.tensor([ids])).logits[0]
    ours = our_prefill_logits(loaded, ids)
    assert logits.std() > 0.5  # the random blocks make a model whose predictions differ per position
    torch.testing.assert_close(ours, logits, rtol=0, atol=1e-4)
    assert torch.equal(ours.argmax(-1), logits.argmax(-1))
