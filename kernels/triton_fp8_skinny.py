"""The FP8 GEMM for decode-sized batches: few activation rows against a large FP8 weight.

At a handful of rows the GEMM is a stream over the weight: what matters is that every SM keeps enough weight bytes
in flight, not the tensor cores. cuBLASLt's FP8 kernels tile the rows (M) by 64 or more and the columns coarsely,
so at M <= 64 they leave the HBM underused (on the H200 no FP8 path of `torch._scaled_mm` halved bf16's time at
decode sizes, though it reads half the bytes: docs/perf/fp8-h200.md). This kernel swaps the operands, as
CUTLASS's small-M FP8 configurations do: out^T [N, M] = W [N, K] @ x^T [K, M], so the weight's rows fill the
dot's long side (BLOCK_N), the few activation rows its short side (BLOCK_M, padded to 16), and narrow column tiles
give many programs, each streaming its weight rows with a deep software pipeline.

Scales multiply once after the K loop: the weight's per output row (0-d or [N]) and the activation's per token
(0-d or [M]); the FP8 products are exact in the fp32 accumulator, so the result is the emulated FP8 math
(quant/fp8_linear.emulated_linear) up to summation order. M is a run-time argument: a new batch size within one
row tile never compiles a new variant.

A gated MLP at decode batches can skip its SiLU·mul launch (at batch 1 on the H200 one program of 14,336 columns,
7.2 us a layer: docs/perf/fp8-h200.md): `fp8_skinny_gated` streams the gate and up rows of each output column in
one program and writes silu(gate) * up in the model dtype, with each row's largest magnitude over its columns;
`fp8_skinny_deferred` (the down projection) takes those partial maxima, forms the per-token scales quantize_fp8
would, and quantises its activation tiles in registers as it streams. Every value is rounded where the separate
kernels round it, so the codes and scales are theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable, sm_count
from .triton_fp8 import _fp8_of, _scale_of, ub_arg
from .triton_fused import _rounded, _silu_mul

MAX_ROWS = 64  # beyond this the activation tile stops being "skinny": the general FP8 GEMMs take over


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int  # weight rows (output features) per program
    block_k: int  # weight columns per pipeline stage
    num_warps: int
    num_stages: int


# From an H200 sweep of 32 tile shapes per Llama-3-8B linear shape at 1, 16 and 64 rows (hack/fp8_gemm_bench.py
# --skinny-sweep, docs/perf/fp8-h200.md). A narrow weight (o_proj, qkv_proj, down_proj: 64-96 programs of 64 rows,
# under one wave on 132 SMs) streams best with 64 rows x 256 columns = 16 KB of FP8 a stage and 6 stages in flight
# per program. A wide one (gate_up_proj: 448 programs, several waves) likes 3 stages, which leave shared memory for
# more programs at once: 128 rows a program at up to 16 activation rows, 64 rows beyond (32.0 and 36.1 us a call
# against 35.1 and 41.1 on the narrow tiles).
DEFAULT_TILES = SkinnyTiles(block_n=64, block_k=256, num_warps=4, num_stages=6)
WIDE_TILES_FEW_ROWS = SkinnyTiles(block_n=128, block_k=256, num_warps=4, num_stages=3)
WIDE_TILES = SkinnyTiles(block_n=64, block_k=256, num_warps=4, num_stages=3)
WIDE_WAVES = 2  # programs of DEFAULT_TILES per SM from which a weight counts as wide
PARTIALS_CHUNK = 64  # partial amaxes a deferred program reduces per step
SHARED_BUDGET = 200 * 1024  # bytes of pipeline stages a program may keep (Hopper: 227 KB a block)


def choose_tiles(n: int, m: int, sm_count: int) -> SkinnyTiles:
    """The tiles for an [m, K] x [n, K]^T product on a GPU of `sm_count` SMs (fixed per weight shape and row
    class: a handful of compiled variants, all met in warm-up)."""
    if -(-n // DEFAULT_TILES.block_n) < WIDE_WAVES * sm_count:
        return DEFAULT_TILES
    return WIDE_TILES_FEW_ROWS if m <= 16 else WIDE_TILES


def row_tile(m: int) -> int:
    """The activation rows one program holds (the dot's short side): 16, 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


@triton.jit
def _scaled_rows(acc, ws_ptr, xs, rows, n_mask, bias_ptr, W_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] of weight rows `rows` times their scales, then the activation rows' (xs), plus the
    bias, in this order: what a fused epilogue rounds is what the plain kernel stores."""
    if W_SCALAR:
        acc = acc * tl.load(ws_ptr)
    else:
        acc = acc * tl.load(ws_ptr + rows, mask=n_mask, other=0.0)[:, None]
    acc = acc * xs
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _fp8_skinny(w_ptr, x_ptr, out_ptr, ws_ptr, xs_ptr, bias_ptr, amax_ptr, amax_ub, M, N, K, P, up_rows,
                stride_wn, stride_xm, stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, W_SCALAR: tl.constexpr, X_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
                GATED: tl.constexpr, X_DEFERRED: tl.constexpr, P_CHUNK: tl.constexpr, ROUND: tl.constexpr,
                BF16: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if X_DEFERRED:  # x's per-token scales from the P partial amaxes its producer left: max is exact in any order
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        offs_p = tl.arange(0, P_CHUNK)
        for start in range(0, P, P_CHUNK):
            parts = tl.load(amax_ptr + offs_m[:, None] * P + start + offs_p[None, :],
                            mask=m_mask[:, None] & (start + offs_p < P)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(parts, 1))
        x_scale = _scale_of(amax, amax_ub)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[None, :]
        else:
            k_mask = offs_k < K - kb * BLOCK_K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[None, :] & k_mask[:, None]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if X_DEFERRED:
            x = _fp8_of(x.to(tl.float32), x_scale[None, :])
        acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), x, acc, out_dtype=tl.float32)
        if GATED:
            acc_up = tl.dot(tl.load(w_ptrs + up_rows, mask=w_mask, other=0.0), x, acc_up, out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if X_DEFERRED:
        xs = x_scale[None, :]
    elif X_SCALAR:
        xs = tl.load(xs_ptr)
    else:
        xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    acc = _scaled_rows(acc, ws_ptr, xs, offs_n, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
    out_mask = m_mask[None, :] & n_mask[:, None]
    if GATED:  # silu(gate) * up as silu_mul_fp8 computes it from the stored gate_up, and each row's partial amax
        up = _scaled_rows(acc_up, ws_ptr, xs, offs_n + N, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
        if ROUND:
            acc, up = _rounded(acc, BF16), _rounded(up, BF16)
        acc = _silu_mul(acc, up, ROUND, BF16)
        tl.store(amax_ptr + offs_m * P + pid, tl.max(tl.where(out_mask, tl.abs(acc), 0.0), 0), mask=m_mask)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check_operands(x: torch.Tensor, w: torch.Tensor, w_rows: int, x_dtypes: tuple[torch.dtype, ...], what: str
                    ) -> None:
    m, k = x.shape
    if w.shape != (w_rows, k) or x.dtype not in x_dtypes or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{what} needs x [M, K] in {' or '.join(map(str, x_dtypes))} and an e4m3 w [{w_rows}, K], "
                         f"got {tuple(x.shape)} {x.dtype} and {tuple(w.shape)} {w.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"{what} takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"{what} needs x and w with contiguous rows")
    require_runnable(x.device)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, w_scale: torch.Tensor, n: int, *,
            x_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, amax: torch.Tensor | None = None,
            amax_ub: float | None = None, gated: bool = False, tiles: SkinnyTiles) -> None:
    m, k = x.shape
    if w_scale.numel() not in (1, w.shape[0]) or x_scale is not None and x_scale.numel() not in (1, m):
        raise ValueError("fp8_skinny scales must be one value or one per row of x / per row of w")
    deferred = x_scale is None
    dtype = out.dtype
    _fp8_skinny[(triton.cdiv(n, tiles.block_n),)](
        w, x, out, w_scale, x_scale if x_scale is not None else w_scale, bias if bias is not None else w_scale,
        amax if amax is not None else w_scale, ub_arg(amax_ub), m, n, k, amax.shape[1] if amax is not None else 0,
        n * w.stride(0), w.stride(0), x.stride(0), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_M=row_tile(m), BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
        W_SCALAR=w_scale.numel() == 1, X_SCALAR=not deferred and x_scale.numel() == 1, HAS_BIAS=bias is not None,
        GATED=gated, X_DEFERRED=deferred, P_CHUNK=PARTIALS_CHUNK, ROUND=dtype in (torch.bfloat16, torch.float16),
        BF16=dtype == torch.bfloat16, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _tiles(x: torch.Tensor, n: int, tiles: SkinnyTiles | None) -> SkinnyTiles:
    if tiles is not None:
        return tiles
    return choose_tiles(n, x.shape[0], sm_count(x.device)) if x.device.type == "cuda" else DEFAULT_TILES


def fp8_skinny_matmul(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [M, K] e4m3 (M <= MAX_ROWS) @ w [N, K]^T e4m3 → [M, N] in out_dtype; x_scale 0-d or per row ([M] or
    [M, 1]), w_scale 0-d or per output row ([N]); tiles: choose_tiles' unless given."""
    _check_operands(x, w, w.shape[0], (torch.float8_e4m3fn,), "fp8_skinny_matmul")
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    if x.shape[0]:
        _launch(x, w, out, w_scale, w.shape[0], x_scale=x_scale, bias=bias, tiles=_tiles(x, w.shape[0], tiles))
    return out


def fp8_skinny_gated(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None, tiles: SkinnyTiles | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's first half in one launch: x [M, K] e4m3 @ w [2I, K]^T (gate rows, then up rows) with silu(gate)
    * up as the epilogue, each rounded as silu_mul_fp8 rounds them from the stored product. Returns (h [M, I] in
    out_dtype, amax [M, P]): each row's largest |h| per program, for fp8_skinny_deferred to take h's per-token
    scales from. tiles: the plain product's (choose_tiles for 2I rows), of which each half takes block_n / 2."""
    m, _ = x.shape
    inter = w.shape[0] // 2
    _check_operands(x, w, 2 * inter, (torch.float8_e4m3fn,), "fp8_skinny_gated")
    plain = _tiles(x, 2 * inter, tiles)
    half = SkinnyTiles(max(16, plain.block_n // 2), plain.block_k, plain.num_warps, plain.num_stages)
    h = torch.empty((m, inter), dtype=out_dtype, device=x.device)
    amax = torch.empty((m, triton.cdiv(inter, half.block_n)), dtype=torch.float32, device=x.device)
    if m:
        _launch(x, w, h, w_scale, inter, x_scale=x_scale, bias=bias, amax=amax, gated=True, tiles=half)
    return h, amax


def fp8_skinny_deferred(h: torch.Tensor, amax: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, amax_ub: float | None = None,
                        tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """h [M, K] in the model dtype @ w [N, K]^T e4m3 → [M, N] in h's dtype, h quantised per token inside the K loop
    with the scale its partial amaxes give ([M, P] from fp8_skinny_gated; bounded by amax_ub): the codes and scales
    quantize_fp8 would produce, without its launch or a store of them."""
    m, _ = h.shape
    _check_operands(h, w, w.shape[0], (torch.bfloat16, torch.float16, torch.float32), "fp8_skinny_deferred")
    if amax.shape[0] != m or amax.dtype != torch.float32 or amax.stride(-1) != 1:
        raise ValueError(f"fp8_skinny_deferred needs float32 partial amaxes [{m}, P], got {tuple(amax.shape)} "
                         f"{amax.dtype}")
    out = torch.empty((m, w.shape[0]), dtype=h.dtype, device=h.device)
    if m:
        plain = _tiles(h, w.shape[0], tiles)
        # the activation tile is h.element_size() times an FP8 one: fewer stages where they would outgrow the
        # shared memory a block may hold (a stage per 64 rows of bf16 is 48 KB at these tiles)
        stage = plain.block_k * (plain.block_n + row_tile(m) * h.element_size())
        fitted = SkinnyTiles(plain.block_n, plain.block_k, plain.num_warps,
                             max(1, min(plain.num_stages, SHARED_BUDGET // stage)))
        _launch(h, w, out, w_scale, w.shape[0], bias=bias, amax=amax.contiguous(), amax_ub=amax_ub, tiles=fitted)
    return out
