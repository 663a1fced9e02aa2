"""GGUF files (llama.cpp's format) → ModelConfig + transformers-named float tensors.

llama.cpp's converter permutes the rows of Q and K in llama-architecture files (its rope pairs adjacent
elements; transformers' pairs halves). We undo that exactly as transformers' own GGUF loader does, so a GGUF
loaded here computes what transformers computes from the same file.

Cold start matters (a restart or a new replica pays it): the file is memory-mapped and read lazily
(gguf_file.py: the vocabulary is not decoded, tensor bytes are touched only when their turn comes), and the common
block formats are dequantised with torch (gguf_dequant.py).
"""
from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import torch

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import ModelConfig, UnsupportedModelError
from metronome.server.models.gguf_dequant import dequantize, tensor_nbytes
from metronome.server.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# GGUF architectures we read, and whether their Q/K rows were permuted by llama.cpp's converter.
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def open_gguf(path: str | Path) -> GGUFFile:
    """The file, memory-mapped with its header parsed, or ModelNotFoundError saying why it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {path}")
    started = time.perf_counter()
    try:
        reader = GGUFFile(path)
    except (OSError, ValueError) as error:
        raise ModelNotFoundError(f"cannot read GGUF file {path}: {error}") from None
    log.info("gguf %s: header of %d tensors and %d keys read in %.3fs", path.name, len(reader.tensors),
             len(reader.metadata), time.perf_counter() - started)
    return reader


def open_gguf_cached(path: str | Path) -> tuple[GGUFFile, dict[str, Any]]:
    """(reader, metadata), once per process and file version (engines and tests load the default model often)."""
    path = Path(path)
    try:
        stat = path.stat()
    except OSError:
        raise ModelNotFoundError(f"GGUF file not found: {path}") from None
    return _open_parsed(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_parsed(path: str, mtime_ns: int, size: int) -> tuple[GGUFFile, dict[str, Any]]:
    reader = open_gguf(path)
    return reader, gguf_metadata(reader)


def gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value fields as Python values; string arrays (vocabulary, merges) decode when first read."""
    return {key: value for key, value in reader.metadata.items() if not key.startswith("GGUF.")}


def gguf_config(reader, metadata: dict[str, Any]) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelNotFoundError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dims != head_dim:
        raise UnsupportedModelError(f"partial rotary (rope over {rope_dims} of {head_dim} dims) is not supported")
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab_size:
        raise ModelNotFoundError("GGUF metadata gives no vocabulary size")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_output_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(
            int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata
        )),
    )


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    raise UnsupportedModelError(f"unsupported GGUF rope scaling {kind!r}")


def gguf_weights(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers name, float32 CPU tensor) for every tensor, dequantised and un-permuted.

    On one intra-op thread: dequantising is memory-bound, and on a busy machine torch's OpenMP threads spin
    waiting for each other (measured on 2 shared cores: 14.8 s with two threads, 0.7 s with one)."""
    permuted = GGUF_ARCHITECTURES[config.architecture]
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for tensor in reader.tensors:
            name = _hf_name(tensor.name)
            shape = tuple(reversed(tensor.shape))
            try:
                raw = reader.raw(tensor, tensor_nbytes(tensor.ggml_type, prod(tensor.shape)))
                weight = dequantize(raw, tensor.ggml_type, shape)
            except (NotImplementedError, KeyError, ValueError) as error:
                raise UnsupportedModelError(f"GGUF tensor {tensor.name} has ggml type {tensor.ggml_type}, which "
                                            f"cannot be dequantised: {error}") from None
            if permuted and ".self_attn.q_proj." in name:
                weight = unpermute_rows(weight, config.num_attention_heads)
            elif permuted and ".self_attn.k_proj." in name:
                weight = unpermute_rows(weight, config.num_key_value_heads)
            yield name, weight.contiguous()
    finally:
        torch.set_num_threads(threads)
    log.info("gguf %s: %d tensors dequantised and loaded in %.3fs", reader.path.name, len(reader.tensors),
             time.perf_counter() - started)


def unpermute_rows(weight, num_heads: int):
    """Inverse of llama.cpp's Q/K permutation: per head, rows (pair i, half h) go back to (half h, pair i).
    Works on numpy arrays and torch tensors alike."""
    half_dim = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half_dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r} for a Llama-family model")
