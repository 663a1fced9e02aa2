"""The KV cache tensors: per layer a (key, value) pair `[num_blocks, block_size, n_kv_heads, head_dim]`, their
element type (`--kv-cache-dtype`), and how many blocks fit the memory budget."""
from __future__ import annotations

import math
import mmap

import torch

from metronome.contract.errors import InvalidRequestError
from metronome.server.engine.config import EngineConfig

_GIB = 1 << 30
# Kept free on a GPU for activations, logits and the allocator's slack when sizing the cache from memory.
_GPU_ACTIVATION_RESERVE_BYTES = 2 * _GIB


def kv_cache_dtype(requested: str, model_dtype: torch.dtype, attention_backend: str) -> torch.dtype:
    """The cache's element type: the model's (auto), bfloat16 (for a bfloat16 model: the kernels read a cache of
    another float type in the model's dtype only), or FP8 e4m3 (one byte; torch and triton attention)."""
    if requested == "auto":
        return model_dtype
    if requested == "bf16":
        if model_dtype != torch.bfloat16:
            raise InvalidRequestError(f"--kv-cache-dtype bf16 needs a bfloat16 model (--dtype bfloat16), this one is "
                                      f"{str(model_dtype).removeprefix('torch.')}", param="kv_cache_dtype")
        return torch.bfloat16
    if requested != "fp8":
        raise InvalidRequestError(f"unknown kv_cache_dtype {requested!r}", param="kv_cache_dtype")
    if attention_backend not in ("torch", "triton"):
        raise InvalidRequestError(f"an FP8 KV cache is read by the torch and triton attention backends, not "
                                  f"{attention_backend}", param="kv_cache_dtype")
    return torch.float8_e4m3fn


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def plan_num_blocks(config: EngineConfig, per_block: int, device: torch.device) -> int:
    """Blocks for the configured count, or for the memory budget (GPU: what gpu_memory_utilization leaves after
    weights and a reserve; CPU: kv_cache_memory_gb)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = total * config.gpu_memory_utilization - in_use - _GPU_ACTIVATION_RESERVE_BYTES
    else:
        budget = config.kv_cache_memory_gb * _GIB
    blocks = int(budget // per_block)
    if blocks < 2:
        raise RuntimeError(
            f"KV cache budget of {budget / _GIB:.2f} GiB holds {max(blocks, 0)} blocks of {per_block} bytes; "
            "raise gpu_memory_utilization / kv_cache_memory_gb or set num_kv_blocks"
        )
    return blocks


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Zeroed, not empty: kernels may load padding slots under a mask, and NaN garbage * 0 is still NaN.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    zeros = _lazy_zeros if device.type == "cpu" else torch.zeros
    return [(zeros(shape, dtype=dtype, device=device), zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor in anonymous memory: the kernel hands out zeroed pages on first touch, so a 1 GiB CPU cache
    costs nothing at start-up (torch.zeros writes every page: ~2 s of a cold start) and only what is used later."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(math.prod(shape) * itemsize, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)
