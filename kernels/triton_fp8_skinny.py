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
from .triton_fused import _rotated, _rounded, _silu_mul

MAX_ROWS = 64  # beyond this the activation tile stops being "skinny": the general FP8 GEMMs take over


@dataclass(frozen=True)
class SkinnyTiles:
    block_n: int  # weight rows (output features) per program
    block_k: int  # weight columns per pipeline stage
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs a column tile's K range is split over (plain products only)


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
PARTIALS_CHUNK = 64  # partial amaxes a deferred program reduces per step
SHARED_BUDGET = 200 * 1024  # bytes of pipeline stages a program may keep (Hopper: 227 KB a block)


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
def _stream(w_ptr, x_ptr, pair_rows, offs_n, n_mask, offs_m, m_mask, x_scale, K, k_first, k_last, stride_wn,
            stride_xm, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            PAIRED: tl.constexpr, X_DEFERRED: tl.constexpr):
    """The K loop over K tiles [k_first, k_last): weight rows offs_n (and, PAIRED, the rows pair_rows further on)
    against the activation rows offs_m; an activation in the model dtype (X_DEFERRED) is quantised with x_scale
    [BLOCK_M] tile by tile. Returns the fp32 accumulators [BLOCK_N, BLOCK_M] of both row sets (the second zero
    unless PAIRED)."""
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_first * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + (k_first * BLOCK_K + offs_k)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_pair = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(k_first, k_last):
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
        if PAIRED:
            acc_pair = tl.dot(tl.load(w_ptrs + pair_rows, mask=w_mask, other=0.0), x, acc_pair,
                              out_dtype=tl.float32)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc, acc_pair


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
def _fp8_skinny(w_ptr, x_ptr, out_ptr, ws_ptr, xs_ptr, bias_ptr, amax_ptr, amax_ub, M, N, K, P, up_rows,
                partials_ptr, arrivals_ptr, stride_wn, stride_xm, stride_om, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, W_SCALAR: tl.constexpr,
                X_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, X_DEFERRED: tl.constexpr,
                P_CHUNK: tl.constexpr, ROUND: tl.constexpr, BF16: tl.constexpr, SPLIT_K: tl.constexpr):
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = split * tl.cdiv(k_tiles, SPLIT_K)
    k_last = tl.minimum(k_first + tl.cdiv(k_tiles, SPLIT_K), k_tiles)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if X_DEFERRED:  # x's per-token scales from the P partial amaxes its producer left: max is exact in any order
        offs_p = tl.arange(0, P_CHUNK)
        for start in range(0, P, P_CHUNK):
            parts = tl.load(amax_ptr + offs_m[:, None] * P + start + offs_p[None, :],
                            mask=m_mask[:, None] & (start + offs_p < P)[None, :], other=0.0)
            x_scale = tl.maximum(x_scale, tl.max(parts, 1))
        x_scale = _scale_of(x_scale, amax_ub)
    acc, acc_up = _stream(w_ptr, x_ptr, up_rows, offs_n, n_mask, offs_m, m_mask, x_scale, K, k_first, k_last,
                          stride_wn, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, GATED, X_DEFERRED)
    if SPLIT_K > 1:
        acc, finish = _split_k_sum(acc, partials_ptr, arrivals_ptr, tile, split, SPLIT_K, BLOCK_N, BLOCK_M)
    else:
        finish = True
    if finish:
        if X_DEFERRED:
            xs = x_scale[None, :]
        else:
            xs = _activation_scales(xs_ptr, offs_m, m_mask, X_SCALAR)
        acc = _scaled_rows(acc, ws_ptr, xs, offs_n, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
        out_mask = m_mask[None, :] & n_mask[:, None]
        if GATED:  # silu(gate) * up as silu_mul_fp8 computes it from the stored gate_up, and each row's partial amax
            up = _scaled_rows(acc_up, ws_ptr, xs, offs_n + N, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
            if ROUND:
                acc, up = _rounded(acc, BF16), _rounded(up, BF16)
            acc = _silu_mul(acc, up, ROUND, BF16)
            tl.store(amax_ptr + offs_m * P + tile, tl.max(tl.where(out_mask, tl.abs(acc), 0.0), 0), mask=m_mask)
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _to_cache(x, cache_ptr, scale_ptr, kv_head, slot, offs_d, m_mask, stride_cb, stride_ct, stride_ch,
              PAGE: tl.constexpr, KV_FP8: tl.constexpr):
    """x [BLOCK_N dims, BLOCK_M tokens] of one kv head into the paged cache at each token's slot (none below 0)."""
    block = (slot // PAGE).to(tl.int64)
    dst = cache_ptr + block[None, :] * stride_cb + (slot % PAGE)[None, :] * stride_ct + kv_head * stride_ch
    mask = (m_mask & (slot >= 0))[None, :]
    if KV_FP8:
        tl.store(dst + offs_d[:, None], _fp8_of(x, tl.load(scale_ptr + kv_head)), mask=mask)
    else:
        tl.store(dst + offs_d[:, None], x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_skinny_rope(w_ptr, x_ptr, ws_ptr, xs_ptr, bias_ptr, M, K, stride_wn, stride_xm, positions_ptr, slot_ptr,
                     cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, stride_qo,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     N_HEADS: tl.constexpr, N_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     W_SCALAR: tl.constexpr, X_SCALAR: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                     BF16: tl.constexpr, KV_FP8: tl.constexpr):
    # a program takes BLOCK_N dims of a head's first half and the same dims of its second half: the pairs rope
    # turns together, so q and k leave rotated and k, v go straight to the cache
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_N)
    offs_d = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = head * HEAD_DIM + offs_d
    n_mask = offs_d < HALF
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lo, hi = _stream(w_ptr, x_ptr, HALF * stride_wn, offs_n, n_mask, offs_m, m_mask, x_scale, K, 0,
                     tl.cdiv(K, BLOCK_K), stride_wn, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K, EVEN_K, True, False)
    xs = _activation_scales(xs_ptr, offs_m, m_mask, X_SCALAR)
    lo = _scaled_rows(lo, ws_ptr, xs, offs_n, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
    hi = _scaled_rows(hi, ws_ptr, xs, offs_n + HALF, n_mask, bias_ptr, W_SCALAR, HAS_BIAS)
    if ROUND:  # the projection as the plain kernel stores it
        lo, hi = _rounded(lo, BF16), _rounded(hi, BF16)
    if head < N_HEADS + N_KV_HEADS:  # q or k: rotated by each token's position
        pos = tl.load(positions_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        table = pos[None, :] * HALF + offs_d[:, None]
        cos = tl.load(cos_ptr + table, mask=m_mask[None, :], other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + table, mask=m_mask[None, :], other=0.0).to(tl.float32)
        lo, hi = _rotated(lo, hi, cos, sin, -1.0, ROUND, BF16), _rotated(hi, lo, cos, sin, 1.0, ROUND, BF16)
    if head < N_HEADS:
        q_ptrs = q_out_ptr + offs_m[None, :].to(tl.int64) * stride_qo + head * HEAD_DIM + offs_d[:, None]
        tl.store(q_ptrs, lo.to(q_out_ptr.dtype.element_ty), mask=m_mask[None, :])
        tl.store(q_ptrs + HALF, hi.to(q_out_ptr.dtype.element_ty), mask=m_mask[None, :])
    else:
        slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)
        if head < N_HEADS + N_KV_HEADS:
            if ROUND:  # rotated k in the model dtype before its FP8 code, as rope_write_kv holds it
                lo, hi = _rounded(lo, BF16), _rounded(hi, BF16)
            kv_head = head - N_HEADS
            _to_cache(lo, k_cache_ptr, k_scale_ptr, kv_head, slot, offs_d, m_mask, stride_kcb, stride_kct,
                      stride_kch, PAGE, KV_FP8)
            _to_cache(hi, k_cache_ptr, k_scale_ptr, kv_head, slot, offs_d + HALF, m_mask, stride_kcb, stride_kct,
                      stride_kch, PAGE, KV_FP8)
        else:
            kv_head = head - N_HEADS - N_KV_HEADS
            _to_cache(lo, v_cache_ptr, v_scale_ptr, kv_head, slot, offs_d, m_mask, stride_vcb, stride_vct,
                      stride_vch, PAGE, KV_FP8)
            _to_cache(hi, v_cache_ptr, v_scale_ptr, kv_head, slot, offs_d + HALF, m_mask, stride_vcb, stride_vct,
                      stride_vch, PAGE, KV_FP8)


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
    column_tiles = triton.cdiv(n, tiles.block_n)
    partials = arrivals = w_scale  # not read without a split
    if tiles.split_k > 1:
        if gated or deferred:
            raise ValueError("fp8_skinny splits K for plain products only")
        partials = torch.empty(column_tiles * tiles.split_k * tiles.block_n * row_tile(m), dtype=torch.float32,
                               device=x.device)
        arrivals = arrival_counts(x.device, column_tiles)
    _fp8_skinny[(column_tiles * tiles.split_k,)](
        w, x, out, w_scale, x_scale if x_scale is not None else w_scale, bias if bias is not None else w_scale,
        amax if amax is not None else w_scale, ub_arg(amax_ub), m, n, k, amax.shape[1] if amax is not None else 0,
        n * w.stride(0), partials, arrivals, w.stride(0), x.stride(0), out.stride(0),
        BLOCK_N=tiles.block_n, BLOCK_M=row_tile(m), BLOCK_K=tiles.block_k, EVEN_K=k % tiles.block_k == 0,
        W_SCALAR=w_scale.numel() == 1, X_SCALAR=not deferred and x_scale.numel() == 1, HAS_BIAS=bias is not None,
        GATED=gated, X_DEFERRED=deferred, P_CHUNK=PARTIALS_CHUNK, ROUND=dtype in (torch.bfloat16, torch.float16),
        BF16=dtype == torch.bfloat16, SPLIT_K=tiles.split_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
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


def fp8_skinny_qkv_rope(x: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        positions: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                        q_out: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        tiles: SkinnyTiles | None = None) -> torch.Tensor:
    """The qkv projection with rope and the KV write as its epilogue: x [M, K] e4m3 @ w [(H + 2 KVH) * D, K]^T →
    rotated q [M, H, D] (into q_out if given) in the cache's model dtype, rotated k and v into the paged cache at
    slot_mapping [M], every value rounded where the small-M GEMM and rope_write_kv round it (their arguments'
    conventions). Full rotary only (cos / sin [P, D / 2]); no QK-norm. tiles: the plain product's, of which each
    half of a head takes block_n / 2."""
    m = x.shape[0]
    head_dim = k_cache.shape[-1]
    half = head_dim // 2
    n = (num_heads + 2 * num_kv_heads) * head_dim
    _check_operands(x, w, n, (torch.float8_e4m3fn,), "fp8_skinny_qkv_rope")
    dtype = cos.dtype
    if cos.shape[-1] != half or sin.shape != cos.shape or half % 16:
        raise ValueError(f"fp8_skinny_qkv_rope needs full-rotary tables [P, {half}] and a head_dim divisible by 32")
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs k_scale and v_scale")
    if q_out is None:
        q_out = torch.empty((m, num_heads, head_dim), dtype=dtype, device=x.device)
    if q_out.stride(-1) != 1 or q_out.stride(1) != head_dim or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("fp8_skinny_qkv_rope needs contiguous heads in q_out and the KV cache")
    if m == 0:
        return q_out
    plain = _tiles(x, n, tiles)
    block_n = max(16, plain.block_n // 2)  # rows of each half of a head: the plain tile's bytes a stage
    while half % block_n:
        block_n //= 2
    _fp8_skinny_rope[(n // (2 * block_n),)](
        w, x, w_scale, x_scale, bias if bias is not None else w_scale, m, x.shape[1], w.stride(0), x.stride(0),
        positions, slot_mapping, cos, sin, q_out, k_cache, v_cache, k_scale if kv_fp8 else w_scale,
        v_scale if kv_fp8 else w_scale, q_out.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        N_HEADS=num_heads, N_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_N=block_n,
        BLOCK_M=row_tile(m), BLOCK_K=plain.block_k, EVEN_K=x.shape[1] % plain.block_k == 0,
        W_SCALAR=w_scale.numel() == 1, X_SCALAR=x_scale.numel() == 1, HAS_BIAS=bias is not None,
        ROUND=dtype in (torch.bfloat16, torch.float16), BF16=dtype == torch.bfloat16, KV_FP8=kv_fp8,
        num_warps=plain.num_warps, num_stages=plain.num_stages,
    )
    return q_out
