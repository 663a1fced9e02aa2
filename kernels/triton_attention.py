"""Triton attention for a flat mixed batch (prefill chunks and decodes together) over the paged KV cache.

One launch covers the whole batch, or two where its leading decodes fill the GPU beside a long chunk (decodes
and chunks each on their own tiles: `launch_apart`). The grid is (query tile, kv head, kv split):
- a query tile is some new tokens of one sequence times all GROUP query heads that share the kv head, so each
  K/V tile is loaded once for the whole GQA group (rows = tokens * GROUP_PAD);
- the batch's leading decodes (the engine puts decodes first) get one small tile each (16 rows); the other
  sequences are cut into tiles of BLOCK_Q tokens, numbered without a host-built map: sequence b's tiles start at
  (cu_seqlens_q[b] - D) // BLOCK_Q + (b - D) for D leading decodes (an upper bound on the tiles before it),
  found by binary search in the kernel; spare tiles past a sequence's end exit at once. Chunk tiles run first,
  heaviest first, and decode tiles fill in around them;
- kv splits (flash-decoding) cut the key range of each tile into NUM_SPLITS parts when the batch alone cannot
  fill the GPU (decode of a few long sequences); a second small kernel merges the parts.
Keys are read through the block table one token at a time (block id = table[pos // PAGE]), so any page size
works, and the causal mask is aligned bottom-right (new token i of a sequence sits at seq_len - q_len + i).
A sliding window (a per-layer constant, compiled in) starts each tile's key loop at the first key its first row
sees and masks only the tiles at the window's edge; keys behind it are never read, so their blocks may be freed.
A logit softcap (cap * tanh(score / cap)) is a compiled-in option too, and so are attention sinks (gpt-oss): a
learned logit per head that joins each row's softmax denominator, added once per row after its key loop (in the
merge when the keys were split).
Softmax is online in fp32 with exp2; fp32 inputs use exact ("ieee") dots. An FP8 (e4m3) cache is read as is and
converted in registers (exact) to fp16 on the GPU with half-precision queries (`fp8_read_mode`), else to q's
dtype; its per-kv-head scales multiply the scores (K's) and the output (V's).

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported): tests only.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .metadata import AttentionMetadata

# How an FP8 V tile reaches the P.V dot (V_READ). The dot wants V key-major, the cache holds it head_dim-major, and
# Triton moves a conversion that feeds a dot behind the shared-memory load of the dot's operand: the 8-bit tile is
# then read from shared memory byte by byte in key-major order (hack/attention_sass.py: 375 shared loads and 26
# spill loads per kernel against bf16's 21 and none). The modes: as loaded, converted where Triton puts it
# (V_AS_LOADED); with the conversion in PTX (V_ASM: no spills); the same conversion marked impure, so Triton keeps
# it before the shared-memory store and the tile meets the dot through 16-bit ldmatrix.trans (V_CONVERTED_FIRST:
# 103 shared loads). The PTX modes are GPU-only.
# On the H200 the byte-wise reads cost less than their count suggests (hack/bench_kernels.py --v-read-ab, 3
# interleaved rounds, docs/perf/fp8-h200.md): against V_AS_LOADED, V_ASM takes 3.3 % off a 64-decode batch's
# attention and 3.4 % off 256 decodes, V_CONVERTED_FIRST 3.5 % and 2.1 %; in a mixed batch (64 decodes + a 512
# chunk) V_ASM is within 0.6 % and V_CONVERTED_FIRST 3.7 % slower (V loaded transposed like K, also measured, was
# slower everywhere). Decode tiles take V_ASM.
V_AS_LOADED, V_ASM, V_CONVERTED_FIRST = 0, 2, 3  # 1, V transposed, appears in the recorded sweeps' JSON
FP8_DECODE_V_READ = V_ASM  # what choose_config gives an FP8 cache's decode-only batches on the GPU
_V_ASM = tl.constexpr(V_ASM)
_V_FIRST = tl.constexpr(V_CONVERTED_FIRST)


@triton.jit
def _e4m3_to_f16(x, PURE: tl.constexpr):
    """e4m3 → fp16, four values a step: two packed conversions (exact). PURE=False pins it where it stands."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=PURE, pack=4)


@triton.jit
def _attend_kv_tile(
    q, acc, m_i, l_i, kv_tile, table, k_cache_ptr, v_cache_ptr, kv_head, q_pos, kv_start, kv_end, scale_log2,
    softcap,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    MASKED: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr, V_READ: tl.constexpr = 0,
):
    """One online-softmax step over keys [kv_tile * BLOCK_N, +BLOCK_N). MASKED: the tile crosses the causal
    diagonal, a window's edge or the end of the context; otherwise every row sees every key and loads need no
    bounds. Keys before kv_start are never loaded (their blocks may have been freed)."""
    offs_n = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    n_valid = (offs_n < kv_end) & (offs_n >= kv_start)
    if MASKED:
        block = tl.load(table + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + offs_n // PAGE).to(tl.int64)
    in_page = offs_n % PAGE
    k_ptrs = k_cache_ptr + (block * stride_kb + in_page * stride_kt + kv_head * stride_kh)[None, :] + offs_d[:, None]
    v_ptrs = v_cache_ptr + (block * stride_vb + in_page * stride_vt + kv_head * stride_vh)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=n_valid[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)  # [D_PAD, BLOCK_N]
        v = tl.load(v_ptrs, mask=n_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # [BLOCK_N, D_PAD]
    elif HEAD_DIM == D_PAD:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if KV_FP8:  # e4m3 → q's dtype is exact; the per-head scales are folded into scale_log2 and the output
        k = k.to(q.dtype)
        if V_READ == _V_ASM:
            v = _e4m3_to_f16(v, True)
        elif V_READ == _V_FIRST:
            v = _e4m3_to_f16(v, False)
        else:
            v = v.to(q.dtype)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    if SOFTCAP:  # cap * tanh(score / cap), tanh(x) = 1 - 2 / (exp(2x) + 1); then to log2 units
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * (scale_log2 / 1.4426950408889634) / softcap
        s = (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * softcap * 1.4426950408889634
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        seen = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if WINDOW > 0:
            seen = seen & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST_DOT:  # round p as the GPU path does, then multiply in fp32
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                            input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attention_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr, block_tables_ptr,
    sinks_ptr, k_scale_ptr, v_scale_ptr,
    seq, q_start, q_len, first_q, kv_head, split, num_tokens, n_heads, scale_log2, softcap,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr, V_READ: tl.constexpr = 0,
):
    """New tokens first_q .. first_q + BLOCK_Q - 1 of sequence `seq`, all GROUP query heads of `kv_head`."""
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first_q + offs_m // GROUP_PAD  # token index within the sequence's new tokens
    g = offs_m % GROUP_PAD
    head = kv_head * GROUP + g
    row_valid = (q_idx < q_len) & (g < GROUP)
    offs_d = tl.arange(0, D_PAD)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    if KV_FP8 == FP8_AS_FP16:
        q = q.to(tl.float16)

    if KV_FP8:  # K's scale multiplies every score of this kv head, V's the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)

    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - q_len + q_idx  # absolute position of each row's token
    first_pos = seq_len - q_len + first_q  # the tile's first token
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)  # keys any row of this tile may see end here
    kv_start = 0
    full_lo = 0  # key tiles from here on are inside every row's window
    if WINDOW > 0:
        kv_start = tl.maximum(first_pos - WINDOW + 1, 0)
        full_lo = tl.maximum(tl.cdiv(kv_end - WINDOW, BLOCK_N), 0)
    start_tile = kv_start // BLOCK_N
    n_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    if NUM_SPLITS == 1:
        tile_lo = start_tile
        tile_hi = n_kv_tiles
    else:
        per_split = tl.cdiv(n_kv_tiles - start_tile, NUM_SPLITS)
        tile_lo = start_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, n_kv_tiles)

    # A finite floor instead of -inf keeps rows that see no key in a range free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # Key tiles wholly at or before the tile's first query position (and, with a window, wholly inside the window
    # of its last one) need no mask; only those at the diagonal and at the window's edge do.
    n_full = (first_pos + 1) // BLOCK_N
    edge_end = tl.maximum(tile_lo, tl.minimum(tile_hi, full_lo))
    full_end = tl.maximum(edge_end, tl.minimum(tile_hi, n_full))
    if WINDOW > 0:
        for kv_tile in range(tile_lo, edge_end):
            acc, m_i, l_i = _attend_kv_tile(
                q, acc, m_i, l_i, kv_tile, table, k_cache_ptr, v_cache_ptr, kv_head, q_pos, kv_start, kv_end,
                scale_log2, softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                True, PAGE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION, UPCAST_DOT, WINDOW, SOFTCAP, KV_FP8, V_READ)
    for kv_tile in range(edge_end, full_end):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, kv_tile, table, k_cache_ptr, v_cache_ptr, kv_head, q_pos, kv_start, kv_end,
            scale_log2, softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            False, PAGE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION, UPCAST_DOT, WINDOW, SOFTCAP, KV_FP8, V_READ)
    for kv_tile in range(full_end, tile_hi):
        acc, m_i, l_i = _attend_kv_tile(
            q, acc, m_i, l_i, kv_tile, table, k_cache_ptr, v_cache_ptr, kv_head, q_pos, kv_start, kv_end,
            scale_log2, softcap, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            True, PAGE, BLOCK_N, HEAD_DIM, D_PAD, DOT_PRECISION, UPCAST_DOT, WINDOW, SOFTCAP, KV_FP8, V_READ)

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the head's sink joins the denominator (log2 units, like m_i)
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            rescale = tl.exp2(m_i - m_all)
            l_i = l_i * rescale + tl.exp2(sink - m_all)
            acc = acc * rescale[:, None]
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        part = (split * num_tokens + token) * n_heads + head  # workspace row: [NUM_SPLITS, T, H]
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_valid[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)


# Batch-dependent integers are not specialised (==1, %16): new batch shapes must not recompile.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_lead_decodes", "num_chunk_tiles", "stride_bt"])
def _paged_attention(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, num_tokens, num_lead_decodes, num_chunk_tiles, n_heads, scale_log2, softcap,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DECODE_BLOCK_M: tl.constexpr, DECODE_BLOCK_N: tl.constexpr, HAS_CHUNKS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr, V_READ: tl.constexpr = 0,
):
    """The first num_chunk_tiles programs cover the sequences after the leading decodes in tiles of BLOCK_Q tokens,
    heaviest (latest) tiles first so that they do not start last; the remaining programs are the batch's leading
    decodes (q_len 1, so decode b is token b), one small tile each, filling in around them."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if tile >= num_chunk_tiles:
        decode = tile - num_chunk_tiles
        _attention_tile(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr,
            block_tables_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, decode, decode, 1, 0, kv_head, split, num_tokens,
            n_heads, scale_log2, softcap,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_bt,
            GROUP, GROUP_PAD, HEAD_DIM, D_PAD, PAGE, 1, DECODE_BLOCK_M, DECODE_BLOCK_N, NUM_SPLITS,
            DOT_PRECISION, UPCAST_DOT, WINDOW, SOFTCAP, HAS_SINKS, KV_FP8, V_READ)
    elif HAS_CHUNKS:
        # Sequence b (>= num_lead_decodes) owns tiles from (cu_q[b] - D) // BLOCK_Q + (b - D) on (D leading
        # decodes, which hold tokens 0 .. D-1): an upper bound on the tiles before it. Find the last b whose first
        # tile is <= this one.
        chunk_tile = num_chunk_tiles - 1 - tile
        lo = num_lead_decodes
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            first_tile = (tl.load(cu_seqlens_q_ptr + mid) - num_lead_decodes) // BLOCK_Q + mid - num_lead_decodes
            if first_tile <= chunk_tile:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        first_q = (chunk_tile - ((q_start - num_lead_decodes) // BLOCK_Q + seq - num_lead_decodes)) * BLOCK_Q
        if first_q < q_len:  # spare tiles past the sequence's end do nothing
            _attention_tile(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, seq_lens_ptr,
                block_tables_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr, seq, q_start, q_len, first_q, kv_head, split,
                num_tokens, n_heads, scale_log2, softcap, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                stride_vb, stride_vt, stride_vh, stride_ot, stride_oh, stride_bt,
                GROUP, GROUP_PAD, HEAD_DIM, D_PAD, PAGE, BLOCK_Q, BLOCK_M, BLOCK_N, NUM_SPLITS,
                DOT_PRECISION, UPCAST_DOT, WINDOW, SOFTCAP, HAS_SINKS, KV_FP8, V_READ)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr, sinks_ptr, num_tokens, n_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    part = (splits * num_tokens + token) * n_heads + head
    m = tl.load(part_m_ptr + part)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_all, sink)
    weight = tl.exp2(m - m_all)
    denom = tl.sum(weight * tl.load(part_l_ptr + part), 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_all)
    offs_d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


FP8_AS_Q = 1  # an e4m3 cache converted to the queries' dtype
FP8_IN_FP16 = 2  # an e4m3 cache met in fp16, the half-precision queries converted once per tile
FP8_AS_FP16 = tl.constexpr(FP8_IN_FP16)  # the same, as the kernels compare it


def fp8_read_mode(kv_fp8: bool, q_dtype: torch.dtype, on_cuda: bool) -> int:
    """How the kernel reads an FP8 cache (its KV_FP8 constexpr; 0: the cache is not FP8). On the GPU with bf16 or
    fp16 queries the dots run in fp16: e4m3 → fp16 is one packed conversion per two values and exact, where
    e4m3 → bf16 costs several instructions a value, enough to make the decode kernel issue-bound rather than
    bandwidth-bound; fp16 holds every e4m3 value and a bf16 query's 8 mantissa bits (queries beyond fp16's
    65,504 would not fit, far outside what attention layers produce)."""
    if not kv_fp8:
        return 0
    return FP8_IN_FP16 if on_cuda and q_dtype in (torch.bfloat16, torch.float16) else FP8_AS_Q


def require_runnable(device: torch.device) -> None:
    """Triton runs CPU tensors only in its interpreter, which must be on (TRITON_INTERPRET=1) before triton is
    imported: its own library functions (tl.max, tl.cdiv, ...) are wrapped at import time."""
    if device.type == "cuda":
        return
    if type(tl.cdiv).__name__ != "InterpretedFunction":
        raise ValueError(f"Triton kernels need CUDA tensors, got {device.type}; for the (slow) interpreter set "
                         "TRITON_INTERPRET=1 before triton is first imported")


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 64  # rows of a chunk tile = its query tokens x the padded GQA group
    block_n: int = 64  # keys per inner step of a chunk tile
    num_warps: int = 4
    num_stages: int = 3
    decode_block_n: int = 128  # keys per inner step of a decode tile (rows: max(16, padded group))
    v_read: int = 0  # how an FP8 V tile reaches its dot (V_AS_LOADED ... V_CONVERTED_FIRST, above); 16-bit: unused
    max_registers: int = 0  # a cap on registers per thread (ptxas .maxnreg), for occupancy; 0: the compiler's choice


LONG_CHUNK_TOKENS = 2048  # a mixed batch with this many chunk tokens takes a pure chunk batch's tiles
# Over an FP8 cache the busy decode tile compiles to 184 registers a thread: 5 programs of 2 warps fit an SM, 10
# warps to hide the latency of a tile that does twice the work per byte of a bf16 one. Capped at 168 (ptxas moves a
# few values to L1) 6 programs fit, and a batch with more decode programs than the GPU holds at once streams faster.
# On the H200 (bench_kernels --kv-fp8 --registers-ab, one Llama-3-8B layer, docs/perf/fp8-h200.md): 921 decodes at
# 1,328 keys -12 %, 256 at 2k -7 %; 64 at 2k (512 programs, all resident either way) +3 %, hence the threshold.
FP8_QUEUED_DECODE_REGISTERS = 168
QUEUED_PROGRAMS_PER_SM = 6


def batch_fill(seqs: int, n_kv_heads: int, sm_count: int) -> tuple[bool, bool]:
    """(busy, queued) for a launch of `seqs` decode programs per kv head: busy when they fill every SM, queued
    when there are more than an SM holds at once (QUEUED_PROGRAMS_PER_SM)."""
    programs = seqs * n_kv_heads
    return programs >= sm_count, programs >= QUEUED_PROGRAMS_PER_SM * sm_count


def choose_config(decode_only: bool, chunks_only: bool, busy: bool, group_pad: int, d_pad: int,
                  on_cuda: bool, kv_fp8: bool = False, chunk_tokens: int = 0, queued: bool = False) -> TileConfig:
    """Fixed tiles by batch class, so a server compiles a handful of variants, never one per batch.

    From an H200 sweep (bench_kernels --sweep, Llama-3-8B layer, bf16): decode-only batches that fill the GPU
    (`busy`) stream best with 64-key steps and 2 stages, small ones with 128-key steps; pure prefill chunks like
    128-row tiles on 8 warps; mixed batches like 64-row tiles on 4 warps, 3 stages. Over an FP8 cache (the same
    sweep with --kv-fp8) busy decodes like 2 warps and 3 stages of 64 keys, small ones 2 stages of 128 keys,
    their V converted in PTX (FP8_DECODE_V_READ, above), and when `queued` (more programs than the GPU holds at
    once) a register cap that fits one more program an SM (FP8_QUEUED_DECODE_REGISTERS, above).
    A mixed batch whose chunks carry LONG_CHUNK_TOKENS or more is mostly chunk work, and takes the chunk tiles
    (each 16-token tile re-reads every key before it, twice as often as a 32-token one). Measured since
    (docs/perf/mixed-step-h200.md): the whole 2,048 step's attention went from 30.9 to 28.9 ms, still twice the
    13.6 ms of its chunk launched alone, so the tiles are not what a mixed launch costs that chunk.
    """
    if not on_cuda:  # interpreter: big tiles mean few Python-level steps
        return TileConfig(max(64, group_pad), 128, num_stages=1, decode_block_n=128)
    if d_pad > 128:  # head_dim 256 (Gemma 3): K and V tiles twice as wide; halve the keys per step to stay within
        # shared memory (2 stages of [256 x 64] K and V tiles in bf16: 128 KB)
        return TileConfig(max(64, group_pad), 32, num_warps=8 if not decode_only else 4, num_stages=2,
                          decode_block_n=64)
    if decode_only:
        block_m = max(64, group_pad)  # unused by decode tiles, but must stay a multiple of the group
        if kv_fp8:
            return TileConfig(block_m, num_warps=2 if busy else 4, num_stages=3 if busy else 2,
                              decode_block_n=64 if busy else 128, v_read=FP8_DECODE_V_READ,
                              max_registers=FP8_QUEUED_DECODE_REGISTERS if busy and queued else 0)
        return TileConfig(block_m, decode_block_n=64 if busy else 128, num_stages=2 if busy else 3)
    if (chunks_only or chunk_tokens >= LONG_CHUNK_TOKENS) and d_pad <= 128:
        return TileConfig(max(128, group_pad), 64, num_warps=8, num_stages=2)
    return TileConfig(max(64, group_pad), 64, num_warps=4, num_stages=3, decode_block_n=128)


@lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    device = torch.device(device)
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256  # keys per split at least


def choose_num_splits(num_programs: int, num_tokens: int, max_seqlen_k: int, sm_count: int) -> int:
    """Split the key range only when the batch alone leaves most SMs idle and keys are many (flash-decoding)."""
    if num_tokens > 256 or max_seqlen_k < 1024 or num_programs >= sm_count:
        return 1
    wanted = -(-2 * sm_count // num_programs)
    by_length = max_seqlen_k // MIN_SPLIT_KEYS
    splits = min(wanted, by_length, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)  # a power of two: few compiled variants, tl.arange in the merge


# Every layer of a forward pass gets metadata sharing one q_lens list (built once per step and never changed
# after; one metadata object per KV group): classify its batch on the first layer only.
_batch_memo: list = [None, (0, False)]


def _batch_shape(meta: AttentionMetadata) -> tuple[int, bool]:
    """(how many sequences at the start of the batch are decodes, whether any sequence is a decode). Leading
    decodes get small tiles of their own; decodes elsewhere ride in chunk tiles."""
    q_lens = meta.q_lens_host
    if _batch_memo[0] is not q_lens:
        _batch_memo[:] = [q_lens, (len(list(itertools.takewhile((1).__eq__, q_lens))), 1 in q_lens)]
    return _batch_memo[1]


def split_keys(max_seqlen_k: int, window: int | None) -> int:
    """The key count a launch's kv-split choice reads: a window layer's is its window, whatever the batch (so a
    captured graph launches it exactly as an eager step would)."""
    return window if window is not None else max_seqlen_k


FP8_APART_MIN_CHUNK_TOKENS = 512  # over an FP8 cache; a 16-bit cache's threshold is LONG_CHUNK_TOKENS


def launch_apart(lead_decodes: int, chunk_tokens: int, n_kv_heads: int, sm_count: int, kv_fp8: bool) -> bool:
    """Whether a mixed batch runs as two launches, its leading decodes on decode tiles and its chunks on chunk
    tiles, rather than one launch whose decode tiles take the mixed (or long-chunk) warps and stages. Only where
    the decodes fill the GPU alone (so neither launch splits keys) and the chunk is long enough.
    On the H200 (hack/bench_kernels.py --apart-ab, one Llama-3-8B layer, docs/perf/mixed-step-h200.md) two
    launches took 3-34 % off every mixed batch over an FP8 cache from a 512-token chunk (an FP8 cache's decode
    tiles want 2 warps, a chunk's 4 or 8), and 6-22 % off a 16-bit cache's from a 2,048-token chunk, where below
    it one launch was up to 8 % faster."""
    busy, _ = batch_fill(lead_decodes, n_kv_heads, sm_count)
    return busy and chunk_tokens >= (FP8_APART_MIN_CHUNK_TOKENS if kv_fp8 else LONG_CHUNK_TOKENS)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, config: TileConfig | None = None, num_splits: int | None = None,
                    out: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    apart: bool | None = None) -> torch.Tensor:
    """Attention of the batch's new tokens over the paged cache (their K/V already written). Returns [T, H, D]
    (`out` when given: [T, H, D] with contiguous heads, e.g. rows of a static buffer). window: a query at
    position p sees keys p - window + 1 .. p; softcap: scores -> softcap * tanh(scores / softcap); sinks [H]: a
    logit per head in every row's softmax denominator. An FP8 cache needs k_scale and v_scale, float32
    [n_kv_heads]. apart: run a mixed batch's leading decodes and its chunks as two launches, each on its own
    tiles (None: as `launch_apart` decides; a given config or split count means one launch)."""
    num_tokens, n_heads, head_dim = q.shape
    n_kv_heads = k_cache.shape[2]
    group = n_heads // n_kv_heads
    group_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    on_cuda = q.device.type == "cuda"
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim axis must be contiguous")
    num_seqs = meta.num_seqs
    lead_decodes, any_decode = _batch_shape(meta)
    has_chunks = lead_decodes < num_seqs
    sm_count = _sm_count(q.device.index or 0) if on_cuda else 1
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    read_mode = fp8_read_mode(kv_fp8, q.dtype, on_cuda)
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    if apart and num_splits not in (None, 1):
        raise ValueError("two launches do not split keys: pass apart=False with num_splits")
    if out is None:
        out = torch.empty((num_tokens, n_heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"out must be [T, H, D] like q with contiguous heads, got {tuple(out.shape)} {out.dtype}")
    require_runnable(q.device)

    def tiles(decode_only: bool, chunks_only: bool, seqs: int) -> TileConfig:
        busy, queued = batch_fill(seqs, n_kv_heads, sm_count)
        cfg = config or choose_config(decode_only, chunks_only, busy, group_pad, d_pad, on_cuda, kv_fp8,
                                      num_tokens - lead_decodes, queued)
        if config is None and kv_fp8 and read_mode != FP8_IN_FP16:
            cfg = dataclasses.replace(cfg, v_read=V_AS_LOADED)  # float32 queries: no fp16 conversion in PTX
        if cfg.block_m % group_pad or min(cfg.block_m, cfg.block_n, cfg.decode_block_n) < 16:
            raise ValueError(f"tile {cfg} must have block_m a multiple of {group_pad} and every side >= 16")
        if kv_fp8 and cfg.v_read != V_AS_LOADED and read_mode != FP8_IN_FP16:
            raise ValueError(f"v_read {cfg.v_read} converts to fp16 with inline PTX: CUDA with bf16 or fp16 queries "
                             "only")
        return cfg

    def chunk_tiles_for(cfg: TileConfig) -> int:  # an upper bound: each chunk sequence may waste one partial tile
        return (num_tokens - lead_decodes) // (cfg.block_m // group_pad) + (num_seqs - lead_decodes)

    def launch(cfg: TileConfig, decodes: int, chunk_tiles: int, splits: int) -> None:
        _launch(q, k_cache, v_cache, out, meta, scale, window, softcap, sinks, k_scale, v_scale, kv_fp8, read_mode,
                cfg, decodes, chunk_tiles, splits, lead_decodes, group, group_pad, d_pad, on_cuda)

    if apart is None:
        apart = (config is None and num_splits is None and on_cuda
                 and launch_apart(lead_decodes, num_tokens - lead_decodes, n_kv_heads, sm_count, kv_fp8))
    if apart and has_chunks and lead_decodes:
        launch(tiles(True, False, lead_decodes), lead_decodes, 0, 1)
        chunk_cfg = tiles(False, True, 0)
        launch(chunk_cfg, 0, chunk_tiles_for(chunk_cfg), 1)
        return out

    cfg = tiles(not has_chunks, not any_decode, num_seqs)
    chunk_tiles = chunk_tiles_for(cfg) if has_chunks else 0
    if num_splits is None:
        num_splits = 1
        if on_cuda:
            num_splits = choose_num_splits((chunk_tiles + lead_decodes) * n_kv_heads, num_tokens,
                                           split_keys(meta.max_seqlen_k, window), sm_count)
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1, got {num_splits}")
    launch(cfg, lead_decodes, chunk_tiles, num_splits)
    return out


def _launch(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, window, softcap, sinks, k_scale, v_scale,
            kv_fp8: bool, read_mode: int, cfg: TileConfig, decodes: int, chunk_tiles: int, num_splits: int,
            lead_decodes: int, group: int, group_pad: int, d_pad: int, on_cuda: bool) -> None:
    """One launch over `chunk_tiles` chunk programs and the first `decodes` leading decodes (the whole batch, or
    one of its two parts), then the merge of its key splits."""
    num_tokens, n_heads, head_dim = q.shape
    if num_splits > 1:
        part_acc = torch.empty((num_splits, num_tokens, n_heads, d_pad), dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_splits, num_tokens, n_heads), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # never touched
    _paged_attention[(chunk_tiles + decodes, k_cache.shape[2], num_splits)](
        q, k_cache, v_cache, out, part_acc, part_m, part_l,
        meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, sinks if sinks is not None else out,
        k_scale if kv_fp8 else meta.seq_lens, v_scale if kv_fp8 else meta.seq_lens,
        meta.num_seqs, num_tokens, lead_decodes, chunk_tiles, n_heads, scale * math.log2(math.e),
        float(softcap or 1.0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, D_PAD=d_pad, PAGE=k_cache.shape[1],
        BLOCK_Q=cfg.block_m // group_pad, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DECODE_BLOCK_M=max(16, group_pad), DECODE_BLOCK_N=cfg.decode_block_n, HAS_CHUNKS=chunk_tiles > 0,
        NUM_SPLITS=num_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter (3.9) computes bf16 x bf16 dots wrongly; it upcasts the operands instead.
        UPCAST_DOT=not on_cuda and q.dtype == torch.bfloat16, WINDOW=window or 0, SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, KV_FP8=read_mode,
        V_READ=cfg.v_read if kv_fp8 else 0, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    if num_splits > 1:
        _merge_splits[(num_tokens, n_heads)](
            part_acc, part_m, part_l, out, sinks if sinks is not None else out, num_tokens, n_heads, out.stride(0),
            out.stride(1), HEAD_DIM=head_dim, D_PAD=d_pad, NUM_SPLITS=num_splits, HAS_SINKS=sinks is not None,
            num_warps=4,
        )
