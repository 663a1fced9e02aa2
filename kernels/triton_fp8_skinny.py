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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable, sm_count

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
def _fp8_skinny(w_ptr, x_ptr, out_ptr, ws_ptr, xs_ptr, bias_ptr, M, N, K, stride_wn, stride_xm, stride_om,
                BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                W_SCALAR: tl.constexpr, X_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - kb * BLOCK_K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(w, x, acc, out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if W_SCALAR:
        acc = acc * tl.load(ws_ptr)
    else:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if X_SCALAR:
        acc = acc * tl.load(xs_ptr)
    else:
        acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


def fp8_skinny_matmul(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [M, K] e4m3 (M <= MAX_ROWS) @ w [N, K]^T e4m3 → [M, N] in out_dtype; x_scale 0-d or per row ([M] or
    [M, 1]), w_scale 0-d or per output row ([N]); tiles: choose_tiles' unless given."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_skinny_matmul needs e4m3 x [M, K] and w [N, K], got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(w.shape)} {w.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"fp8_skinny_matmul takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("fp8_skinny_matmul needs x and w with contiguous rows")
    if x_scale.numel() not in (1, m) or w_scale.numel() not in (1, n):
        raise ValueError("fp8_skinny_matmul scales must be one value or one per row of x / per row of w")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    require_runnable(x.device)
    if tiles is None:
        tiles = choose_tiles(n, m, sm_count(x.device)) if x.device.type == "cuda" else DEFAULT_TILES
    x_scalar, w_scalar = x_scale.numel() == 1, w_scale.numel() == 1  # one value: the same for every row
    _fp8_skinny[(triton.cdiv(n, tiles.block_n),)](
        w, x, out, w_scale, x_scale, bias if bias is not None else out, m, n, k, w.stride(0), x.stride(0),
        out.stride(0), BLOCK_N=tiles.block_n, BLOCK_M=row_tile(m), BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0, W_SCALAR=w_scalar, X_SCALAR=x_scalar, HAS_BIAS=bias is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
