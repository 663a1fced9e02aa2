"""The FP8-weight GEMM for the smallest decode batches: the input stays in the model dtype (W8A16), and the kernel
that would have made it runs inside the GEMM's K loop.

At a few rows a decode step's linear layers stream their e4m3 weights, while the kernels that make their inputs —
the residual add with RMSNorm, SiLU·mul, and for FP8 activations a quantiser after each — read and write almost
nothing: each costs the latency of a launch (1.8-3.9 us at one row on an H100, docs/perf/fp8-h200.md), four a
Llama layer beside its four GEMMs. Here the GEMM reads its input as the producer's inputs and makes it per K tile:

- PLAIN: x as given (o_proj reading the attention output: no quantiser);
- ADD_NORM: s = residual + delta, rounded to the model dtype as the add stores it (the first column tile writes s
  to `new_residual`); the dot takes s times the norm weight, and 1/rms(s), one factor per row, multiplies the
  accumulator after the loop from the sum of squares the loop gathers, so no pass over the row comes first;
- SILU_MUL: silu(gate) * up of a gate_up row, rounded as the SiLU·mul kernel stores it.

The weight tile widens to the model dtype in registers (exact: every e4m3 value is a bf16 or fp16 value), the dot
sums in float32, and the weight's scales (0-d or per output row) and the bias apply after the loop. Nothing is
quantised on the activation side, so the result is the dequantised weight times the unquantised input, up to
summation order and one rounding of the normed input (weight * s rounded once, where the norm kernel rounds
s / rms and then its product with the weight): nearer the model-dtype layer than the W8A8 path.

Operands are swapped as in triton_fp8_skinny.py: out^T [N, M] = W [N, K] @ x^T [K, M], the weight rows on the
dot's long side, the few input rows (padded to 16) on its short side, many narrow column tiles streaming the
weight. Every program reads the whole input, from L2: a few KB at one row, which is why this kernel is for the
smallest batches only (quant/cuda_gemm.py chooses).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable, sm_count
from .triton_fp8_skinny import SkinnyTiles
from .triton_fused import _rounded, _silu_mul_value

MAX_ROWS = 16  # one 16-row tile of the dot's short side
# Half the FP8 kernel's K step (triton_fp8_skinny.DEFAULT_TILES): a 64 x 256 weight tile widened to bf16 takes 64
# registers a thread more than the e4m3 one, and the normed input's tile spilled at 255 registers; 64 x 128 compiles
# to 93-140 registers without spills for sm_90. A weight of several waves of such tiles (gate_up_proj) takes 128
# rows a program on 8 warps, fewer programs each keeping more bytes in flight, as the FP8 kernel's wide tiles do.
DEFAULT_TILES = SkinnyTiles(block_n=64, block_k=128, num_warps=4, num_stages=6)
WIDE_TILES = SkinnyTiles(block_n=128, block_k=128, num_warps=8, num_stages=4)
WIDE_WAVES = 2  # programs of DEFAULT_TILES per SM from which a weight counts as wide
PLAIN, ADD_NORM, SILU_MUL = 0, 1, 2
_ADD_NORM = tl.constexpr(ADD_NORM)
_SILU_MUL = tl.constexpr(SILU_MUL)


def choose_tiles(n: int, sm_count: int) -> SkinnyTiles:
    """The tiles for a weight of n rows on a GPU of sm_count SMs (one variant per weight shape)."""
    return WIDE_TILES if triton.cdiv(n, DEFAULT_TILES.block_n) >= WIDE_WAVES * sm_count else DEFAULT_TILES


@triton.jit
def _input_tile(x_ptr, delta_ptr, norm_w_ptr, new_res_ptr, offs_m, ks, x_mask, k_mask, K, stride_xm, stride_dm,
                stride_rm, write_residual, BLOCK_M: tl.constexpr, INPUT: tl.constexpr, HAS_DELTA: tl.constexpr,
                ROUND: tl.constexpr, BF16: tl.constexpr):
    """The input tile x^T [BLOCK_K, BLOCK_M] in float32, and the sum of s^2 per row for ADD_NORM (else zeros)."""
    rows = offs_m[None, :].to(tl.int64)
    if INPUT == _SILU_MUL:  # x_ptr: gate_up [M, 2K], gate columns first
        x = _silu_mul_value(x_ptr + rows * stride_xm, ks[:, None], x_mask, K, ROUND, BF16)
        squares = tl.zeros([BLOCK_M], tl.float32)
    elif INPUT == _ADD_NORM:  # x_ptr: the residual stream
        s = tl.load(x_ptr + rows * stride_xm + ks[:, None], mask=x_mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            s = s + tl.load(delta_ptr + rows * stride_dm + ks[:, None], mask=x_mask, other=0.0).to(tl.float32)
            if ROUND:
                s = _rounded(s, BF16)
            if write_residual:
                tl.store(new_res_ptr + rows * stride_rm + ks[:, None], s.to(new_res_ptr.dtype.element_ty),
                         mask=x_mask)
        squares = tl.sum(s * s, 0)
        x = s * tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)[:, None]
    else:
        x = tl.load(x_ptr + rows * stride_xm + ks[:, None], mask=x_mask, other=0.0).to(tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
    return x, squares


@triton.jit(do_not_specialize=["M"])
def _w8a16(w_ptr, x_ptr, delta_ptr, norm_w_ptr, new_res_ptr, out_ptr, ws_ptr, bias_ptr, M, N, K, eps, stride_wn,
           stride_xm, stride_dm, stride_rm, stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, W_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
           INPUT: tl.constexpr, HAS_DELTA: tl.constexpr, ROUND: tl.constexpr, BF16: tl.constexpr):
    tile = tl.program_id(0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dot_dtype = out_ptr.dtype.element_ty
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x, tile_squares = _input_tile(x_ptr, delta_ptr, norm_w_ptr, new_res_ptr, offs_m, ks,
                                      k_mask[:, None] & m_mask[None, :], k_mask, K, stride_xm, stride_dm, stride_rm,
                                      tile == 0, BLOCK_M, INPUT, HAS_DELTA, ROUND, BF16)
        squares += tile_squares
        acc = tl.dot(w.to(dot_dtype), x.to(dot_dtype), acc, out_dtype=tl.float32)
        w_ptrs += BLOCK_K
    if INPUT == _ADD_NORM:
        acc = acc * tl.rsqrt(squares / K + eps)[None, :]
    if W_SCALAR:
        acc = acc * tl.load(ws_ptr)
    else:
        acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


def _check(x: torch.Tensor, k: int, w: torch.Tensor, w_scale: torch.Tensor, what: str) -> None:
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != k or w.stride(-1) != 1:
        raise ValueError(f"w8a16_matmul needs an e4m3 weight [N, {k}] with contiguous rows, got {tuple(w.shape)} "
                         f"{w.dtype}")
    if x.dim() != 2 or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w8a16_matmul needs {what} as float rows [M, ...] with a contiguous last axis, got "
                         f"{tuple(x.shape)} {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"w8a16_matmul takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if w_scale.numel() not in (1, w.shape[0]):
        raise ValueError("w8a16_matmul's weight scale must be one value or one per weight row")


def _run(x: torch.Tensor, k: int, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, *, kind: int,
         delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
         new_residual: torch.Tensor | None = None, eps: float = 0.0, tiles: SkinnyTiles | None = None
         ) -> torch.Tensor:
    m, n = x.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    require_runnable(x.device)
    if tiles is None:
        tiles = choose_tiles(n, sm_count(x.device)) if x.device.type == "cuda" else SkinnyTiles(32, 64, 4, 1)
    unused = w_scale  # a pointer the kernel never reads for this variant
    delta = delta if delta is not None else unused
    _w8a16[(triton.cdiv(n, tiles.block_n),)](
        w, x, delta, norm_weight if norm_weight is not None else unused,
        new_residual if new_residual is not None else unused, out, w_scale, bias if bias is not None else unused,
        m, n, k, eps, w.stride(0), x.stride(0), delta.stride(0) if delta is not unused else 0,
        new_residual.stride(0) if new_residual is not None else 0, out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_M=16, BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
        W_SCALAR=w_scale.numel() == 1, HAS_BIAS=bias is not None, INPUT=kind, HAS_DELTA=delta is not unused,
        ROUND=x.dtype in (torch.bfloat16, torch.float16), BF16=x.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def w8a16_matmul(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ (w [N, K] e4m3 times w_scale, 0-d or [N])^T (+ bias) → [M, N] in x's dtype."""
    _check(x, x.shape[1], w, w_scale, "x")
    return _run(x, x.shape[1], w, w_scale, bias, kind=PLAIN, tiles=tiles)


def add_rms_norm_w8a16(delta: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                       new_residual: torch.Tensor | None = None, tiles: SkinnyTiles | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * norm_weight @ w^T, s) for s = residual + delta (residual alone when delta is None), the
    Llama RMSNorm (weight times the normed row). s goes to `new_residual` (a new tensor if not given), never to
    the residual itself: every program reads that while the first writes s."""
    _check(residual, residual.shape[1], w, w_scale, "residual")
    if delta is not None and (delta.shape != residual.shape or delta.dtype != residual.dtype
                              or delta.stride(-1) != 1):
        raise ValueError(f"add_rms_norm_w8a16: delta {tuple(delta.shape)} {delta.dtype} does not match the residual "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if delta is None:
        new_residual = residual
    elif new_residual is None:
        new_residual = torch.empty_like(residual)
    elif new_residual.shape != residual.shape or new_residual.stride(-1) != 1 or new_residual is residual:
        raise ValueError("add_rms_norm_w8a16: new_residual must be another tensor of the residual's shape")
    out = _run(residual, residual.shape[1], w, w_scale, bias, kind=ADD_NORM, delta=delta, norm_weight=norm_weight,
               new_residual=new_residual if delta is not None else None, eps=eps, tiles=tiles)
    return out, new_residual


def silu_mul_w8a16(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                   tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ w^T for gate_up [M, 2K], gate columns first, each product rounded as silu_mul rounds."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul_w8a16 needs gate_up [M, 2K], got {tuple(gate_up.shape)}")
    k = gate_up.shape[1] // 2
    _check(gate_up, k, w, w_scale, "gate_up")
    return _run(gate_up, k, w, w_scale, bias, kind=SILU_MUL, tiles=tiles)
