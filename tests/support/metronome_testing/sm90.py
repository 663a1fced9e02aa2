"""Compile the Triton kernels a call launches for a Hopper GPU (sm_90) on a machine without one, and read what each
compiled kernel uses: registers, spilled bytes, shared memory, asynchronous copies.

Inside `compiling_for_sm90()` Triton's active driver reports an sm_90 target and every kernel launch compiles
(with the specialisation a real launch would get: the tensors' 16-byte alignment, integer divisibility, M == 1)
and returns without running; Metronome's wrappers take CPU tensors as if they were on the GPU. Their outputs are
never written, so only the compiled kernels mean anything. `ptxas` and `cuobjdump` ship inside the triton wheel.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SM90_SHARED_LIMIT = 232_448  # bytes of shared memory one block may use on an H100 / H200


@dataclass(frozen=True)
class CompiledKernel:
    name: str
    registers: int  # per thread
    spilled: int  # bytes of local memory per thread (the stack ptxas gave registers that did not fit)
    shared: int  # bytes per block
    async_copies: int  # cp.async instructions in the PTX: the software pipeline streams through shared memory
    fp_fusion: bool  # compiled with multiplies and adds contracted into FMAs (metronome.kernels keeps it on)
    kernel: object  # triton's CompiledKernel (asm: ttgir, ptx, cubin)


class _Sm90Driver:
    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


def _kernel_modules() -> list:
    return [module for name, module in sys.modules.items()
            if name.startswith("metronome.kernels.") and hasattr(module, "require_runnable")]


@contextmanager
def compiling_for_sm90() -> Iterator[list[CompiledKernel]]:
    """Yields the list every launch inside the block appends its compiled kernel to."""
    import triton  # noqa: F401 - the driver module below needs the package imported first
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    import metronome.kernels.triton_fp8_skinny  # noqa: F401 - every kernel module the FP8 path imports
    import metronome.kernels.triton_fused  # noqa: F401

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compiling for sm_90 needs Triton's compiler: unset TRITON_INTERPRET")
    compiled: list[CompiledKernel] = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(_read(self.fn.__name__, kernel))
        return kernel

    patched = [(module, module.require_runnable) for module in _kernel_modules()]
    previous = driver._active  # None until a driver was asked for; making the default one needs a GPU
    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    for module, _ in patched:
        module.require_runnable = lambda device: None
    try:
        yield compiled
    finally:
        JITFunction.run = launch
        driver._active = previous
        for module, original in patched:
            module.require_runnable = original


def cuobjdump(kernel, *args: str) -> str:
    """cuobjdump's output for a compiled kernel's cubin (e.g. "-sass", "-res-usage")."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, *args, cubin.name], capture_output=True, text=True, check=True).stdout


def registers_and_spills(kernel) -> tuple[int, int]:
    """(registers a thread, bytes of stack a thread: spilled registers) from the cubin."""
    usage = cuobjdump(kernel, "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage: {usage!r}")
    return int(found[1]), int(found[2])


def _read(name: str, kernel) -> CompiledKernel:
    ptx = kernel.asm["ptx"]
    return CompiledKernel(name, *registers_and_spills(kernel), kernel.metadata.shared,
                          ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), kernel.metadata.enable_fp_fusion,
                          kernel)


LLAMA3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 14336}
SM_COUNT = 132  # an H200's (and an H100 SXM's)


def fp8_decode_layer(rows: int, shapes: dict[str, int] = LLAMA3_8B) -> None:
    """Launch every Triton kernel of one Llama-style decoder layer's FP8 decode step at `rows` tokens (FP8 weights,
    per-token activations, FP8 KV cache) except the attention itself (hack/attention_sass.py), on CPU tensors of
    the layer's shapes; the small-M GEMMs take the tiles they get on `SM_COUNT` SMs. Meant for inside
    compiling_for_sm90()."""
    import torch

    from metronome.kernels.triton_fp8 import quantize_fp8
    from metronome.kernels.triton_fp8_skinny import choose_tiles, fp8_skinny_matmul
    from metronome.kernels.triton_fused import add_rms_norm_fp8, rope_write_kv, silu_mul_fp8

    hidden, heads, kv_heads, dim, inter = (shapes[k] for k in ("hidden", "heads", "kv_heads", "head_dim",
                                                               "intermediate"))
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16

    def skinny(x, scale, n: int, k: int) -> torch.Tensor:
        w, w_scale = torch.zeros(n, k, dtype=e4m3), torch.ones(n)
        return fp8_skinny_matmul(x, scale, w, w_scale, bf16, tiles=choose_tiles(n, k, rows, SM_COUNT))

    residual, delta = torch.zeros(rows, hidden, dtype=bf16), torch.zeros(rows, hidden, dtype=bf16)
    norm_weight = torch.ones(hidden, dtype=bf16)
    x, x_scale = add_rms_norm_fp8(delta, residual, norm_weight, 1e-5)
    cache = torch.zeros(64, 16, kv_heads, dim, dtype=e4m3)
    table = torch.zeros(4096, dim // 2, dtype=bf16)
    rope_write_kv(skinny(x, x_scale, (heads + 2 * kv_heads) * dim, hidden), torch.zeros(rows, dtype=torch.int64),
                  torch.zeros(rows, dtype=torch.int64), table, table, cache, cache.clone(), heads, kv_heads,
                  k_scale=torch.ones(kv_heads), v_scale=torch.ones(kv_heads))
    attention_out = torch.zeros(rows, heads * dim, dtype=bf16)
    skinny(*quantize_fp8(attention_out), hidden, heads * dim)
    x, x_scale = add_rms_norm_fp8(delta, residual, norm_weight, 1e-5)
    gate_up = skinny(x, x_scale, 2 * inter, hidden)
    skinny(*silu_mul_fp8(gate_up), hidden, inter)
