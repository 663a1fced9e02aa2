"""Choosing an attention backend: the protocol every backend follows, lookup by name, and automatic selection
(per batch class on CUDA where FlashAttention-4 runs: attention_choice.py)."""
from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Protocol

import torch

from . import flash_attn_backend
from .attention_choice import ChoiceTable, PerClassBackend, load_table
from .flash_attn_backend import MIN_CAPABILITY
from .metadata import AttentionMetadata

BACKEND_NAMES = ("torch", "triton", "flash_attn")


class AttentionBackend(Protocol):
    name: str
    # What CUDA graphs may capture around this backend: "all" (its decode launches too: they read no host data
    # that changes between replays), "pieces" (only the pieces between its eager attentions) or "none".
    graph_capture: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """key/value [T, n_kv_heads, head_dim] into caches [num_blocks, block_size, n_kv_heads, head_dim] at
        slot_mapping [T] (block * block_size + offset; negative = skip). An FP8 (e4m3) cache takes
        e4m3(x / scale) with float32 scales [n_kv_heads] (torch and triton backends only)."""

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, n_heads, head_dim] of the batch's new tokens, whose K/V are already in the cache → [T, n_heads,
        head_dim] in q's dtype (written into `out` when given). Causal, bottom-right aligned; query head h reads
        kv head h // (n_heads // n_kv). window (a layer's sliding window): a query at position p sees keys
        p - window + 1 .. p only, and keys behind every query's window are never read (their blocks may have been
        freed); softcap: scores -> softcap * tanh(scores / softcap); sinks [n_heads]: a logit per head that joins
        every row's softmax denominator and attends to nothing (gpt-oss). An FP8 cache is read back times its
        scales."""

    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        """Which launch variant a decode-only batch of num_seqs sequences gets at this longest context: a CUDA
        graph replays fixed launches, so decode graphs are captured once per variant."""

    def variant_lengths(self, max_model_len: int) -> list[int]:
        """Context lengths (ascending, max_model_len last) among which every decode variant occurs."""

    def warm_up(self, q_shape: tuple[int, int, int], k_cache: torch.Tensor, v_cache: torch.Tensor,
                max_num_tokens: int, windows: tuple[int | None, ...] = (None,), softcap: float | None = None,
                sinks: bool = False, dtype: torch.dtype | None = None) -> int:
        """Compile every kernel variant this backend can launch for these shapes and the model's layer windows,
        softcap and sinks (before a server is ready); returns how many launches it made. dtype: q's, when the
        cache's is another (FP8)."""


@cache
def _importable(module: str) -> bool:
    """Installed and importable (flash_attn: FA4's flash_attn.cute really imports, see flash_attn_backend)."""
    if module == "flash_attn":
        return flash_attn_backend.fa4_importable()
    return importlib.util.find_spec(module) is not None


def available_backends() -> list[str]:
    """Backends whose packages are installed in this process (device rules are `select_backend`'s business)."""
    return [name for name, module in (("torch", "torch"), ("triton", "triton"), ("flash_attn", "flash_attn"))
            if _importable(module)]


def triton_available() -> bool:
    return _importable("triton")


def get_backend(name: str, table: ChoiceTable | None = None) -> AttentionBackend:
    """A backend by name; "auto" is the per-class composite of triton and flash_attn (attention_choice.py) that
    `select_backend` resolves to where the table sends a class to FA4 (`table`: its table, default the file's)."""
    if name == "torch":
        from .torch_ref import TorchBackend
        return TorchBackend()
    if name not in (*BACKEND_NAMES, "auto"):
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    try:
        if name == "triton":
            from .triton_backend import TritonBackend
            return TritonBackend()
        if name == "flash_attn":
            return flash_attn_backend.FlashAttnBackend()
        from .triton_backend import TritonBackend
        return PerClassBackend(table or load_table(), TritonBackend(), flash_attn_backend.FlashAttnBackend())
    except ImportError as exc:
        raise ValueError(f"attention backend {name!r} is not available here ({exc}); available: "
                         f"{', '.join(available_backends())}") from exc


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def flash_attn_usable(device: torch.device | str, head_dim: int) -> str | None:
    """Why FA4 cannot run here (None: it can): installed, on CUDA of compute capability 9.0 or newer, a head
    size it has kernels for."""
    if not _importable("flash_attn"):
        return f"FlashAttention-4 is not installed ({flash_attn_backend.INSTALL_HINT})"
    if not flash_attn_backend.fa4_runs_on(device):
        return (f"FlashAttention-4 runs on CUDA of compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer, "
                f"not on {torch.device(device)}")
    if not flash_attn_backend.flash_attn_fits(head_dim):
        return f"FlashAttention-4 needs head_dim a multiple of 8 in 8..256, got {head_dim}"
    return None


def select_backend(device: torch.device | str, block_size: int, head_dim: int, requested: str = "auto",
                   table: ChoiceTable | None = None) -> str:
    """The backend to run: `requested` checked against this device and cache shape, or the best that fits.

    auto: on CUDA, "auto" (per batch class: attention_choice.py) where FA4 runs here and the measured table sends
    some class to it, else triton; elsewhere torch. An explicit request that cannot work raises ValueError
    saying why. block_size: any (FA4 and Triton read any page size).
    """
    device_type = torch.device(device).type
    if requested == "auto":
        if device_type != "cuda" or not _importable("triton"):
            return "torch"
        if (table or load_table()).uses_flash_attn and flash_attn_usable(device, head_dim) is None:
            return "auto"
        return "triton"
    if requested not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {requested!r}; choose one of auto, {', '.join(BACKEND_NAMES)}")
    if requested == "triton":
        if not _importable("triton"):
            raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
        if device_type != "cuda" and not _interpreting():
            raise ValueError(f"attention backend 'triton' runs on CUDA; on {device_type} set TRITON_INTERPRET=1 "
                             "to use Triton's (slow) interpreter, or choose 'torch'")
    if requested == "flash_attn":
        problem = flash_attn_usable(device, head_dim)
        if problem:
            raise ValueError(f"attention backend 'flash_attn': {problem}; choose 'triton' or 'auto'")
    return requested
