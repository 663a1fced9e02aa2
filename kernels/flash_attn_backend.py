"""The `flash_attn` backend: flash-attn 2's varlen kernel over the paged cache (block size a multiple of 256).

`flash_attn` is imported on first use only; `select_backend` offers this backend only where it imports. K/V writes
go through the Triton kernel on CUDA (flash-attn has no scatter of its own).
"""
from __future__ import annotations

import torch

from .checks import check_attention_inputs, check_write_kv_inputs
from .metadata import AttentionMetadata


def flash_attn_fits(block_size: int, head_dim: int) -> bool:
    """flash-attn 2's paged rule: pages of a multiple of 256 tokens, head_dim a multiple of 8 up to 256."""
    return block_size % 256 == 0 and head_dim % 8 == 0 and head_dim <= 256


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func  # ImportError here is turned into ValueError by get_backend
        self._varlen = flash_attn_varlen_func

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        check_write_kv_inputs(key, value, k_cache, v_cache, slot_mapping)
        from .triton_kv_write import write_kv_triton
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                  scale: float, out: torch.Tensor | None = None, window: int | None = None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_attention_inputs(q, k_cache, v_cache, meta, window, sinks)
        if sinks is not None:
            raise ValueError("flash_attn (flash-attn 2) has no attention sinks; use the triton backend for this model")
        if not flash_attn_fits(k_cache.shape[1], q.shape[2]):
            raise ValueError(f"flash_attn needs block_size % 256 == 0 and head_dim % 8 == 0 (<= 256), got "
                             f"block_size {k_cache.shape[1]}, head_dim {q.shape[2]}")
        cu_seqlens_k = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=q.device)
        cu_seqlens_k[1:] = torch.cumsum(meta.seq_lens, 0, dtype=torch.int32)
        result = self._varlen(
            q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
            block_table=meta.block_tables, window_size=(-1 if window is None else window - 1, 0),
            softcap=softcap or 0.0,
        )
        if out is None:
            return result
        out.copy_(result)
        return out

    # flash-attn's kernels are compiled ahead of time; its launches read host values (not captured in graphs).
    def decode_variant(self, num_seqs: int, num_kv_heads: int, max_seqlen_k: int, device: torch.device) -> int:
        return 0

    def variant_lengths(self, max_model_len: int) -> list[int]:
        return [max_model_len]

    def warm_up(self, q_shape, k_cache, v_cache, max_model_len: int, windows=(None,), softcap=None,
                sinks=False) -> int:
        from .triton_kv_write import write_kv_triton  # its K/V writes are Triton's
        slots = torch.full((1,), -1, dtype=torch.int64, device=k_cache.device)
        kv = torch.zeros((1, *k_cache.shape[2:]), dtype=k_cache.dtype, device=k_cache.device)
        write_kv_triton(kv, kv, k_cache, v_cache, slots)
        return 1
