"""FP8 (e4m3) Triton kernels: dynamic activation quantisation and the scaled FP8 GEMM.

- `quantize_fp8(x, group=None, static_scale=None, amax_ub=None)`: x [T, K] → (q e4m3 [T, K], scales): one scale
  per token (`group` None: [T, 1]), per `group` columns of a token ([T, ceil(K / group)]), or the given static
  scale (0-d). `amax_ub` bounds a token's amax before its scale is taken (FBGEMM's activation_scale_ub: values
  past it saturate at ±448), per token only.
  One program per token row; a per-token row up to WHOLE_ROW_MAX columns is read once and quantised from
  registers, a wider one twice (amax, then quantise); groups and static scales once.
- `fp8_matmul(a, a_scale, b, b_scale, ...)`: a [M, K] e4m3 @ b [N, K] e4m3 (a weight as stored, rows = output
  features) → [M, N] in the output dtype. Scales either multiply once after the K loop (a: 0-d or per row [M],
  b: 0-d or per column [N]) or, with `group_k`, per K group inside the loop (a [M, ceil(K / g)], b [N, ceil(K / g)]
  — the block-scaled layout of DeepSeek-style checkpoints with each weight row carrying its block's scales).
  Tiles are chosen by M (fp8_tiles.py); M itself is a run-time argument, so a new batch size never compiles a new
  variant.

Scales follow metronome.server.models.quant.fp8 (amax / 448, floored at 1 / (448 * 512), round to nearest even
after clamping to ±448). On the GPU the cast (cvt, round to nearest even) does that by itself; under Triton's
interpreter, whose fp32 → fp8 conversion drops the carry into the exponent (124.3 became 64), `_e4m3_grid` first
rounds to the e4m3 grid in integer arithmetic so that the cast is exact, and both agree bit for bit with torch.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .fp8_tiles import matmul_tiles
from .triton_attention import require_runnable, sm_count

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)

# Hopper's FP8 tensor cores add a chain of products into fewer mantissa bits than float32 keeps (cuBLAS's "fast
# accumulation", Triton's default for FP8 dots on sm_90). PROMOTE_EVERY = n adds their partial sum into a float32
# accumulator every n products, as CUTLASS's FP8 kernels do, in the GEMMs whose dots chain the whole K (the
# block-scaled one promotes every K group anyway). Left off: on an H100 it made the skinny kernel 4-17 % slower a
# call and the tiled one 3.2-3.6x (Triton then waits on each group of MMAs), for an error that goes from 2.1-4.2e-3
# of the output's norm to bf16's own rounding, 1.7e-3, an order below what e4m3 operands differ from bf16 by
# (docs/perf/fp8-h200.md, hack/fp8_accumulation.py). Read at each launch.
PROMOTE_EVERY: int | None = None


# Compiled for the GPU (not Triton's interpreter, which is chosen before triton is imported, so this is fixed for
# the process), fp32 → e4m3 is one cvt that rounds to nearest even, subnormals included, so the integer rounding
# below (some 15 instructions an element, in kernels bound by instruction issue) is needed only under the
# interpreter; likewise the kernels' fma-based division and PTX roundings.
_COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def _e4m3_grid(x):
    """fp32 x (already within ±448) rounded to the nearest e4m3 value (ties to even), still in fp32."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits; a carry moves into the exponent by itself
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) << 20
    # subnormal e4m3: multiples of 2^-9, rounded by adding and removing 2^23 (fp32 addition rounds to even)
    ax = mag.to(tl.float32, bitcast=True)
    sub = ((ax * 512.0 + 8388608.0) - 8388608.0) * (1.0 / 512.0)
    out = tl.where(mag < 0x3C800000, sub.to(tl.uint32, bitcast=True), normal)
    return (out | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quotient(x, scale):
    """x / scale rounded as IEEE division (torch's). On the GPU from the scale's correctly rounded reciprocal: q =
    x * r is within an ulp of the quotient, the residual x - q * scale is exact in one fma, and q + residual * r
    rounds to the quotient itself (Markstein's theorem) in three instructions, where a division takes some ten
    and a branch to its slow path. Quotients in fp32's subnormal range, where the residual may not be exact, are
    e4m3 zeros either way. The interpreter, whose fma rounds twice, divides."""
    if _COMPILED:
        r = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        q = x * r
        return tl.fma(tl.fma(-q, scale, x), r, q)
    return tl.math.div_rn(x, scale)


@triton.jit
def _fp8_of(x, scale):
    """e4m3(x / scale) for fp32 x, the quotient as IEEE division gives it (torch's)."""
    y = tl.clamp(_quotient(x, scale), -448.0, 448.0)
    if _COMPILED:
        return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return _e4m3_grid(y).to(tl.float8e4nv)


@triton.jit
def _scale_of(amax, amax_ub):
    return tl.maximum(tl.math.div_rn(tl.minimum(amax, amax_ub), 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def _quantize_registers(y, cols, mask, q_row, s_row, static_ptr, amax_ub, N, BLOCK: tl.constexpr,
                        GROUP: tl.constexpr, STATIC: tl.constexpr):
    """Quantise a whole row y [BLOCK] (fp32, columns `cols`, valid where `mask`) held in registers: per token
    (GROUP 0, its amax bounded by `amax_ub`), per GROUP columns, or with the static scale at static_ptr. Stores q
    and the scale(s)."""
    if STATIC:
        scale = tl.load(static_ptr)
        tl.store(q_row + cols, _fp8_of(y, scale), mask=mask)
    elif GROUP == 0:
        scale = _scale_of(tl.max(tl.where(mask, tl.abs(y), 0.0), 0), amax_ub)
        tl.store(q_row + cols, _fp8_of(y, scale), mask=mask)
        tl.store(s_row, scale)
    else:
        groups = tl.reshape(tl.where(mask, tl.abs(y), 0.0), (BLOCK // GROUP, GROUP))
        scale = _scale_of(tl.max(groups, 1), amax_ub)
        per_col = tl.reshape(tl.broadcast_to(scale[:, None], (BLOCK // GROUP, GROUP)), (BLOCK,))
        tl.store(q_row + cols, _fp8_of(y, per_col), mask=mask)
        g = tl.arange(0, BLOCK // GROUP)
        tl.store(s_row + g, scale, mask=g * GROUP < N)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, stride_s, amax_ub, N,
                   CHUNK: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr, WHOLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    s_row = s_ptr + row * stride_s
    offs = tl.arange(0, CHUNK)
    if WHOLE:  # the row fits one chunk: read once, its amax and codes from registers
        mask = offs < N
        y = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        _quantize_registers(y, offs, mask, q_row, s_row, static_ptr, amax_ub, N, CHUNK, GROUP, STATIC)
    elif STATIC or GROUP != 0:  # every chunk is self-contained (CHUNK == GROUP for groups)
        for start in range(0, N, CHUNK):
            cols = start + offs
            mask = cols < N
            y = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            _quantize_registers(y, cols, mask, q_row, s_row + start // CHUNK, static_ptr, amax_ub, N - start,
                                CHUNK, GROUP, STATIC)
    else:
        amax = tl.zeros((CHUNK,), dtype=tl.float32)
        for start in range(0, N, CHUNK):
            cols = start + offs
            y = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _scale_of(tl.max(amax, 0), amax_ub)
        for start in range(0, N, CHUNK):
            cols = start + offs
            mask = cols < N
            y = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_row + cols, _fp8_of(y, scale), mask=mask)
        tl.store(s_row, scale)


WHOLE_ROW_MAX = 16384  # a per-token row up to this many columns is quantised from registers in one pass
STREAM_CHUNK = 1024  # otherwise columns per step of the two passes (amax, then codes)


def whole_row_warps(width: int) -> int:
    """Warps for one program holding a whole row of `width` columns (about 32 fp32 values a thread)."""
    return min(16, max(4, triton.next_power_of_2(width) // 512))


def row_chunk(width: int, group: int | None, chunk: int, whole: bool) -> int:
    """Columns a row-quantising program takes per step: the whole row, one group, or a streaming chunk."""
    if whole:
        return triton.next_power_of_2(width)
    if group is not None:
        return group
    return min(chunk, STREAM_CHUNK, triton.next_power_of_2(width))


def scale_buffer(rows: int, width: int, group: int | None, static_scale: torch.Tensor | None,
                 device: torch.device) -> torch.Tensor:
    """Where a quantising kernel writes its scales: [T, 1] per token, [T, ceil(K / group)] per group, or the static
    scale itself (0-d, read only)."""
    if static_scale is not None:
        return static_scale
    return torch.empty((rows, 1 if group is None else triton.cdiv(width, group)), dtype=torch.float32,
                       device=device)


def check_quant_args(width: int, group: int | None, static_scale: torch.Tensor | None,
                     amax_ub: float | None = None) -> None:
    if amax_ub is not None and (group is not None or static_scale is not None):
        raise ValueError("an amax bound applies to per-token FP8 scales only")
    if amax_ub is not None and not 0 < amax_ub < float("inf"):
        raise ValueError(f"the FP8 amax bound must be a positive finite number, got {amax_ub}")
    if group is not None and (group < 16 or group & (group - 1)):
        raise ValueError(f"FP8 activation groups must be a power of two >= 16, got {group}")
    if group is not None and static_scale is not None:
        raise ValueError("a static FP8 scale is per tensor: no groups")
    if static_scale is not None and (static_scale.numel() != 1 or static_scale.dtype != torch.float32):
        raise ValueError("the static FP8 scale must be one float32 value")


def ub_arg(amax_ub: float | None) -> float:
    """The kernels' amax bound: none is +inf."""
    return float("inf") if amax_ub is None else float(amax_ub)


def quantize_fp8(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                 chunk: int = WHOLE_ROW_MAX, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (contiguous rows) → (q e4m3 [T, K], scales) as the module doc says; a per-token row of at most
    `chunk` columns in one pass from registers, wider ones in two streaming passes."""
    rows, width = x.shape
    check_quant_args(width, group, static_scale, amax_ub)
    q = torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=x.device)
    scales = scale_buffer(rows, width, group, static_scale, x.device)
    if rows == 0:
        return q, scales
    if x.stride(-1) != 1:
        raise ValueError("quantize_fp8 needs rows with a contiguous last axis")
    require_runnable(x.device)
    whole = group is None and static_scale is None and triton.next_power_of_2(width) <= chunk
    _quantize_rows[(rows,)](
        x, q, scales, static_scale if static_scale is not None else scales, x.stride(0), q.stride(0),
        scales.stride(0) if scales.dim() == 2 else 0, ub_arg(amax_ub), width,
        CHUNK=row_chunk(width, group, chunk, whole), GROUP=group or 0, STATIC=static_scale is not None,
        WHOLE=whole, num_warps=whole_row_warps(width) if whole else 4,
    )
    return q, scales


def promote_every(block_k: int) -> int | None:
    """The products a dot over block_k columns adds on the tensor cores before promoting (at most block_k)."""
    return None if PROMOTE_EVERY is None else min(PROMOTE_EVERY, block_k)


@triton.jit(do_not_specialize=["M"])  # one variant for every row count: eager steps of any size compile nothing
def _fp8_matmul(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                stride_am, stride_bn, stride_cm, stride_as, stride_bs,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                K_SCALES: tl.constexpr, A_SCALAR: tl.constexpr, B_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
                PROMOTE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each column tile while it is in L2
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if K_SCALES:
            sa = tl.load(as_ptr + offs_m.to(tl.int64) * stride_as + kb, mask=m_mask, other=0.0)
            sb = tl.load(bs_ptr + offs_n.to(tl.int64) * stride_bs + kb, mask=n_mask, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]  # promoted every K group
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=PROMOTE)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not K_SCALES:
        if A_SCALAR:
            acc = acc * tl.load(as_ptr)
        else:
            acc = acc * tl.load(as_ptr + offs_m.to(tl.int64) * stride_as, mask=m_mask, other=0.0)[:, None]
        if B_SCALAR:
            acc = acc * tl.load(bs_ptr)
        else:
            acc = acc * tl.load(bs_ptr + offs_n.to(tl.int64) * stride_bs, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None, group_k: int | None = None,
               out: torch.Tensor | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] e4m3 @ b[N, K]^T e4m3 → [M, N] out_dtype (see the module doc for the scale shapes); `tiles`
    overrides matmul_tiles (BLOCK_M, BLOCK_N, num_warps, num_stages), for tuning."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_matmul needs e4m3 a [M, K] and b [N, K], got {tuple(a.shape)} {a.dtype} and "
                         f"{tuple(b.shape)} {b.dtype}")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("fp8_matmul needs a and b with contiguous rows")
    if group_k is not None:
        groups = triton.cdiv(k, group_k)
        if group_k < 16 or group_k & (group_k - 1):
            raise ValueError(f"fp8_matmul scale groups must be a power of two >= 16, got {group_k}")
        if tuple(a_scale.shape) != (m, groups) or tuple(b_scale.shape) != (n, groups):
            raise ValueError(f"group scales must be a [{m}, {groups}] and b [{n}, {groups}], got "
                             f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    else:
        if a_scale.numel() not in (1, m) or b_scale.numel() not in (1, n):
            raise ValueError("fp8_matmul scales must be one value or one per row of a / per row of b")
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    require_runnable(a.device)
    block_m, block_n, warps, stages = tiles or matmul_tiles(m, n, sm_count(a.device) if a.is_cuda else None)
    block_k = group_k if group_k is not None else 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    a_scalar = group_k is None and a_scale.numel() == 1
    b_scalar = group_k is None and b_scale.numel() == 1
    _fp8_matmul[grid](
        a, b, out, a_scale, b_scale, bias if bias is not None else out, m, n, k,
        a.stride(0), b.stride(0), out.stride(0),
        0 if a_scalar else a_scale.stride(0), 0 if b_scalar else b_scale.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, K_SCALES=group_k is not None,
        A_SCALAR=a_scalar, B_SCALAR=b_scalar, HAS_BIAS=bias is not None, PROMOTE=promote_every(block_k),
        num_warps=warps, num_stages=stages,
    )
    return out
