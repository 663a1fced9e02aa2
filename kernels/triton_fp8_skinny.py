"""The FP8 GEMM for decode-sized batches: few activation rows against a large FP8 weight.

At a handful of rows the GEMM is a stream over the weight: what matters is that every SM keeps enough weight bytes
in flight, not the tensor cores. cuBLASLt's FP8 kernels tile the rows (M) by 64 or more and the columns coarsely,
so at M <= 64 they leave the HBM underused (on the H200 no FP8 path of `torch._scaled_mm` halved bf16's time at
decode sizes, though it reads half the bytes: docs/perf/fp8-h200.md). This kernel swaps the operands, as
CUTLASS's small-M FP8 configurations do: out^T [N, M] = W [N, K] @ x^T [K, M], so the weight's rows fill the
dot's long side (BLOCK_N), the few activation rows its short side (BLOCK_M, padded to 16), and narrow column tiles
give many programs, each streaming its weight rows with a deep software pipeline.

Scales multiply once after the K loop: the weight's per output row (0-d or [N]) and the activation's per token
(0-d or [M]); the FP8 products are exact and summed by the tensor cores (in fewer bits than fp32 unless
triton_fp8.PROMOTE_EVERY is set), so the result is the emulated FP8 math (quant/fp8_linear.emulated_linear) up to
summation order. M is a run-time argument: a new batch size within one row tile never compiles a new variant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_fp8
from .triton_attention import require_runnable, sm_count

MAX_ROWS = 64  # beyond this the activation tile stops being "skinny": the general FP8 GEMMs take over


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int  # weight rows (output features) per program
    block_k: int  # weight columns per pipeline stage
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs a column tile's K range is split over


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
# A narrow weight with a long K (down_proj: K = 3.5 N) at more than 32 activation rows streams faster with its K
# range over two programs: each program's dots are four times those at 16 rows, one program an SM no longer keeps
# its share of the weight in flight, and a second wave of programs fills the SMs the first leaves idle (20.6 against
# 22.8 us at 64 rows on the H200; at 1 and 16 rows and for o_proj and qkv_proj, K <= N, one program a tile is as
# fast or faster).
SPLIT_TILES = SkinnyTiles(block_n=64, block_k=256, num_warps=4, num_stages=6, split_k=2)
SPLIT_ROWS = 32  # split K above this many activation rows
LONG_K = 2  # ... for weights with K at least this many times N


def choose_tiles(n: int, k: int, m: int, sm_count: int) -> SkinnyTiles:
    """The tiles for an [m, k] x [n, k]^T product on a GPU of `sm_count` SMs (fixed per weight shape and row
    class: a handful of compiled variants, all met in warm-up)."""
    column_tiles = -(-n // DEFAULT_TILES.block_n)
    if column_tiles >= WIDE_WAVES * sm_count:
        return WIDE_TILES_FEW_ROWS if m <= 16 else WIDE_TILES
    if m > SPLIT_ROWS and k >= LONG_K * n and SPLIT_TILES.split_k * column_tiles <= sm_count:
        return SPLIT_TILES
    return DEFAULT_TILES


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
def _stream(w_ptr, x_ptr, offs_n, n_mask, offs_m, m_mask, K, k_first, k_last, stride_wn, stride_xm,
            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            PROMOTE: tl.constexpr):
    """The K loop over K tiles [k_first, k_last): weight rows offs_n against the activation rows offs_m. Returns
    the fp32 accumulator [BLOCK_N, BLOCK_M] (the tensor cores' partial sums added into it every PROMOTE products
    when set: triton_fp8.PROMOTE_EVERY)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_first * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_first * BLOCK_K + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(k_first, k_last):
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[None, :]
        else:
            k_mask = offs_k < K - kb * BLOCK_K
            w_mask = n_mask[:, None] & k_mask[None, :]
            x_mask = m_mask[None, :] & k_mask[:, None]
        acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), tl.load(x_ptrs, mask=x_mask, other=0.0), acc,
                     out_dtype=tl.float32, max_num_imprecise_acc=PROMOTE)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _activation_scales(xs_ptr, offs_m, m_mask, X_SCALAR: tl.constexpr):
    """The activation's scale per column of an accumulator: [1, BLOCK_M], or one value."""
    if X_SCALAR:
        return tl.load(xs_ptr)
    else:
        return tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]


@triton.jit
def _split_k_sum(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """Split-K's fix-up: each of a column tile's SPLIT_K programs leaves its partial sum; the last to arrive adds
    them in split order (the same sum whichever arrives last) and resets the tile's arrival count for the next
    launch or graph replay. Returns (the sum, whether this program is the last)."""
    offs = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_N * BLOCK_M)
    tl.store(tile_partials + split * (BLOCK_N * BLOCK_M) + offs, acc)
    tl.debug_barrier()  # every thread's partial written before the arrival releases them
    last = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = tl.load(tile_partials + offs, cache_modifier=".cg")  # past L1, which other SMs' writes bypass
        for other in tl.static_range(1, SPLIT_K):
            acc += tl.load(tile_partials + other * (BLOCK_N * BLOCK_M) + offs, cache_modifier=".cg")
        tl.atomic_xchg(arrivals_ptr + tile, 0)
    return acc, last


@triton.jit
def _fp8_skinny(w_ptr, x_ptr, out_ptr, ws_ptr, xs_ptr, bias_ptr, M, N, K, partials_ptr, arrivals_ptr, stride_wn,
                stride_xm, stride_om, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, W_SCALAR: tl.constexpr, X_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr,
                SPLIT_K: tl.constexpr, PROMOTE: tl.constexpr):
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = split * tl.cdiv(k_tiles, SPLIT_K)
    k_last = tl.minimum(k_first + tl.cdiv(k_tiles, SPLIT_K), k_tiles)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = _stream(w_ptr, x_ptr, offs_n, n_mask, offs_m, m_mask, K, k_first, k_last, stride_wn, stride_xm, BLOCK_N,
                  BLOCK_M, BLOCK_K, EVEN_K, PROMOTE)
    if SPLIT_K > 1:
        acc, finish = _split_k_sum(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K, BLOCK_N, BLOCK_M)
    else:
        finish = True
    if finish:
        xs = _activation_scales(xs_ptr, offs_m, m_mask, X_SCALAR)
        acc = _scaled_rows(acc, ws_ptr, xs, offs_n, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


def _check_operands(x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    if w.shape[1] != k or x.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_skinny_matmul needs e4m3 x [M, K] and w [N, K], got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(w.shape)} {w.dtype}")
    if m > MAX_ROWS:
        raise ValueError(f"fp8_skinny_matmul takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("fp8_skinny_matmul needs x and w with contiguous rows")
    require_runnable(x.device)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor,
            bias: torch.Tensor | None, tiles: SkinnyTiles) -> None:
    m, k = x.shape
    n = w.shape[0]
    if w_scale.numel() not in (1, n) or x_scale.numel() not in (1, m):
        raise ValueError("fp8_skinny scales must be one value or one per row of x / per row of w")
    column_tiles = triton.cdiv(n, tiles.block_n)
    partials = arrivals = w_scale  # not read without a split
    if tiles.split_k > 1:
        partials = torch.empty(column_tiles * tiles.split_k * tiles.block_n * row_tile(m), dtype=torch.float32,
                               device=x.device)
        arrivals = arrival_counts(x.device, column_tiles)
    _fp8_skinny[(column_tiles * tiles.split_k,)](
        w, x, out, w_scale, x_scale, bias if bias is not None else w_scale, m, n, k, partials, arrivals,
        w.stride(0), x.stride(0), out.stride(0), BLOCK_N=tiles.block_n, BLOCK_M=row_tile(m), BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0, W_SCALAR=w_scale.numel() == 1, X_SCALAR=x_scale.numel() == 1,
        HAS_BIAS=bias is not None, SPLIT_K=tiles.split_k, PROMOTE=triton_fp8.promote_every(tiles.block_k),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


_ARRIVALS: dict[tuple[str, int], torch.Tensor] = {}


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counts for split-K's fix-up, at least `tiles` of them, one buffer per device and
    stream: the fix-up leaves them zero again, so they are zeroed once, and products on two streams at once (the
    mixed step's overlap) never share one. Graphs capture on one stream, so their launches share that stream's
    buffer (made during the first capture, kept alive here; that graph also zeroes it again when it replays)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counts = _ARRIVALS.get(key)
    if counts is None or counts.numel() < tiles:
        counts = _ARRIVALS[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counts


def _tiles(x: torch.Tensor, n: int, tiles: SkinnyTiles | None) -> SkinnyTiles:
    if tiles is not None:
        return tiles
    return choose_tiles(n, x.shape[1], x.shape[0], sm_count(x.device)) if x.device.type == "cuda" else DEFAULT_TILES


def fp8_skinny_matmul(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """x [M, K] e4m3 (M <= MAX_ROWS) @ w [N, K]^T e4m3 → [M, N] in out_dtype; x_scale 0-d or per row ([M] or
    [M, 1]), w_scale 0-d or per output row ([N]); tiles: choose_tiles' unless given."""
    _check_operands(x, w)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    if x.shape[0]:
        _launch(x, w, out, w_scale, x_scale, bias, _tiles(x, w.shape[0], tiles))
    return out
