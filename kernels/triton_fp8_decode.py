"""Decode attention over an FP8 (e4m3) paged KV cache, with the keys as the tensor cores' long side.

The general kernel (triton_attention.py) gives a decode tile one token's GQA group of query heads as rows, padded
to 16, and converts every K and V element to fp16 before its dot. Over an FP8 cache that kernel streams at about
70 % of the copy rate on an H200 whatever its tiles: per byte read it converts twice as many elements as over a
bf16 cache, and Hopper converts e4m3 at a quarter of its integer rate. Here the product is transposed:
- S^T = K · Q^T: the key tile ([BLOCK_N, D], as stored) is the left operand and the group's queries, quantised to
  e4m3 with one scale per query head, the right one, so QK^T is an e4m3 dot on the keys as stored (no conversion)
  and the BLOCK_N keys fill the tensor cores' 64-row side (4 warps: Hopper's warpgroup MMA);
- O^T += V^T · P^T: V converted to fp16 once per element, the probabilities in fp16.
The online softmax runs down the key axis. A decode-only batch (every sequence one new token) without a window,
softcap or sinks; flash-decoding splits write the general kernel's partials, merged by its `_merge_splits`.
Quantising the queries costs accuracy the cache already pays (e4m3 keys): docs/perf/fp8-h200.md measures both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata
from .triton_attention import _e4m3_to_f16, _merge_splits, require_runnable


@dataclass(frozen=True)
class DecodeTiles:
    block_n: int = 64  # keys per step: the warpgroup MMA's 64 rows
    num_warps: int = 4  # one warpgroup
    num_stages: int = 3
    query_cols: int = 16  # the group's query heads, padded: the MMA's N side


@triton.jit
def _step(q8, acc, m_i, l_i, kv_tile, seq_len, table, k_cache_ptr, v_cache_ptr, kv_head, col_scale,
          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
          MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr, PTX: tl.constexpr):
    offs_n = kv_tile * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    if MASKED:
        n_valid = offs_n < seq_len
        block = tl.load(table + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + offs_n // PAGE).to(tl.int64)
    in_page = offs_n % PAGE
    k_rows = k_cache_ptr + (block * stride_kb + in_page * stride_kt + kv_head * stride_kh)[:, None] + offs_d[None, :]
    v_rows = v_cache_ptr + (block * stride_vb + in_page * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_rows, mask=n_valid[:, None], other=0.0)
        v = tl.load(v_rows, mask=n_valid[:, None], other=0.0)
    else:
        k = tl.load(k_rows)
        v = tl.load(v_rows)
    s = tl.dot(k, q8) * col_scale[None, :]  # [BLOCK, NQ], log2 units
    if MASKED:
        s = tl.where(n_valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    if PTX:  # one packed conversion per two values; the interpreter converts as torch does (also exact)
        v = _e4m3_to_f16(v, True)
    else:
        v = v.to(tl.float16)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_tokens"])
def _fp8_decode(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, block_tables_ptr,
    k_scale_ptr, v_scale_ptr, num_tokens, n_heads, scale_log2,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, NQ: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, PTX: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, NQ)
    head = kv_head * GROUP + g
    g_valid = g < GROUP
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[None, :] * stride_qh + offs_d[:, None],
                mask=g_valid[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0).to(tl.float32)  # Q^T [D, NQ]
    q_scale = tl.maximum(tl.max(tl.abs(q), 0), 1e-30) / 448.0  # per query head: its largest value at e4m3's max
    q8 = (q / q_scale[None, :]).to(tl.float8e4nv)
    col_scale = q_scale * (scale_log2 * tl.load(k_scale_ptr + kv_head))

    seq_len = tl.load(seq_lens_ptr + seq)
    n_tiles = tl.cdiv(seq_len, BLOCK)
    if NUM_SPLITS == 1:
        lo = 0
        hi = n_tiles
    else:
        per_split = tl.cdiv(n_tiles, NUM_SPLITS)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, n_tiles)
    full_hi = tl.maximum(lo, tl.minimum(hi, seq_len // BLOCK))  # tiles before this hold BLOCK keys each

    m_i = tl.full([NQ], -1.0e30, tl.float32)  # finite: a split that sees no key stays free of inf - inf
    l_i = tl.zeros([NQ], tl.float32)
    acc = tl.zeros([D_PAD, NQ], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for kv_tile in range(lo, full_hi):
        acc, m_i, l_i = _step(q8, acc, m_i, l_i, kv_tile, seq_len, table, k_cache_ptr, v_cache_ptr, kv_head,
                              col_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                              False, PAGE, BLOCK, D_PAD, PTX)
    for kv_tile in range(full_hi, hi):
        acc, m_i, l_i = _step(q8, acc, m_i, l_i, kv_tile, seq_len, table, k_cache_ptr, v_cache_ptr, kv_head,
                              col_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                              True, PAGE, BLOCK, D_PAD, PTX)
    acc = acc * tl.load(v_scale_ptr + kv_head)
    token = seq.to(tl.int64)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[None, :]
        tl.store(out_ptr + token * stride_ot + head[None, :] * stride_oh + offs_d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=g_valid[None, :] & (offs_d[:, None] < HEAD_DIM))
    else:
        part = (split * num_tokens + token) * n_heads + head  # the general kernel's workspace rows [S, T, H]
        tl.store(part_acc_ptr + part[None, :] * D_PAD + offs_d[:, None], acc, mask=g_valid[None, :])
        tl.store(part_m_ptr + part, m_i, mask=g_valid)
        tl.store(part_l_ptr + part, l_i, mask=g_valid)


def quantised_queries(q: torch.Tensor) -> torch.Tensor:
    """What the kernel's QK^T dot sees of q [T, H, D], in float32: each query head's row in e4m3 with its largest
    value at 448, times its scale (the reference for tests)."""
    q = q.float()
    scale = q.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 448.0
    return (q / scale).to(torch.float8_e4m3fn).float() * scale


def fp8_decode_applies(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, window, softcap,
                       sinks) -> bool:
    """Whether this launch can take the transposed kernel: an e4m3 cache, 16-bit queries, every sequence one new
    token, head_dim at most 128, no window, softcap or sinks."""
    return (k_cache.dtype == torch.float8_e4m3fn
            and q.dtype in (torch.bfloat16, torch.float16) and meta.num_tokens == meta.num_seqs
            and q.shape[-1] <= 128 and window is None and softcap is None and sinks is None)


def fp8_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor, out: torch.Tensor,
                         num_splits: int, tiles: DecodeTiles = DecodeTiles()) -> torch.Tensor:
    """One new token per sequence over an FP8 cache (see fp8_decode_applies); writes and returns `out`."""
    num_tokens, n_heads, head_dim = q.shape
    page, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = n_heads // n_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    require_runnable(q.device)
    if num_splits > 1:
        part_acc = torch.empty((num_splits, num_tokens, n_heads, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_splits, num_tokens, n_heads), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out
    _fp8_decode[(num_tokens, n_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l, meta.seq_lens, meta.block_tables, k_scale, v_scale,
        num_tokens, n_heads, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        GROUP=group, NQ=max(tiles.query_cols, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        PAGE=page, BLOCK=tiles.block_n, NUM_SPLITS=num_splits, PTX=q.device.type == "cuda",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        _merge_splits[(num_tokens, n_heads)](
            part_acc, part_m, part_l, out, out, num_tokens, n_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits, HAS_SINKS=False, num_warps=4)
    return out
