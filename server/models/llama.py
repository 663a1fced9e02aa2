"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat, mixed batch and a paged KV cache.

One forward pass takes T tokens from any number of sequences laid end to end (prefill chunks and decodes
mixed); attention goes through a `metronome.kernels` backend, which reads each sequence's context from the
paged cache through its block table. Parameter names follow transformers' (`model.layers.N.self_attn...`)
except that q/k/v and gate/up are fused into `qkv_proj` and `gate_up_proj`; `load_weights` takes the
transformers names and fills the fused matrices.

A forward pass is a chain of pieces around the attentions (`piece`, `attend`): the piecewise CUDA graphs of
mixed steps capture the pieces and launch the attentions between them. On CUDA the element-wise ops of a piece
are fused Triton kernels (norm + residual add, rope + K/V write, SiLU * up); elsewhere torch ops, in the order
transformers uses.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.models.config import ModelConfig
from metronome.server.models.layers import GatedMLP, RMSNorm
from metronome.server.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [num_blocks, block_size, n_kv_heads, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_output_bias)
        self.attention = attention
        self.kv_scales: dict[str, torch.Tensor] = {}  # an FP8 KV cache's k_scale / v_scale [n_kv_heads] (engine-set)

    def project_and_cache(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          rotary: RotaryEmbedding, kv_cache: KVCache, fused: bool,
                          q_out: torch.Tensor | None = None) -> torch.Tensor:
        """qkv projection and rope; K/V written to the cache. Returns q [T, H, D] (in q_out if given)."""
        k_cache, v_cache = kv_cache
        qkv = self.qkv_proj(x)
        if fused:
            from metronome.kernels.triton_fused import rope_write_kv
            cos, sin = rotary.tables(qkv.device, qkv.dtype)
            return rope_write_kv(qkv, positions, slot_mapping, cos, sin, k_cache, v_cache, self.num_heads,
                                 self.num_kv_heads, q_out, **self.kv_scales)
        tokens = x.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.contiguous().view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        self.attention.write_kv(k, v, k_cache, v_cache, slot_mapping, **self.kv_scales)
        if q_out is None:
            return q
        q_out.copy_(q)
        return q_out

    def attend(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H, D] attention of q over the cache (the one launch a captured piece leaves out)."""
        return self.attention.attention(q, kv_cache[0], kv_cache[1], meta, self.scale, out=out, **self.kv_scales)


class LlamaDecoderLayer(nn.Module):
    """A layer in two halves around its attention, so that everything between two attentions can be one
    captured piece: `begin` (residual add, norm, qkv, rope, K/V write) and `finish` (o_proj, residual add, norm,
    MLP). The order of operations is transformers' (add, then norm), so the torch path stays exact."""

    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def begin(self, delta: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
              slot_mapping: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, fused: bool,
              q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual + delta (the previous layer's MLP output; None at layer 0) → (q, residual)."""
        x, residual = self.input_layernorm.add_forward(delta, residual, fused)
        return self.self_attn.project_and_cache(x, positions, slot_mapping, rotary, kv_cache, fused, q_out), residual

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor, fused: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [T, H, D] → (MLP output, residual after the attention)."""
        o = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        x, residual = self.post_attention_layernorm.add_forward(o, residual, fused)
        return self.mlp(x, fused), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, attention) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


# transformers' parameter name suffix → (our fused parameter, which shard). Shards are stacked in this order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, attention: AttentionBackend):
        super().__init__()
        self.config = config
        self.attention_backend = attention
        self.fused: bool | None = None  # None: fused element-wise kernels on CUDA (use_fused)
        self.model = LlamaModel(config, attention)
        # Tied models reuse the embedding matrix for the output projection (no second copy).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)

    def set_attention_backend(self, attention: AttentionBackend) -> None:
        """Swap the attention kernels (e.g. once the engine knows its block size)."""
        self.attention_backend = attention
        for layer in self.model.layers:
            layer.self_attn.attention = attention

    @property
    def num_pieces(self) -> int:
        """Pieces of a forward pass: one before the first attention, one between each two, one after the last."""
        return len(self.model.layers) + 1

    def use_fused(self, device: torch.device) -> bool:
        """The fused Triton element-wise kernels run on CUDA (unless `fused` is set False, e.g. to compare with the
        torch path); elsewhere the torch ops run (Triton's interpreter would be slow)."""
        if self.fused is not None:
            return self.fused
        return device.type == "cuda" and _triton_importable()

    def piece(self, index: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              slot_mapping: torch.Tensor, kv_caches: list[KVCache], q_out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Piece `index` of the forward: x is input_ids for piece 0, else the attention output of layer index - 1.
        Returns (q of layer index, residual), or (final-normed hidden states, None) for the last piece. Reads no
        host data that changes between steps: a CUDA graph can replay it."""
        layers = self.model.layers
        fused = self.use_fused(x.device)
        if index == 0:
            delta, residual = None, self.model.embed_tokens(x)
        else:
            delta, residual = layers[index - 1].finish(x, residual, fused)
        if index == len(layers):
            return self.model.norm.add_forward(delta, residual, fused)[0], None
        return layers[index].begin(delta, residual, positions, slot_mapping, self.model.rotary, kv_caches[index],
                                   fused, q_out)

    def attend(self, index: int, q: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.layers[index].self_attn.attend(q, kv_caches[index], meta, out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final-normed hidden states [T, hidden] (feed compute_logits)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x, residual = input_ids, None
        last = len(self.model.layers)
        for index in range(last + 1):
            out, residual = self.piece(index, x, residual, positions, meta.slot_mapping, kv_caches)
            if index == last:
                return out
            x = self.attend(index, out, kv_caches, meta)
        raise AssertionError("unreachable")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (rows of forward's output, e.g. the last token of each sequence) → float32 [N, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # ---- weights -------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into this model (any dtype/device; cast on copy).

        Every parameter must be filled exactly once; unknown names and wrong shapes are errors, because a
        silently half-loaded model produces plausible garbage.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints store the rope buffer; we compute it
            if name == "rope_freqs":
                self.model.rotary.set_freq_factors(tensor)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints still carry a copy of the embedding
            target, shard = _fused_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            destination = self._shard_view(param, target, shard)
            if tuple(destination.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(destination.shape)}")
            with torch.no_grad():
                destination.copy_(tensor)
            filled.add((target, shard if shard is not None else -1))
        missing = [name for name, shards in self._expected_shards().items()
                   for shard in shards if (name, shard) not in filled]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")

    def _shard_view(self, param: torch.Tensor, target: str, shard: int | None) -> torch.Tensor:
        if shard is None:
            return param
        sizes = self._shard_sizes(target)
        start = sum(sizes[:shard])
        return param.narrow(0, start, sizes[shard])

    def _shard_sizes(self, target: str) -> list[int]:
        c = self.config
        if target.endswith("qkv_proj.weight") or target.endswith("qkv_proj.bias"):
            return [c.q_size, c.kv_size, c.kv_size]
        return [c.intermediate_size, c.intermediate_size]

    def _expected_shards(self) -> dict[str, list[int]]:
        expected: dict[str, list[int]] = {}
        for name, _ in self.named_parameters():
            fused = ".qkv_proj." in name or ".gate_up_proj." in name
            expected[name] = list(range(len(self._shard_sizes(name)))) if fused else [-1]
        return expected


def _triton_importable() -> bool:
    from metronome.kernels.backend import triton_available
    return triton_available()


def _fused_target(name: str) -> tuple[str, int | None]:
    """'model.layers.3.self_attn.k_proj.weight' → ('model.layers.3.self_attn.qkv_proj.weight', 1)."""
    for source, (target, shard) in _FUSED.items():
        marker = f".{source}."
        if marker in name:
            return name.replace(marker, f".{target}."), shard
    return name, None
