"""Tiles of the Triton FP8 GEMM (triton_fp8.fp8_matmul) by row count. Pure and free of triton, so that the
server's choice of GEMM per batch (server/models/quant/cuda_gemm.py) reads the same threshold without importing
the kernels."""
from __future__ import annotations

LARGE_ROWS = 768  # above: 128 x 256 tiles, 7-10 % faster than 128 x 128 at Llama-3-8B shapes (docs/perf/fp8-h200.md)


def matmul_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows: small tiles for decode batches."""
    if m <= 16:
        return 16, 128, 4, 4
    if m <= 32:
        return 32, 128, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    if m <= LARGE_ROWS:
        return 128, 128, 8, 3
    return 128, 256, 8, 3
