"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream still runs.

A decode step of a small batch is a chain of some ten launches a layer, most of them a few microseconds of
latency-bound work (a norm, RoPE and the KV write, attention over a short context, a quantisation), between GEMMs
that stream the weights. Launched one after the other, each kernel waits for the previous one to drain before its
programs are even scheduled, and the HBM idles through every small kernel. On Hopper a kernel launched as a
programmatic dependent may be scheduled as soon as every program of the kernel before it has signalled
(`gdc_launch_dependents`); it then blocks in `gdc_wait` until that kernel has finished and its writes are visible.
The launch latency leaves the critical path, and a GEMM can start pulling its weights into L2 (which depend on
nothing) before it waits for its activations.

The contract each kernel launched this way keeps: nothing written by an earlier kernel is read, and nothing is
written, before `gdc_wait`. Every kernel here calls `dependency_wait` first thing (the skinny FP8 GEMM after its
weight prefetch), so a chain of them is ordered exactly as plain launches are. CUDA graphs capture the
programmatic edges, so replayed decode steps keep the overlap.

`METRONOME_PDL=off` launches them plainly (for A/B measurement); the switch is read once a process, before the
first launch, so CUDA graphs and eager steps agree.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: dependent launch is never switched on, so these are never compiled
    gdc_launch_dependents = gdc_wait = None

PDL_ENV = "METRONOME_PDL"
MIN_CAPABILITY = (9, 0)  # griddepcontrol is a Hopper instruction


@lru_cache(maxsize=1)
def _switched_on() -> bool:
    value = os.environ.get(PDL_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{PDL_ENV} must be 'on' or 'off', got {value!r}")
    return value == "on"


@lru_cache(maxsize=8)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def _launcher_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and gdc_wait is not None


def uses_dependent_launch(device: torch.device) -> bool:
    """Whether Triton kernels on `device` launch as programmatic dependents: compiled (not the interpreter) for a
    CUDA GPU of compute capability 9.0 or newer, a Triton that can, and METRONOME_PDL not 'off'."""
    if device.type != "cuda" or _interpreting() or not _switched_on():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= MIN_CAPABILITY and _launcher_supports_pdl()


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a launch of a kernel that takes a `PDL` constexpr: the flag, and Triton's launch
    option when it is on."""
    if uses_dependent_launch(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def dependency_wait(PDL: tl.constexpr):
    """First thing in a kernel launched by launch_args: let the next kernel be scheduled, then wait until the one
    before has finished and its writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
