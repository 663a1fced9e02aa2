"""GGUF files (llama.cpp's format) → ModelConfig + transformers-named float tensors.

Architectures: llama (and Mistral, which llama.cpp files as llama), qwen2, qwen3, gemma3 (text), phi3. We undo
llama.cpp's conventions exactly as transformers' own GGUF loader does, so a GGUF loaded here computes what
transformers computes from the same file:
- its converter permutes the rows of Q and K in llama-architecture files (its rope pairs adjacent elements;
  transformers' pairs halves): un-permuted here;
- Gemma's norm weights are stored as 1 + w (llama.cpp multiplies by the weight): 1 is subtracted again;
- Phi-3 keeps q/k/v and gate/up fused (`attn_qkv`, `ffn_up` of 2 x intermediate rows) and its LongRoPE factor
  sets as tensors (`rope_factors_short`, `rope_factors_long`), read into the config;
- Gemma 3's sliding-window pattern and local rope base are llama.cpp's (every sixth layer global, base 10,000)
  unless the file says otherwise (`sliding_window_pattern`, `rope.freq_base_swa`).

Cold start matters (a restart or a new replica pays it): the file is memory-mapped and read lazily
(gguf_file.py: the vocabulary is not decoded, tensor bytes are touched only when their turn comes), and the common
block formats are dequantised with torch (gguf_dequant.py).
"""
from __future__ import annotations

import functools
import logging
import math
import re
import time
from collections.abc import Iterator
from math import prod
from pathlib import Path
from typing import Any

import torch

from metronome.contract.errors import ModelNotFoundError
from metronome.server.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, UnsupportedModelError
from metronome.server.models.gguf_dequant import dequantize, tensor_nbytes
from metronome.server.models.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# GGUF architectures we read, and whether their Q/K rows were permuted by llama.cpp's converter. A llama file with
# experts is Mixtral; qwen3moe is Qwen3-MoE.
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "gemma3": False, "phi3": False,
                      "qwen3moe": False}
_MODEL_ARCHITECTURES = {"qwen3moe": "qwen3_moe"}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's layer tensors differ from the table above.
_ARCH_LAYER_TENSORS = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, gate rows first
}
# The expert block: the router and the experts stacked per projection, [E, out, in] (moe.py reads them).
_MOE_LAYER_TENSORS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                      "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}
_ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
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
    layers = int(key("block_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_size = int(metadata.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
    if not vocab_size:
        raise ModelNotFoundError("GGUF metadata gives no vocabulary size")
    family = _family_fields(reader, metadata, arch, layers, hidden, head_dim, tensor_names)
    if rope_dims != head_dim:
        family["partial_rotary_factor"] = rope_dims / head_dim
    family.update(_moe_fields(metadata, arch, layers, tensor_names))
    architecture = family.pop("architecture", _MODEL_ARCHITECTURES.get(arch, arch))
    return ModelConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(metadata.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=family.pop("rope_scaling", None) or _rope_scaling(metadata, arch),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_output_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(
            int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in metadata
        )),
        **family,
    )


def _family_fields(reader, metadata: dict[str, Any], arch: str, layers: int, hidden: int, head_dim: int,
                   tensor_names: set[str]) -> dict[str, Any]:
    """The ModelConfig fields a family reads beyond the common shape."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    window = int(window) if window else None
    if arch in ("qwen3", "qwen3moe"):
        return {"qk_norm": True}
    if arch == "phi3":
        fields: dict[str, Any] = {"sliding_window": window}
        if all(name in tensor_names for name in _ROPE_FACTOR_TENSORS):
            short, long = (_small_tensor(reader, name).tolist() for name in _ROPE_FACTOR_TENSORS)
            scaling: dict[str, Any] = {
                "rope_type": "longrope", "short_factor": short, "long_factor": long,
                "original_max_position_embeddings": int(metadata[f"{arch}.rope.scaling.original_context_length"])}
            if metadata.get(f"{arch}.rope.scaling.attn_factor") is not None:
                scaling["attention_factor"] = float(metadata[f"{arch}.rope.scaling.attn_factor"])
            fields["rope_scaling"] = scaling
        return fields
    if arch == "gemma3":
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", 6)
        if isinstance(pattern, (list, tuple)):  # per layer: True where the layer slides
            types = tuple(SLIDING_ATTENTION if slides else FULL_ATTENTION for slides in pattern)
        else:
            types = tuple(SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(layers))
        return {"qk_norm": True, "norm_plus_one": True, "sandwich_norm": True, "hidden_act": "gelu_tanh",
                "embedding_scale": math.sqrt(hidden), "query_pre_attn_scalar": float(head_dim),
                "sliding_window": window, "layer_types": types,
                "rope_local_theta": float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0))}
    return {}


def _moe_fields(metadata: dict[str, Any], arch: str, layers: int, tensor_names: set[str]) -> dict[str, Any]:
    """The expert block of a file with experts: Qwen3-MoE (qwen3moe; llama.cpp always renormalises its top-k) or
    Mixtral (a llama file with `llama.expert_count`). The sparse layers are those with a router tensor."""
    experts = metadata.get(f"{arch}.expert_count")
    if not experts:
        return {}
    from metronome.server.models.moe_config import MoeSpec

    top_k = int(metadata[f"{arch}.expert_used_count"])
    sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names)
    fields: dict[str, Any] = {"moe_layers": None if len(sparse) == layers else sparse}
    if arch == "qwen3moe":
        size = int(metadata[f"{arch}.expert_feed_forward_length"])
        fields["moe"] = MoeSpec(num_experts=int(experts), top_k=top_k, intermediate_size=size,
                                weights_in_model_dtype=True)
    elif arch == "llama":
        size = int(metadata[f"{arch}.feed_forward_length"])
        fields["architecture"] = "mixtral"
        fields["moe"] = MoeSpec(num_experts=int(experts), top_k=top_k, intermediate_size=size)
    else:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not read")
    return fields


def _small_tensor(reader: GGUFFile, name: str) -> torch.Tensor:
    tensor = next(t for t in reader.tensors if t.name == name)
    raw = reader.raw(tensor, tensor_nbytes(tensor.ggml_type, prod(tensor.shape)))
    return dequantize(raw, tensor.ggml_type, tuple(reversed(tensor.shape))).reshape(-1)


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if kind in ("longrope", "su") and arch == "phi3":
        return None  # the factor sets are tensors (rope_factors_*), read by _family_fields
    raise UnsupportedModelError(f"unsupported GGUF rope scaling {kind!r}")


def gguf_weights(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (transformers name, float32 CPU tensor) for every tensor, dequantised and un-permuted.

    On one intra-op thread: dequantising is memory-bound, and on a busy machine torch's OpenMP threads spin
    waiting for each other (measured on 2 shared cores: 14.8 s with two threads, 0.7 s with one)."""
    permuted = GGUF_ARCHITECTURES[reader.metadata.get("general.architecture")]
    plus_one_norms = config.norm_plus_one
    names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(config.architecture, {}),
             **(_MOE_LAYER_TENSORS if config.moe is not None else {})}
    started = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for tensor in reader.tensors:
            if tensor.name in _ROPE_FACTOR_TENSORS:
                continue  # read into the config
            name = _hf_name(tensor.name, names)
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
            if plus_one_norms and tensor.name.endswith("norm.weight"):
                weight = weight - 1  # llama.cpp stores Gemma's norms as 1 + w
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


def _hf_name(gguf_name: str, layer_tensors: dict[str, str] = _LAYER_TENSORS) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in layer_tensors:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{layer_tensors[kind]}.{suffix}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r} for this architecture")
