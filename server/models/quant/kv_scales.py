"""Scales of an FP8 (e4m3) KV cache: one float32 per kv head for K and one for V, in every layer.

K and V are stored as `e4m3(x / scale)` and read back as `q * scale` in registers, so a cache element takes one
byte. The scales come from the checkpoint when it has them — `self_attn.k_scale` / `v_scale` (compressed-tensors'
`kv_cache_scheme`, vLLM's FP8 checkpoints), the older `k_proj.output_scale` / `v_proj.output_scale`, or ModelOpt's
`k_proj.k_scale` / `v_proj.v_scale`, one value per layer (per tensor) or one per kv head — and are otherwise
computed at start-up by `calibrate`: one prefill of a fixed text through the model's torch path, recording each
layer's K and V amax per kv head as they are written to the cache, scale = HEADROOM x amax / 448 (values past the
calibrated range saturate at ±448 x scale rather than overflow). A per-tensor scale is stored as that value for
every head, so the kernels have one form to read.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from metronome.server.models.quant import fp8

HEADROOM = 2.0
CALIBRATION_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could see the whole "
    "bay: fishing boats returning with their catch, gulls circling the harbour, and the dark line of the storm that "
    "was coming in from the west. def area(radius):\n    return 3.14159 * radius ** 2\n\n"
    "Question: what is 17 times 23? Answer: 17 x 23 = 391. Les étoiles brillent au-dessus de la mer; 東京の夜景. "
)
_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\."
                   r"(?:(k|v)_scale|(k|v)_proj\.output_scale|(k|v)_proj\.\4_scale)$")


@dataclass
class KVScales:
    """Per layer: k [n_kv_heads] and v [n_kv_heads] float32 scales; `source` says where they came from."""
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    source: str  # "checkpoint" | "calibrated"

    def to(self, device: torch.device) -> KVScales:
        return KVScales([t.to(device) for t in self.k], [t.to(device) for t in self.v], self.source)


def from_checkpoint(tensors: dict[str, torch.Tensor], num_layers: int, num_kv_heads: int) -> KVScales | None:
    """The checkpoint's KV scales by layer (None when it has none); ValueError naming what does not fit."""
    if not tensors:
        return None
    found: dict[tuple[str, int], torch.Tensor] = {}
    for name, tensor in tensors.items():
        match = _NAME.match(name)
        if match is None:
            raise ValueError(f"checkpoint tensor {name!r} is not a KV-cache scale this server reads")
        layer, kind = int(match.group(1)), match.group(2) or match.group(3) or match.group(4)
        if layer >= num_layers:
            raise ValueError(f"checkpoint tensor {name!r}: the model has {num_layers} layers")
        values = tensor.float().reshape(-1)
        if values.numel() == 1:
            values = values.expand(num_kv_heads)
        if values.numel() != num_kv_heads or not bool((values > 0).all() and values.isfinite().all()):
            raise ValueError(f"checkpoint tensor {name!r} must hold one positive scale or one per kv head "
                             f"({num_kv_heads}), got shape {tuple(tensor.shape)}")
        found[(kind, layer)] = values.contiguous().clone()
    missing = [f"{kind}_scale of layer {layer}" for kind in "kv" for layer in range(num_layers)
               if (kind, layer) not in found]
    if missing:
        raise ValueError(f"the checkpoint has KV-cache scales for some layers only: it lacks {missing[:3]}")
    return KVScales([found[("k", i)] for i in range(num_layers)], [found[("v", i)] for i in range(num_layers)],
                    "checkpoint")


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax per kv head → the scale that maps HEADROOM x amax onto 448."""
    return fp8.dynamic_scale(amax.float() * HEADROOM)


class _RecordingBackend:
    """Wraps an attention backend and records the amax per kv head of every K and V written, in call order (the
    layers' order in a forward pass)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.k_amax: list[torch.Tensor] = []
        self.v_amax: list[torch.Tensor] = []

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self.k_amax.append(key.detach().float().abs().amax(dim=(0, 2)))
        self.v_amax.append(value.detach().float().abs().amax(dim=(0, 2)))
        self.inner.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def whole_prefill_scratch(config, n: int, block_size: int, dtype: torch.dtype, device: torch.device):
    """(a fresh KV cache per layer holding n tokens, the metadata of one sequence of n tokens prefilled whole into
    it): a forward over one text outside the engine's cache (calibration here; scoring a text elsewhere)."""
    from metronome.kernels.metadata import AttentionMetadata

    blocks = -(-n // block_size)
    shape = (blocks, block_size, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device), max_seqlen_q=n, max_seqlen_k=n,
        q_lens_host=[n], seq_lens_host=[n])
    return caches, meta


def calibrate(model, config, tokenizer, device: torch.device, dtype: torch.dtype, block_size: int = 16,
              max_tokens: int = 512) -> KVScales:
    """Scales from one prefill of CALIBRATION_TEXT (repeated up to max_tokens) through the model's torch path, K
    and V written to a scratch cache in the model dtype."""
    ids = tokenizer.encode(CALIBRATION_TEXT)
    ids = (ids * (max_tokens // max(len(ids), 1) + 1))[:max_tokens]
    n, layers = len(ids), config.num_hidden_layers
    caches, meta = whole_prefill_scratch(config, n, block_size, dtype, device)
    backend, fused = model.attention_backend, model.fused
    recorder = _RecordingBackend(backend)
    model.set_attention_backend(recorder)
    model.fused = False  # the torch path writes K/V through write_kv, where they are recorded
    try:
        with torch.inference_mode():
            model(torch.tensor(ids, device=device), torch.arange(n, device=device), caches, meta)
    finally:
        model.set_attention_backend(backend)
        model.fused = fused
    if len(recorder.k_amax) != layers:
        raise RuntimeError(f"KV calibration saw {len(recorder.k_amax)} K/V writes for {layers} layers")
    return KVScales([scales_from_amax(a) for a in recorder.k_amax], [scales_from_amax(a) for a in recorder.v_amax],
                    "calibrated")


def install_kv_scales(loaded, block_size: int = 16) -> KVScales:
    """Give every attention layer of a loaded model its FP8 KV-cache scales (`kv_scales`, passed to the kernels):
    the checkpoint's when it has them, else calibrated now. ModelNotFoundError when the checkpoint's do not fit."""
    from metronome.contract.errors import ModelNotFoundError

    model = loaded.model
    config = model.config  # a tensor-parallel rank's own: its kv heads (the checkpoint's came cut to them)
    try:
        scales = from_checkpoint(getattr(model, "fp8_kv_scales", None) or {}, config.num_hidden_layers,
                                 config.num_key_value_heads)
    except ValueError as error:
        raise ModelNotFoundError(f"the KV-cache scales of {loaded.name} do not fit its config: {error}") from None
    if scales is None:
        scales = calibrate(model, config, loaded.tokenizer, loaded.device, loaded.dtype, block_size)
    scales = scales.to(loaded.device)
    for layer, k_scale, v_scale in zip(model.model.layers, scales.k, scales.v):
        layer.self_attn.kv_scales = {"k_scale": k_scale, "v_scale": v_scale}
    return scales
