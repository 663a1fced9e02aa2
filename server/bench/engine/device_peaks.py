"""What the device can do, measured here: copy bandwidth and dense matmul throughput (bf16, and FP8 e4m3 with
per-tensor scales through torch._scaled_mm where the GPU has FP8 tensor cores: compute capability 8.9 and up).

These are the denominators of the engine benchmark's efficiency ratios (decode vs the HBM floor, prefill vs the
matmul peak), so they are measured on the same device in the same run rather than taken from a datasheet.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any


def time_op(fn: Callable[[], Any], device: Any, reps: int, warmup: int = 2) -> list[float]:
    """Seconds per call of fn, one sample per call: CUDA events on a GPU, perf_counter elsewhere."""
    import torch

    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return samples


@dataclass
class CopyBandwidth:
    bytes_per_copy: int
    median_s: float
    bandwidth_bytes_per_s: float  # (bytes read + bytes written) / time
    samples_s: list[float]


@dataclass
class MatmulPeak:
    size: int
    dtype: str
    median_s: float
    tflops: float  # 2·n³ / time / 1e12
    samples_s: list[float]


def measure_copy_bandwidth(device: Any, megabytes: int, reps: int) -> CopyBandwidth:
    """A large device-to-device copy: it reads and writes every byte once, like a decode step reads weights."""
    import torch

    nbytes = megabytes * (1 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    samples = time_op(lambda: dst.copy_(src), device, reps)
    median = statistics.median(samples)
    return CopyBandwidth(nbytes, median, 2 * nbytes / median, samples)


def measure_matmul(device: Any, size: int, reps: int, dtype: Any = None) -> MatmulPeak:
    """n x n @ n x n on random data (bf16 on CUDA, fp32 on CPU unless given), median of `reps`."""
    import torch

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    out = torch.empty(size, size, device=device, dtype=dtype)
    samples = time_op(lambda: torch.matmul(a, b, out=out), device, reps)
    median = statistics.median(samples)
    return MatmulPeak(size, str(dtype).replace("torch.", ""), median, 2 * size ** 3 / median / 1e12, samples)


def has_fp8_tensor_cores(device: Any) -> bool:
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def measure_fp8_matmul(device: Any, size: int, reps: int) -> MatmulPeak:
    """n x n @ n x n in e4m3 with 0-d float32 scales into bf16: the GEMM an FP8 layer with per-tensor scales runs."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device)
    samples = time_op(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device,
                      reps)
    median = statistics.median(samples)
    return MatmulPeak(size, "float8_e4m3fn", median, 2 * size ** 3 / median / 1e12, samples)


def device_section(device: Any, copy_mb: int, matmul_size: int, reps: int, dtype: Any = None) -> dict[str, Any]:
    copy = measure_copy_bandwidth(device, copy_mb, reps)
    matmul = measure_matmul(device, matmul_size, reps, dtype)
    out = {
        "copy": asdict(copy),
        "matmul": asdict(matmul),
        "bandwidth_gb_per_s": copy.bandwidth_bytes_per_s / 1e9,
        "matmul_tflops": matmul.tflops,
    }
    if has_fp8_tensor_cores(device):
        fp8 = measure_fp8_matmul(device, matmul_size, reps)
        out["fp8_matmul"] = asdict(fp8)
        out["fp8_matmul_tflops"] = fp8.tflops
    return out
