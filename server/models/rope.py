"""Rotary position embeddings in Hugging Face's layout (rotate-half, not interleaved): plain, linear, Llama 3,
LongRoPE (Phi-3) and YaRN (gpt-oss; rope_yarn.py) scaling, partial rotary (the first `rotary_dim` dims of a head
turn, the rest pass through), and one rope per layer kind (Gemma 3's sliding layers turn on their own base).

The frequencies are computed once on the CPU in float32 the way transformers computes them, so that greedy
outputs match it bit for bit where the arithmetic allows. cos/sin are computed once per model, for every
position, into tables on the model's device (the same float32 products and cos/sin as transformers' per-step
computation, so the same values); a step only looks its positions up, and the fused kernel reads the tables
directly.

LongRoPE keeps two frequency sets: a sequence no longer than the original context turns with the short one, a
longer sequence with the long one at every position (transformers recomputes a generation's cache when it
crosses; so does the engine: scheduler.py). The table holds both: rows [0, P) short, rows [P, 2P) long
(`long_offset` = P); the runner adds P to the positions of a long sequence.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from metronome.server.models.config import ModelConfig
from metronome.server.models.rope_yarn import yarn_attention_factor, yarn_inv_freq


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """1 / theta^(2i/d) for i < d/2, float32 on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency bands: long wavelengths slowed by `factor`, short ones kept, the middle blended."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_middle_band = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(in_middle_band, blended, scaled)


def scaled_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                    long: bool = False) -> torch.Tensor:
    """The frequencies of `rotary_dim` dims at base theta under a scaling (long: LongRoPE's long factor set)."""
    inv_freq = default_inv_freq(rotary_dim, theta)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(rotary_dim, theta, scaling)
    if scaling["rope_type"] == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim
        return 1.0 / (factors * theta ** exponents)
    raise ValueError(f"unsupported rope type {scaling['rope_type']!r}")  # validate() rejects these earlier


def longrope_attention_factor(scaling: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's cos/sin multiplier: given, or sqrt(1 + ln(factor) / ln(original context))."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def compute_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The global layers' frequencies (LongRoPE: the short set)."""
    return scaled_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    """Applies rope to q [T, Hq, D] and k [T, Hkv, D] at `positions` [T] (the first rotary_dim dims of each head).

    The frequencies are a plain float32 attribute, not a buffer: module-wide dtype casts (model.to(bf16)) and
    meta-device construction must not touch them. The cos/sin tables follow the device and dtype asked for.
    """

    def __init__(self, config: ModelConfig, local: bool = False):
        """local: the rope of sliding layers where the config gives them a base of their own (plain rope)."""
        super().__init__()
        self.rotary_dim = config.rotary_dim
        self.max_positions = config.max_position_embeddings
        scaling = None if local else config.rope_scaling
        theta = config.rope_local_theta if local else config.rope_theta
        self.inv_freq = scaled_inv_freq(self.rotary_dim, theta, scaling)
        self.long_inv_freq: torch.Tensor | None = None
        self.original_context = 0
        self.attention_factor = 1.0
        if scaling is not None and scaling["rope_type"] == "longrope":
            self.long_inv_freq = scaled_inv_freq(self.rotary_dim, theta, scaling, long=True)
            self.original_context = int(scaling["original_max_position_embeddings"])
            self.attention_factor = longrope_attention_factor(scaling, config.max_position_embeddings)
        if scaling is not None and scaling["rope_type"] == "yarn":
            self.attention_factor = yarn_attention_factor(scaling)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def long_offset(self) -> int:
        """Added to a position to read its LongRoPE long-factor row (0: one set of rows)."""
        return self.max_positions if self.long_inv_freq is not None else 0

    def set_freq_factors(self, freq_factors: torch.Tensor) -> None:
        """llama.cpp's `rope_freqs` tensor (Llama 3.1 GGUFs bake their rope scaling into it): divides the freqs."""
        factors = freq_factors.detach().to("cpu", torch.float32).reshape(-1)
        if factors.numel() != self.inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} entries, expected {self.inv_freq.numel()}")
        self.inv_freq = self.inv_freq.to("cpu") / factors
        self._tables.clear()

    def limit_positions(self, max_positions: int) -> None:
        """Tables only as long as the engine's context (a Llama 3.1 table of 131,072 positions is 32 MB)."""
        if max_positions != self.max_positions:
            self.max_positions = max_positions
            self._tables.clear()

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [max_positions (x 2 with LongRoPE), rotary_dim / 2] in dtype: the first half of transformers'
        cat(freqs, freqs) angles, whose second half repeats it. Built on first use (outside any graph capture: the
        runner asks first)."""
        key = (torch.device(device), dtype)
        found = self._tables.get(key)
        if found is None:
            positions = torch.arange(self.max_positions, device=device, dtype=torch.int64).to(torch.float32)
            freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
            if self.long_inv_freq is not None:
                freqs = torch.cat([freqs, positions[:, None] * self.long_inv_freq.to(device)[None, :]])
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            found = (cos.to(dtype).contiguous(), sin.to(dtype).contiguous())
            self._tables[key] = found
        return found

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, D] each, at positions (looked up, not recomputed)."""
        cos, sin = self.tables(positions.device, dtype)
        c, s = cos[positions], sin[positions]
        return torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        cos, sin = cos[:, None, :], sin[:, None, :]
        r = self.rotary_dim
        if r == q.shape[-1]:
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q_rot, k_rot = q[..., :r], k[..., :r]
        return (torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q[..., r:]], dim=-1),
                torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k[..., r:]], dim=-1))
