"""The FP8 number format and its scale conventions, as plain torch functions (the reference every kernel matches).

Format: float8_e4m3fn (4 exponent bits, 3 mantissa bits, no infinities), largest finite value 448. A tensor is
stored as `q = e4m3(x / scale)` with a float32 `scale`, so `x ≈ q * scale`; `scale` is the dequantisation factor
(the `weight_scale` / `weight_scale_inv` / `input_scale` of every checkpoint layout: all three multiply).
A dynamic scale is `amax / 448` over its group (a tensor, a row, a row's group of 128 columns, a 128 x 128
block), floored at MIN_SCALE so an all-zero group divides by something. Rounding is round-to-nearest-even with
values clamped to ±448 first (torch's cast does not saturate).

Granularities: per tensor (one scale), per channel (one per output row of a weight, [N]), per token (one per
activation row, [T, 1]), per group (one per 128 columns of an activation row, [T, ceil(K / 128)]) and per block
(one per 128 x 128 tile of a weight, [ceil(N / 128), ceil(K / 128)]).
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor: a zero group gets a tiny scale, and its values stay 0


def dynamic_scale(amax: torch.Tensor, amax_ub: float | None = None) -> torch.Tensor:
    """float32 scale(s) that map amax (bounded by `amax_ub`, when given) onto FP8_MAX."""
    amax = amax.float()
    if amax_ub is not None:
        amax = amax.clamp_max(amax_ub)
    # Divided by a tensor, not a Python number: on CUDA torch turns division by a scalar into a multiply by its
    # reciprocal, which can miss the correctly rounded quotient (what the kernels compute) by one bit.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(MIN_SCALE)


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale), scale broadcast against x; division in float32 as the kernels do it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, 0-d scale); a given scale is static (e.g. a checkpoint's input_scale), else amax / 448."""
    if scale is None:
        scale = dynamic_scale(x.abs().amax())
    scale = scale.float().reshape(())
    return to_fp8(x, scale), scale


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q, scale [N]): one scale per output row."""
    scale = dynamic_scale(weight.abs().amax(dim=1))
    return to_fp8(weight, scale[:, None]), scale


def quantize_per_token(x: torch.Tensor, amax_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] → (q, scale [T, 1]); with `amax_ub` a token's amax is bounded first (FBGEMM's
    activation_scale_ub), so the values of an outlier token past the bound saturate at ±448."""
    scale = dynamic_scale(x.abs().amax(dim=-1, keepdim=True), amax_ub)
    return to_fp8(x, scale), scale


def expand_groups(scale: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """[..., ceil(width / group)] → [..., width]: each group's scale repeated over its columns."""
    return scale.repeat_interleave(group, dim=-1)[..., :width]


def quantize_per_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] → (q, scale [T, ceil(K / group)]): one scale per `group` columns of a row (the last group may be
    short)."""
    rows, width = x.shape
    groups = -(-width // group)
    padded = torch.nn.functional.pad(x.float().abs(), (0, groups * group - width))
    scale = dynamic_scale(padded.view(rows, groups, group).amax(dim=-1))
    return to_fp8(x, expand_groups(scale, width, group)), scale


def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """Block scales [ceil(N / bn), ceil(K / bk)] → one per element [N, K]."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def quantize_per_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q, scale [ceil(N / bn), ceil(K / bk)]): one scale per bn x bk tile (edge tiles short)."""
    rows, cols = weight.shape
    bn, bk = block
    grid = (-(-rows // bn), -(-cols // bk))
    padded = torch.nn.functional.pad(weight.float().abs(), (0, grid[1] * bk - cols, 0, grid[0] * bn - rows))
    scale = dynamic_scale(padded.view(grid[0], bn, grid[1], bk).amax(dim=(1, 3)))
    return to_fp8(weight, expand_blocks(scale, (rows, cols), block)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in float32 (scale already broadcastable: 0-d, [N, 1], [T, 1] or element-wise)."""
    return q.float() * scale
