"""Fused element-wise kernels of a decoder layer: one launch where the torch path takes 3-17.

- `add_rms_norm`: residual += x (rounded to the model dtype), then out = weight * norm(residual) (Llama) or
  (1 + weight) * norm(residual) in float32 (Gemma); without x it is a plain RMSNorm (`rms_norm`). One program
  per token row.
- `add_rms_norm_fp8`, `silu_mul_fp8`: the (Llama-style) norm and SiLU * up with their output quantised to FP8
  e4m3 in the same launch (per token, per group of columns, or with a static scale) for the FP8 linear layers
  that read them; one program per token row (a token's scale needs its whole row).
- `rope_write_kv`: from the fused qkv projection, optionally RMS-norm each q and k head (QK-norm: Qwen3, Gemma 3),
  rotate q and k (rotate-half layout, over all of a head or its first rotary dims) with cos/sin read from a
  per-position table built once, write rotated q to its own buffer and k, v into their paged-cache slots
  (a negative slot skips the cache write; an FP8 cache gets them quantised with their kv head's scale). One
  program per token.
- `gated_act`: act(gate) * up from the fused gate_up projection, act SiLU or tanh-GELU (`silu_mul`).

Every rounding step of the torch path (models/layers.py, models/rope.py) is reproduced: each product or sum
torch rounds to bf16/fp16 is rounded here too, so rotary and the residual add are bit-exact, and the norm and
SiLU differ only by fp32 reduction order and the hardware rsqrt/exp (bf16 tolerances; on the H200 they came out
equal to torch's in all but a few elements). Batch-dependent sizes
are the grid only: a new token count never compiles a new variant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable
from .triton_fp8 import (
    _COMPILED,
    WHOLE_ROW_MAX,
    _fp8_of,
    _quantize_registers,
    _scale_of,
    check_quant_args,
    row_chunk,
    scale_buffer,
    ub_arg,
    whole_row_warps,
)


@triton.jit
def _add_rms_norm(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, eps,
                  N: tl.constexpr, BLOCK: tl.constexpr, HAS_X: tl.constexpr, PLUS_ONE: tl.constexpr,
                  FLOAT_SCALE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=mask)
    r32 = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(r32 * r32, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PLUS_ONE:  # Gemma: scaled by (1 + w) in float32, rounded once
        out = r32 * inv * (1.0 + w)
    elif FLOAT_SCALE:  # gpt-oss: scaled by w in float32, rounded once
        out = w * (r32 * inv)
    else:  # Llama: rounded to the model dtype, then times w
        out = w * (r32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None, plus_one: bool = False, float_scale: bool = False) -> torch.Tensor:
    """residual [T, N] (updated in place to residual + x when x is given); returns weight * rmsnorm(residual)
    ((1 + weight) * rmsnorm(residual) with plus_one; scaled in float32 before rounding with float_scale)."""
    rows, n = residual.shape
    if out is None:
        out = torch.empty_like(residual)
    if rows == 0:
        return out
    for t in (residual, out) + ((x,) if x is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError("add_rms_norm needs rows with a contiguous last axis")
    require_runnable(residual.device)
    block = triton.next_power_of_2(n)
    _add_rms_norm[(rows,)](
        x if x is not None else residual, residual, weight, out,
        x.stride(0) if x is not None else 0, residual.stride(0), out.stride(0), eps,
        N=n, BLOCK=block, HAS_X=x is not None, PLUS_ONE=plus_one, FLOAT_SCALE=float_scale,
        num_warps=min(16, max(4, block // 512)),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool = False,
             float_scale: bool = False) -> torch.Tensor:
    """RMSNorm of the rows of x [T, N] (x is not changed)."""
    return add_rms_norm(None, x, weight, eps, plus_one=plus_one, float_scale=float_scale)



@triton.jit
def _add_rms_norm_fp8(x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_r, stride_q,
                      stride_s, eps, amax_ub, N: tl.constexpr, BLOCK: tl.constexpr, HAS_X: tl.constexpr,
                      GROUP: tl.constexpr, STATIC: tl.constexpr, ROUND: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=mask)
    r32 = r.to(tl.float32)
    inv = tl.rsqrt(tl.sum(r32 * r32, 0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # the norm's output in the model dtype, as add_rms_norm stores it, before it is quantised
        y = _rounded(w * _rounded(r32 * inv, BF16), BF16)
    else:
        y = w * (r32 * inv)
    _quantize_registers(y, cols, mask, q_ptr + row * stride_q, s_ptr + row * stride_s, static_ptr, amax_ub, N,
                        BLOCK, GROUP, STATIC)


def add_rms_norm_fp8(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     group: int | None = None, static_scale: torch.Tensor | None = None,
                     amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm whose output goes straight to FP8: residual [T, N] updated in place as add_rms_norm does;
    returns (q e4m3 [T, N], scales) of weight * rmsnorm(residual) rounded to the model dtype, quantised per token
    (group None, its amax bounded by `amax_ub`), per `group` columns or with a static scale (triton_fp8.quantize_fp8's
    conventions)."""
    rows, n = residual.shape
    check_quant_args(n, group, static_scale, amax_ub)
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=residual.device)
    scales = scale_buffer(rows, n, group, static_scale, residual.device)
    if rows == 0:
        return q, scales
    for t in (residual,) + ((x,) if x is not None else ()):
        if t.stride(-1) != 1:
            raise ValueError("add_rms_norm_fp8 needs rows with a contiguous last axis")
    require_runnable(residual.device)
    block = triton.next_power_of_2(n)
    _add_rms_norm_fp8[(rows,)](
        x if x is not None else residual, residual, weight, q, scales,
        static_scale if static_scale is not None else scales,
        x.stride(0) if x is not None else 0, residual.stride(0), q.stride(0),
        scales.stride(0) if scales.dim() == 2 else 0, eps, ub_arg(amax_ub),
        N=n, BLOCK=block, HAS_X=x is not None, GROUP=min(group or 0, block), STATIC=static_scale is not None,
        ROUND=residual.dtype in (torch.bfloat16, torch.float16), BF16=residual.dtype == torch.bfloat16,
        num_warps=min(16, max(4, block // 512)),
    )
    return q, scales

@triton.jit
def _silu_mul_value(gate_up_row, cols, mask, N, ROUND: tl.constexpr, BF16: tl.constexpr):
    g = tl.load(gate_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_row + N + cols, mask=mask, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    if ROUND:  # silu(gate) and the product each rounded to the model dtype, as silu_mul stores them
        return _rounded(_rounded(silu, BF16) * u, BF16)
    else:
        return silu * u


@triton.jit
def _silu_mul_fp8(gate_up_ptr, q_ptr, s_ptr, static_ptr, stride_g, stride_q, stride_s, amax_ub, N,
                  CHUNK: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr, ROUND: tl.constexpr,
                  BF16: tl.constexpr, WHOLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    gate_up_row = gate_up_ptr + row * stride_g
    q_row = q_ptr + row * stride_q
    s_row = s_ptr + row * stride_s
    offs = tl.arange(0, CHUNK)
    if WHOLE:  # the row fits one chunk: computed once, its amax and codes from registers
        mask = offs < N
        y = _silu_mul_value(gate_up_row, offs, mask, N, ROUND, BF16)
        _quantize_registers(y, offs, mask, q_row, s_row, static_ptr, amax_ub, N, CHUNK, GROUP, STATIC)
    elif STATIC or GROUP != 0:  # every chunk is self-contained (CHUNK == GROUP for groups)
        for start in range(0, N, CHUNK):
            cols = start + offs
            mask = cols < N
            y = _silu_mul_value(gate_up_row, cols, mask, N, ROUND, BF16)
            _quantize_registers(y, cols, mask, q_row, s_row + start // CHUNK, static_ptr, amax_ub, N - start,
                                CHUNK, GROUP, STATIC)
    else:  # per token: the row's amax first, then quantise (the second read of gate_up mostly hits L2)
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, N, CHUNK):
            cols = start + offs
            mask = cols < N
            amax = tl.maximum(amax, tl.where(mask, tl.abs(_silu_mul_value(gate_up_row, cols, mask, N, ROUND, BF16)),
                                             0.0))
        scale = _scale_of(tl.max(amax, 0), amax_ub)
        for start in range(0, N, CHUNK):
            cols = start + offs
            mask = cols < N
            y = _silu_mul_value(gate_up_row, cols, mask, N, ROUND, BF16)
            tl.store(q_row + cols, _fp8_of(y, scale), mask=mask)
        tl.store(s_row, scale)


def silu_mul_fp8(gate_up: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                 chunk: int = WHOLE_ROW_MAX, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] (gate columns first) → (q e4m3 [T, I], scales) of silu(gate) * up rounded to the model
    dtype, quantised per token (group None, amax bounded by `amax_ub`), per `group` columns or with a static
    scale. A per-token row of at most `chunk` columns is held whole in one program's registers (one pass, 16
    warps): at decode batches a program per row is all the parallelism there is, and two passes of small chunks
    made it latency-bound."""
    rows, width = gate_up.shape
    n = width // 2
    check_quant_args(n, group, static_scale, amax_ub)
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scales = scale_buffer(rows, n, group, static_scale, gate_up.device)
    if rows == 0:
        return q, scales
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_mul_fp8 needs rows with a contiguous last axis")
    require_runnable(gate_up.device)
    whole = group is None and static_scale is None and triton.next_power_of_2(n) <= chunk
    _silu_mul_fp8[(rows,)](
        gate_up, q, scales, static_scale if static_scale is not None else scales, gate_up.stride(0), q.stride(0),
        scales.stride(0) if scales.dim() == 2 else 0, ub_arg(amax_ub), n,
        CHUNK=row_chunk(n, group, chunk, whole), GROUP=group or 0, STATIC=static_scale is not None,
        ROUND=gate_up.dtype in (torch.bfloat16, torch.float16), BF16=gate_up.dtype == torch.bfloat16, WHOLE=whole,
        num_warps=whole_row_warps(n) if whole else 4,
    )
    return q, scales


@triton.jit
def _rounded(x, BF16: tl.constexpr):
    """fp32 x rounded to the model dtype (nearest even) and widened back. A plain `.to(bf16).to(fp32)` pair may be
    folded away by the compiler, which then contracts the products and the sum into FMAs (seen on the H200: 19 %
    of rotated elements off by one bf16 step), where torch rounds each. For bf16 on the GPU one cvt in PTX, which
    the compiler cannot fold; under the interpreter the same rounding in integer arithmetic."""
    if BF16:
        if _COMPILED:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b16 lo, 0; cvt.rn.bf16.f32 hi, $1; mov.b32 $0, {lo, hi}; }",
                "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _normed(x, inv, w, ROUND: tl.constexpr, BF16: tl.constexpr, PLUS_ONE: tl.constexpr):
    """RMSNorm of fp32 x given 1/rms: Llama's weight * round(x / rms), or Gemma's round(x / rms * (1 + weight))."""
    if PLUS_ONE:
        y = x * inv[:, None] * (1.0 + w[None, :])
        if ROUND:
            y = _rounded(y, BF16)
    elif ROUND:
        y = _rounded(w[None, :] * _rounded(x * inv[:, None], BF16), BF16)
    else:
        y = w[None, :] * (x * inv[:, None])
    return y


@triton.jit
def _rope_heads(x_ptr, w_ptr, cos_ptr, sin_ptr, pos, heads, n_heads, eps, HEAD_DIM: tl.constexpr,
                D_PAD: tl.constexpr, ROT_HALF: tl.constexpr, ROUND: tl.constexpr, BF16: tl.constexpr,
                QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr):
    """Heads [n, HEAD_DIM] at x_ptr, per-head RMS-normed (QK_NORM) then rotate-half roped over their first
    2 * ROT_HALF dims (the rest pass through), as torch computes them in the model dtype: each product rounded,
    then the sum. Each element's rotate-half partner is loaded alongside it, so any head_dim and rotary size work."""
    offs = tl.arange(0, D_PAD)
    d_mask = offs < HEAD_DIM
    rot = offs < 2 * ROT_HALF
    partner = tl.where(offs < ROT_HALF, offs + ROT_HALF, tl.where(rot, offs - ROT_HALF, offs))
    mask = (heads < n_heads)[:, None] & d_mask[None, :]
    rows = x_ptr + heads[:, None] * HEAD_DIM
    x = tl.load(rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    if QK_NORM:
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=d_mask & rot, other=0.0).to(tl.float32)
        x = _normed(x, inv, w, ROUND, BF16, PLUS_ONE)
        xp = _normed(xp, inv, wp, ROUND, BF16, PLUS_ONE)
    angle = offs % ROT_HALF
    cos = tl.load(cos_ptr + pos * ROT_HALF + angle, mask=rot, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * ROT_HALF + angle, mask=rot, other=0.0).to(tl.float32)[None, :]
    sign = tl.where(offs < ROT_HALF, -1.0, 1.0)[None, :]
    if ROUND:
        turned = _rounded(x * cos, BF16) + _rounded(sign * xp * sin, BF16)
    else:
        turned = x * cos + sign * xp * sin
    return tl.where(rot[None, :], turned, x), mask


@triton.jit
def _rope_write_kv(qkv_ptr, positions_ptr, slot_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                   q_norm_ptr, k_norm_ptr, eps, k_scale_ptr, v_scale_ptr,
                   stride_qkv, stride_qo, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                   N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, KV_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROT_HALF: tl.constexpr, PAGE: tl.constexpr,
                   ROUND: tl.constexpr, BF16: tl.constexpr, QK_NORM: tl.constexpr, PLUS_ONE: tl.constexpr,
                   KV_FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    row = qkv_ptr + token * stride_qkv
    offs = tl.arange(0, D_PAD)

    heads = tl.arange(0, H_PAD)
    q, qmask = _rope_heads(row, q_norm_ptr, cos_ptr, sin_ptr, pos, heads, N_HEADS, eps, HEAD_DIM, D_PAD, ROT_HALF,
                           ROUND, BF16, QK_NORM, PLUS_ONE)
    tl.store(q_out_ptr + token * stride_qo + heads[:, None] * HEAD_DIM + offs[None, :],
             q.to(q_out_ptr.dtype.element_ty), mask=qmask)

    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // PAGE
        in_page = slot % PAGE
        kv_heads = tl.arange(0, KV_PAD)
        k_row = row + N_HEADS * HEAD_DIM
        k, kmask = _rope_heads(k_row, k_norm_ptr, cos_ptr, sin_ptr, pos, kv_heads, N_KV_HEADS, eps, HEAD_DIM, D_PAD,
                               ROT_HALF, ROUND, BF16, QK_NORM, PLUS_ONE)
        k_dst = k_cache_ptr + block * stride_kcb + in_page * stride_kct + kv_heads[:, None] * stride_kch + offs[None, :]
        v_row = k_row + N_KV_HEADS * HEAD_DIM
        v = tl.load(v_row + kv_heads[:, None] * HEAD_DIM + offs[None, :], mask=kmask, other=0.0)
        v_dst = (v_cache_ptr + block * stride_vcb + in_page * stride_vct + kv_heads[:, None] * stride_vch
                 + offs[None, :])
        if KV_FP8:  # rotated k in the model dtype (as the torch path holds it), then e4m3 with its head's scale
            k_scale = tl.load(k_scale_ptr + kv_heads, mask=kv_heads < N_KV_HEADS, other=1.0)[:, None]
            v_scale = tl.load(v_scale_ptr + kv_heads, mask=kv_heads < N_KV_HEADS, other=1.0)[:, None]
            if ROUND:
                k = _rounded(k, BF16)
            tl.store(k_dst, _fp8_of(k, k_scale), mask=kmask)
            tl.store(v_dst, _fp8_of(v.to(tl.float32), v_scale), mask=kmask)
        else:
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=kmask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=kmask)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, q_out: torch.Tensor | None = None,
                  qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (H + 2 KVH) * D] → rotated q [T, H, D] (into q_out if given); rotated k and v into the cache at
    slot_mapping [T]. cos/sin: [max_position, R / 2] tables in qkv's dtype (RotaryEmbedding.tables) for the first
    R <= D dims of each head. qk_norm: (q weight [D], k weight [D], eps, plus_one): each q and k head is
    RMS-normed before rope (Qwen3: weight * norm; Gemma: (1 + weight) * norm). An FP8 cache stores
    e4m3(k / k_scale[head]) and e4m3(v / v_scale[head]) (scales float32 [KVH])."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    rot_half = cos.shape[-1]
    if qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not a contiguous-row [T, (H + 2 KVH) * D] projection")
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rope_write_kv supports float32, bfloat16 and float16, not {qkv.dtype}")
    if 2 * rot_half > head_dim or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype or sin.shape != cos.shape:
        raise ValueError("rope_write_kv needs cos/sin tables [P, R/2] (R <= head_dim) in qkv's dtype")
    if q_out is None:
        q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q_out.stride(-1) != 1 or q_out.stride(1) != head_dim:
        raise ValueError("rope_write_kv needs contiguous heads in q_out and the KV cache")
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    require_runnable(qkv.device)
    q_weight, k_weight, eps, plus_one = qk_norm if qk_norm is not None else (qkv, qkv, 0.0, False)
    _rope_write_kv[(tokens,)](
        qkv, positions, slot_mapping, cos, sin, q_out, k_cache, v_cache, q_weight, k_weight, eps,
        k_scale if kv_fp8 else positions, v_scale if kv_fp8 else positions,
        qkv.stride(0), q_out.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        N_HEADS=num_heads, N_KV_HEADS=num_kv_heads, H_PAD=triton.next_power_of_2(num_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        ROT_HALF=rot_half, PAGE=k_cache.shape[1], ROUND=qkv.dtype in (torch.bfloat16, torch.float16),
        BF16=qkv.dtype == torch.bfloat16, QK_NORM=qk_norm is not None, PLUS_ONE=bool(plus_one), KV_FP8=kv_fp8,
        num_warps=4,
    )
    return q_out


@triton.jit
def _gated_act(gate_up_ptr, out_ptr, stride_g, stride_o, N: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + N + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # tanh-approximated GELU; tanh(y) = 1 - 2 / (exp(2y) + 1)
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(dtype).to(tl.float32)  # torch rounds act(gate) before the product
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dtype), mask=mask)


def gated_act(gate_up: torch.Tensor, act: str = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) → act(gate) * up [T, I]; act "silu" or "gelu_tanh"."""
    if act not in ("silu", "gelu_tanh"):
        raise ValueError(f"gated_act supports silu and gelu_tanh, not {act!r}")
    rows, width = gate_up.shape
    n = width // 2
    if out is None:
        out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    if gate_up.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("gated_act needs rows with a contiguous last axis")
    require_runnable(gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _gated_act[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), N=n, BLOCK=block,
                                              GELU=act == "gelu_tanh", num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) → silu(gate) * up [T, I]."""
    return gated_act(gate_up, "silu", out)
