"""What every decoder family shares: a flat, mixed batch in, the paged KV cache, the forward as a chain of
pieces around the attentions, the logits, and loading transformers-named weights.

One forward pass takes T tokens from any number of sequences laid end to end (prefill chunks and decodes
mixed); attention goes through a `metronome.kernels` backend, which reads each sequence's context from the
paged cache through its block table. A family (llama.py, gemma3.py, ...) gives its decoder layer, which splits
in two halves around its attention: `begin` (residual add, norm, qkv, QK-norm, rope, K/V write) and `finish`
(o_proj, norms, MLP). A forward pass is then a chain of pieces (`piece`: one layer's `finish` and the next one's
`begin`) and attentions (`attend`): the piecewise CUDA graphs of mixed steps capture the pieces and launch the
attentions between them.

Parameter names follow transformers' (`model.layers.N.self_attn...`) except that q/k/v and gate/up are fused
into `qkv_proj` and `gate_up_proj`; `load_weights` takes either form.

Attention metadata and slot mappings are one object for every layer, or one per layer (a list): where layers
keep their KV in different block tables (sliding-window layers, whose blocks behind the window are freed), each
layer reads its own.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from metronome.kernels.metadata import AttentionMetadata
from metronome.server.models.attention import KVCache
from metronome.server.models.config import ModelConfig
from metronome.server.models.layers import ModelParts, RMSNorm
from metronome.server.models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from metronome.kernels import AttentionBackend

PerLayer = Any  # one value for every layer, or a list/tuple with one per layer

# transformers' parameter name part → (our fused parameter, which shard). Shards are stacked in this order.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def at_layer(value: PerLayer, index: int):
    return value[index] if isinstance(value, (list, tuple)) else value


class DecoderModel(nn.Module):
    """The embedding, the layers, the final norm and the rope tables (one per rope kind)."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_plus_one, config.norm_float_scale)
        self.rotary = RotaryEmbedding(config)
        # Sliding layers turn on a base of their own where the config gives one (Gemma 3).
        self.rotary_local = RotaryEmbedding(config, local=True) if config.rope_local_theta is not None else None

    def rotary_for(self, layer: int, config: ModelConfig) -> RotaryEmbedding:
        if self.rotary_local is not None and config.layer_window(layer) is not None:
            return self.rotary_local
        return self.rotary

    def rotaries(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary, self.rotary_local) if r is not None]


class DecoderForCausalLM(nn.Module):
    """A family subclasses this with its `layer_class(config, index, attention, parts)`."""

    layer_class: type[nn.Module]

    def __init__(self, config: ModelConfig, attention: AttentionBackend, parts: ModelParts | None = None):
        super().__init__()
        self.config = config
        self.attention_backend = attention
        self.fused: bool | None = None  # None: fused element-wise kernels on CUDA (use_fused)
        parts = parts or ModelParts()
        layers = [self.layer_class(config, i, attention, parts) for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, layers)
        self._rotary = [self.model.rotary_for(i, config) for i in range(config.num_hidden_layers)]
        # Tied models reuse the embedding matrix for the output projection (no second copy).
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self._embedding_scales: dict[torch.dtype, float] = {}

    def set_attention_backend(self, attention: AttentionBackend) -> None:
        """Swap the attention kernels (e.g. once the engine knows its block size)."""
        self.attention_backend = attention
        for layer in self.model.layers:
            layer.self_attn.attention = attention

    def prepare_rope_tables(self, device: torch.device, dtype: torch.dtype) -> None:
        """Build the rope tables now (never inside a graph capture)."""
        for rotary in self.model.rotaries():
            rotary.tables(device, dtype)

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE: the original context, past which a sequence turns with the long factors (None: no switch)."""
        rotary = self.model.rotary
        return rotary.original_context if rotary.long_offset else None

    @property
    def rope_long_offset(self) -> int:
        """Added to the positions of a sequence past long_rope_from (its rows of the long factors)."""
        return self.model.rotary.long_offset

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.config.layer_windows

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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, times the config's scale rounded to the model dtype first (as transformers does)."""
        hidden = self.model.embed_tokens(input_ids)
        scale = self.config.embedding_scale
        if scale is None:
            return hidden
        rounded = self._embedding_scales.get(hidden.dtype)
        if rounded is None:  # a Python float: no host-to-device copy inside a graph capture
            rounded = self._embedding_scales[hidden.dtype] = float(torch.tensor(scale, dtype=hidden.dtype))
        return hidden * rounded

    def piece(self, index: int, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
              slot_mapping: PerLayer, kv_caches: list[KVCache], q_out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Piece `index` of the forward: x is input_ids for piece 0, else the attention output of layer index - 1.
        Returns (q of layer index, residual), or (final-normed hidden states, None) for the last piece. Reads no
        host data that changes between steps: a CUDA graph can replay it."""
        layers = self.model.layers
        fused = self.use_fused(x.device)
        if index == 0:
            delta, residual = None, self.embed(x)
        else:
            delta, residual = layers[index - 1].finish(x, residual, fused)
        if index == len(layers):
            return self.model.norm.add_forward(delta, residual, fused)[0], None
        return layers[index].begin(delta, residual, positions, at_layer(slot_mapping, index), self._rotary[index],
                                   kv_caches[index], fused, q_out)

    def attend(self, index: int, q: torch.Tensor, kv_caches: list[KVCache], meta: PerLayer,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.layers[index].self_attn.attend(q, kv_caches[index], at_layer(meta, index), out)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata | Sequence[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: [T]; meta: one for every layer or one per layer. Returns the final-normed hidden
        states [T, hidden] (feed compute_logits)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        slots = [m.slot_mapping for m in meta] if isinstance(meta, (list, tuple)) else meta.slot_mapping
        x, residual = input_ids, None
        last = len(self.model.layers)
        for index in range(last + 1):
            out, residual = self.piece(index, x, residual, positions, slots, kv_caches)
            if index == last:
                return out
            x = self.attend(index, out, kv_caches, meta)
        raise AssertionError("unreachable")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (rows of forward's output, e.g. the last token of each sequence) → float32 [N, vocab]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    # ---- weights -------------------------------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model's transformers-style name; None: not part of this model."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into this model (any dtype/device; cast on copy).

        Every parameter must be filled exactly once; unknown names and wrong shapes are errors, because a
        silently half-loaded model produces plausible garbage.
        """
        params = dict(self.named_parameters())
        filled: set[tuple[str, int]] = set()
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is None or name.endswith("rotary_emb.inv_freq"):
                continue  # not ours (e.g. a vision tower), or an old checkpoint's rope buffer: we compute it
            if name == "rope_freqs":
                self.model.rotary.set_freq_factors(tensor)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # some tied checkpoints still carry a copy of the embedding
            own = self.load_own_tensor(name, tensor)
            if own is not None:  # a tensor the family stores its own way (e.g. stacked experts)
                filled.update(own)
                continue
            target, shard = _fused_target(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {raw_name!r} has no place in this model")
            destination = self._shard_view(param, target, shard)
            if tuple(destination.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {raw_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(destination.shape)}")
            with torch.no_grad():
                destination.copy_(tensor)
            if shard is None:  # a whole parameter (fused in the checkpoint too, as Phi-3's): every shard filled
                filled.update((target, s) for s in self._expected_shards().get(target, [-1]))
            else:
                filled.add((target, shard))
        missing = [self.shard_tensor_name(name, shard) for name, shards in self._expected_shards().items()
                   for shard in shards if (name, shard) not in filled]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")

    def shard_tensor_name(self, name: str, shard: int) -> str:
        """What a checkpoint calls shard `shard` of parameter `name` (for saying what it lacks)."""
        return name

    def load_own_tensor(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int]] | None:
        """A family that stores some tensors its own way loads them here and returns the (parameter, shard) pairs
        they filled; None: the generic path loads it."""
        return None

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
