"""Triton KV write: scatter each new token's K and V (all kv heads) into its paged-cache slot in one launch.

One program per token; a negative slot (a token whose K/V must not be stored) exits at once. Inputs may be strided
views (e.g. slices of a fused qkv projection) as long as head_dim is contiguous; values are cast to the cache dtype,
or for an FP8 (e4m3) cache divided by their kv head's scale and rounded as torch rounds (kernels/triton_fp8.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable
from .triton_fp8 import _fp8_of


@triton.jit
def _write_kv(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    N_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // PAGE
    in_page = slot % PAGE
    heads = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (heads[:, None] < N_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + in_page * stride_kct + heads[:, None] * stride_kch + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + in_page * stride_vct + heads[:, None] * stride_vch + offs_d[None, :]
    if FP8:
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < N_KV_HEADS, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < N_KV_HEADS, other=1.0)[:, None]
        tl.store(k_dst, _fp8_of(k.to(tl.float32), k_scale), mask=mask)
        tl.store(v_dst, _fp8_of(v.to(tl.float32), v_scale), mask=mask)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """k_scale / v_scale: float32 [n_kv_heads], for an FP8 cache only."""
    num_tokens, n_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous")
    require_runnable(key.device)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _write_kv[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        N_KV_HEADS=n_kv_heads, H_PAD=triton.next_power_of_2(n_kv_heads), HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1], FP8=fp8, num_warps=4,
    )
