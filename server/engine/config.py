"""Engine construction settings (fixed for the life of an engine; the scheduler knobs live in
metronome.contract.config.SchedulerConfig and can change at runtime)."""
from __future__ import annotations

from dataclasses import dataclass

from metronome.contract.errors import InvalidRequestError
from metronome.contract.precision import KV_CACHE_DTYPES, QUANTIZATIONS
from metronome.server.models.moe_config import MOE_BACKENDS

ASYNC_SCHEDULING = ("auto", "on", "off")
MIXED_OVERLAP = ("off", "on", "pipeline")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # load_model spec; None = default SmolLM2
    dtype: str = "auto"
    device: str = "auto"  # auto -> cuda if available else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None -> sized from memory (see kv_cache.num_blocks_for_budget)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float = 1.0  # cpu default budget
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None -> model's max positions
    max_waiting: int = 1024  # waiting queue bound: beyond it add_request raises EngineOverloadedError
    attention_backend: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    watermark: float = 0.01  # fraction of KV blocks kept free at admission so running decodes can grow
    cuda_graphs: bool = True  # capture decode steps as CUDA graphs (CUDA + triton only; False = --enforce-eager)
    async_scheduling: str = "auto"  # ASYNC_SCHEDULING: launch step n+1 before reading step n (auto: on for CUDA)
    moe_backend: str = "auto"  # MOE_BACKENDS: how a mixture of experts runs its experts (auto: triton on CUDA)
    # MIXED_OVERLAP: "on", a mixed step's decodes beside its chunk; "pipeline", a step's two halves pipelined layer by
    # layer (nano_batches.py); both on two streams, with CUDA graphs
    mixed_overlap: str = "off"
    quantization: str | None = None  # QUANTIZATIONS; None = as the checkpoint is (FP8 checkpoints load as FP8)
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES

    def validate(self) -> None:
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be >= 1, got {self.block_size}", param="block_size")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidRequestError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}", param="num_kv_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization")
        if self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be > 0", param="kv_cache_memory_gb")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be >= 1", param="max_model_len")
        if self.max_waiting < 0:
            raise InvalidRequestError("max_waiting must be >= 0", param="max_waiting")
        if not 0.0 <= self.watermark < 1.0:
            raise InvalidRequestError("watermark must be in [0, 1)", param="watermark")
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise InvalidRequestError(f"async_scheduling must be one of {', '.join(ASYNC_SCHEDULING)}, got "
                                      f"{self.async_scheduling!r}", param="async_scheduling")
        if self.mixed_overlap not in MIXED_OVERLAP:
            raise InvalidRequestError(f"mixed_overlap must be one of {', '.join(MIXED_OVERLAP)}, got "
                                      f"{self.mixed_overlap!r}", param="mixed_overlap")
        if self.moe_backend not in MOE_BACKENDS:
            raise InvalidRequestError(f"moe_backend must be one of {', '.join(MOE_BACKENDS)}, got "
                                      f"{self.moe_backend!r}", param="moe_backend")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                                      f"{self.quantization!r}", param="quantization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                      f"{self.kv_cache_dtype!r}", param="kv_cache_dtype")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise InvalidRequestError("tensor_parallel_size must be an integer >= 1", param="tensor_parallel_size")
