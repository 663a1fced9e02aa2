"""A token row's amax shared by the programs that split the row, within one launch.

A per-token FP8 scale needs the whole row's amax before any of it can be quantised, so the quantising kernels
give each row one program; at decode batches that is one SM per token, and a 14,336-column SiLU·mul row keeps one
SM busy for 6.8 us where the bf16 kernel over 64 rows takes 2.1 (docs/perf/fp8-h200.md). Split over PARTS
programs, each part adds its amax to the row's slot (an atomic max), arrives, and waits until every part of its row
has arrived; then each part quantises its own columns from registers. The last part to leave zeroes the row's
slots, so the next launch, or the next replay of a graph, starts from zero.

Waiting on other programs needs them resident at once. A row's parts are adjacent in launch order (the part is
program_id(0)), and callers split rows only at small row counts (`SPLIT_MAX_ROWS`), whose few hundred small
programs fit an H100 or H200 many times over. Triton's interpreter runs programs one after another, so it never
splits (`can_split`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SPLIT_MAX_ROWS = 64  # rows a launch splits at most; above, a program per row fills the GPU by itself
SPLIT_COLUMNS = 2048  # columns a part takes: 16 of each input a thread on 4 warps

_SLOTS: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def can_split(rows: int, columns: int) -> bool:
    """Whether a per-token quantisation of `rows` rows of `columns` splits its rows (compiled, not interpreted; few
    rows; more than one part's columns)."""
    return os.environ.get("TRITON_INTERPRET") != "1" and 0 < rows <= SPLIT_MAX_ROWS and columns > SPLIT_COLUMNS


def parts(columns: int) -> int:
    return triton.cdiv(columns, SPLIT_COLUMNS)


def row_slots(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax float32 [rows], counts int32 [rows, 2]: arrived, left), zero, one pair per device and stream: the
    kernels leave them zero, and launches on two streams at once (the mixed step's overlap) never share one.
    A graph captures its stream's pair (made at the first capture and kept here) and zeroes it again each replay."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    slots = _SLOTS.get(key)
    if slots is None or slots[0].numel() < rows:
        size = max(rows, SPLIT_MAX_ROWS)
        slots = _SLOTS[key] = (torch.zeros(size, dtype=torch.float32, device=device),
                               torch.zeros((size, 2), dtype=torch.int32, device=device))
    return slots


@triton.jit
def row_amax(part_amax, amax_ptr, counts_ptr, row, PARTS: tl.constexpr):
    """The amax of row `row` over its PARTS programs, given this program's part of it (>= 0)."""
    tl.atomic_max(amax_ptr + row, part_amax, sem="relaxed")
    arrived = tl.atomic_add(counts_ptr + 2 * row, 1, sem="acq_rel") + 1  # releases the max above
    while arrived < PARTS:
        arrived = tl.atomic_add(counts_ptr + 2 * row, 0, sem="acquire")
    amax = tl.atomic_max(amax_ptr + row, 0.0, sem="acquire")  # a read at L2, where the maxima were taken
    if tl.atomic_add(counts_ptr + 2 * row + 1, 1, sem="acq_rel") == PARTS - 1:  # every part has read it
        tl.atomic_xchg(amax_ptr + row, 0.0, sem="relaxed")
        tl.atomic_xchg(counts_ptr + 2 * row, 0, sem="relaxed")
        tl.atomic_xchg(counts_ptr + 2 * row + 1, 0, sem="relaxed")
    return amax
