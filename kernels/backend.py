"""Choosing an attention backend: the protocol every backend follows, lookup by name, and automatic selection."""
from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Protocol

import torch

from .metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton", "flash_attn")


class AttentionBackend(Protocol):
    name: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key/value [T, n_kv_heads, head_dim] into caches [num_blocks, block_size, n_kv_heads, head_dim] at
        slot_mapping [T] (block * block_size + offset; negative = skip)."""

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_heads, head_dim] of the batch's new tokens, whose K/V are already in the cache → [T, n_heads,
        head_dim] in q's dtype (written into `out` when given). Causal, bottom-right aligned; query head h reads
        kv head h // (n_heads // n_kv). window (a layer's sliding window): a query at position p sees keys
        p - window + 1 .. p only, and keys behind every query's window are never read (their blocks may have been
        freed); softcap: scores -> softcap * tanh(scores / softcap); sinks [n_heads]: a logit per head that joins
        every row's softmax denominator and attends to nothing (gpt-oss)."""

    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        """Which launch variant a decode-only batch of num_seqs sequences gets at this longest context: a CUDA
        graph replays fixed launches, so decode graphs are captured once per variant."""

    def variant_lengths(self, max_model_len: int) -> list[int]:
        """Context lengths (ascending, max_model_len last) among which every decode variant occurs."""

    def warm_up(self, q_shape: tuple[int, int, int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                max_num_tokens: int, windows: tuple[int | None, ...] = (None,), softcap: float | None = None,
                sinks: bool = False) -> int:
        """Compile every kernel variant this backend can launch for these shapes and the model's layer windows,
        softcap and sinks (before a server is ready); returns how many launches it made."""


@cache
def _importable(module: str) -> bool:
    """Installed and importable. flash_attn is really imported: a wheel built for another CUDA/torch is installed
    but fails to load, and auto-selection must not pick it then."""
    if importlib.util.find_spec(module) is None:
        return False
    if module != "flash_attn":
        return True
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any load failure means "not available"
        return False
    return True


def available_backends() -> list[str]:
    """Backends whose packages are installed in this process (device rules are `select_backend`'s business)."""
    return [name for name, module in (("torch", "torch"), ("triton", "triton"), ("flash_attn", "flash_attn"))
            if _importable(module)]


def triton_available() -> bool:
    return _importable("triton")


def get_backend(name: str) -> AttentionBackend:
    if name == "torch":
        from .torch_ref import TorchBackend
        return TorchBackend()
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    try:
        if name == "triton":
            from .triton_backend import TritonBackend
            return TritonBackend()
        from .flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend()
    except ImportError as exc:
        raise ValueError(f"attention backend {name!r} is not available here ({exc}); available: "
                         f"{', '.join(available_backends())}") from exc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def select_backend(device: torch.device | str, block_size: int, head_dim: int, requested: str = "auto") -> str:
    """The backend to run: `requested` checked against this device and cache shape, or the best that fits.

    auto: flash_attn where it imports on CUDA and its paged rule fits (block_size % 256 == 0); else triton on
    CUDA; else torch. An explicit request that cannot work raises ValueError saying why.
    """
    from .flash_attn_backend import flash_attn_fits

    device_type = torch.device(device).type
    if requested == "auto":
        if device_type == "cuda" and _importable("flash_attn") and flash_attn_fits(block_size, head_dim):
            return "flash_attn"
        if device_type == "cuda" and _importable("triton"):
            return "triton"
        return "torch"
    if requested not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of auto, {', '.join(BACKEND_NAMES)}")
    if requested == "triton":
        if not _importable("triton"):
            raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
        if device_type != "cuda" and not _interpreting():
            raise ValueError(f"attention backend 'triton' runs on CUDA; on {device_type} set TRITON_INTERPRET=1 "
                             "to use Triton's (slow) interpreter, or choose 'torch'")
    if requested == "flash_attn":
        if not _importable("flash_attn"):
            raise ValueError("attention backend 'flash_attn' needs the flash_attn package, which is not installed; "
                             "choose 'triton' or 'auto'")
        if device_type != "cuda":
            raise ValueError(f"attention backend 'flash_attn' runs on CUDA only, not {device_type}")
        if not flash_attn_fits(block_size, head_dim):
            raise ValueError(f"attention backend 'flash_attn' needs block_size a multiple of 256 and head_dim a "
                             f"multiple of 8 up to 256; got block_size {block_size}, head_dim {head_dim}")
    return requested
