"""Fused mixture-of-experts on CUDA: the (token, expert) pairs grouped by expert in block-aligned segments, and
both expert projections as grouped GEMMs over those segments (the scheme of vLLM's fused_moe).

A batch of T tokens routed to k experts each has S = T * k pairs; pair p = token * k + slot.
1. `align_routes` (three small kernels, no host reads): count each expert's pairs per chunk, lay the experts'
   segments out back to back with each rounded up to a multiple of BLOCK_M (the padding slots hold the sentinel S),
   and scatter every pair id into its expert's segment. Every GEMM row block then belongs to one expert
   (`block_experts`), and `num_padded` says where the real blocks end. The buffers are sized for the worst case
   of T (S + min(E, S) * (BLOCK_M - 1) slots), so their shapes depend on T only: a CUDA graph can capture them.
2. `_moe_gemm` (up): rows of x gathered by pair // k, times the expert's gate and up rows at once (two
   accumulators), the activation in the epilogue (SiLU * up, or gpt-oss's clamped SwiGLU with its biases), written
   per pair: [S, I].
3. `_moe_gemm` (down): those rows times the expert's down matrix, + bias, times the routing weight in the
   epilogue, written per pair: [S, H]; the k rows of a token are then summed.
Blocks past `num_padded` exit at once, so the grid is fixed per T too.
A decode step of a few tokens skips step 1: with BLOCK_M = 1 every pair is its own row block and the routing ids
are the block experts as they stand (`align_routes` launches nothing). Its pairs mostly land on distinct experts,
where a 16-row block would hold one pair and 15 rows of padding.

FP8 experts (an FP8 checkpoint's, W8A16): the weights are e4m3 with float32 scales [E, N, G] per output row and
per group of `group_k` input columns (G = 1: one scale a row). Each weight tile is converted to the activations'
dtype in registers (exact: every e4m3 value is a bf16 one) and the scales are applied to the float32 partial
sums: once after the K loop for row scales, per K step for group scales (a K step never straddles two groups).

Every rounding the torch reference does (models/moe_experts.py) is reproduced in the epilogues: the projection
rounded to the model dtype, then the bias, then each activation op, then the weight product. On CPU the kernels
run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): tests only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .triton_attention import require_runnable
from .triton_fused import _rounded

ACTIVATION_CODES = {"silu": 1, "swiglu_clamped": 2}
_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_SCRATCH_ELEMENTS = 8192  # elements of a [rows, experts] tile in the alignment kernels (registers, not memory)


@triton.jit
def _round(x, OUT_KIND: tl.constexpr):
    """fp32 x as the model dtype would hold it (0: float32, as is; 1: bf16; 2: fp16), still in fp32."""
    if OUT_KIND == 0:
        return x
    else:
        return _rounded(x, OUT_KIND == 1)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_chunks(ids_ptr, chunk_counts_ptr, num_pairs, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """chunk_counts[c, e] = how many of pairs c*CHUNK .. (c+1)*CHUNK - 1 chose expert e."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    experts = tl.arange(0, E_PAD)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, tl.sum(hit, 0))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _plan_segments(chunk_counts_ptr, chunk_offsets_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
                   num_pairs, num_chunks, max_blocks,
                   E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr):
    """One program: each expert's segment (its count rounded up to BLOCK_M), where each chunk's pairs of that
    expert start, the sentinel in the padding slots, and the expert of every row block."""
    experts = tl.arange(0, E_PAD)
    totals = tl.zeros([E_PAD], tl.int32)
    for first in range(0, num_chunks, ROWS):
        rows = first + tl.arange(0, ROWS)
        counts = tl.load(chunk_counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=rows[:, None] < num_chunks,
                         other=0)
        totals += tl.sum(counts, 0)
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    running = starts
    for first in range(0, num_chunks, ROWS):
        rows = first + tl.arange(0, ROWS)
        in_range = rows[:, None] < num_chunks
        counts = tl.load(chunk_counts_ptr + rows[:, None] * E_PAD + experts[None, :], mask=in_range, other=0)
        before = tl.cumsum(counts, 0) - counts
        tl.store(chunk_offsets_ptr + rows[:, None] * E_PAD + experts[None, :], running[None, :] + before,
                 mask=in_range)
        running += tl.sum(counts, 0)

    pad = tl.arange(0, BLOCK_M)
    tl.store(sorted_pairs_ptr + (starts + totals)[:, None] + pad[None, :],
             tl.full([E_PAD, BLOCK_M], 0, tl.int32) + num_pairs, mask=pad[None, :] < (padded - totals)[:, None])

    for first in range(0, max_blocks, BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
        tl.store(block_experts_ptr + blocks, owner, mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_pairs(ids_ptr, chunk_offsets_ptr, sorted_pairs_ptr, num_pairs, E_PAD: tl.constexpr,
                   CHUNK: tl.constexpr):
    """Each pair id into its expert's segment, after the same expert's pairs of earlier chunks and rows (the
    order within a segment is the pair order, so results never depend on scheduling)."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    experts = tl.arange(0, E_PAD)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)
    rank = tl.cumsum(hit, 0) - hit
    base = tl.load(chunk_offsets_ptr + chunk * E_PAD + experts)
    dest = tl.sum(hit * (rank + base[None, :]), 1)
    tl.store(sorted_pairs_ptr + dest, offs, mask=offs < num_pairs)


@dataclass
class RoutePlan:
    # int32 [num_m_blocks * BLOCK_M]: pair ids by expert segment, S marks padding; None: pair p is row block p
    sorted_pairs: torch.Tensor | None
    block_experts: torch.Tensor  # [num_m_blocks]: the expert of each row block (int32, or the routing ids)
    num_padded: torch.Tensor | None  # int32 [1]: slots in use (a multiple of BLOCK_M); None: every block
    num_m_blocks: int  # the worst case for this T (a host constant: the GEMM grid)
    block_m: int


def max_row_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Row blocks of the worst case: every used expert (at most min(E, S)) wastes up to BLOCK_M - 1 slots."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


def align_routes(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> RoutePlan:
    """topk_ids [T, k] → the block-aligned segments (module docstring, step 1); for block_m 1 the pairs as they
    are, one a row block."""
    if block_m & (block_m - 1) or block_m < 1:
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    if block_m == 1:
        return RoutePlan(None, ids, None, num_pairs, 1)
    device = ids.device
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = max(16, min(1024, _SCRATCH_ELEMENTS // e_pad))
    num_chunks = triton.cdiv(num_pairs, chunk)
    num_m_blocks = max_row_blocks(num_pairs, num_experts, block_m)
    chunk_counts = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    chunk_offsets = torch.empty_like(chunk_counts)
    sorted_pairs = torch.empty(num_m_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_m_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    require_runnable(device)
    _count_chunks[(num_chunks,)](ids, chunk_counts, num_pairs, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    _plan_segments[(1,)](chunk_counts, chunk_offsets, sorted_pairs, block_experts, num_padded, num_pairs, num_chunks,
                         num_m_blocks, E_PAD=e_pad, BLOCK_M=block_m, ROWS=max(1, _SCRATCH_ELEMENTS // (4 * e_pad)),
                         BLOCKS=max(16, min(256, _SCRATCH_ELEMENTS // e_pad)), num_warps=4)
    _scatter_pairs[(num_chunks,)](ids, chunk_offsets, sorted_pairs, num_pairs, E_PAD=e_pad, CHUNK=chunk,
                                  num_warps=4)
    return RoutePlan(sorted_pairs, block_experts, num_padded, num_m_blocks, block_m)


@triton.jit
def _weight_scales(b_scale_ptr, expert, rows, n_valid, group, stride_bse, stride_bsn):
    return tl.load(b_scale_ptr + expert * stride_bse + rows * stride_bsn + group, mask=n_valid, other=0.0)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gemm(
    a_ptr, b_ptr, bias_ptr, out_ptr, route_weights_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
    b_scale_ptr, num_pairs, num_m_blocks, N, K,
    stride_am, stride_be, stride_bn, stride_bias_e, stride_om, stride_bse, stride_bsn,
    A_ROW_DIV: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, OUT_KIND: tl.constexpr, B_SCALE: tl.constexpr,
    GROUP_K: tl.constexpr, SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """out[pair, n] for the BLOCK_M pairs of one row block (one expert) and BLOCK_N output columns. A row is
    a[pair // A_ROW_DIV]; b is [E, N(, +N for the up rows when ACTIVATION), K] with K contiguous. B_SCALE: 0 for
    weights in the activations' dtype, 1 for e4m3 weights with a scale per row, 2 with a scale per row and GROUP_K
    columns (b_scale [E, rows, groups]). Without SORTED, row block p is pair p (BLOCK_M 1, no alignment)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    if SORTED:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    else:
        pairs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k_step in range(0, tl.cdiv(K, BLOCK_K)):
        k_valid = offs_k < K - k_step * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        if B_SCALE != 0:
            b = b.to(a_ptr.dtype.element_ty)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if B_SCALE == 2:
            group = (k_step * BLOCK_K) // GROUP_K
            scale = _weight_scales(b_scale_ptr, expert, offs_n, n_valid, group, stride_bse, stride_bsn)
            acc += tl.dot(a, b, input_precision=DOT_PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if ACTIVATION != 0:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            if B_SCALE != 0:
                b_up = b_up.to(a_ptr.dtype.element_ty)
            if UPCAST_DOT:
                b_up = b_up.to(tl.float32)
            if B_SCALE == 2:
                scale_up = _weight_scales(b_scale_ptr, expert, offs_n + N, n_valid, group, stride_bse, stride_bsn)
                acc_up += tl.dot(a, b_up, input_precision=DOT_PRECISION) * scale_up[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if B_SCALE == 1:
        acc = acc * _weight_scales(b_scale_ptr, expert, offs_n, n_valid, 0, stride_bse, stride_bsn)[None, :]
        if ACTIVATION != 0:
            acc_up = acc_up * _weight_scales(b_scale_ptr, expert, offs_n + N, n_valid, 0, stride_bse,
                                             stride_bsn)[None, :]

    out = _round(acc, OUT_KIND)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        out = _round(out + bias[None, :], OUT_KIND)
    if ACTIVATION != 0:
        up = _round(acc_up, OUT_KIND)
        if HAS_BIAS:
            bias_up = tl.load(bias_ptr + expert * stride_bias_e + N + offs_n, mask=n_valid, other=0.0)
            up = _round(up + bias_up.to(tl.float32)[None, :], OUT_KIND)
        if ACTIVATION == 1:  # silu(gate) * up
            gate = _round(out / (1.0 + tl.exp(-out)), OUT_KIND)
            out = _round(gate * up, OUT_KIND)
        else:  # gpt-oss: (clamp(up, ±limit) + 1) * gate * sigmoid(alpha * gate), gate <= limit
            gate = tl.minimum(out, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            scaled = _round(gate * ALPHA, OUT_KIND)
            glu = _round(gate * _round(1.0 / (1.0 + tl.exp(-scaled)), OUT_KIND), OUT_KIND)
            out = _round(_round(up + 1.0, OUT_KIND) * glu, OUT_KIND)
    if MUL_WEIGHT:
        weight = tl.load(route_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        out = _round(out * weight[:, None], OUT_KIND)
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # pairs per row block (and the segment alignment)
    block_n: int  # output columns of the up GEMM per program (each with a gate and an up accumulator)
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int | None = None  # output columns of the down GEMM per program (None: block_n)


# A step whose pairs are at most a quarter of the experts (Qwen3-30B-A3B: up to 4 tokens; gpt-oss-20b: 2; Mixtral: 1)
# seldom routes two pairs to one expert: each pair is its own row block, with no alignment launches, on narrow deep
# tiles that spread an expert's rows over many SMs. On an H100 (hack/bench_moe.py --sweep, docs/perf/moe-decode.md)
# Qwen3-30B-A3B's experts at one token took 34.6 against 45.5 µs in bf16 and 28.2 against 42.1 in FP8.
DIRECT_TILES = MoeTiles(1, 16, 256, group_m=1, num_warps=2, num_stages=4)
DIRECT_MAX_PAIRS_PER_EXPERT = 0.25


def direct_max_tokens(top_k: int, num_experts: int) -> int:
    """The most tokens a step may have for one row block a pair (DIRECT_TILES); 0 when even one is too many."""
    return int(num_experts * DIRECT_MAX_PAIRS_PER_EXPERT) // top_k


def choose_tiles(num_tokens: int, top_k: int, num_experts: int, on_cuda: bool) -> MoeTiles:
    """Fixed tiles by the expected pairs per used expert, so a server compiles a handful of variants: one row
    block a pair for a decode step of a few tokens, small blocks where each expert sees a few tokens (decode: the
    GEMMs stream weights), large ones for prefill. The same T always gets the same tiles (a CUDA graph replays
    what its capture launched)."""
    if not on_cuda:  # interpreter: the smallest tiles tl.dot takes, few Python-level steps
        return MoeTiles(16, 32, 32, group_m=1, num_stages=1)
    if num_tokens <= direct_max_tokens(top_k, num_experts):
        return DIRECT_TILES
    per_expert = num_tokens * top_k / min(num_experts, num_tokens * top_k)
    if per_expert <= 16:
        return MoeTiles(16, 64, 128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 48:
        return MoeTiles(32, 64, 128, group_m=8, num_warps=4, num_stages=3)
    # Prefill-sized blocks: the down GEMM (one accumulator) takes twice the up GEMM's columns.
    if per_expert <= 128:
        return MoeTiles(64, 64, 64, group_m=8, num_warps=4, num_stages=3, down_block_n=128)
    return MoeTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=3, down_block_n=128)


def representative_token_counts(top_k: int, num_experts: int) -> list[int]:
    """One token count per tile class choose_tiles can pick on CUDA (the smallest of each): what a warm-up runs
    so that every kernel variant is compiled before serving."""
    counts, seen = [], set()
    firsts = [1, direct_max_tokens(top_k, num_experts) + 1]
    firsts += [threshold * num_experts // top_k + 1 for threshold in (16, 48, 128)]
    for tokens in sorted(set(firsts)):
        tiles = choose_tiles(tokens, top_k, num_experts, True)
        if tiles not in seen:
            seen.add(tiles)
            counts.append(tokens)
    return counts


def _gemm(a, b, bias, out, route_weights, plan: RoutePlan, num_pairs: int, n: int, k: int, a_row_div: int,
          activation: int, alpha: float, limit: float, tiles: MoeTiles, block_n: int,
          b_scale: torch.Tensor | None = None, group_k: int = 0) -> None:
    on_cuda = a.device.type == "cuda"
    grid = (plan.num_m_blocks * triton.cdiv(n, block_n),)
    scale_kind = 0 if b_scale is None else (1 if b_scale.shape[2] == 1 else 2)
    _moe_gemm[grid](
        a, b, bias if bias is not None else b, out, route_weights if route_weights is not None else out,
        plan.sorted_pairs if plan.sorted_pairs is not None else plan.block_experts, plan.block_experts,
        plan.num_padded if plan.num_padded is not None else plan.block_experts, b_scale if b_scale is not None else out,
        num_pairs, plan.num_m_blocks, n, k,
        a.stride(0), b.stride(0), b.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
        b_scale.stride(0) if b_scale is not None else 0, b_scale.stride(1) if b_scale is not None else 0,
        A_ROW_DIV=a_row_div, ACTIVATION=activation, ALPHA=alpha, LIMIT=limit,
        HAS_BIAS=bias is not None, MUL_WEIGHT=route_weights is not None, OUT_KIND=_OUT_KINDS[out.dtype],
        B_SCALE=scale_kind, GROUP_K=group_k if scale_kind == 2 else 0, SORTED=plan.sorted_pairs is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton's interpreter computes bf16 x bf16 dots wrongly; it upcasts the operands instead.
        UPCAST_DOT=not on_cuda and a.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


@dataclass(frozen=True)
class Fp8ExpertScales:
    """The float32 scales of e4m3 expert weights: gate_up [E, 2I, G] and down [E, H, G'], per output row and per
    `group_k` input columns (G = ceil(H / group_k); G = 1 and group_k = 0 for one scale a row)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    group_k: int = 0


def _check_fp8_scales(scales: Fp8ExpertScales, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    for name, scale, weight in (("gate_up", scales.gate_up, gate_up), ("down", scales.down, down)):
        groups = 1 if not scales.group_k else -(-weight.shape[2] // scales.group_k)
        if scale.dtype != torch.float32 or tuple(scale.shape) != (*weight.shape[:2], groups) or \
                not scale.is_contiguous():
            raise ValueError(f"{name} scales must be contiguous float32 {(*weight.shape[:2], groups)}, got "
                             f"{scale.dtype} {tuple(scale.shape)}")


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0,
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  tiles: MoeTiles | None = None, fp8_scales: Fp8ExpertScales | None = None) -> torch.Tensor:
    """x [T, H], gate_up [E, 2I, H] (gate rows, then up), down [E, H, I], topk_weights/ids [T, k] → [T, H] in
    x's dtype. Biases (gpt-oss): gate_up_bias [E, 2I], down_bias [E, H]. The weights scale each expert's output
    in their own dtype's precision (pass them as the family's router made them). With `fp8_scales` the expert
    weights are e4m3 (float8_e4m3fn) and x stays in its dtype."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"unknown MoE activation {activation!r}")
    weight_dtype = torch.float8_e4m3fn if fp8_scales is not None else x.dtype
    if x.dtype not in _OUT_KINDS or gate_up.dtype != weight_dtype or down.dtype != weight_dtype:
        raise ValueError(f"expert weights must be {weight_dtype} for x in {x.dtype}, got {gate_up.dtype}, "
                         f"{down.dtype}")
    if down.shape != (num_experts, hidden, inter) or gate_up.shape[2] != hidden or two_i % 2:
        raise ValueError(f"expert shapes gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not fit "
                         f"hidden size {hidden}")
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
            raise ValueError(f"{name} needs contiguous rows")
    num_pairs = tokens * top_k
    if tiles is None:
        tiles = choose_tiles(tokens, top_k, num_experts, x.device.type == "cuda")
    group_k = 0
    if fp8_scales is not None:
        _check_fp8_scales(fp8_scales, gate_up, down)
        group_k = fp8_scales.group_k
        if group_k and group_k % tiles.block_k:  # a K step must lie within one scale group
            block_k = group_k & -group_k
            if block_k < 16:
                raise ValueError(f"FP8 expert scales per {group_k} columns: K steps need a multiple of 16")
            tiles = replace(tiles, block_k=block_k)
    plan = align_routes(topk_ids, num_experts, tiles.block_m)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, gate_up_bias, act, None, plan, num_pairs, inter, hidden, top_k, ACTIVATION_CODES[activation],
          alpha, limit, tiles, tiles.block_n, fp8_scales.gate_up if fp8_scales else None, group_k)
    out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    _gemm(act, down, down_bias, out, weights, plan, num_pairs, hidden, inter, 1, 0, alpha, limit, tiles,
          tiles.down_block_n or tiles.block_n, fp8_scales.down if fp8_scales else None, group_k)
    return out.view(tokens, top_k, hidden).sum(dim=1) if top_k > 1 else out
