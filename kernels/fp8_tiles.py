"""Tiles of the Triton FP8 GEMM (triton_fp8.fp8_matmul) by row count and weight width. Pure and free of triton, so
that the server's choice of GEMM per batch (server/models/quant/cuda_gemm.py) reads the same threshold without
importing the kernels."""
from __future__ import annotations

LARGE_ROWS = 768  # above: 128 x 256 tiles, 7-10 % faster than 128 x 128 at Llama-3-8B shapes (docs/perf/fp8-h200.md)
WIDE = (128, 256, 8, 3)
NARROW = (128, 128, 8, 3)
# What a 128 x 256 tile gains over a 128 x 128 one when both fill their waves: 3-17 % (median 10 %) at Llama-3-8B
# shapes from 960 to 8,192 rows on the H200 (h200-fp8-gemm-large-rows.json). The choice credits it 8 %, so only a
# grid whose last wave is clearly emptier switches to the narrow tiles.
WIDE_TILE_GAIN = 1.08
# Only up to here may a weight's grid switch tiles by its waves: steps of this many tokens or fewer replay piecewise
# CUDA graphs (server/engine/piecewise_graphs.py: buckets up to 4,096), captured at start-up with every variant they
# launch; longer ones run eagerly on the wide tiles, which those captures compiled too. So no row count met while
# serving compiles a new variant.
WAVE_CHOICE_MAX_ROWS = 4096


def wave_efficiency(tiles: int, sm_count: int) -> float:
    """The share of the SMs' turns that a grid of `tiles` programs, one an SM at a time, keeps busy."""
    waves = -(-tiles // sm_count)
    return tiles / (waves * sm_count)


def matmul_tiles(m: int, n: int | None = None, sm_count: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows of an [M, K] x [n, K]^T product: small tiles for
    decode batches, 128 x 256 above LARGE_ROWS unless their grid leaves so much of its last wave empty that
    128 x 128 tiles finish first (Llama-3-8B's qkv_proj, 6,144 wide, at 960 rows on 132 SMs: 192 wide tiles are
    two waves, 73 % busy; 384 narrow ones three, 97 % busy: 46.1 against 49.1 us on the H200)."""
    if m <= 16:
        return 16, 128, 4, 4
    if m <= 32:
        return 32, 128, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    if m <= LARGE_ROWS:
        return NARROW
    if n is None or not sm_count or m > WAVE_CHOICE_MAX_ROWS:
        return WIDE
    row_tiles = -(-m // WIDE[0])
    wide = wave_efficiency(row_tiles * -(-n // WIDE[1]), sm_count) * WIDE_TILE_GAIN
    narrow = wave_efficiency(row_tiles * -(-n // NARROW[1]), sm_count)
    return NARROW if narrow > wide else WIDE
